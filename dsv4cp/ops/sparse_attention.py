"""``sparse_attention``: the one attention op of the layer (docs/design.md §4.1), with pluggable backends.

Every key, window or compressed, reaches attention through this op; backends register a forward and
a backward implementing the same contract, and ``torch`` is the oracle the others are tested against.
Each call notes the implementation that ran per direction (``sparse_attention.fwd`` / ``.bwd``,
:func:`dsv4cp.kernel_options.note_backend`); ``options`` (a :class:`~dsv4cp.kernel_options.KernelOptions`)
holds the kernel options of both directions: the backends get it as their ``options`` keyword and hand its
values to the kernels, and the autograd function keeps it for the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4cp import choices, kernel_options, kernels
from dsv4cp.kernel_options import DEFAULT_OPTIONS, OPTIONS, KernelOptions
from dsv4cp.kernels import cudnn_dsa, flashmla
from dsv4cp.kernels.contracts import check_sparse_attention_inputs as _check_inputs
from dsv4cp.ops import sparse_attention_torch
from dsv4cp.profiling.injection import injected_slowdown
from dsv4cp.profiling.nvtx import nvtx_range


@dataclass(frozen=True)
class SparseAttentionBackend:
    """A forward ``(q, kv, idx, sink, scale, topk_length, *, options) -> (out, lse)`` and a backward
    ``(dout, q, kv, idx, sink, scale, out, lse, topk_length, *, options) -> (dq, dkv, dsink)``, ``options``
    the call's :class:`~dsv4cp.kernel_options.KernelOptions` (keyword, default: the defaults).

    Either may be None for a one-sided library (FlashMLA has only a forward, cuDNN's DSA only a
    backward on Hopper); such backends are used in a pair named ``"forward+backward"``, e.g.
    ``"flashmla+cudnn"`` or ``"triton+cudnn"``. A resolved backend's ``name`` is that of its one backend
    (``"triton"``) or the pair of its two (``"flashmla+cudnn"``): what records store.
    """

    name: str
    forward: Callable | None
    backward: Callable | None
    available: Callable[[torch.device], bool]
    head_dims: tuple[int, ...] | None = None
    """The head dims D the backend runs (None: any); "auto" passes over it for others (FlashMLA and
    cuDNN's DSA kernels exist for D = 512 only)."""

    def runs_head_dim(self, head_dim: int | None) -> bool:
        return head_dim is None or self.head_dims is None or head_dim in self.head_dims

    @property
    def direction_names(self) -> tuple[str, str]:
        """``(forward, backward)`` backend names: ``"flashmla+cudnn"`` -> ``("flashmla", "cudnn")``,
        ``"triton"`` -> ``("triton", "triton")``."""
        forward, plus, backward = self.name.partition("+")
        return (forward, backward) if plus else (forward, forward)


_BACKENDS: dict[str, SparseAttentionBackend] = {}
# What "auto" tries per direction, fastest first as measured on an H200 (docs/kernels.md); the first
# available on a CUDA device wins. On
# any other device "auto" is the oracle "torch": Triton's CPU interpreter is for kernel tests only.
AUTO_FORWARD_ORDER: list[str] = ["flashmla", "triton"]
AUTO_BACKWARD_ORDER: list[str] = ["cudnn", "triton"]
AUTO_NONDETERMINISTIC: set[str] = {"cudnn"}
"""Backwards "auto" passes over while deterministic mode is on (cuDNN's DSA backward adds with fp32 atomics
and refuses that mode; "triton" then reduces without atomics)."""
FALLBACK = "torch"
_AUTO_RESOLVED: dict[tuple[str, bool, int | None], SparseAttentionBackend] = {}
""""auto" resolved per (device, deterministic mode, head dim): availability checks import libraries, once
is enough."""


def register_backend(backend: SparseAttentionBackend) -> None:
    """Add (or replace) a backend; "auto" tries it only if its name is in ``AUTO_FORWARD_ORDER`` /
    ``AUTO_BACKWARD_ORDER``."""
    _BACKENDS[backend.name] = backend
    _AUTO_RESOLVED.clear()  # a new backend may change what "auto" picks


def backend_names() -> list[str]:
    return list(_BACKENDS)


def check_backend_name(name: str) -> None:
    """Raise ``ValueError`` for a name no registered backend (or pair of them) answers to, before any work."""
    choices.check_backend_name(name, _BACKENDS)


def resolve_backend(name: str, device: torch.device, head_dim: int | None = None) -> SparseAttentionBackend:
    """The backend called ``name`` on ``device``; ``"auto"`` takes the fastest available forward and,
    independently, the fastest available backward that run ``head_dim`` (resolved once per device and
    head dim; None: the choice for head dims every backend runs).

    ``"A+B"`` pairs the forward of backend A with the backward of backend B; an explicit name wins over
    "auto"'s preferences and fails with ``ValueError`` when that backend cannot run on ``device``.
    """
    if name == "auto":
        deterministic = kernels.is_deterministic()
        key = (str(torch.device(device)), deterministic, head_dim)
        if key not in _AUTO_RESOLVED:
            backward_order = [n for n in AUTO_BACKWARD_ORDER if not (deterministic and n in AUTO_NONDETERMINISTIC)]
            _AUTO_RESOLVED[key] = _pair(_auto_choice(AUTO_FORWARD_ORDER, "forward", device, head_dim),
                                        _auto_choice(backward_order, "backward", device, head_dim))
        return _AUTO_RESOLVED[key]
    if "+" in name:
        fwd_name, _, bwd_name = name.partition("+")
        fwd, bwd = available_backend(fwd_name, device), available_backend(bwd_name, device)
        if fwd.forward is None:
            raise ValueError(f"backend: {fwd_name!r} has no forward; it cannot come first in {name!r}")
        if bwd.backward is None:
            raise ValueError(f"backend: {bwd_name!r} has no backward; it cannot come second in {name!r}")
        for part in (fwd, bwd):
            _check_head_dim(part, head_dim)
        return _pair(fwd, bwd)
    backend = available_backend(name, device)
    _check_head_dim(backend, head_dim)
    if backend.forward is None or backend.backward is None:
        side = "forward" if backend.forward is None else "backward"
        raise ValueError(f"backend: {name!r} has no {side}; pair it, e.g. 'flashmla+cudnn' or 'triton+cudnn'")
    return backend


def check_head_dim(name: str, head_dim: int) -> None:
    """``ValueError`` when a backend ``name`` names explicitly cannot run ``head_dim`` on any device
    ("auto" passes over such backends); ``name`` is a valid one (:func:`check_backend_name`)."""
    for part in [] if name == "auto" else name.split("+"):
        _check_head_dim(_BACKENDS[part], head_dim)


def _check_head_dim(backend: SparseAttentionBackend, head_dim: int | None) -> None:
    """An explicitly named backend that cannot run ``head_dim`` fails here, before any collective."""
    choices.check_runs_head_dim(backend.name, backend.head_dims, head_dim)


def _auto_choice(order: list[str], side: str, device: torch.device, head_dim: int | None) -> SparseAttentionBackend:
    """The first backend of ``order`` that has ``side``, runs ``head_dim`` and is available on CUDA
    ``device``, else "torch"."""
    if torch.device(device).type == "cuda":
        for candidate in order:
            backend = _BACKENDS.get(candidate)
            if (backend is not None and getattr(backend, side) is not None and backend.runs_head_dim(head_dim)
                    and backend.available(device)):
                return backend
    return _BACKENDS[FALLBACK]


def _pair(fwd: SparseAttentionBackend, bwd: SparseAttentionBackend) -> SparseAttentionBackend:
    """``fwd``'s forward with ``bwd``'s backward, named ``"fwd+bwd"`` (or ``fwd`` itself when the same)."""
    if fwd is bwd:
        return fwd
    return SparseAttentionBackend(f"{fwd.name}+{bwd.name}", fwd.forward, bwd.backward, lambda d: True)


def available_backend(name: str, device: torch.device) -> SparseAttentionBackend:
    """The registered backend ``name`` as it is, one-sided or not (benchmarks time each side alone);
    ``ValueError`` when it is unknown or cannot run on ``device``."""
    if name not in _BACKENDS:
        raise ValueError(f"backend: unknown sparse-attention backend {name!r}; choose from {['auto', *_BACKENDS]}")
    backend = _BACKENDS[name]
    if not backend.available(device):
        hint = getattr(backend.available, "missing_hint", None) or "is its package installed?"
        raise ValueError(f"backend: {name!r} is not available on device {device} ({hint})")
    return backend


# ------------------------------------------------------------------------------------------ backends
# The op chooses its kernels: this module imports dsv4cp.kernels (never the reverse) and registers
# "torch" (the oracle), "triton" and "triton-deterministic" (own kernels, docs/design.md §4.2) and the one-sided
# library adapters "flashmla" (forward) and "cudnn" (backward), which "auto" prefers where available. Importing
# triton or a library waits for first use: on CPU, Triton's interpreter needs TRITON_INTERPRET=1 set
# before triton's first import.


OPTION_NAMES = ("triton_fwd_config", "triton_fwd_logits", "triton_fwd_index_ahead", "triton_fwd_lazy_rescale",
                "triton_bwd_config", "triton_dkv_config", "triton_dq_in_dkv", "triton_dkv_one_product",
                "triton_bwd_index_ahead", "library_compact_slots", "triton_bwd_dq_pass", "triton_kv_pass_config",
                "triton_dq_pass_config", "triton_fwd_warp_specialize")
"""The kernel options the backends read: the custom ops (:mod:`.sparse_attention_library`) take their values
as arguments (:func:`option_values`), so a compiled graph holds them as constants."""


def option_values(options: KernelOptions) -> tuple:
    """``options``' values of :data:`OPTION_NAMES`, in order, as the custom ops take them."""
    return options.op_values(OPTION_NAMES)


def options_of(values: tuple) -> KernelOptions:
    """The options the custom ops' ``values`` (:func:`option_values`) hold (every other option: its default)."""
    return KernelOptions.from_op_values(OPTION_NAMES, values)


def _tile(fields: tuple[str, ...], tile: tuple[int, ...] | None) -> dict[str, int]:
    """A pinned tile as the kernel wrapper's keyword arguments (none for ``auto``: the ladder)."""
    return dict(zip(fields, tile)) if tile is not None else {}


def _torch_forward(q, kv, idx, sink, scale, topk_length=None, *, options=DEFAULT_OPTIONS):
    return sparse_attention_torch.sparse_attention_forward(q, kv, idx, sink, scale, topk_length)


def _torch_backward(dout, q, kv, idx, sink, scale, out, lse, topk_length=None, *, options=DEFAULT_OPTIONS):
    return sparse_attention_torch.sparse_attention_backward(dout, q, kv, idx, sink, scale, out, lse, topk_length)


def _triton_forward(q, kv, idx, sink, scale, topk_length=None, *, options=DEFAULT_OPTIONS):
    if q.dtype == torch.float64:  # tl.dot has no fp64 matrix-unit path: the oracle serves fp64 (tests)
        kernel_options.note_backend("sparse_attention.fwd", "torch")
        return sparse_attention_torch.sparse_attention_forward(q, kv, idx, sink, scale, topk_length)
    from dsv4cp.kernels.sparse_attention_triton import sparse_attention_fwd  # lazy: imports triton

    return sparse_attention_fwd(q, kv, idx, sink, scale, topk_length, logits=options.triton_fwd_logits,
                                index_ahead=options.triton_fwd_index_ahead,
                                lazy_rescale=options.triton_fwd_lazy_rescale,
                                warp_specialize=options.triton_fwd_warp_specialize,
                                **_tile(OPTIONS["triton_fwd_config"].fields, options.triton_fwd_config))


def _triton_backward(deterministic: bool | None) -> Callable:
    """The Triton backward; ``deterministic=None`` follows :func:`dsv4cp.kernels.is_deterministic`."""

    def backward(dout, q, kv, idx, sink, scale, out, lse, topk_length=None, *, options=DEFAULT_OPTIONS):
        if q.dtype == torch.float64:
            kernel_options.note_backend("sparse_attention.bwd", "torch")
            return sparse_attention_torch.sparse_attention_backward(dout, q, kv, idx, sink, scale, out, lse,
                                                                    topk_length)
        if options.triton_bwd_dq_pass and not (kernels.is_deterministic() if deterministic is None else deterministic):
            from dsv4cp.kernels.sparse_attention_bwd_dq_pass_triton import (  # lazy: imports triton
                DqPassConfig,
                KvPassConfig,
                sparse_attention_bwd_dq_pass,
            )

            kv_tile, dq_tile = options.triton_kv_pass_config, options.triton_dq_pass_config
            return sparse_attention_bwd_dq_pass(dout, q, kv, idx, sink, scale, out, lse, topk_length,
                                                kv_config=None if kv_tile is None else KvPassConfig(*kv_tile),
                                                dq_config=None if dq_tile is None else DqPassConfig(*dq_tile))
        from dsv4cp.kernels.sparse_attention_triton import DkvConfig, sparse_attention_bwd  # lazy: imports triton

        dkv = options.triton_dkv_config
        return sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, topk_length, deterministic=deterministic,
                                    dkv_config=None if dkv is None else DkvConfig(*dkv),
                                    dq_in_dkv=options.triton_dq_in_dkv, dkv_one_product=options.triton_dkv_one_product,
                                    index_ahead=options.triton_bwd_index_ahead,
                                    **_tile(OPTIONS["triton_bwd_config"].fields, options.triton_bwd_config))

    return backward


