"""Parity pass: a Case's layer, under CP or not, against the fp64 reference layer (docs/design.md §3.8).

The checked layer is the Case's (its kernels, its dtype, its CP degree and split, its overlap, recompute
and compile settings). The reference is the same layer at fp64: the checked layer's weights cast to
fp64 (exactly: every bf16 and fp32 value is an fp64 value), the torch reference kernels (fp64 runs no
Triton kernel; its sparse attention is the torch backend), one rank on the whole batch, and the same
inputs (the whole batch's rows, every rank's drawn as :mod:`dsv4cp.harness.build` draws them, cast to
fp64). Both back-propagate the one objective (:func:`dsv4cp.harness.build.backward_`).

The reference runs first and only its results are kept (output, input gradient, indexer loss,
parameter gradients, all fp64), so the peak is the larger of the two layers' steps, not their sum.

Judged per quantity by the relative error ``||got - want|| / ||want||`` over the whole tensor (each
parameter's gradient on its own scale: the indexer's gradients are ~1e-5 of the attention's, and an
error in them would vanish against one shared scale), against :data:`TOLERANCES` for the checked dtype:

- fp64: only the summation order differs from the reference (CP splits, chunked kernels): 1e-10.
- fp32: rounding at 2^-24 through the step, amplified by the long reductions of the backward.
- bf16: rounding at 2^-8 of every stored activation and of the weights' products; the indexer may also
  pick a different entry where two scores tie within bf16 rounding, which moves a few rows, not the
  whole tensor: the norm-wise error stays small where an element-wise one would not.

An all-zero reference (an unused parameter's gradient, an empty slice) has no scale: the result's
norm must stay within :data:`ZERO_ABS_TOLERANCE`. The maximum element-wise error relative to the
largest reference element and the cosine similarity are reported beside the judged error.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from dsv4cp import kernel_options
from dsv4cp.cp.layout import build_layout
from dsv4cp.cp.partition import RowSplit
from dsv4cp.environment import deterministic_algorithms
from dsv4cp.harness.build import backward_, batch_inputs, build_layer, rank_inputs
from dsv4cp.harness.case import Case
from dsv4cp.harness.selection import agreement, global_entries, imposed_selection, recording_selection
from dsv4cp.layer import DSv4Attention

QUANTITIES = ("out", "selection", "indexer_loss", "x_grad", "param_grads", "indexer_grads")

TOLERANCES: dict[str, dict[str, float]] = {
    "fp64": {"out": 1e-10, "indexer_loss": 1e-10, "x_grad": 1e-10, "param_grads": 1e-10, "indexer_grads": 1e-10},
    "fp32": {"out": 1e-5, "indexer_loss": 1e-5, "x_grad": 1e-5, "param_grads": 2e-5, "indexer_grads": 1e-4},
    "bf16": {"out": 2e-2, "indexer_loss": 1e-2, "x_grad": 2e-2, "param_grads": 3e-2, "indexer_grads": 0.15},
}
"""Checked dtype -> quantity -> largest ``||got - want|| / ||want||`` against the fp64 reference."""
SELECTION_TOLERANCE = {"fp64": 0.0, "fp32": 1e-3, "bf16": 0.05}
"""Checked dtype -> the largest share of the reference's selected entries the checked layer may miss."""
ZERO_ABS_TOLERANCE = {"fp64": 1e-12, "fp32": 1e-6, "bf16": 1e-4}
"""An all-zero reference: the largest norm of the result."""


def _gradient_group(name: str) -> str:
    """``indexer_grads`` for the indexer's parameters (trained by the indexer loss alone, through a KL of
    distributions rounded at the checked dtype: the noisiest gradients), ``param_grads`` for the others."""
    return "indexer_grads" if name.startswith("indexer.") else "param_grads"


def tolerance_summary(dtype: str) -> str:
    """One line stating how :func:`compare` judges results at ``dtype`` (for reports)."""
    limits = ", ".join(f"{q} {limit:g}" for q, limit in TOLERANCES[dtype].items())
    return (f"against fp64: ||got - want|| / ||want|| <= {limits}; selection missed <= "
            f"{SELECTION_TOLERANCE[dtype]:g}; "
            f"zero references |result| <= {ZERO_ABS_TOLERANCE[dtype]:g}")


