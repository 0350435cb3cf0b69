"""Measure one sweep point: the point's checks, its split and its Case, then the timed pass over the Case
(:func:`dsv4cp.harness.time.time_case`; docs/design.md §5): the layer step of ``profile`` and of every
sweep point.

:func:`measure_point` is called by every rank of the point's CP group (or by one process without
torch.distributed for CP = 1). It checks the point against the group and the device, computes its split
under its ``partition`` policy (identical on all ranks), builds its Case (:func:`point_case`: the seeded
packing, layer and rows the timed steps and the parity check both run) and times it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from dsv4cp import kernel_options
from dsv4cp.config import DSv4Config
from dsv4cp.cp.emulate import emulated_rank
from dsv4cp.cp.partition import RowSplit, floor_rows
from dsv4cp.harness.case import Case
from dsv4cp.harness.case import check_fresh_batches as check_case_fresh_batches
from dsv4cp.harness.time import Measurement, time_case
from dsv4cp.model import Machine
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.machine import no_machine_reason, this_machine
from dsv4cp.model.partition import policy_split
from dsv4cp.ops.determinism import deterministic_backend
from dsv4cp.sweeps.spec import MEASURED, Point, RunOptions, point_inputs  # point_inputs: the spec's own shape checks


def check_fresh_batches(point: Point) -> None:
    """``ValueError`` naming ``fresh_batches`` when ``point`` asks for fresh batches it cannot time;
    called before any work."""
    check_case_fresh_batches(point.fresh_batches, point.cuda_graph)


def check_cuda_graph(point: Point, device: torch.device) -> None:
    """``ValueError`` naming ``cuda_graph`` when ``point`` asks for graph replays ``device`` cannot
    give; called before any work (by :func:`measure_point`, and by ``profile`` before its checks)."""
    if not point.cuda_graph:
        return
    if device.type != "cuda":
        raise ValueError(f"cuda_graph: CUDA-graph replays need a CUDA device, got {device}; "
                         "time this point eagerly (cuda_graph false)")
    if point.emulated_rank is not None:
        # its peers' rows are drawn with a host read of their spread and a generator of its own,
        # neither of which a capture accepts (dsv4cp.cp.emulate)
        raise ValueError(f"cuda_graph: an emulated rank (emulated_rank {point.emulated_rank}) cannot be "
                         "captured; time it eagerly")
    if point.cp > 1:
        # NCCL collectives inside a capture are not exercised by any test of this suite: a failed
        # capture on one rank would leave its peers waiting in a collective
        raise ValueError(f"cuda_graph: only CP = 1 steps are captured, got cp {point.cp}; "
                         "time CP > 1 eagerly")


def point_split(point: Point, cfg: DSv4Config, lengths: list[int], machine: Machine | None = None,
                calibration: Calibration | None = None) -> RowSplit:
    """The ranks' row ranges under the point's ``partition`` policy (the balanced one equalises the
    model's per-rank times of the point's pass at ``machine``'s ceilings, scaled by ``calibration``
    when given, the step priced under the kernel options in force: the point's own are in force only while
    it is measured); identical on every rank."""
    return policy_split(cfg, point.ratio, lengths, point.cp, point.partition, machine, total=point.tokens,
                        direction=point.direction, calibration=calibration,
                        kernel_options=kernel_options.KernelOptions.resolve())


def point_case(point: Point, cfg: DSv4Config | None = None, lengths: list[int] | None = None,
               split: RowSplit | None = None, device: torch.device | str = "cpu") -> Case:
    """The :class:`~dsv4cp.harness.case.Case` of ``point``: what its timed steps, its parity check, its
    emulated ranks and its measured split's rounds all run, with the point's kernel options over those in
    force. The one conversion of a sweep point into a Case.

    ``cfg`` and ``lengths``: the point's config and documents (default: :func:`point_inputs`, which checks
    the point's shapes); ``split``: the ranks' row ranges (default: the point's policy split at this
    process's machine, :func:`point_split`; a ``measured`` point has no policy and needs one); ``device``:
    where the Case runs (its type is kept).
    """
    if cfg is None or lengths is None:
        inputs = point_inputs(point)
        cfg, lengths = cfg if cfg is not None else inputs[0], lengths if lengths is not None else inputs[1]
    if split is None:
        if point.partition == MEASURED:
            raise ValueError("partition: a measured split comes from measurements (profile --partition measured, "
                             "or --split-file): give it as split=")
        split = point_split(point, cfg, lengths)
    device = torch.device(device)
    return Case(cfg=cfg, ratio=point.ratio, lengths=tuple(lengths), total=point.tokens, split=split.bounds,
                seed=point.seed, dtype=point.dtype, device=device.type, direction=point.direction,
                overlap=point.overlap, recompute=point.recompute, backend=point_backend(point, cfg, device),
                kernel_options=kernel_options.KernelOptions.resolve(point.kernel_options or {}),
                deterministic=point.deterministic, compile=point.compile, cuda_graph=point.cuda_graph,
                fresh_batches=point.fresh_batches)


def point_backend(point: Point, cfg: DSv4Config, device: torch.device) -> str:
    """The sparse-attention backend the point's layer asks for: a deterministic point's "auto" picks
    deterministic backends only (:func:`dsv4cp.ops.determinism.deterministic_backend`)."""
    if not point.deterministic:
        return point.kernel_backend
    return deterministic_backend(point.kernel_backend, device, head_dim=cfg.head_dim)


def measure_point(
    point: Point, group: dist.ProcessGroup | None, device: torch.device, run: RunOptions, *,
    machine: Machine | None = None, trace_dir: str | Path | None = None, nsys: bool = False, check: bool = False,
    on_step: Callable[[str], object] | None = None, memory_phases: bool = False,
    calibration: Calibration | None = None, memory_snapshot: bool = False, split: RowSplit | None = None,
) -> Measurement:
    """Measure ``point`` on this rank of ``group`` (``group`` has ``point.cp`` ranks; None: one process):
    its Case (:func:`point_case`) through :func:`dsv4cp.harness.time.time_case`, whose arguments these are
    but for the point's own.

    ``machine``: default the machine this process runs on (:func:`~dsv4cp.model.machine.this_machine`;
    where it has none, no bound). ``calibration``: measured-over-bound phase factors the balanced split
    uses (metric ``calibration``). ``split``: the ranks' row split to measure instead of the point's
    policy's (a ``measured`` split, :mod:`dsv4cp.sweeps.measured_split`); checked against the point before
    any work. The point's ``cuda_graph`` and ``fresh_batches`` choose how the pass times; its
    ``kernel_options`` and deterministic mode are in force throughout (the checked parity run included).

    Raises ``ValueError`` for shapes the point cannot run, for a group that is not the point's, for a
    ``cuda_graph`` it cannot replay and for fresh batches with ``cuda_graph`` (before any collective), and
    whatever :func:`~dsv4cp.harness.time.time_case` raises.
    """
    cp = dist.get_world_size(group) if group is not None else 1
    if cp != point.cp:
        raise ValueError(f"cp: the point needs {point.cp} ranks, the group has {cp}")
    emulated = emulated_rank(group)
    if point.emulated_rank != emulated:
        raise ValueError(f"emulated_rank: the point has {point.emulated_rank}, the group "
                         + ("is a real one" if emulated is None else f"emulates rank {emulated}"))
    if check and emulated is not None:
        raise ValueError("check: the parity check needs every real rank, not one emulated rank")
    case, machine, label = checked_case(point, device, machine=machine, calibration=calibration, split=split)
    return time_case(case, group, device, run, machine=machine, calibration_label=label, trace_dir=trace_dir,
                     nsys=nsys, check=check, on_step=on_step, memory_phases=memory_phases,
                     memory_snapshot=memory_snapshot, trace_point=point.axes())


def checked_case(point: Point, device: torch.device, *, machine: Machine | None = None,
                 calibration: Calibration | None = None, split: RowSplit | None = None,
                 ) -> tuple[Case, Machine | None, str | None]:
    """The checks of ``point`` on ``device`` that need no group, then its Case (:func:`point_case`) under
    ``split`` (default: its policy's, at ``machine`` scaled by ``calibration``): ``(case, machine, label)``
    with the machine the bound uses (default: this process's, :func:`~dsv4cp.model.machine.this_machine`)
    and the calibration label the record names. ``ValueError`` before any work (see :func:`measure_point`)."""
    check_fresh_batches(point)
    check_cuda_graph(point, device)
    machine = machine if machine is not None else this_machine()
    if machine is None and point.partition == "balanced":
        raise ValueError(f"partition: a balanced split equalises modelled times at a machine's ceilings; "
                         f"{no_machine_reason()}")
    cfg, lengths = point_inputs(point)
    if split is not None:
        split.validate(point.tokens, point.cp, floor_rows(cfg, point.ratio, point.cp, None), field="split")
    elif point.partition != MEASURED:
        split = point_split(point, cfg, lengths, machine, calibration)
    # every kernel option checked here, before any work; a measured point without its split refused
    case = point_case(point, cfg, lengths, split, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # device_used_bytes must not count blocks cached for an earlier point
    label = calibration.label if calibration is not None and point.partition != "equal" else None
    return case, machine, label
