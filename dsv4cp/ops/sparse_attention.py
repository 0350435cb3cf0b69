"""``sparse_attention``: the one attention op of the layer (DESIGN 4.1), with pluggable backends.

Every key, window or compressed, reaches attention through this op; backends register a forward and
a backward implementing the same contract, and ``torch`` is the oracle the others are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dsv4cp.ops import sparse_attention_torch
from dsv4cp.profiling.nvtx import nvtx_range


@dataclass(frozen=True)
class SparseAttentionBackend:
    """A forward ``(q, kv, idx, sink, scale, topk_length) -> (out, lse)`` and a backward
    ``(dout, q, kv, idx, sink, scale, out, lse, topk_length) -> (dq, dkv, dsink)``.

    Either may be None for a one-sided library (FlashMLA has only a forward, cuDNN's DSA only a
    backward on Hopper); such backends are used in a pair named ``"forward+backward"``, e.g.
    ``"flashmla+cudnn"`` or ``"triton+cudnn"``.
    """

    name: str
    forward: Callable | None
    backward: Callable | None
    available: Callable[[torch.device], bool]


_BACKENDS: dict[str, SparseAttentionBackend] = {}
# Preference order of "auto": fastest first; the first available on the device wins.
AUTO_ORDER: list[str] = []


def register_backend(backend: SparseAttentionBackend, *, auto_rank: int | None = None) -> None:
    """Add a backend; ``auto_rank`` places it in the order "auto" tries (0 = first)."""
    _BACKENDS[backend.name] = backend
    if auto_rank is not None:
        AUTO_ORDER.insert(auto_rank, backend.name)


def backend_names() -> list[str]:
    return list(_BACKENDS)


def check_backend_name(name: str) -> None:
    """Raise ``ValueError`` for a name no backend (or pair of backends) answers to, before any work."""
    parts = (name.split("+") if "+" in name else [name]) if isinstance(name, str) else [name]
    unknown = [p for p in parts if p not in _BACKENDS and not (p == "auto" and len(parts) == 1)]
    if not isinstance(name, str) or len(parts) > 2 or unknown:
        raise ValueError(f"backend: unknown sparse-attention backend {name!r}; choose from {['auto', *_BACKENDS]} "
                         f"or a pair 'forward+backward'")


def resolve_backend(name: str, device: torch.device) -> SparseAttentionBackend:
    """The backend called ``name`` (or the fastest available for "auto") on ``device``.

    ``"A+B"`` pairs the forward of backend A with the backward of backend B.
    """
    if name == "auto":
        for candidate in AUTO_ORDER:
            if _BACKENDS[candidate].available(device):
                return _BACKENDS[candidate]
        return _BACKENDS["torch"]
    if "+" in name:
        fwd_name, _, bwd_name = name.partition("+")
        fwd, bwd = _available(fwd_name, device), _available(bwd_name, device)
        if fwd.forward is None:
            raise ValueError(f"backend: {fwd_name!r} has no forward; it cannot come first in {name!r}")
        if bwd.backward is None:
            raise ValueError(f"backend: {bwd_name!r} has no backward; it cannot come second in {name!r}")
        return SparseAttentionBackend(name, fwd.forward, bwd.backward, lambda d: True)
    backend = _available(name, device)
    if backend.forward is None or backend.backward is None:
        side = "forward" if backend.forward is None else "backward"
        raise ValueError(f"backend: {name!r} has no {side}; pair it, e.g. 'flashmla+cudnn' or 'triton+cudnn'")
    return backend


def _available(name: str, device: torch.device) -> SparseAttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"backend: unknown sparse-attention backend {name!r}; choose from {['auto', *_BACKENDS]}")
    backend = _BACKENDS[name]
    if not backend.available(device):
        hint = getattr(backend.available, "missing_hint", None) or "is its package installed?"
        raise ValueError(f"backend: {name!r} is not available on device {device} ({hint})")
    return backend


register_backend(
    SparseAttentionBackend(
        "torch", sparse_attention_torch.sparse_attention_forward,
        sparse_attention_torch.sparse_attention_backward, available=lambda device: True,
    ),
    auto_rank=0,
)


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, sink, scale, topk_length, backend):
        with nvtx_range("sparse_attn.fwd"):
            out, lse = backend.forward(q, kv, idx, sink, scale, topk_length)
        ctx.save_for_backward(q, kv, idx, sink, out, lse, topk_length)
        ctx.scale, ctx.backend = scale, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, idx, sink, out, lse, topk_length = ctx.saved_tensors
        with nvtx_range("sparse_attn.bwd"):
            dq, dkv, dsink = ctx.backend.backward(dout.contiguous(), q, kv, idx, sink, ctx.scale, out, lse, topk_length)
        return dq, dkv, None, dsink, None, None, None


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    topk_length: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query sparse attention with an attention sink, over flat packed tensors.

    Args:
        q: ``[T, H, D]`` queries (fp32, fp64 or bf16).
        kv: ``[N, D]`` rows, each both key and value of every head (same dtype as ``q``).
        idx: ``[T, Kt]`` int32 rows of ``kv`` each query attends to; ``-1`` marks an empty slot.
            A repeated row counts as that many keys.
        sink: ``[H]`` fp32 per-head sink logit (a key with logit ``sink_h`` and a zero value).
        scale: logit scale (``D ** -0.5`` in the model).
        topk_length: optional ``[T]`` int32; query ``t`` uses only its first ``topk_length[t]`` slots.
        backend: "torch", another registered backend, or "auto".

    Returns:
        ``out [T, H, D]`` in ``q``'s dtype: ``sum_j e^{l_j} kv_j / (sum_j e^{l_j} + e^{sink_h})`` with
        ``l_j = scale <q, kv_j>``, zero for a row with no valid key; and ``lse [T, H]`` fp32 (fp64 for
        fp64 inputs): ``log sum_j e^{l_j}`` over the valid keys EXCLUDING the sink, ``-inf`` when none.
        Differentiable in ``q``, ``kv`` and ``sink``.
    """
    _check_inputs(q, kv, idx, sink, topk_length)
    chosen = resolve_backend(backend, q.device)
    out, lse = _SparseAttention.apply(q, kv, idx, sink, float(scale), topk_length, chosen)
    return out, lse