@dataclass
class Comparison:
    quantity: str
    max_rel_error: float
    """``max |got - want| / max |want|`` (reported, not judged)."""
    cosine: float
    passed: bool
    worst: str = ""
    """For a group of tensors (the parameter gradients): the member with the largest error."""
    rel_error: float = 0.0
    """``||got - want|| / ||want||``: the judged error (the norm of ``got`` for an all-zero reference)."""
    tolerance: float = 0.0
    """What ``rel_error`` was judged against."""


def _worst(quantity: str, members: list[Comparison]) -> Comparison:
    """One row for a group: the member whose error is largest against its tolerance, the smallest cosine,
    passed only if every member passed."""
    worst = max(members, key=lambda c: c.rel_error / c.tolerance if c.tolerance else c.rel_error)
    return Comparison(quantity, max(c.max_rel_error for c in members), min(c.cosine for c in members),
                      all(c.passed for c in members), worst.worst or worst.quantity, worst.rel_error, worst.tolerance)


def compare(name: str, quantity: str, got: torch.Tensor, want: torch.Tensor, dtype: str) -> Comparison:
    """Judge ``got`` (at ``dtype``) against the fp64 reference ``want`` as ``quantity`` (module docstring)."""
    got, want = got.detach().double().flatten(), want.detach().double().flatten()
    if got.shape != want.shape:
        raise ValueError(f"{name}: the checked result has {got.numel()} elements, the reference {want.numel()}")
    tolerance = TOLERANCES[dtype][quantity]
    if want.numel() == 0:
        return Comparison(name, 0.0, 1.0, True, rel_error=0.0, tolerance=tolerance)
    diff = got - want
    peak, scale = float(want.abs().max()), float(want.norm())
    if peak == 0.0:
        norm = float(got.norm())
        zero = ZERO_ABS_TOLERANCE[dtype]
        return Comparison(name, float(diff.abs().max()), 1.0 if norm == 0.0 else 0.0, norm <= zero,
                          rel_error=norm, tolerance=zero)
    rel = float(diff.norm()) / scale
    cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
    return Comparison(name, float(diff.abs().max()) / peak, cosine, rel <= tolerance, rel_error=rel,
                      tolerance=tolerance)


@dataclass
class Results:
    """One layer's results: ``out`` and ``x_grad`` rows, the batch's indexer loss, parameter gradients by
    name (the batch's sums; empty forward only), and the selected entries of the batch's rows (None: no
    indexer)."""

    out: torch.Tensor
    x_grad: torch.Tensor | None
    indexer_loss: torch.Tensor | None
    param_grads: dict[str, torch.Tensor]
    selection: torch.Tensor | None


def reference_layer(layer: DSv4Attention) -> DSv4Attention:
    """``layer``'s weights in fp64 on a layer of the same shape that runs the torch reference kernels, one
    rank, no overlap, no recompute."""
    reference = DSv4Attention(layer.cfg, layer.compress_ratio, backend="torch", kernel_options=layer.kernel_options)
    reference.load_state_dict(layer.state_dict())  # into fp32 parameters: bf16 and fp32 values are kept exactly
    device = next(layer.parameters()).device
    return reference.to(device=device, dtype=torch.float64)


def run_reference(case: Case, layer: DSv4Attention, split: RowSplit, device: torch.device,
                  selection: torch.Tensor | None) -> Results:
    """The fp64 reference of ``case`` with ``layer``'s weights on the whole batch whose rows the ranks of
    ``split`` draw; ``selection``: the entries it must select (the checked layer's), its own choice
    returned as ``selection``."""
    reference = reference_layer(layer)
    x, upstream = batch_inputs(case, split, device)
    x = x.double().requires_grad_(case.backward)
    own: list[torch.Tensor] = []
    imposing = imposed_selection(selection, own) if selection is not None else contextlib.nullcontext()
    with imposing:
        result = reference(x, case.packed(device))
    if case.backward:
        backward_(result, upstream.double())
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
             for name, p in reference.named_parameters()} if case.backward else {}
    loss = result.indexer_loss.detach() if result.indexer_loss is not None else None
    return Results(result.out.detach(), x.grad if case.backward else None, loss, grads, own[-1] if own else None)


