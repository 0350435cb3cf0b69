"""Which kernel backends give bitwise-identical results when the same step is replayed, per op and direction.

A floating-point sum added in a different order rounds differently, so a kernel is deterministic iff its
reductions run in an order fixed by the shapes alone. The usual culprit is an atomic add into a row that
several programs share (the key / value rows every query reads): the order of the adds is the order the
hardware schedules the programs in. Integer atomics (histogram counts of the radix select) commute and
stay deterministic.

Verdicts describe CUDA devices. On CPU every path is deterministic: the torch kernels reduce in a fixed
order at a fixed thread count, and Triton's interpreter runs a grid's programs one after another.

:data:`REGISTRY` is what ``dsv4cp env``, the README and ``check-determinism`` (which exits 1 when a
configuration that claims determinism differs between replays) read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4cp.environment import deterministic_algorithms

ALWAYS, UNDER_MODE, NEVER, NOT_APPLICABLE = "deterministic", "under deterministic mode", "not deterministic", "n/a"
VERDICTS = (ALWAYS, UNDER_MODE, NEVER, NOT_APPLICABLE)



@dataclass(frozen=True)
class Direction:
    """One direction of one backend: a verdict from :data:`VERDICTS` and why."""

    verdict: str
    reason: str

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict: must be one of {VERDICTS}, got {self.verdict!r}")

    def holds(self, deterministic_mode: bool) -> bool:
        """Whether this direction replays bitwise on CUDA (always true of a direction that does not exist)."""
        return self.verdict in (ALWAYS, NOT_APPLICABLE) or (self.verdict == UNDER_MODE and deterministic_mode)


@dataclass(frozen=True)
class BackendDeterminism:
    op: str
    backend: str
    forward: Direction
    backward: Direction


_FIXED_ORDER = Direction(ALWAYS, "every output element is reduced by one program in a fixed order")
_NO_GRAD = Direction(NOT_APPLICABLE, "no backward (a selection)")
_INDEX_ADD = Direction(UNDER_MODE, "index_add_ into shared rows: CUDA atomics unless "
                                   "torch.use_deterministic_algorithms(True)")

REGISTRY: tuple[BackendDeterminism, ...] = (
    BackendDeterminism("sparse_attention", "torch", _FIXED_ORDER, _INDEX_ADD),
    BackendDeterminism("sparse_attention", "triton", _FIXED_ORDER, Direction(
        UNDER_MODE, "fp32 atomics on the kv gradients unless deterministic mode selects the sorted reduction")),
    BackendDeterminism("sparse_attention", "triton-deterministic", _FIXED_ORDER, Direction(
        ALWAYS, "kv gradients reduced per row in sorted order, no atomics")),
    BackendDeterminism("sparse_attention", "flashmla", Direction(ALWAYS, "no atomics"),
                       Direction(NOT_APPLICABLE, "forward only")),
    BackendDeterminism("sparse_attention", "cudnn", Direction(NOT_APPLICABLE, "backward only"), Direction(
        NEVER, "fp32 atomics on dkv and d_sink (cuDNN refuses deterministic mode)")),
    BackendDeterminism("indexer_topk", "torch", Direction(ALWAYS, "torch.topk; ties go to the earlier entry"),
                       _NO_GRAD),
    BackendDeterminism("indexer_topk", "triton", Direction(
        ALWAYS, "scores and select per query block; ties go to the earlier entry; radix counts are integer "
                "atomics (order-free)"), _NO_GRAD),
    BackendDeterminism("indexer_scores", "torch", _FIXED_ORDER, _INDEX_ADD),
    BackendDeterminism("indexer_scores", "triton", _FIXED_ORDER, Direction(
        UNDER_MODE, "fp32 atomics into the key gradient unless deterministic mode (or the kernel option "
                    "triton_scores_bwd_reduce=sorted / sorted-bf16) selects the sorted reduction")),
    BackendDeterminism("indexer_kl", "triton", Direction(
        ALWAYS, "one program per row, then torch.sum over the rows; no atomics"),
        Direction(ALWAYS, "the forward's saved score gradient scaled elementwise")),
    BackendDeterminism("compress_pool", "torch", _FIXED_ORDER, _INDEX_ADD),
    BackendDeterminism("compress_pool", "triton", _FIXED_ORDER,
                       Direction(ALWAYS, "every input gradient written by one program, no atomics")),
    BackendDeterminism("norm_rope", "triton", _FIXED_ORDER,
                       Direction(ALWAYS, "one program per (row, head block); no cross-row sum")),
    BackendDeterminism("attention_probs", "triton", Direction(ALWAYS, "no atomics"),
                       Direction(NOT_APPLICABLE, "no backward (the indexer loss's target)")),
)


def lookup(op: str, backend: str) -> BackendDeterminism:
    """The entry of ``backend`` for ``op``; ``ValueError`` naming both when none is registered."""
    for entry in REGISTRY:
        if entry.op == op and entry.backend == backend:
            return entry
    known = sorted({f"{e.op}/{e.backend}" for e in REGISTRY})
    raise ValueError(f"backend: no determinism entry for op {op!r} backend {backend!r}; known: {known}")


def attention_replays_bitwise(backend_name: str, device: torch.device, deterministic_mode: bool) -> bool:
    """Whether a layer step whose sparse attention runs the resolved ``backend_name`` (``"fwd"`` or
    ``"fwd+bwd"``) replays bitwise on ``device``, with or without deterministic mode.

    On CUDA the layer's other ops count too: the indexer scores' Triton backward adds with atomics unless
    deterministic mode selects its sorted reduction, and the torch glue (gathers' backwards) is
    deterministic only in that mode. On CPU every path is deterministic.
    """
    if torch.device(device).type != "cuda":
        return True
    forward, plus, backward = backend_name.partition("+")
    backward = backward if plus else forward
    return (deterministic_mode and lookup("sparse_attention", forward).forward.holds(True)
            and lookup("sparse_attention", backward).backward.holds(True))


def registry_lines() -> list[str]:
    """One line per (op, backend): the verdict of each direction, with the reason where it is not always
    deterministic."""
    def shown(direction: Direction) -> str:
        return direction.verdict if direction.verdict in (ALWAYS, NOT_APPLICABLE) else \
            f"{direction.verdict}: {direction.reason}"

    return [f"{e.op + '/' + e.backend:>38}: forward {shown(e.forward)}; backward {shown(e.backward)}"
            for e in REGISTRY]


def deterministic_backend(name: str, device: torch.device, head_dim: int | None = None) -> str:
    """The sparse-attention backend a deterministic run of ``name`` uses on ``device``: "auto" resolved in
    deterministic mode with Triton as ``triton-deterministic``; an explicit name as it is. ``ValueError``
    naming ``kernel_backend`` when that backend cannot replay bitwise even in the mode (e.g. cudnn)."""
    from dsv4cp.ops.sparse_attention import resolve_backend

    with deterministic_algorithms():
        resolved = resolve_backend(name, device, head_dim=head_dim).name
    parts = ["triton-deterministic" if part == "triton" else part for part in resolved.split("+")]
    chosen = parts[0] if len(set(parts)) == 1 else "+".join(parts)
    if not attention_replays_bitwise(chosen, device, deterministic_mode=True):
        raise ValueError(f"kernel_backend: {name!r} ({resolved}) is not deterministic on {device}; "
                         "use auto, torch or triton-deterministic")
    return chosen if name == "auto" else name
