"""CP parity check: every rank's results under CP equal the CP = 1 layer's (docs/design.md §3.8).

Each rank builds the same layer (same seed), runs the full batch at CP = 1 and its own slice under
CP, back-propagates the same random output weighting plus the indexer loss, sums parameter gradients
over the group, and compares: output slice, input-gradient slice, indexer loss, parameter gradients.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from dsv4cp.config import DTYPES, DSv4Config
from dsv4cp.cp.partition import POLICIES, RowSplit, as_split
from dsv4cp.layer import DSv4Attention
from dsv4cp.packing import PackedSeqs

REL_TOLERANCE = {"fp64": 1e-10, "fp32": 1e-5}
COSINE_TOLERANCE = 1e-3  # bf16 tensors: cosine similarity > 1 - this
SCALAR_REL_TOLERANCE = {**REL_TOLERANCE, "bf16": 1e-2}
"""Scalars (the indexer loss) are judged by relative error: a one-element cosine is only a sign test.
bf16: a loss rounded to bf16 per rank, then summed in bf16, may differ by ~2 ulps (2^-8 each)."""
ZERO_ABS_TOLERANCE = {"fp64": 1e-12, "fp32": 1e-6, "bf16": 1e-4}
"""An all-zero reference (an unused parameter's gradient, an empty slice) has no scale nor direction:
the result's norm must stay within this."""
QUANTITIES = ("out", "x_grad", "indexer_loss", "param_grads")


def tolerance_summary(dtype: str) -> str:
    """One line stating how :func:`_compare` judges results at ``dtype`` (for reports)."""
    tensors = f"cosine > 1 - {COSINE_TOLERANCE:g}" if dtype == "bf16" else f"rel <= {REL_TOLERANCE[dtype]:g}"
    return (f"tensors {tensors}; scalars rel <= {SCALAR_REL_TOLERANCE[dtype]:g}; "
            f"zero references |result| <= {ZERO_ABS_TOLERANCE[dtype]:g}")


@dataclass(frozen=True)
class CheckCase:
    """One parity check: which layer, which batch, which CP settings."""

    preset: str = "tiny"
    ratio: int = 4
    lengths: tuple[int, ...] = (300,)
    total: int | None = None
    pad_to_multiple: int = 1
    dtype: str = "fp32"
    overlap: str = "none"
    recompute: bool = False
    backend: str = "auto"
    seed: int = 0
    config_overrides: dict = field(default_factory=dict)
    partition: str = "equal"
    """Row split policy ("equal" or "balanced"); a balanced case carries its ``split``, which the cost
    model computes (:func:`dsv4cp.model.partition.partition`)."""
    split: tuple[int, ...] | None = None
    """Explicit split points ``0 = b_0 <= ... <= b_cp = T``; None: equal slices."""
    compile: str | None = None
    """A ``torch.compile`` backend for the CP layer (the CP = 1 reference stays eager); None: eager."""

    def __post_init__(self) -> None:
        if self.partition not in POLICIES:
            raise ValueError(f"partition: must be one of {POLICIES}, got {self.partition!r}")
        if self.partition == "balanced" and self.split is None:
            raise ValueError("split: a balanced case needs its split points (dsv4cp.model.partition.partition "
                             "computes them), got None")

    def config(self) -> DSv4Config:
        return DSv4Config.preset(self.preset, **self.config_overrides)

    def row_split(self, cp: int) -> RowSplit:
        """The ranks' row ranges over ``cp`` ranks; an explicit ``split`` is checked here (cp + 1 points from 0
        to T, ascending) so a malformed one raises ``ValueError`` before a rank slices its rows with it, and
        the layer checks the halo before any collective."""
        return as_split(self.split, self.packed().total, cp)

    def packed(self, device: torch.device | None = None) -> PackedSeqs:
        return PackedSeqs.from_lengths(self.lengths, self.pad_to_multiple, self.total, device=device)


@dataclass
class Comparison:
    quantity: str
    max_rel_error: float
    cosine: float
    passed: bool
    worst: str = ""
    """For a group of tensors (the parameter gradients): the member with the largest error."""


def _worst(quantity: str, members: list[Comparison]) -> Comparison:
    """One row for a group: the largest error, the smallest cosine, passed only if every member passed."""
    worst = max(members, key=lambda c: c.max_rel_error)
    return Comparison(quantity, worst.max_rel_error, min(c.cosine for c in members),
                      all(c.passed for c in members), worst.worst or worst.quantity)


def randomize_(layer: DSv4Attention, generator: torch.Generator) -> None:
    """Give every parameter a non-trivial value (sinks, biases by position, norm weights too)."""
    with torch.no_grad():
        layer.reset_parameters(generator)
        for name, param in layer.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * noise)
            elif name.endswith("attn_sink") or name.endswith("ape"):
                param.copy_(0.5 * noise)


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, dtype: str) -> Comparison:
    """Judge ``got`` against the CP = 1 ``want`` at ``dtype``'s tolerance.

    fp32 / fp64: max abs error relative to ``max |want|``. bf16 tensors: cosine similarity (rounding
    makes elementwise errors meaningless). Two cases where cosine says nothing: a scalar (its cosine is
    1 whenever the signs agree) is judged by relative error, and an all-zero reference (no direction) by
    the norm of ``got``, reported as ``max_rel_error`` against a unit scale.
    """
    got, want = got.detach().double().flatten(), want.detach().double().flatten()
    if got.shape != want.shape:
        raise ValueError(f"{name}: CP result has {got.numel()} elements, the CP = 1 reference {want.numel()}")
    if want.numel() == 0:
        return Comparison(name, 0.0, 1.0, True)
    error, peak = float((got - want).abs().max()), float(want.abs().max())
    if peak == 0.0:
        norm = float(got.norm())
        return Comparison(name, error, 1.0 if norm == 0.0 else 0.0, norm <= ZERO_ABS_TOLERANCE[dtype])
    rel = error / peak
    cos = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
    if want.numel() == 1:
        passed = rel <= SCALAR_REL_TOLERANCE[dtype]
    else:
        passed = cos > 1 - COSINE_TOLERANCE if dtype == "bf16" else rel <= REL_TOLERANCE[dtype]
    return Comparison(name, rel, cos, passed)


