"""Replay pass: the same layer step of a Case, run again on the same inputs, gives the same bits.

A replay is the Case's step (:mod:`dsv4cp.harness.build`: its layer, and the batch's inputs and upstream
gradient as one rank draws them, sliced to this rank's rows so that every CP degree replays the same
batch) run from a fresh copy of the layer: forward on this rank's rows, the one objective's backward.
Each replay leaves a :data:`Snapshot` of this rank's output, indexer loss, selected top-k entries (as
global entry numbers, so CP degrees compare), input gradient and every parameter gradient (this rank's
partial sums: the reduction over ranks is data parallelism's, not the layer's). :func:`compare_snapshots`
compares two of them bit for bit.

Ties on purpose (``Replay.ties``): the indexer compressor's value projection is zeroed, so every
indexer key is zero and every visible entry of a query scores exactly 0: one plateau of ties per query,
which the documented rule resolves to the query's earliest visible entries (:func:`tie_rule_violations`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsv4cp.cp.layout import build_layout
from dsv4cp.environment import deterministic_algorithms
from dsv4cp.harness.build import backward_, build_layer, one_rank_inputs
from dsv4cp.harness.case import Case
from dsv4cp.harness.selection import global_entries, recording_selection

Snapshot = dict[str, torch.Tensor]
"""Quantity name -> CPU tensor: ``out``, ``indexer_loss``, ``selected``, ``x_grad``, ``grad/<param>``."""

FIXED_QUANTITIES = ("out", "indexer_loss", "selected", "x_grad")


@dataclass(frozen=True)
class Replay:
    """What to replay: one Case (in deterministic mode when ``case.deterministic``), how often."""

    case: Case
    replays: int = 3
    ties: bool = False
    """Zero the indexer keys so that every visible entry ties (C layers only)."""

    def __post_init__(self) -> None:
        if self.replays < 1:
            raise ValueError(f"replays: must be >= 1, got {self.replays}")
        if self.ties and self.case.ratio != 4:
            raise ValueError(f"ties: needs a C layer (ratio 4, the one with an indexer), got ratio {self.case.ratio}")


@dataclass(frozen=True)
class Difference:
    """How a quantity of one run differs from the reference run's; ``identical`` means bit for bit."""

    quantity: str
    identical: bool
    max_abs: float = 0.0
    first_index: tuple[int, ...] | None = None
    where: str = ""
    """Which run differed first (e.g. ``replay 2``, ``fresh process``, ``rank 1``)."""

    def describe(self) -> str:
        if self.identical:
            return "identical"
        return f"max |diff| {self.max_abs:.3e}, first at {list(self.first_index or ())} ({self.where})"


def make_ties_(layer: torch.nn.Module) -> None:
    """Zero the indexer keys' value projection: every key is then 0 and every score exactly 0."""
    with torch.no_grad():
        layer.indexer.compressor.wkv.weight.zero_()


