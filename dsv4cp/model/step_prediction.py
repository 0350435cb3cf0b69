"""A CP step predicted from each rank's own compute time plus the modelled communication of the layout.

One device can measure every rank's compute (:mod:`dsv4cp.sweeps.emulation`), not the collectives
between ranks. The step of a real run is composed here from both halves:

* each rank's compute time, measured (an emulated rank's step time, or a traced rank's busy plus idle
  time);
* each collective's transfer time from the cost model (:mod:`dsv4cp.model.costs`: all-gather and
  reduce-scatter sizes at the machine's bus bandwidth, the halo at its P2P bandwidth), of which only the
  part not hidden by the compute the layer schedules while it flies is exposed (:data:`OVERLAP_WINDOWS`);
  with ``overlap="none"`` every transfer is exposed, and the halo exchange always is;
* ranks meet at every collective, so the step ends with the slowest rank: ``step = max over ranks of
  (compute + exposed communication)``.

The windows follow the layer's order (``dsv4cp.layer.attention``): the indexer keys' gather is launched
first and waited for before scoring; the compressed KV's gather is waited for before sparse attention;
each reduce-scatter is launched once its gradient is complete and waited for after the query path's
backward. What is not modelled: the host's own gaps on a rank (inside the measured compute when it is a
step time) and the slowdown of kernels sharing the GPU with a collective (measured on an H200: a
1.39 ms matmul beside a 0.56 ms all-gather took 1.85 ms, not 1.39).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dsv4cp.model.costs import LayerEstimate, phase_measured_in

OVERLAP_WINDOWS: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    ("allgather.index_k", "fwd"): (("compress", "fwd"), ("q_proj", "fwd"), ("indexer.q_proj", "fwd")),
    ("allgather.kv", "fwd"): (("q_proj", "fwd"), ("indexer.q_proj", "fwd"), ("indexer.score", "fwd"),
                              ("indexer.topk", "fwd")),
    ("allgather.index_k", "bwd"): (("q_proj", "bwd"), ("indexer.q_proj", "bwd")),
    ("allgather.kv", "bwd"): (("q_proj", "bwd"), ("indexer.q_proj", "bwd")),
}
"""Per asynchronous collective (the model's phase and direction; ``bwd`` is the reduce-scatter), the compute
phases the layer runs while it flies. A phase a layer kind lacks counts zero; the halo has no window."""

OVERLAPS = ("none", "async")


@dataclass(frozen=True)
class StepPrediction:
    """A predicted CP step (milliseconds; per-rank lists indexed by rank)."""

    compute_ms: tuple[float, ...]
    """Each rank's compute, as given."""
    comm_ms: tuple[float, ...]
    """Each rank's modelled transfer time of every collective of the step."""
    exposed_comm_ms: tuple[float, ...]
    """The part of ``comm_ms`` no scheduled compute hides."""

    @property
    def rank_ms(self) -> tuple[float, ...]:
        return tuple(c + e for c, e in zip(self.compute_ms, self.exposed_comm_ms))

    @property
    def step_ms(self) -> float:
        """The slowest rank's compute plus exposed communication: every rank waits for it."""
        return max(self.rank_ms)

    @property
    def slowest_rank(self) -> int:
        return int(np.argmax(self.rank_ms))


def predict_step(
    est: LayerEstimate, compute_ms: Sequence[float], *, overlap: str = "async", direction: str = "fwd+bwd",
    phase_compute_ms: Mapping[tuple[int, str, str], float] | None = None,
) -> StepPrediction:
    """The step of ``est``'s layout (its cp, split and machine) with each rank's measured ``compute_ms``.

    ``direction``: ``fwd`` or ``fwd+bwd`` (which collectives the step runs). ``phase_compute_ms``: measured
    compute per ``(rank, phase, direction)`` (model phase names, keyed as :func:`dsv4cp.model.measured_phase`
    keys ranges) for the overlap windows; a window's phases that share a key
    (:func:`~dsv4cp.model.costs.phase_measured_in`: the top-k's scoring is measured in ``indexer.topk``) take
    its measured time once, and keys it lacks, or all of them when None, the model's bounds of those phases.
    Raises ``ValueError`` naming a bad argument."""
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap: must be one of {OVERLAPS}, got {overlap!r}")
    if direction not in ("fwd", "fwd+bwd"):
        raise ValueError(f"direction: must be 'fwd' or 'fwd+bwd', got {direction!r}")
    if len(compute_ms) != est.cp:
        raise ValueError(f"compute_ms: needs one time per rank of cp {est.cp}, got {len(compute_ms)}")
    for rank, value in enumerate(compute_ms):
        if value is None or not np.isfinite(value) or value < 0:
            raise ValueError(f"compute_ms[{rank}]: must be a finite time >= 0 ms, got {value!r}")
    directions = ("fwd",) if direction == "fwd" else ("fwd", "bwd")
    table = est.table()
    table = table[table["direction"].isin(directions)]
    bound_ms = {(int(r), p, d): t * 1e3 for r, p, d, t in
                zip(table["rank"], table["phase"], table["direction"], table["time_lower_bound_s"])}
    measured = dict(phase_compute_ms or {})
    comm = table[table["resource"] == "comm"]
    comm_ms, exposed_ms = np.zeros(est.cp), np.zeros(est.cp)
    for rank, phase, phase_direction, seconds in zip(comm["rank"], comm["phase"], comm["direction"],
                                                      comm["time_lower_bound_s"]):
        transfer = seconds * 1e3
        comm_ms[rank] += transfer
        window = 0.0
        if overlap == "async":
            keys: dict[tuple[int, str, str], float] = {}  # measured key -> the window's bounds under it
            for key in OVERLAP_WINDOWS.get((phase, phase_direction), ()):
                measured_key = (int(rank), *phase_measured_in(*key))
                keys[measured_key] = keys.get(measured_key, 0.0) + bound_ms.get((int(rank), *key), 0.0)
            window = sum(measured.get(key, bounds) for key, bounds in keys.items())
        exposed_ms[rank] += max(0.0, transfer - window)
    return StepPrediction(tuple(float(c) for c in compute_ms), tuple(comm_ms.tolist()), tuple(exposed_ms.tolist()))