def _check_inputs(q, kv, idx, sink, topk_length) -> None:
    for name, tensor in (("q", q), ("kv", kv), ("idx", idx), ("sink", sink)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: must be a tensor, got {type(tensor).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q: must be [T, H, D], got shape {tuple(q.shape)}")
    t, h, d = q.shape
    if kv.dim() != 2 or kv.shape[1] != d:
        raise ValueError(f"kv: must be [N, {d}], got shape {tuple(kv.shape)}")
    if kv.dtype != q.dtype:
        raise ValueError(f"kv: dtype must match q ({q.dtype}), got {kv.dtype}")
    if q.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"q: dtype must be a floating type, got {q.dtype}")
    if idx.dim() != 2 or idx.shape[0] != t:
        raise ValueError(f"idx: must be [{t}, Kt], got shape {tuple(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx: must be int32 (or int64), got {idx.dtype}")
    if sink.shape != (h,):
        raise ValueError(f"sink: must be [{h}], got shape {tuple(sink.shape)}")
    if not sink.is_floating_point():
        raise ValueError(f"sink: must be a floating tensor (fp32 in the model), got {sink.dtype}")
    if topk_length is not None and topk_length.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_length: must be int32 (or int64), got {topk_length.dtype}")
    if topk_length is not None and topk_length.shape != (t,):
        raise ValueError(f"topk_length: must be [{t}], got shape {tuple(topk_length.shape)}")
    for name, tensor in (("kv", kv), ("idx", idx), ("sink", sink), ("topk_length", topk_length)):
        if tensor is not None and tensor.device != q.device:
            raise ValueError(f"{name}: must be on q's device {q.device}, got {tensor.device}")


try:  # own Triton kernels ("triton", "triton-deterministic") and the optional FlashMLA / cuDNN adapters
    import dsv4cp.kernels  # noqa: E402,F401
except ImportError:  # pragma: no cover - the package is importable wherever dsv4cp is
    pass