def replay_rank(rank: int, world: int, device: torch.device, replay: Replay,
                group: dist.ProcessGroup | None = None) -> list[Snapshot]:
    """``replay.replays`` snapshots of rank ``rank`` of ``world`` (world 1: no process group needed).

    Called under :func:`dsv4cp.cp.launch.spawn`, torchrun, or directly for CP = 1.
    """
    if world > 1 and group is None:
        group = dist.group.WORLD
    case = replay.case if world > 1 else dataclasses.replace(replay.case, split=None)  # the split is for CP > 1
    with deterministic_algorithms(case.deterministic):  # the kernel options travel in the Case's layer
        pristine = build_layer(case, device)
        packed = case.packed(device)
        x, upstream = one_rank_inputs(case, device)  # one rank's draw: every CP degree's batch
        if replay.ties:
            make_ties_(pristine)
        split = case.row_split(world)
        mine = slice(split.start(rank), split.start(rank) + split.rows(rank))
        layout = build_layout(packed, pristine.cfg, case.ratio, rank, world, split=split) if case.ratio else None
        snapshots = []
        for _ in range(replay.replays):
            layer = copy.deepcopy(pristine)
            x_local = x[mine].clone().requires_grad_()
            selections: list[torch.Tensor] = []
            with recording_selection(selections):
                step = layer if case.compile is None else torch.compile(layer, backend=case.compile)
                result = step(x_local, packed, cp_group=group if world > 1 else None, split=split)
            backward_(result, upstream[mine])
            snapshot = {"out": result.out, "x_grad": x_local.grad}
            if result.indexer_loss is not None:
                snapshot["indexer_loss"] = result.indexer_loss
            if selections and layout is not None:
                snapshot["selected"] = global_entries(selections[-1], layout)
            for name, param in layer.named_parameters():
                if param.grad is not None:
                    snapshot[f"grad/{name}"] = param.grad
            snapshots.append({k: v.detach().cpu().clone() for k, v in snapshot.items()})
    return snapshots


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers (NaNs and signed zeros compare by their bits)."""
    if not t.is_floating_point():
        return t
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def compare_tensors(name: str, want: torch.Tensor, got: torch.Tensor, where: str) -> Difference:
    """``got`` against ``want`` bit for bit; else the largest difference and the first differing element."""
    if want.shape != got.shape or want.dtype != got.dtype:
        return Difference(name, False, float("inf"), (), f"{where}: {tuple(got.shape)} {got.dtype} vs "
                                                         f"{tuple(want.shape)} {want.dtype}")
    differs = _bits(want) != _bits(got)
    if not bool(differs.any()):
        return Difference(name, True)
    first = tuple(int(i) for i in differs.nonzero()[0])
    gap = (got.double() - want.double()).abs()
    max_abs = float(gap.nan_to_num(nan=float("inf")).max())
    return Difference(name, False, max_abs, first, where)


def compare_snapshots(want: Snapshot, got: Snapshot, where: str) -> list[Difference]:
    """Every quantity of ``want`` (and any only one of them has) compared; in :func:`quantity_order`."""
    names = quantity_order(set(want) | set(got))
    out = []
    for name in names:
        if name not in want or name not in got:
            out.append(Difference(name, False, float("inf"), (), f"{where}: present in only one run"))
        else:
            out.append(compare_tensors(name, want[name], got[name], where))
    return out


def quantity_order(names: set[str]) -> list[str]:
    """The fixed quantities first, then the parameter gradients in name order."""
    return [n for n in FIXED_QUANTITIES if n in names] + sorted(n for n in names if n not in FIXED_QUANTITIES)


def worst(differences: list[Difference]) -> dict[str, Difference]:
    """Per quantity: identical when every comparison was; else the first differing comparison (the runs
    are compared in order), with the largest difference over all of them."""
    by_quantity: dict[str, list[Difference]] = {}
    for d in differences:
        by_quantity.setdefault(d.quantity, []).append(d)
    merged = {}
    for name in quantity_order(set(by_quantity)):
        differing = [d for d in by_quantity[name] if not d.identical]
        merged[name] = (dataclasses.replace(differing[0], max_abs=max(d.max_abs for d in differing))
                        if differing else by_quantity[name][0])
    return merged


def replay_differences(per_rank: list[list[Snapshot]], fresh: list[Snapshot] | None = None) -> dict[str, Difference]:
    """Every replay of every rank against that rank's first replay, and ``fresh[rank]`` (one replay per rank
    from another process) against it too."""
    found = []
    for rank, snapshots in enumerate(per_rank):
        suffix = f", rank {rank}" if len(per_rank) > 1 else ""
        for i, snapshot in enumerate(snapshots[1:], start=2):
            found += compare_snapshots(snapshots[0], snapshot, f"replay {i}{suffix}")
        if fresh is not None:
            found += compare_snapshots(snapshots[0], fresh[rank], f"fresh process{suffix}")
    return worst(found)


def nonfinite_quantities(per_rank: list[list[Snapshot]]) -> list[str]:
    """The floating-point quantities (in :func:`quantity_order`) that hold NaN or infinity in any replay of
    any rank: equal bits of a broken computation prove nothing, so such a replay is never a pass."""
    bad = {name for snapshots in per_rank for snapshot in snapshots for name, tensor in snapshot.items()
           if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())}
    return quantity_order(bad)


def whole_selection(per_rank: list[Snapshot]) -> torch.Tensor | None:
    """``[T, K]`` the selected entries of every row, the ranks' rows in order (None: no indexer)."""
    if "selected" not in per_rank[0]:
        return None
    return torch.cat([s["selected"] for s in per_rank])


def tie_rule_violations(selected: torch.Tensor, case: Case) -> int:
    """Rows whose selection is not their earliest ``min(K, visible)`` visible entries in entry order:
    what the tie rule gives when every visible entry of a query ties (:func:`make_ties_`)."""
    packed = case.packed()
    layout = build_layout(packed, case.cfg, case.ratio)
    visible = layout.all_visible_idx()  # [T, M] gathered rows in entry order, -1 padded (CP = 1: rows == eid)
    k = selected.shape[1]
    expected = torch.full_like(selected, -1)
    keep = min(k, visible.shape[1])
    expected[:, :keep] = global_entries(visible[:, :keep], layout)
    return int((expected != selected).any(dim=1).sum())
