"""cuDNN frontend's DeepSeek-sparse-attention backward as the backward-only backend "cudnn" (docs/design.md §4.2).

Library call (``python/cudnn/deepseek_sparse_attention/sparse_attention_backward/{api,op,_interface_sm90,
dsa_bwd_sm90}.py`` of NVIDIA/cudnn-frontend; wheel ``nvidia-cudnn-frontend`` 1.32 with CuTe DSL)::

    cudnn.DSA.sparse_attention_backward_wrapper(q [T, Hl, D], kv [N, D], out [T, Hl, Dv], dout [T, Hl, Dv],
        lse [T, Hl] fp32, attn_sink [Hl] fp32, topk_idxs [T, Kl] int32, softmax_scale=None, topk_length=None)
        -> {"dq": [T, Hl, D] q.dtype, "dkv": [N, D] kv.dtype, "d_sink": [Hl] fp32}

* flat MQA tensors (one kv head, K = V), all row-major contiguous; q, kv, out, dout of one dtype, fp16
  or bf16 (bf16 only on SM100); ``D`` in {512, 576} with ``Dv = 512 if D == 576 else D``;
  ``Hl`` a multiple of 64 (the kernels' head tile);
* ``lse`` is the natural-log, sink-EXCLUDED ("KV-only") lse of the forward; the sink is folded in
  by the kernel. A row with ``lse = -inf`` is treated as ``lse = 0`` (its keys must then all be empty);
* without ``topk_length`` a slot ``< 0`` is loaded as a zero key and left out of ``dkv``; WITH
  ``topk_length`` the SM90 kernel neither checks nor skips ``-1`` inside the first ``topk_length`` slots
  (it would read row -1 and add into it), and stops at it;
* SM90 adds ``dkv`` and ``d_sink`` with fp32 atomics: not deterministic.

Adapter to the op contract (:func:`dsv4cp.ops.sparse_attention`), whose value is the WHOLE kv row:

* ``D`` must be 512 (``D = 576`` means ``Dv = 512``, a different op: ValueError);
* heads padded to a multiple of 64 with zero ``q``/``out``/``dout``, ``lse = 0`` and ``-inf`` sinks: a
  padded head has zero ``dO`` and zero ``delta``, so it adds exactly nothing to ``dkv`` or ``d_sink``;
* ``idx`` is compacted (``compact``: the kernel option ``library_compact_slots``, default 1): each query's valid slots
  (``>= 0`` and before the op's ``topk_length``) first, in their order, ``-1`` after them, padded to a
  multiple of 64 (one key block), and their count passed as the library's ``topk_length``
  (:func:`~dsv4cp.kernels._library.compact_slots`), so the kernel skips the empty slots instead of
  computing them; with ``0``, ``topk_length`` is folded into ``idx`` (slots past it become ``-1``), padded
  likewise, and none is passed (empty slots cost compute but add nothing);
* fp16 and bf16 pass through; fp32 inputs are computed in bf16 and the gradients returned in the
  inputs' dtypes; fp64 is rejected;
* in deterministic mode (``torch.use_deterministic_algorithms``) it raises (warns in warn-only mode).

Importing this module never imports ``cudnn``.
"""

from __future__ import annotations

import importlib
import warnings

import torch
import torch.nn.functional as F

from dsv4cp.kernels._library import (
    availability,
    check_inputs,
    compact_slots,
    entry_point,
    round_up,
    sm90_problem,
)

NAME = "cudnn"
PACKAGE = "nvidia-cudnn-frontend"
MISSING_HINT = (
    f"the 'cudnn' backend needs the '{PACKAGE}' package (1.32, import name 'cudnn', whose DSA kernels need "
    "CuTe DSL 'nvidia-cutlass-dsl'; on a CUDA-13 driver use the CUDA-12 flavour "
    "'nvidia-cutlass-dsl-libs-cu12' 4.8.1, see README.md, 'Kernel backends') and an SM90+ CUDA device"
)
SUPPORTED_HEAD_DIMS = (512,)
HEAD_MULTIPLE = 64
"""The kernels' query-head tile: the head count must be a multiple of it."""
TOPK_MULTIPLE = 64
"""The kernels' key-block size; slots are padded to a multiple of it."""


# ------------------------------------------------------------------------------------------ availability
def library_problem() -> str | None:
    """Why ``cudnn.DSA.sparse_attention_backward_wrapper`` cannot be used in this process, or None."""
    try:
        module = importlib.import_module("cudnn")
    except Exception as exc:  # noqa: BLE001  (ImportError, or an OSError from loading libcudnn)
        return f"'import cudnn' failed ({type(exc).__name__}: {exc})"
    try:  # DSA is a lazy attribute: it imports CuTe DSL and may raise ImportError, not AttributeError
        wrapper = getattr(module.DSA, "sparse_attention_backward_wrapper", None)
    except Exception as exc:  # noqa: BLE001
        return f"cudnn.DSA could not be loaded ({type(exc).__name__}: {exc})"
    if not callable(wrapper):
        return "cudnn.DSA has no sparse_attention_backward_wrapper (nvidia-cudnn-frontend older than 1.32?)"
    return None


