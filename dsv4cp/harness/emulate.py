"""Every rank of a Case's CP run measured in turn on one device (:mod:`dsv4cp.cp.emulate`): a pass run once
per rank, each rank in a fake process group of its own, and one summary of the ranks' metrics.

An emulated rank's collectives are no-ops, so nothing here measures communication: the summary is the
compute-only view of the step, a lower bound of the real one. Ranks run one after the other in this
process, each with its group created and destroyed around its measurement, so the same weights, inputs
and split are built for every rank exactly as a real run builds them (the group's fills are seeded with
the Case's seed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch.distributed as dist

from dsv4cp.cp.emulate import destroy_emulated_group, init_emulated_group
from dsv4cp.harness.case import Case

Result = TypeVar("Result")

SHARED_METRICS = ("split", "calibration", "model_flops", "bound_ms", "bound_measured_ms", "bound_machine")
"""Metrics every emulated rank computes identically (the whole CP step's model and split)."""


def emulated_ranks(cp: int, ranks: Sequence[int] | None = None) -> list[int]:
    """The ranks to emulate of a CP = ``cp`` run: ``ranks`` (default: 0, 1, ..., ``cp - 1``), checked;
    ``ValueError`` naming ``cp`` or ``ranks`` before any work."""
    if cp < 2:
        raise ValueError(f"cp: emulating every rank needs cp >= 2, got {cp}")
    ranks = list(range(cp)) if ranks is None else list(ranks)
    bad = [rank for rank in ranks if not 0 <= rank < cp]
    if bad or len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"ranks: must be distinct ranks in [0, {cp}), got {ranks}")
    return ranks


def emulate_each_rank(case: Case, cp: int, measure: Callable[[int, dist.ProcessGroup], Result], *,
                      ranks: Sequence[int] | None = None) -> Iterator[tuple[int, Result]]:
    """Run ``measure(rank, group)`` for ``ranks`` (default: every rank) of ``case`` over ``cp`` ranks, one
    after the other in this process, each in its own emulated group; yield each rank and its result as soon
    as it is taken, so a caller can record it before the next rank starts."""
    ranks = emulated_ranks(cp, ranks)
    if case.split is not None and len(case.split) - 1 != cp:
        raise ValueError(f"split: the Case's split has {len(case.split) - 1} ranks, emulating cp {cp}")
    for rank in ranks:
        group = init_emulated_group(cp, rank, seed=case.seed)
        try:
            result = measure(rank, group)
        finally:  # also on an error: the next rank (or the caller) creates its own group
            destroy_emulated_group(group)
        yield rank, result


def summary_metrics(per_rank: list[dict], tokens: int) -> dict:
    """The all-ranks summary of every rank's own metrics (``per_rank[r]``: rank r's record metrics, as the
    timed pass gives them for an emulated rank: its lists hold None at the other ranks).

    ``rank_time_ms_median`` and the memory lists take each rank's own entry; the time statistics,
    throughput and measured/bound are the slowest rank's (the step cannot end before it);
    ``imbalance_max_over_mean`` is max/mean of the per-rank medians; ``slowest_rank`` and
    ``slowest_rank_ms`` name it. Raises ``ValueError`` when a rank's own entries are missing."""
    if not per_rank:
        raise ValueError("per_rank: no rank was measured")
    medians = []
    for rank, metrics in enumerate(per_rank):
        own = metrics["rank_time_ms_median"][rank]
        if own is None:
            raise ValueError(f"per_rank[{rank}]: rank_time_ms_median holds no time for rank {rank}")
        medians.append(own)
    slowest = max(range(len(medians)), key=medians.__getitem__)
    worst = per_rank[slowest]
    mean = sum(medians) / len(medians)
    summary = {name: worst[name] for name in SHARED_METRICS}
    summary.update({
        "time_ms_median": worst["time_ms_median"], "time_ms_p20": worst["time_ms_p20"],
        "time_ms_p80": worst["time_ms_p80"], "rank_time_ms_median": medians,
        "imbalance_max_over_mean": max(medians) / mean, "slowest_rank": slowest, "slowest_rank_ms": medians[slowest],
        "tokens_per_s": tokens / (worst["time_ms_median"] / 1e3), "tflops_per_gpu": worst["tflops_per_gpu"],
        "mfu": worst["mfu"], "measured_over_bound": worst["measured_over_bound"],
        "measured_over_measured_bound": worst["measured_over_measured_bound"],
        "peak_allocated_bytes": [m["peak_allocated_bytes"][r] for r, m in enumerate(per_rank)],
        "device_used_bytes": [m["device_used_bytes"][r] for r, m in enumerate(per_rank)],
    })
    return summary
