"""Packed THD batches: documents concatenated along one token axis (docs/design.md §2)."""

from __future__ import annotations

import copy
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PackedSeqs:
    """Where each document of a packed ``[T, ...]`` buffer lies.

    Attributes:
        cu_seqlens: int64 ``[n_docs + 1]``, cumulative REAL lengths (the tokens that count in losses).
        cu_seqlens_padded: int64 ``[n_docs + 1]``, cumulative PADDED extents; every layout and position
            computation uses these. Document ``d`` occupies rows ``[cu_seqlens_padded[d],
            cu_seqlens_padded[d + 1])``; its first ``len_d`` rows are real, the rest are padding that
            behaves like later tokens of the same document.
        total: ``T``, the number of rows of the buffer, ``>= cu_seqlens_padded[-1]``; rows past the
            padded end form a tail padding segment that sees no key and outputs zero.
        max_seqlen_padded: the longest padded document, kept on the host so kernels and metadata get
            static sizes without reading the device.
        real_tokens: the number of real (loss-bearing) tokens, kept on the host for the same reason:
            the global normaliser of the indexer loss.

    The constructor validates every field (``ValueError`` naming the field and its value): 1-D int64
    offset tensors of the same length on the same device, each starting at 0 and non-decreasing,
    every document padded to at least its real length, ``total >= cu_seqlens_padded[-1]``, and the two
    host counts equal to what the offsets give. It reads the offsets once to do so (one host sync for
    device tensors), so prefer :meth:`from_lengths` / :meth:`from_tensors`, which validate on the host
    before the offsets reach the device; :meth:`to` moves a validated batch without validating again.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    total: int
    max_seqlen_padded: int
    real_tokens: int

    def __post_init__(self) -> None:
        for name in ("cu_seqlens", "cu_seqlens_padded"):
            offsets = getattr(self, name)
            if not isinstance(offsets, torch.Tensor):
                raise ValueError(f"{name}: must be a torch.Tensor, got {type(offsets).__name__} "
                                 "(PackedSeqs.from_tensors takes lists, tuples and numpy arrays)")
            if offsets.dtype != torch.int64:
                raise ValueError(f"{name}: must be an int64 tensor, got dtype {offsets.dtype} "
                                 "(PackedSeqs.from_tensors converts int32)")
            if offsets.dim() != 1:
                raise ValueError(f"{name}: must be 1-D, got shape {tuple(offsets.shape)}")
        if self.cu_seqlens_padded.device != self.cu_seqlens.device:
            raise ValueError(f"cu_seqlens_padded: must be on cu_seqlens' device {self.cu_seqlens.device}, "
                             f"got {self.cu_seqlens_padded.device}")
        cu, cu_padded = self.cu_seqlens.tolist(), self.cu_seqlens_padded.tolist()
        _validate_offsets(cu, cu_padded, self.total)
        for name, want in (("max_seqlen_padded", _longest(cu_padded)), ("real_tokens", cu[-1])):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value != want:
                raise ValueError(f"{name}: must be the int {want} the offsets give, got {value!r}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int], pad_to_multiple: int = 1, total: int | None = None,
        device: torch.device | str | None = None,
    ) -> PackedSeqs:
        """Pack documents of the given real lengths, each padded up to a multiple of ``pad_to_multiple``.

        ``lengths``: a list, tuple, numpy array or tensor of non-negative integral numbers. ``total``
        defaults to the padded end; a larger value adds a tail padding segment.
        """
        if not isinstance(pad_to_multiple, int) or isinstance(pad_to_multiple, bool) or pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple: must be a positive int, got {pad_to_multiple!r}")
        lengths = [_as_count(f"lengths[{i}]", n) for i, n in enumerate(_elements("lengths", lengths))]
        padded = [-(-n // pad_to_multiple) * pad_to_multiple for n in lengths]
        cu = _cumsum(lengths)
        cu_padded = _cumsum(padded)
        return cls._on_host(cu, cu_padded, cu_padded[-1] if total is None else total).to(_device(device))

    @classmethod
    def from_tensors(
        cls, cu_seqlens: torch.Tensor | Sequence[int], cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None,
        total: int | None = None, device: torch.device | str | None = None,
    ) -> PackedSeqs:
        """Wrap explicit offsets (as produced by a data loader): lists, tuples, numpy arrays or tensors
        of integral values (int32 / int64 tensors), read once to validate. ``cu_seqlens_padded``
        defaults to ``cu_seqlens`` (no padding), ``total`` to the padded end, ``device`` to the
        device of the ``cu_seqlens`` tensor (CPU for other inputs)."""
        if device is None:
            device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
        cu = _host_offsets("cu_seqlens", cu_seqlens)
        cu_padded = cu if cu_seqlens_padded is None else _host_offsets("cu_seqlens_padded", cu_seqlens_padded)
        if total is None:
            total = cu_padded[-1] if cu_padded else 0
        return cls._on_host(cu, cu_padded, total).to(_device(device))

    @classmethod
    def _on_host(cls, cu: list[int], cu_padded: list[int], total: int) -> PackedSeqs:
        """The batch of these offsets on the CPU, where the constructor validates them cheaply."""
        return cls(
            cu_seqlens=torch.tensor(cu, dtype=torch.int64),
            cu_seqlens_padded=torch.tensor(cu_padded, dtype=torch.int64),
            total=total,
            max_seqlen_padded=_longest(cu_padded),
            real_tokens=cu[-1] if cu else 0,  # no offset at all: the constructor says so
        )

    # ------------------------------------------------------------------ views
    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def padded_end(self) -> int:
        return int(self.cu_seqlens_padded[-1])

    def lengths(self) -> list[int]:
        return torch.diff(self.cu_seqlens).tolist()

    def padded_lengths(self) -> list[int]:
        return torch.diff(self.cu_seqlens_padded).tolist()

    def to(self, device: torch.device | str) -> PackedSeqs:
        """The same batch with its offsets on ``device``. Not validated again (this batch was, when
        constructed), so the move reads nothing back from a GPU."""
        moved = copy.copy(self)  # a shallow copy skips __init__ and so __post_init__
        object.__setattr__(moved, "cu_seqlens", self.cu_seqlens.to(device))
        object.__setattr__(moved, "cu_seqlens_padded", self.cu_seqlens_padded.to(device))
        return moved

    def __repr__(self) -> str:
        return (
            f"PackedSeqs(num_docs={self.num_docs}, total={self.total}, padded_end={self.padded_end}, "
            f"real_tokens={self.real_tokens}, max_seqlen_padded={self.max_seqlen_padded})"
        )


def _longest(cu_padded: list[int]) -> int:
    return max((b - a for a, b in zip(cu_padded[:-1], cu_padded[1:])), default=0)


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def _elements(name: str, values) -> list:
    """The items of a list, tuple, numpy array or 1-D tensor (what both constructors take)."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        if values.ndim != 1:
            raise ValueError(f"{name}: must be 1-D, got shape {tuple(values.shape)}")
        return values.tolist()
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name}: must be a sequence of ints, got {values!r}")
    return list(values)


