"""What the optional library adapters (:mod:`.flashmla`, :mod:`.cudnn_dsa`) share: the SM90+ device
check, the availability functions the registry reads, loading the library's entry point, and the checks
of the op contract that both apply before calling it. Importing this module imports no library."""

from __future__ import annotations

from collections.abc import Callable

import torch


def sm90_problem(device: torch.device | str, what: str) -> str | None:
    """Why ``device`` is not an SM90+ CUDA device, or None; ``what`` names what needs SM90."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"SM{major}{minor}: {what} needs SM90 or newer"
    return None


def availability(device_problem: Callable[[torch.device | str], str | None],
                 library_problem: Callable[[], str | None], missing_hint: str):
    """``(unavailable_reason, available)`` of an optional backend, from its device and package checks;
    ``available.missing_hint`` is read by the registry's "not available" message."""

    def unavailable_reason(device: torch.device | str) -> str | None:
        """The first reason the backend cannot run on ``device`` (device first, then the package), or None."""
        return device_problem(device) or library_problem()

    def available(device: torch.device | str) -> bool:
        """Whether the backend can run on ``device``: an SM90+ CUDA device and an importable library."""
        return unavailable_reason(device) is None

    available.missing_hint = missing_hint  # type: ignore[attr-defined]
    return unavailable_reason, available


def entry_point(name: str, problem: str | None, missing_hint: str, load: Callable[[], Callable]) -> Callable:
    """``load()``, the library function, unless ``problem`` (then a RuntimeError naming it and the hint)."""
    if problem is not None:
        raise RuntimeError(f"{name}: {problem}; {missing_hint}")
    return load()


def check_inputs(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, *, name: str,
                 library: str, head_dims: tuple[int, ...], computes_in: str) -> None:
    """The op contract as backend ``name`` (calling ``library``, which computes in ``computes_in``) takes
    it: ``q [T, H, D]`` with ``D`` in ``head_dims``, no fp64, ``kv [N, D]``, ``idx [T, Kt]``, ``sink [H]``."""
    if q.dim() != 3:
        raise ValueError(f"q: must be [T, H, D], got shape {tuple(q.shape)}")
    d = q.shape[2]
    if d not in head_dims:
        extra = (f" ({library}'s D = 576 mode uses only the first 512 columns as values, while this op's value "
                 "is the whole kv row)") if d == 576 else ""
        raise ValueError(f"q: head dim D = {d} is not supported by the '{name}' backend; it needs D in "
                         f"{head_dims}{extra}; use 'torch' or 'triton'")
    if q.dtype == torch.float64 or kv.dtype == torch.float64:
        raise ValueError(f"q: dtype {q.dtype} is not supported by the '{name}' backend (it computes in "
                         f"{computes_in}); use 'torch' for fp64")
    if kv.dim() != 2 or kv.shape[1] != d:
        raise ValueError(f"kv: must be [N, {d}], got shape {tuple(kv.shape)}")
    if idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        raise ValueError(f"idx: must be [{q.shape[0]}, Kt], got shape {tuple(idx.shape)}")
    if sink.shape != (q.shape[1],):
        raise ValueError(f"sink: must be [{q.shape[1]}], got shape {tuple(sink.shape)}")


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``, at least one ``multiple``."""
    return max(multiple, -(-value // multiple) * multiple)


def compact_slots(idx: torch.Tensor, topk_length: torch.Tensor | None, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx_lib [T, slots] int32, length [T] int32)``: each row's valid slots moved to the front in their
    order, ``-1`` after them, and how many there are (``slots >= Kt``).

    A slot of ``idx [T, Kt]`` is valid when it is ``>= 0`` and, with ``topk_length [T]``, before
    ``topk_length[t]``. Why: the libraries' kernels stop at a row's ``topk_length`` but compute every
    empty slot before it, and packed documents leave many (a query near its document's start fills few
    of its window slots and few of its compressed ones, which follow the window's), so handing them the
    compacted row and its length skips that work; cuDNN's SM90 backward also must not meet ``-1`` before
    ``topk_length`` (it would read kv row -1). The order of the valid slots is kept, so the sum is the
    same up to the kernels' rounding. On CUDA one Triton kernel does it
    (:mod:`dsv4cp.kernels.compact_slots_triton`); elsewhere, and as its reference, torch does, on the
    device (a running count, a batched binary search, a gather; no host read): the p-th valid slot of a
    row is the first whose running count reaches p.
    """
    if idx.is_cuda:
        from dsv4cp.kernels.compact_slots_triton import compact_slots_triton

        return compact_slots_triton(idx, topk_length, slots)
    return compact_slots_torch(idx, topk_length, slots)


def compact_slots_torch(idx: torch.Tensor, topk_length: torch.Tensor | None,
                        slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compact_slots` in torch operations (the reference of the Triton kernel)."""
    t, kt = idx.shape
    valid = idx >= 0
    if topk_length is not None:
        valid &= torch.arange(kt, device=idx.device)[None, :] < topk_length.to(torch.int64)[:, None]
    count = valid.cumsum(1, dtype=torch.int32)
    length = count[:, -1].contiguous()
    wanted = torch.arange(1, slots + 1, device=idx.device, dtype=torch.int32).expand(t, slots).contiguous()
    source = torch.searchsorted(count, wanted, out_int32=True).clamp_max_(kt - 1)
    gathered = torch.gather(idx.to(torch.int32), 1, source.to(torch.int64))
    return torch.where(wanted <= length[:, None], gathered, -1).contiguous(), length