def device_problem(device: torch.device | str) -> str | None:
    """Why ``device`` cannot run the DSA backward, or None (checked before importing anything)."""
    return sm90_problem(device, "the cuDNN DSA backward")


unavailable_reason, available = availability(device_problem, library_problem, MISSING_HINT)
"""``unavailable_reason(device)``: the first reason (device, then package) or None; ``available(device)``:
a CUDA device of SM90+ and an importable ``cudnn`` whose ``DSA`` has the backward wrapper."""


def _library():
    return entry_point(NAME, library_problem(), MISSING_HINT,
                       lambda: importlib.import_module("cudnn").DSA.sparse_attention_backward_wrapper)


# ------------------------------------------------------------------------------------------ adapter
def _check_deterministic() -> None:
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (f"{NAME}: the cuDNN DSA backward accumulates dkv and d_sink with fp32 atomics and is not "
               "deterministic; use 'triton-deterministic' as the backward (e.g. backend "
               "'flashmla+triton-deterministic') or turn deterministic algorithms off")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, stacklevel=3)
    else:
        raise RuntimeError(message)


def padded_heads(h: int) -> int:
    """The head count handed to the library for ``h`` heads."""
    return round_up(h, HEAD_MULTIPLE)


def padded_slots(kt: int) -> int:
    """The slot count handed to the library for ``kt`` slots."""
    return round_up(kt, TOPK_MULTIPLE)


def _pad_heads(x: torch.Tensor, heads: int, value: float = 0.0) -> torch.Tensor:
    """Pad dim 1 of ``[T, H, ...]`` (or dim 0 of ``[H]``) to ``heads`` with ``value``; contiguous."""
    missing = heads - (x.shape[1] if x.dim() > 1 else x.shape[0])
    if missing:
        pad = [0, 0] * (x.dim() - 2) + [0, missing] if x.dim() > 1 else [0, missing]
        x = F.pad(x, pad, value=value)
    return x.contiguous()


def _unpack(result) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The wrapper returns a ``TupleDict``: read it by key, falling back to ``(dq, dkv, d_sink)`` order."""
    try:
        return result["dq"], result["dkv"], result["d_sink"]
    except (KeyError, TypeError, IndexError):
        dq, dkv, dsink = tuple(result)[:3]
        return dq, dkv, dsink


def sparse_attention_backward(dout, q, kv, idx, sink, scale, out, lse, topk_length=None, *,
                              compact: bool = True):
    """``(dq, dkv, dsink)`` of the op contract, computed by cuDNN's DSA backward."""
    _check_deterministic()
    check_inputs(q, kv, idx, sink, name=NAME, library="cuDNN", head_dims=SUPPORTED_HEAD_DIMS,
                 computes_in="bf16/fp16")
    t, h, _ = q.shape
    kt = idx.shape[1]
    if t == 0 or kt == 0:  # no key anywhere: every gradient is zero
        return torch.zeros_like(q), torch.zeros_like(kv), torch.zeros_like(sink)
    backward_wrapper = _library()

    dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    kl = padded_slots(kt)
    length_lib = None
    if compact:  # valid slots first: no -1 before the length
        idx_lib, length_lib = compact_slots(idx, topk_length, kl)
    else:
        idx_lib = idx.to(torch.int32)
        if topk_length is not None:  # fold it into the indices: the kernel must not see -1 inside topk_length
            slots = torch.arange(kt, device=idx.device)
            idx_lib = torch.where(slots[None, :] < topk_length[:, None], idx_lib, -1).to(torch.int32)
        if kl != kt:
            idx_lib = F.pad(idx_lib, (0, kl - kt), value=-1)
        idx_lib = idx_lib.contiguous()

    hp = padded_heads(h)
    q_lib = _pad_heads(q.to(dtype), hp)
    out_lib = _pad_heads(out.to(dtype), hp)
    dout_lib = _pad_heads(dout.to(dtype), hp)
    lse_lib = _pad_heads(lse.to(torch.float32), hp, 0.0)  # finite lse: no inf - inf in the padded heads
    sink_lib = _pad_heads(sink.to(torch.float32), hp, float("-inf"))
    kv_lib = kv.to(dtype).contiguous()

    result = backward_wrapper(q_lib, kv_lib, out_lib, dout_lib, lse_lib, sink_lib, idx_lib,
                              softmax_scale=float(scale), topk_length=length_lib)
    dq, dkv, dsink = _unpack(result)
    if hp != h:
        dq, dsink = dq[:, :h].contiguous(), dsink[:h].contiguous()
    return dq.to(q.dtype), dkv.to(kv.dtype), dsink.to(sink.dtype)