def _scalar(value):
    """A one-element tensor or numpy array as its Python number; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, np.ndarray) and value.size == 1:
        return value.item()
    return value


def _as_count(name: str, n) -> int:
    """A document length: an integral, non-negative number (int, numpy int, integral float, 0-d tensor)."""
    n = _scalar(n)
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not float(n).is_integer() or n < 0:
        raise ValueError(f"{name}: must be a non-negative int, got {n!r}")
    return int(n)


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _host_offsets(name: str, offsets) -> list[int]:
    """Offsets as Python ints: an int32 / int64 tensor, an integer numpy array, or a list / tuple of
    ints (numpy ints and one-element integer tensors included); floats are refused, even integral ones."""
    if isinstance(offsets, torch.Tensor) and offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: must be an int32 or int64 tensor, got dtype {offsets.dtype}")
    if isinstance(offsets, np.ndarray) and not np.issubdtype(offsets.dtype, np.integer):
        raise ValueError(f"{name}: must be an integer numpy array, got dtype {offsets.dtype}")
    values = [_scalar(v) for v in _elements(name, offsets)]
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"{name}[{i}]: must be an int, got {v!r}")
    return [int(v) for v in values]


def _validate_offsets(cu: list[int], cu_padded: list[int], total) -> None:
    for name, offs in (("cu_seqlens", cu), ("cu_seqlens_padded", cu_padded)):
        if len(offs) < 1:
            raise ValueError(f"{name}: needs at least one offset (0), got {offs!r}")
        if offs[0] != 0:
            raise ValueError(f"{name}: must start at 0, got {offs[0]}")
        for d, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
            if b < a:
                raise ValueError(f"{name}: must be non-decreasing, got {name}[{d}]={a} > {name}[{d + 1}]={b}")
    if len(cu) != len(cu_padded):
        raise ValueError(
            f"cu_seqlens_padded: must have the same length as cu_seqlens ({len(cu)}), got {len(cu_padded)}"
        )
    for d in range(len(cu) - 1):
        real, padded = cu[d + 1] - cu[d], cu_padded[d + 1] - cu_padded[d]
        if padded < real:
            raise ValueError(
                f"cu_seqlens_padded: document {d} is padded to {padded} rows, shorter than its real length {real}"
            )
    if not isinstance(total, int) or isinstance(total, bool):
        raise ValueError(f"total: must be an int, got {total!r}")
    if total < cu_padded[-1]:
        raise ValueError(f"total: must be >= the padded end {cu_padded[-1]}, got {total}")