def run_rank(rank: int, world: int, device: torch.device, case: Case,
             group: dist.ProcessGroup | None = None) -> list[dict]:
    """Body of one rank (called under :func:`dsv4cp.cp.launch.spawn`, torchrun, or directly for one rank):
    this rank's comparisons as dicts of :class:`Comparison`. ``rank`` and ``world`` are within ``group``
    (default: the world group when ``world > 1``); the Case's deterministic mode is in force, its kernel
    options are the checked layer's and the reference's."""
    if world > 1 and group is None:
        group = dist.group.WORLD
    with deterministic_algorithms(case.deterministic):  # the kernel options travel in the Case's layer
        return [asdict(c) for c in _check(rank, world, device, case, group if world > 1 else None)]


def _check(rank: int, world: int, device: torch.device, case: Case,
           group: dist.ProcessGroup | None) -> list[Comparison]:
    split = case.row_split(world)
    mine = slice(split.start(rank), split.start(rank) + split.rows(rank))
    layer = build_layer(case, device)
    got = _checked_results(case, layer, split, rank, device, group)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the checked step's activations are gone: hand their blocks to the reference
    checked_ran = kernel_options.backends_ran()
    want = run_reference(case, layer, split, device, got.selection)
    kernel_options.reset_backends_ran()  # what ran is the checked layer's, not the reference's torch paths
    for key, value in checked_ran.items():
        kernel_options.note_backend(key, value)

    comparisons = [compare("out", "out", got.out, want.out[mine], case.dtype)]
    if want.selection is not None:
        share = agreement(got.selection[mine], want.selection[mine])
        tolerance = SELECTION_TOLERANCE[case.dtype]
        comparisons.append(Comparison("selection", 1.0 - share, share, 1.0 - share <= tolerance,
                                      rel_error=1.0 - share, tolerance=tolerance))
    if want.indexer_loss is not None:
        comparisons.append(compare("indexer_loss", "indexer_loss", got.indexer_loss, want.indexer_loss, case.dtype))
    if case.backward:
        comparisons.append(compare("x_grad", "x_grad", got.x_grad, want.x_grad[mine], case.dtype))
        for group_name in ("param_grads", "indexer_grads"):
            members = [compare(name, group_name, grad, want.param_grads[name], case.dtype)
                       for name, grad in got.param_grads.items() if _gradient_group(name) == group_name]
            if members:
                comparisons.append(_worst(group_name, members))
    return comparisons


def _checked_results(case: Case, layer: DSv4Attention, split: RowSplit, rank: int, device: torch.device,
                     group: dist.ProcessGroup | None) -> Results:
    """The checked layer's step on this rank: its output and input gradient rows, the batch's indexer loss
    and parameter gradients (summed over the ranks) and the whole batch's selection (gathered)."""
    x, upstream = rank_inputs(case, split, rank, device)
    x.requires_grad_(case.backward)
    step = layer if case.compile is None else torch.compile(layer, backend=case.compile)
    selections: list[torch.Tensor] = []
    with recording_selection(selections):
        result = step(x, case.packed(device), cp_group=group, split=split)
    if case.backward:
        backward_(result, upstream)
    loss = result.indexer_loss.detach().double() if result.indexer_loss is not None else None
    if loss is not None and group is not None:
        dist.all_reduce(loss, group=group)  # each rank's loss is its rows' part of the batch's
    grads = {}
    for name, param in layer.named_parameters() if case.backward else ():
        grads[name] = (param.grad if param.grad is not None else torch.zeros_like(param)).detach().clone()
        if group is not None:
            dist.all_reduce(grads[name], group=group)  # CP ranks hold partial sums, as data parallelism does
        param.grad = None
    selection = None
    if selections:
        layout = build_layout(case.packed(device), case.cfg, case.ratio, rank, split.cp, split=split)
        selection = global_entries(selections[-1], layout)
        if group is not None:
            parts: list = [None] * split.cp
            dist.all_gather_object(parts, selection.cpu(), group=group)
            selection = torch.cat(parts).to(device)
    return Results(result.out.detach(), x.grad if case.backward else None, loss, grads, selection)


def run_cases(rank: int, world: int, device: torch.device, cases: list[Case]) -> list[list[dict]]:
    """Several checks in one process group (each spawn costs seconds; tests batch their cases)."""
    return [run_rank(rank, world, device, case) for case in cases]


def merge_ranks(per_rank: list[list[dict]]) -> list[Comparison]:
    """Worst case over ranks for each quantity."""
    by_quantity: dict[str, list[Comparison]] = {}
    for results in per_rank:
        for item in results:
            by_quantity.setdefault(item["quantity"], []).append(Comparison(**item))
    return [_worst(q, by_quantity[q]) for q in QUANTITIES if q in by_quantity]
