"""FlashMLA's sparse-prefill forward as the forward-only sparse-attention backend "flashmla" (docs/design.md §4.2).

Library call (``flash_mla/flash_mla_interface.py`` and ``tests/ref.py`` of deepseek-ai/FlashMLA)::

    flash_mla.flash_mla_sparse_fwd(q [T, Hl, D] bf16, kv [N, 1, D] bf16, indices [T, 1, Kl] int32, sm_scale,
                                   d_v=512, attn_sink=[Hl] fp32 | None, topk_length=[T] int32 | None
                                   [, use_legacy=False])
        -> (out [T, Hl, 512] bf16, max_logits [T, Hl] fp32, lse [T, Hl] fp32)

Two packagings provide it: an upstream source build, and the wheel ``sgl-flash-mla`` (SGLang's packaging;
``pip install --no-deps sgl-flash-mla==1.0.0``: its metadata asks for a newer torch than the abi3 build
needs). The wheel's function takes ``use_legacy``: its default path is SM100-only ("only supported on
SM100f") and its SM90 sparse-prefill kernels run with ``use_legacy=True``. The adapter reads the
function's signature once per function and passes ``use_legacy=True`` on SM90 when it is accepted.

* an index ``< 0`` (or ``>= N``) is an empty slot; with ``topk_length`` query ``t`` reads its first
  ``topk_length[t]`` slots only;
* ``lse`` is the natural-log sum of ``exp(sm_scale * <q, k>)`` over the valid keys, EXCLUDING the sink
  (the sink only rescales ``out`` by ``e^lse / (e^lse + e^sink)``); a query with no valid key gets
  ``out = 0`` and ``lse = +inf``;
* Hopper kernels: ``Hl`` in {64, 128}; ``Kl`` a multiple of 128 and at least 128; ``d_v = 512``. With
  ``D = 576`` the keys have 576 columns but the values only their first 512.

Adapter to the op contract (:func:`dsv4cp.ops.sparse_attention`), whose value is the WHOLE kv row:

* ``D`` must be 512 (``D = 576`` would give a ``[T, H, 512]`` output of a different op: ValueError);
* heads go in groups of at most 128, each padded to 64 or 128 with zero queries and ``-inf`` sinks
  (a ``-inf`` sink has no effect); the padded heads' outputs are dropped;
* ``idx`` is compacted (``compact``: the kernel option ``library_compact_slots``, default 1): each query's valid slots
  (``>= 0`` and before the op's ``topk_length``) first, in their order, ``-1`` after them, padded to a
  multiple of 128 (at least 128), and their count passed as ``topk_length``
  (:func:`~dsv4cp.kernels._library.compact_slots`), so the kernel skips the empty slots of short rows
  (packed documents) instead of computing them; with ``0``, ``idx`` is padded with ``-1`` as it is and
  the op's ``topk_length``, clamped to ``[0, Kt]``, passed on;
* ``q`` and ``kv`` are cast to bf16 (fp16 / fp32 inputs are computed in bf16 and ``out`` is returned in
  ``q``'s dtype); fp64 is rejected;
* ``lse = +inf`` (no valid key) becomes ``-inf``.

The forward is deterministic (no atomics). Importing this module never imports ``flash_mla``.
"""

from __future__ import annotations

import functools
import importlib
import inspect

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

NAME = "flashmla"
MISSING_HINT = (
    "the 'flashmla' backend needs the FlashMLA package (import name 'flash_mla'): the wheel "
    "'pip install --no-deps sgl-flash-mla==1.0.0', or a source build of https://github.com/deepseek-ai/FlashMLA "
    "with the SM90 sparse-prefill kernels; and an SM90+ CUDA device"
)
SUPPORTED_HEAD_DIMS = (512,)
VALUE_DIM = 512
HEAD_GROUP_SIZES = (64, 128)
"""Head counts the kernels accept; a group of ``h`` heads is padded to the first size ``>= h``."""
TOPK_MULTIPLE = 128
"""The kernels' key-block size: the slot count must be a multiple of it (and at least one block)."""


# ------------------------------------------------------------------------------------------ availability
def library_problem() -> str | None:
    """Why ``flash_mla.flash_mla_sparse_fwd`` cannot be used in this process, or None."""
    try:
        module = importlib.import_module("flash_mla")
    except Exception as exc:  # noqa: BLE001  (ImportError, or OSError / undefined symbol of a bad build)
        return f"'import flash_mla' failed ({type(exc).__name__}: {exc})"
    if not callable(getattr(module, "flash_mla_sparse_fwd", None)):
        return "flash_mla has no flash_mla_sparse_fwd (a FlashMLA build without the sparse prefill)"
    return None