def build_case(
    case: CheckCase, device: torch.device,
) -> tuple[DSv4Attention, PackedSeqs, torch.Tensor, torch.Tensor]:
    """``(layer, packed, x, weight)`` of ``case`` on ``device``, the same on every rank (drawn from
    ``case.seed``): the randomised layer and ``x [T, hidden]`` at ``case.dtype``, and ``weight
    [T, hidden]``, the random weighting of the output that the checked objective sums."""
    dtype = DTYPES[case.dtype]
    cfg = case.config()
    packed = case.packed(device)
    generator = torch.Generator().manual_seed(case.seed)
    layer = DSv4Attention(cfg, case.ratio, backend=case.backend, overlap=case.overlap, recompute=case.recompute)
    randomize_(layer, generator)
    layer = layer.to(device=device, dtype=dtype)
    x = torch.randn(packed.total, cfg.hidden, generator=generator).to(device=device, dtype=dtype)
    weight = torch.randn(packed.total, cfg.hidden, generator=generator).to(device=device, dtype=dtype)
    return layer, packed, x, weight


def run_rank(rank: int, world: int, device: torch.device, case: CheckCase,
             group: dist.ProcessGroup | None = None) -> list[dict]:
    """Body of one rank (called under :func:`dsv4cp.cp.launch.spawn` or torchrun); ``rank`` and
    ``world`` are within ``group`` (default: the world group)."""
    group = group if group is not None else dist.group.WORLD
    layer, packed, x, weight = build_case(case, device)

    reference = copy.deepcopy(layer)
    x_full = x.clone().requires_grad_()
    full = reference(x_full, packed)
    _objective(full.out, weight, full.indexer_loss).backward()

    split = case.row_split(world)
    mine = slice(split.start(rank), split.start(rank) + split.rows(rank))
    x_local = x[mine].clone().requires_grad_()
    step = layer if case.compile is None else torch.compile(layer, backend=case.compile)
    local = step(x_local, packed, cp_group=group, split=split)
    _objective(local.out, weight[mine], local.indexer_loss).backward()

    comparisons = [
        _compare("out", local.out, full.out[mine], case.dtype),
        _compare("x_grad", x_local.grad, x_full.grad[mine], case.dtype),
    ]
    if full.indexer_loss is not None:
        summed = local.indexer_loss.detach().clone()
        dist.all_reduce(summed, group=group)
        comparisons.append(_compare("indexer_loss", summed, full.indexer_loss, case.dtype))
    # Each parameter on its own scale: the indexer's gradients are ~1e-5 of the attention's, and an
    # error in them would vanish against one shared scale.
    per_parameter = []
    for (name, p_cp), (_, p_ref) in zip(layer.named_parameters(), reference.named_parameters()):
        grad = p_cp.grad if p_cp.grad is not None else torch.zeros_like(p_cp)
        dist.all_reduce(grad, group=group)  # CP ranks hold partial sums, as data parallelism does
        want = p_ref.grad if p_ref.grad is not None else torch.zeros_like(p_ref)
        per_parameter.append(_compare(name, grad, want, case.dtype))
    comparisons.append(_worst("param_grads", per_parameter))
    return [asdict(c) for c in comparisons]


def run_cases(rank: int, world: int, device: torch.device, cases: list[CheckCase]) -> list[list[dict]]:
    """Several checks in one process group (each spawn costs seconds; tests batch their cases)."""
    return [run_rank(rank, world, device, case) for case in cases]


def _objective(out: torch.Tensor, weight: torch.Tensor, indexer_loss: torch.Tensor | None) -> torch.Tensor:
    value = (out.float() * weight.float()).sum()
    return value if indexer_loss is None else value + indexer_loss.float()


def merge_ranks(per_rank: list[list[dict]]) -> list[Comparison]:
    """Worst case over ranks for each quantity."""
    by_quantity: dict[str, list[Comparison]] = {}
    for results in per_rank:
        for item in results:
            by_quantity.setdefault(item["quantity"], []).append(Comparison(**item))
    return [_worst(q, by_quantity[q]) for q in QUANTITIES if q in by_quantity]
