"""Multi-token-prediction rolls under contiguous CP (docs/design.md §3.7).

MTP depth ``k`` trains on the batch shifted LEFT by ``k`` rows: row ``i`` takes row ``i + k``. The shift
never crosses a document end. With ``cu_seqlens_padded`` giving document ``d`` the rows ``[s_d, e_d)``:

* a row ``i`` of document ``d`` takes row ``i + depth`` when ``i + depth < e_d`` (the PADDED end: padded
  rows behave as later tokens of their document, docs/design.md §2);
* otherwise (its source lies at or past the end of its document) it gets the field's fill value;
* every row of the tail padding segment (``i >= cu_seqlens_padded[-1]``) gets the fill value too, so the
  tail never borrows anything and stays "padding";
* empty documents own no rows and are skipped.

Fill values (:func:`default_fill`): ``True`` (``1`` in a non-bool dtype) for a field whose name contains
``"padding_mask"`` (a shifted-out row is padding), ``0`` / ``False`` for every other field (token ids,
labels, loss mask, position ids, ...). A ``fill`` dict passed to :func:`roll_left` overrides the default
per field name.

Under contiguous CP (rank ``rho`` holds rows ``[b_rho, b_{rho+1})``: ``rho L`` with ``L = T / cp`` for
equal slices, or a :class:`~dsv4cp.cp.partition.RowSplit`'s points) a rank's last
``depth`` rows may take their source from the first ``depth`` rows of rank ``rho + 1``. :func:`roll_left`
fetches those rows for ALL fields in ONE point-to-point exchange (the fields' leading rows are packed into
one byte buffer); the last rank receives nothing (its trailing rows are fills: the batch ends there).
:func:`roll_hidden_left` is the differentiable roll of hidden states: its backward returns the gradient of
the borrowed rows to the rank that owns them, which adds it into its first ``depth`` rows.

All row bookkeeping (which rows take their source, which get a fill) is computed on the fields' device
with ``searchsorted`` on ``cu_seqlens_padded``; there are no host loops over rows and no device reads
(fill values are checked on the host before they are put on the device), so a roll never stalls the
CPU and can run inside a CUDA graph. Both rolls emit the ``mtp.roll.fwd`` phase, and the hidden-state
roll's backward ``mtp.roll.bwd``.
Inputs are validated before any communication, identically on every rank, so bad input raises
``ValueError`` everywhere instead of leaving a peer waiting on a collective.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from dsv4cp.cp.comm import group_size_and_rank, p2p_shift
from dsv4cp.cp.partition import RowSplit, as_split
from dsv4cp.packing import PackedSeqs
from dsv4cp.profiling.nvtx import nvtx_range

__all__ = ["default_fill", "roll_left", "roll_hidden_left", "rolled_source_valid"]

_ALIGN = 16  # byte alignment of each field's segment in the exchange buffer (the largest element size)


def default_fill(name: str) -> bool | int:
    """The fill of field ``name`` when :func:`roll_left` gets no override: ``True`` for names containing
    ``"padding_mask"``, ``0`` otherwise (cast to the field's dtype: ``True`` -> 1, ``0`` -> ``False``)."""
    return True if "padding_mask" in name else 0


def rolled_source_valid(
    packed: PackedSeqs, depth: int, rank: int, rows: int, device=None, start: int | None = None
) -> torch.Tensor:
    """``[rows]`` bool: local row ``j`` of rank ``rank`` (global row ``g = start + j``, ``start``
    defaulting to ``rank * rows``, the equal split) takes its source row ``g + depth``; ``False`` means
    it gets the fill value.

    ``g + depth`` must lie before the padded end of ``g``'s document; the tail padding segment and the
    rows whose source is past their document's end are ``False``. Computed on ``device`` with torch ops.
    """
    device = packed.cu_seqlens_padded.device if device is None else torch.device(device)
    cu = packed.cu_seqlens_padded.to(device=device, dtype=torch.int64)
    g = torch.arange(rows, device=device, dtype=torch.int64) + (rank * rows if start is None else start)
    # index of the first offset > g, i.e. the end of g's document (duplicates = empty documents are skipped);
    # rows of the tail segment clamp to the padded end, which is <= g, so they are never valid.
    end_idx = torch.searchsorted(cu, g, right=True).clamp_max(cu.numel() - 1)
    return g + depth < cu[end_idx]


# ---------------------------------------------------------------------------- validation
def _check_depth(depth, split: RowSplit) -> None:
    if not isinstance(depth, int) or isinstance(depth, bool):
        raise ValueError(f"depth: must be an int, got {depth!r}")
    if depth < 1:
        raise ValueError(f"depth: must be >= 1, got {depth}")
    rows = split.min_rows  # the next rank must hold the depth rows it lends
    if depth > rows:
        per_rank = f"the rows per rank L = {rows}" if split.is_equal else f"the smallest rank's {rows} rows"
        raise ValueError(f"depth: must be <= {per_rank}, got {depth}")


def _rank_split(packed: PackedSeqs, cp: int, split: RowSplit | None) -> RowSplit:
    if not isinstance(packed, PackedSeqs):
        raise ValueError(f"packed: must be a PackedSeqs, got {type(packed).__name__}")
    if split is None and packed.total % cp != 0:
        raise ValueError(f"packed.total: T = {packed.total} is not divisible by cp = {cp}")
    return as_split(split, packed.total, cp)


def _check_field(label: str, x, rows: int, device: torch.device | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{label}: must be a tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[0] != rows:
        raise ValueError(f"{label}: must have L = {rows} rows (this rank's slice), got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{label}: on {x.device}, but the other fields are on {device}")


def _fill_tensor(name: str, value, dtype: torch.dtype, device) -> torch.Tensor:
    """The 0-dim fill of field ``name`` on ``device``, checked on the HOST: a device tensor's value would
    have to be copied back to be checked, a synchronisation per field."""
    try:
        host = torch.as_tensor(value, dtype=dtype)
    except (TypeError, RuntimeError, ValueError) as err:
        raise ValueError(f"fill[{name!r}]: {value!r} is not a scalar of dtype {dtype}: {err}") from None
    if host.dim() != 0:
        raise ValueError(f"fill[{name!r}]: must be a scalar, got {value!r}")
    exact = value if isinstance(value, (bool, int, float, complex)) else None
    if exact is not None and not dtype.is_floating_point and not dtype.is_complex and host.item() != exact:
        raise ValueError(f"fill[{name!r}]: {value!r} is not representable in dtype {dtype}")
    return torch.full((), host.item(), dtype=dtype, device=device)  # a fill kernel: no host-to-device copy


# ---------------------------------------------------------------------------- batched exchange
def _exchange_leading_rows(fields: Mapping[str, torch.Tensor], names: list[str], depth: int, group) -> dict:
    """The first ``depth`` rows of every field of rank + 1 (zeros on the last rank), via ONE P2P pair:
    each field's rows become an ``_ALIGN``-padded byte segment of one ``uint8`` buffer."""
    segments, layout, offset = [], [], 0
    for name in names:
        x = fields[name]
        head = x[:depth].detach().contiguous().reshape(-1).view(torch.uint8)
        nbytes = head.numel()
        padded = -(-nbytes // _ALIGN) * _ALIGN
        segments.append(head)
        if padded > nbytes:
            segments.append(head.new_zeros(padded - nbytes))
        layout.append((name, offset, nbytes))
        offset += padded
    device = next(iter(fields.values())).device
    if offset == 0:
        buffer = torch.zeros(0, dtype=torch.uint8, device=device)
    else:
        # send my leading rows to rank - 1, receive rank + 1's (step -1 of p2p_shift)
        buffer = p2p_shift(torch.cat(segments), group, -1)
    received = {}
    for name, off, nbytes in layout:
        x = fields[name]
        received[name] = buffer[off : off + nbytes].view(x.dtype).reshape(depth, *x.shape[1:])
    return received


# ---------------------------------------------------------------------------- public API
def roll_left(
    fields: Mapping[str, torch.Tensor],
    packed: PackedSeqs,
    depth: int,
    cp_group: dist.ProcessGroup | None = None,
    fill: Mapping[str, object] | None = None,
    split: RowSplit | None = None,
) -> dict[str, torch.Tensor]:
    """Shift every field LEFT by ``depth`` rows inside each document (module docstring); not differentiable.

    Args:
        fields: name -> this rank's ``[L, ...]`` slice (any dtype; all on one device). Every rank must
            pass the same names with the same dtypes and trailing shapes.
        packed: the WHOLE batch's packing (``T = packed.total`` rows, divisible by the CP size).
        depth: rows to shift, ``1 <= depth <= L``.
        cp_group: the CP process group (``None``: one rank holds all ``T`` rows).
        fill: name -> scalar overriding :func:`default_fill` for that field.
        split: the ranks' row ranges (None: ``T / cp`` rows each); fields hold this rank's rows.

    Returns a dict with the same keys: the rolled ``[L, ...]`` slices (new tensors, same dtype/device).
    Under CP the leading rows of the next rank are fetched in one batched exchange for all fields.
    """
    cp, rank = group_size_and_rank(cp_group)
    if fill is not None and not isinstance(fill, Mapping):
        raise ValueError(f"fill: must be a dict of field name -> scalar, got {fill!r}")
    fill = {} if fill is None else dict(fill)
    if not isinstance(fields, Mapping) or len(fields) == 0:
        raise ValueError(f"fields: must be a non-empty dict of name -> tensor, got {fields!r}")
    split = _rank_split(packed, cp, split)
    rows = split.rows(rank)
    _check_depth(depth, split)
    names = sorted(fields)  # one buffer layout on every rank whatever the dict's insertion order
    device = None
    for name in names:
        _check_field(f"fields[{name!r}]", fields[name], rows, device)
        device = fields[name].device
    unknown = sorted(set(fill) - set(fields))
    if unknown:
        raise ValueError(f"fill: names {unknown} are not fields (fields: {names})")
    fills = {n: _fill_tensor(n, fill.get(n, default_fill(n)), fields[n].dtype, device) for n in names}

    with nvtx_range("mtp.roll.fwd"), torch.no_grad():
        valid = rolled_source_valid(packed, depth, rank, rows, device, start=split.start(rank))
        if cp > 1:
            nxt = _exchange_leading_rows(fields, names, depth, cp_group)
        else:
            nxt = {n: fields[n].new_zeros((depth, *fields[n].shape[1:])) for n in names}
        out = {}
        for name in names:
            x = fields[name].detach()
            shifted = torch.cat((x[depth:], nxt[name]), dim=0)  # row j <- global row g + depth
            mask = valid.view(rows, *([1] * (x.dim() - 1)))
            out[name] = torch.where(mask, shifted, fills[name])
    return {name: out[name] for name in fields}


class _RollHiddenLeft(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, valid: torch.Tensor, depth: int, group) -> torch.Tensor:
        ctx.depth, ctx.group = depth, group
        ctx.save_for_backward(valid)
        with nvtx_range("mtp.roll.fwd"):
            if group is not None and dist.get_world_size(group) > 1:
                nxt = p2p_shift(h[:depth].contiguous(), group, -1)  # rank + 1's leading rows
            else:
                nxt = h.new_zeros((depth, *h.shape[1:]))
            shifted = torch.cat((h[depth:], nxt), dim=0)
            return torch.where(valid.view(-1, *([1] * (h.dim() - 1))), shifted, shifted.new_zeros(()))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (valid,) = ctx.saved_tensors
        depth, group = ctx.depth, ctx.group
        with nvtx_range("mtp.roll.bwd"):
            g = torch.where(valid.view(-1, *([1] * (grad.dim() - 1))), grad, grad.new_zeros(()))
            rows = g.shape[0]
            # out[j] = h_ext[j + depth]: local rows depth.. get g[: rows - depth]; the borrowed rows'
            # gradient g[rows - depth:] goes back to rank + 1, and rank - 1's comes here for our first
            # depth rows.
            if group is not None and dist.get_world_size(group) > 1:
                returned = p2p_shift(g[rows - depth :].contiguous(), group, +1)
            else:
                returned = g.new_zeros((depth, *g.shape[1:]))
            return torch.cat((returned, g[: rows - depth]), dim=0), None, None, None


def roll_hidden_left(
    h: torch.Tensor, packed: PackedSeqs, depth: int, cp_group: dist.ProcessGroup | None = None,
    split: RowSplit | None = None,
) -> torch.Tensor:
    """Differentiable left roll of this rank's hidden states ``h [L, ...]`` by ``depth`` rows (fill 0).

    Forward as :func:`roll_left`; backward routes the gradient of each output row to its source row: the
    rows borrowed from rank + 1 send their gradient back to it, where it is ADDED into the gradient of its
    first ``depth`` rows (the rest is routed locally); rows that got the fill contribute no gradient.
    """
    cp, rank = group_size_and_rank(cp_group)
    split = _rank_split(packed, cp, split)
    rows = split.rows(rank)
    _check_depth(depth, split)
    _check_field("h", h, rows, None)
    valid = rolled_source_valid(packed, depth, rank, rows, h.device, start=split.start(rank))
    return _RollHiddenLeft.apply(h, valid, depth, cp_group)