def _flashmla_forward(q, kv, idx, sink, scale, topk_length=None, *, options=DEFAULT_OPTIONS):
    return flashmla.sparse_attention_forward(q, kv, idx, sink, scale, topk_length,
                                             compact=options.library_compact_slots)


def _cudnn_backward(dout, q, kv, idx, sink, scale, out, lse, topk_length=None, *, options=DEFAULT_OPTIONS):
    return cudnn_dsa.sparse_attention_backward(dout, q, kv, idx, sink, scale, out, lse, topk_length,
                                               compact=options.library_compact_slots)


register_backend(SparseAttentionBackend("torch", _torch_forward, _torch_backward, available=lambda device: True))
register_backend(SparseAttentionBackend("triton", _triton_forward, _triton_backward(None), kernels.triton_available))
register_backend(SparseAttentionBackend("triton-deterministic", _triton_forward, _triton_backward(True),
                                        kernels.triton_available))
register_backend(SparseAttentionBackend(flashmla.NAME, _flashmla_forward, None, flashmla.available,
                                        head_dims=flashmla.SUPPORTED_HEAD_DIMS))
register_backend(SparseAttentionBackend(cudnn_dsa.NAME, None, _cudnn_backward, cudnn_dsa.available,
                                        head_dims=cudnn_dsa.SUPPORTED_HEAD_DIMS))


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, sink, scale, topk_length, backend, options):
        kernel_options.note_backend("sparse_attention.fwd", backend.direction_names[0])
        with injected_slowdown("sparse_attn", options.inject_slowdown):  # in the caller's range
            out, lse = backend.forward(q, kv, idx, sink, scale, topk_length, options=options)
        ctx.save_for_backward(q, kv, idx, sink, out, lse, topk_length)
        ctx.scale, ctx.backend, ctx.options = scale, backend, options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, idx, sink, out, lse, topk_length = ctx.saved_tensors
        kernel_options.note_backend("sparse_attention.bwd", ctx.backend.direction_names[1])
        with nvtx_range("sparse_attn.bwd"), injected_slowdown("sparse_attn", ctx.options.inject_slowdown):
            dq, dkv, dsink = ctx.backend.backward(dout.contiguous(), q, kv, idx, sink, ctx.scale, out, lse, topk_length,
                                                  options=ctx.options)
        return dq, dkv, None, dsink, None, None, None, None