def device_problem(device: torch.device | str) -> str | None:
    """Why ``device`` cannot run FlashMLA's sparse prefill, or None (checked before importing anything)."""
    return sm90_problem(device, "FlashMLA's sparse prefill")


unavailable_reason, available = availability(device_problem, library_problem, MISSING_HINT)
"""``unavailable_reason(device)``: the first reason (device, then package) or None; ``available(device)``:
a CUDA device of SM90+ and an importable ``flash_mla`` with ``flash_mla_sparse_fwd``."""


def _library():
    return entry_point(NAME, library_problem(), MISSING_HINT,
                       lambda: importlib.import_module("flash_mla").flash_mla_sparse_fwd)


@functools.lru_cache(maxsize=8)
def accepts_use_legacy(sparse_fwd) -> bool:
    """Whether ``sparse_fwd`` takes a ``use_legacy`` argument (the ``sgl-flash-mla`` wheel does, an upstream
    build may not). Read from its signature once per function object; a signature that cannot be read
    (a bare C extension) counts as no."""
    try:
        parameters = inspect.signature(sparse_fwd).parameters
    except (TypeError, ValueError):
        return False
    return "use_legacy" in parameters


def call_options(sparse_fwd, device: torch.device) -> dict:
    """Extra keyword arguments for ``sparse_fwd`` on ``device``: ``use_legacy=True`` on SM90 when accepted
    (the wheel's non-legacy path is SM100-only), none otherwise (SM100 takes the default path)."""
    if compute_capability_major(device) == 9 and accepts_use_legacy(sparse_fwd):
        return {"use_legacy": True}
    return {}


def compute_capability_major(device: torch.device) -> int | None:
    """The SM major version of a CUDA ``device`` (9 for Hopper), None for any other device."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None


# ------------------------------------------------------------------------------------------ adapter
def padded_slots(kt: int) -> int:
    """The slot count handed to the library for ``kt`` slots."""
    return round_up(kt, TOPK_MULTIPLE)


def head_groups(h: int) -> list[tuple[int, int, int]]:
    """``(first head, last head + 1, padded count)`` of each library call for ``h`` heads."""
    groups = []
    largest = HEAD_GROUP_SIZES[-1]
    for h0 in range(0, h, largest):
        h1 = min(h0 + largest, h)
        groups.append((h0, h1, next(size for size in HEAD_GROUP_SIZES if size >= h1 - h0)))
    return groups


def sparse_attention_forward(q, kv, idx, sink, scale, topk_length=None, *, compact: bool = True):
    """``(out [T, H, D] in q.dtype, lse [T, H] fp32)`` of the op contract, computed by FlashMLA."""
    check_inputs(q, kv, idx, sink, name=NAME, library="FlashMLA", head_dims=SUPPORTED_HEAD_DIMS,
                 computes_in="bf16")
    t, h, d = q.shape
    kt = idx.shape[1]
    if t == 0 or kt == 0:
        return (torch.zeros(t, h, d, dtype=q.dtype, device=q.device),
                torch.full((t, h), float("-inf"), dtype=torch.float32, device=q.device))
    sparse_fwd = _library()
    options = call_options(sparse_fwd, q.device)

    kv_lib = kv.to(torch.bfloat16).contiguous().unsqueeze(1)  # [N, 1, D]: one kv head
    kl = padded_slots(kt)
    if compact:  # valid slots first, their count as the length
        idx_lib, length = compact_slots(idx, topk_length, kl)
    else:
        idx_lib = idx.to(torch.int32)
        if kl != kt:
            idx_lib = F.pad(idx_lib, (0, kl - kt), value=-1)
        length = None if topk_length is None else topk_length.clamp(0, kt).to(torch.int32).contiguous()
    idx_lib = idx_lib.contiguous().unsqueeze(1)  # [T, 1, Kl]

    outs, lses = [], []
    for h0, h1, hp in head_groups(h):
        q_g = q[:, h0:h1].to(torch.bfloat16)
        sink_g = sink[h0:h1].to(torch.float32)
        if hp != h1 - h0:
            q_g = F.pad(q_g, (0, 0, 0, hp - (h1 - h0)))  # zero queries
            sink_g = F.pad(sink_g, (0, hp - (h1 - h0)), value=float("-inf"))
        result = sparse_fwd(q_g.contiguous(), kv_lib, idx_lib, float(scale), d_v=VALUE_DIM,
                            attn_sink=sink_g.contiguous(), topk_length=length, **options)
        outs.append(result[0][:, : h1 - h0])
        lses.append(result[2][:, : h1 - h0])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)
    out = out.to(q.dtype).contiguous()
    lse = lse.to(torch.float32)
    lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))  # FlashMLA marks "no valid key" with +inf
    return out, lse
