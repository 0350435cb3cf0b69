"""Packed THD batches: documents concatenated along one token axis (docs/design.md §2)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

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

    Build with :meth:`from_lengths` or :meth:`from_tensors`; both validate before anything runs.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    total: int
    max_seqlen_padded: int
    real_tokens: int

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int], pad_to_multiple: int = 1, total: int | None = None,
        device: torch.device | str | None = None,
    ) -> PackedSeqs:
        """Pack documents of the given real lengths, each padded up to a multiple of ``pad_to_multiple``.

        ``total`` defaults to the padded end; a larger value adds a tail padding segment.
        """
        if not isinstance(pad_to_multiple, int) or isinstance(pad_to_multiple, bool) or pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple: must be a positive int, got {pad_to_multiple!r}")
        if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
            raise ValueError(f"lengths: must be a sequence of ints, got {lengths!r}")
        lengths = [_as_length(i, n) for i, n in enumerate(lengths)]
        padded = [-(-n // pad_to_multiple) * pad_to_multiple for n in lengths]
        cu = _cumsum(lengths)
        cu_padded = _cumsum(padded)
        return cls._checked(cu, cu_padded, cu_padded[-1] if total is None else total, device)

    @classmethod
    def from_tensors(
        cls, cu_seqlens: torch.Tensor | Sequence[int], cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None,
        total: int | None = None,
    ) -> PackedSeqs:
        """Wrap explicit offsets (as produced by a data loader). Reads them once to validate."""
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
        cu = _host_offsets("cu_seqlens", cu_seqlens)
        cu_padded = cu if cu_seqlens_padded is None else _host_offsets("cu_seqlens_padded", cu_seqlens_padded)
        if total is None:
            total = cu_padded[-1] if cu_padded else 0
        return cls._checked(cu, cu_padded, total, device)

    @classmethod
    def _checked(cls, cu: list[int], cu_padded: list[int], total: int, device) -> PackedSeqs:
        _validate_offsets(cu, cu_padded, total)
        padded_lengths = [b - a for a, b in zip(cu_padded[:-1], cu_padded[1:])]
        return cls(
            cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=device),
            cu_seqlens_padded=torch.tensor(cu_padded, dtype=torch.int64, device=device),
            total=int(total),
            max_seqlen_padded=max(padded_lengths, default=0),
            real_tokens=cu[-1],
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
        return PackedSeqs(
            self.cu_seqlens.to(device), self.cu_seqlens_padded.to(device), self.total, self.max_seqlen_padded,
            self.real_tokens,
        )

    def __repr__(self) -> str:
        return (
            f"PackedSeqs(num_docs={self.num_docs}, total={self.total}, padded_end={self.padded_end}, "
            f"real_tokens={self.real_tokens}, max_seqlen_padded={self.max_seqlen_padded})"
        )


def _as_length(i: int, n) -> int:
    """A document length: an integral, non-negative number (int, numpy int, integral float, 0-d tensor)."""
    if isinstance(n, torch.Tensor) and n.numel() == 1:
        n = n.item()
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not float(n).is_integer() or n < 0:
        raise ValueError(f"lengths[{i}]: must be a non-negative int, got {n!r}")
    return int(n)


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _host_offsets(name: str, offsets) -> list[int]:
    if isinstance(offsets, torch.Tensor):
        if offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: must be an int32 or int64 tensor, got dtype {offsets.dtype}")
        if offsets.dim() != 1:
            raise ValueError(f"{name}: must be 1-D, got shape {tuple(offsets.shape)}")
        return offsets.tolist()
    values = list(offsets)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name}: must hold ints, got {values!r}")
    return values


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