def _check_index_values(n_rows: int, idx: torch.Tensor, topk_length: torch.Tensor | None) -> None:
    """``idx`` entries in ``{-1} U [0, n_rows)`` and ``topk_length`` in ``[0, Kt]`` (else the torch
    backend raises a raw IndexError or silently wraps a negative index, and the kernels read garbage)."""
    _require((idx >= -1) & (idx < n_rows), idx, f"idx: entries must be -1 (empty) or in [0, {n_rows}) (kv rows)")
    if topk_length is not None:
        kt = idx.shape[1]
        _require((topk_length >= 0) & (topk_length <= kt), topk_length, f"topk_length: entries must be in [0, {kt}]")


def _require(ok: torch.Tensor, values: torch.Tensor, message: str) -> None:
    """``ValueError(message, the first bad values)`` on CPU; on CUDA an asynchronous device assertion,
    so the check costs no host synchronisation and stays capturable in CUDA graphs."""
    if values.device.type == "cpu":
        if not bool(ok.all()):
            raise ValueError(f"{message}, got {values[~ok][:5].tolist()}")
    else:
        torch._assert_async(ok.all(), message)


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    topk_length: torch.Tensor | None = None,
    backend: str = "auto",
    options: KernelOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query sparse attention with an attention sink, over flat packed tensors.

    Args:
        q: ``[T, H, D]`` queries (fp32, fp64 or bf16).
        kv: ``[N, D]`` rows, each both key and value of every head (same dtype as ``q``).
        idx: ``[T, Kt]`` int32 rows of ``kv`` each query attends to; ``-1`` marks an empty slot.
            A repeated row counts as that many keys. Every entry must be ``-1`` or in ``[0, N)``
            (no other negative index has a meaning).
        sink: ``[H]`` fp32 per-head sink logit (a key with logit ``sink_h`` and a zero value).
        scale: logit scale (``D ** -0.5`` in the model).
        topk_length: optional ``[T]`` int32 in ``[0, Kt]``; query ``t`` uses only its first
            ``topk_length[t]`` slots.
        backend: "torch", another registered backend, or "auto".
        options: the kernel options of this call's forward and, later, its backward (default: the
            registry's defaults; :meth:`dsv4cp.kernel_options.KernelOptions.resolve` adds the environment's).

    Returns:
        ``out [T, H, D]`` in ``q``'s dtype: ``sum_j e^{l_j} kv_j / (sum_j e^{l_j} + e^{sink_h})`` with
        ``l_j = scale <q, kv_j>``, zero for a row with no valid key; and ``lse [T, H]`` fp32 (fp64 for
        fp64 inputs): ``log sum_j e^{l_j}`` over the valid keys EXCLUDING the sink, ``-inf`` when none.
        Differentiable in ``q``, ``kv`` and ``sink``.

    Raises ``ValueError`` naming the argument for a bad shape, dtype or device and, for CPU tensors,
    an index or length out of range. On CUDA the ranges are asserted on the device instead (no host
    synchronisation): a violation stops the run with a device-side assertion naming the argument.
    """
    _check_inputs(q, kv, idx, sink, topk_length)
    if torch.compiler.is_compiling():  # one opaque node per direction: dsv4cp.ops.sparse_attention_library
        return torch.ops.dsv4cp.sparse_attention_fwd(q, kv, idx, sink, float(scale), topk_length, backend,
                                                     *option_values(options))
    if not isinstance(options, KernelOptions):
        raise ValueError(f"options: must be a KernelOptions, got {type(options).__name__}")
    chosen = resolve_backend(backend, q.device, head_dim=q.shape[-1])
    with nvtx_range("sparse_attn.fwd"):  # one range: on CUDA the index checks are kernels of the attention
        _check_index_values(kv.shape[0], idx, topk_length)
        out, lse = _SparseAttention.apply(q, kv, idx, sink, float(scale), topk_length, chosen, options)
    return out, lse
