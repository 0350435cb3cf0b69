"""Per-rank metadata of the contiguous CP layout (docs/design.md §3.1-3.3); CP = 1 is the one-rank case.

Everything is derived on the device from ``cu_seqlens_padded`` with static sizes (no host reads),
so the metadata of a step can be built inside a CUDA graph. Terms used throughout:

* ext rows: this rank's ``halo`` rows borrowed from the previous rank followed by its ``rows`` own
  rows, i.e. global rows ``[start - halo, start + rows)``; the window and compressor read these.
* entry: compressed entry ``j`` of document ``d`` (pools the group of rows ``[j r, (j + 1) r)`` of d);
  ``eid`` numbers all entries of the batch in buffer order.
* gathered buffer: ``[cp * capacity]`` rows, rank-major; rank ``rho`` fills slots
  ``[rho * capacity, rho * capacity + owned)`` with the entries whose LAST row it holds.
* key buffer: ``[ext kv | gathered compressed kv]``; attention indices point into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4cp.config import DSv4Config, layer_kind
from dsv4cp.cp.partition import RowSplit, as_split, compression_reach, halo_rows, split_rows
from dsv4cp.packing import PackedSeqs

__all__ = [
    "RankLayout", "RowSplit", "build_layout", "compression_reach", "entry_capacity", "halo_rows", "split_rows",
]


def entry_capacity(rows: int, compress_ratio: int) -> int:
    """Most entries one rank can own: their groups are disjoint and end inside its ``rows`` rows."""
    return -(-rows // compress_ratio) if compress_ratio else 0


class RankSizes:
    """The row counts a rank's buffers take from its own rows, its halo and the gathered capacity: one
    definition for the layout and for the cost model's counts (:class:`dsv4cp.model.counts.RankCounts`),
    so the two cannot disagree."""

    cp: int
    rows: int
    halo: int
    capacity: int

    @property
    def ext_rows(self) -> int:
        """Rows each rank projects for the window KV and the compressors: ``halo + rows``."""
        return self.halo + self.rows

    @property
    def gathered_rows(self) -> int:
        """Rows of the gathered compressed buffer, ``cp * capacity`` (identical on every rank)."""
        return self.cp * self.capacity


@dataclass(frozen=True)
class RankLayout(RankSizes):
    """What rank ``rank`` of ``cp`` computes for one layer on one packed batch.

    Shapes: ``E = halo + rows`` ext rows, ``S`` compressor slots per entry (``r``, or ``2r`` with
    overlap), ``G = cp * capacity`` gathered entries, ``M = max_seqlen_padded // r``.
    """

    rank: int
    cp: int
    rows: int
    start: int
    halo: int
    compress_ratio: int
    capacity: int
    max_entries_per_doc: int
    ext_doc: torch.Tensor  # [E] int64 document of each ext row, -1 outside every document
    ext_pos: torch.Tensor  # [E] int64 document position (0 outside)
    real: torch.Tensor  # [rows] bool: own row holds a real (loss-bearing) token
    window_idx: torch.Tensor  # [rows, W] int32 ext row of the j-th previous token, -1 if none
    group_rows: torch.Tensor  # [capacity, S] int64 ext rows pooled by each owned entry, -1 absent
    group_pos: torch.Tensor  # [capacity] int64 RoPE position j * r of each owned entry
    group_valid: torch.Tensor  # [capacity] bool
    entry_row: torch.Tensor  # [T // r] int64 gathered row of each eid (-1 past the last entry)
    doc_first_eid: torch.Tensor  # [n_docs] int64 eid of each document's entry 0
    gathered_doc: torch.Tensor  # [G] int64 document of each gathered row (-1 empty slot)
    gathered_j: torch.Tensor  # [G] int64 entry number inside its document

    @property
    def local_doc(self) -> torch.Tensor:
        return self.ext_doc[self.halo :]

    @property
    def local_pos(self) -> torch.Tensor:
        return self.ext_pos[self.halo :]

    @property
    def key_row_limit(self) -> tuple[int, int]:
        """``(base, r)``: own row ``t`` sees no gathered row at or past ``base + t // r + 1``, with
        ``base = rank * capacity``; a bound known from sizes alone (compressed layers, ``r > 0``).

        Why: an entry visible to own row t is complete by then (its last row is at or before global row
        ``start + t``), so its owner is this rank or an earlier one. Earlier ranks' slots lie below
        ``base``. This rank numbers its entries from slot 0 in buffer order, and the entries whose last
        row lies in ``[start, start + t]`` are disjoint groups of ``r`` rows, at most ``t // r + 1``
        of them, so a visible entry of this rank sits in a slot below ``t // r + 1``.
        """
        return self.rank * self.capacity, self.compress_ratio

    def visible_entries(self) -> torch.Tensor:
        """``[rows]`` int64: how many entries of its document each own row may see, ``(pos+1)//r``."""
        count = (self.local_pos + 1) // self.compress_ratio
        return torch.where(self.local_doc >= 0, count, 0)

    def all_visible_idx(self, own_rows: slice = slice(None)) -> torch.Tensor:
        """``[len(own_rows), M]`` int64 gathered rows of every visible entry of each own row in
        ``own_rows`` (all by default), -1 padded; a slice keeps a chunk of queries from needing all rows'."""
        slots = torch.arange(self.max_entries_per_doc, device=self.ext_doc.device)
        doc = self.local_doc[own_rows]
        if self.doc_first_eid.numel() == 0:  # a batch of no documents: nothing to see
            return torch.full((doc.numel(), slots.numel()), -1, dtype=torch.int64, device=slots.device)
        first = self.doc_first_eid[doc.clamp_min(0)]
        eids = (first[:, None] + slots[None, :]).clamp_max(self.entry_row.numel() - 1)
        visible = slots[None, :] < self.visible_entries()[own_rows][:, None]
        return torch.where(visible, self.entry_row[eids], -1)

    def visible_mask(self, doc: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``[len(doc), G]`` bool: gathered entries visible to queries at (doc, pos)."""
        limit = torch.where(doc >= 0, (pos + 1) // self.compress_ratio, 0)
        return (self.gathered_doc[None, :] == doc[:, None]) & (self.gathered_j[None, :] < limit[:, None])


def layer_split(
    packed: PackedSeqs, cfg: DSv4Config, compress_ratio: int, cp: int, split: RowSplit | None = None
) -> tuple[RowSplit, int]:
    """``(split, halo rows)`` of a layer: ``split`` validated (``None``: equal slices, checked by
    :func:`split_rows`), every rank holding at least the halo it must send (and at least one row)."""
    if split is None:
        rows, halo = split_rows(packed.total, cp, cfg, compress_ratio)
        return RowSplit.equal(packed.total, cp), halo
    halo = halo_rows(cfg, compress_ratio, cp)
    return as_split(split, packed.total, cp, max(halo, 1)), halo


def _on_device(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[len(values)]`` int64 on ``device``, filled there one scalar each: a host list copied with
    ``torch.tensor`` would synchronise the host and break CUDA-graph capture."""
    return torch.stack([torch.full((), v, dtype=torch.int64, device=device) for v in values])


def build_layout(
    packed: PackedSeqs, cfg: DSv4Config, compress_ratio: int, rank: int = 0, cp: int = 1,
    capacity: int | None = None, split: RowSplit | None = None,
) -> RankLayout:
    """Metadata of rank ``rank`` of ``cp`` (see :class:`RankLayout`); validates sizes first.

    ``split``: the ranks' row ranges (None: ``T / cp`` rows each). With unequal slices every rank
    still contributes ``capacity`` entries (the bound of the LARGEST slice, padded with empty slots)
    rather than a variable count: equal-size all-gathers and reduce-scatters need no size exchange,
    and static shapes keep the step capturable in a CUDA graph.
    ``capacity`` overrides the provable bound ``ceil(max rows / r)`` (to save gathered memory); a value
    too small for this batch raises ``ValueError`` (this check reads the device once).
    """
    total = packed.total
    if cp < 1:
        raise ValueError(f"cp: must be >= 1, got {cp}")
    if not 0 <= rank < cp:
        raise ValueError(f"rank: must be in [0, {cp}), got {rank}")
    split, halo = layer_split(packed, cfg, compress_ratio, cp, split)
    rows, start = split.rows(rank), split.start(rank)
    device = packed.cu_seqlens_padded.device
    cu_p, cu = packed.cu_seqlens_padded, packed.cu_seqlens
    n_docs = packed.num_docs

    rows_g = torch.arange(start - halo, start + rows, device=device)
    inside = (rows_g >= 0) & (rows_g < cu_p[-1])
    doc = torch.searchsorted(cu_p, rows_g, right=True) - 1
    doc = torch.where(inside, doc, -1)
    doc_c = doc.clamp(0, max(n_docs - 1, 0))
    pos = torch.where(inside, rows_g - cu_p[doc_c], 0) if n_docs else torch.zeros_like(rows_g)
    real_end = cu_p[doc_c] + (cu[doc_c + 1] - cu[doc_c]) if n_docs else rows_g
    real = (inside & (rows_g < real_end))[halo:]

    back = torch.arange(cfg.window, device=device)
    own = torch.arange(halo, halo + rows, device=device)
    window_ok = (doc[halo:, None] >= 0) & (back[None, :] <= pos[halo:, None])
    window_idx = torch.where(window_ok, own[:, None] - back[None, :], -1).to(torch.int32)

    r = compress_ratio
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    if r == 0:
        return RankLayout(
            rank, cp, rows, start, halo, r, 0, 0, doc, pos, real, window_idx,
            empty.view(0, 0), empty, empty.bool(), empty, empty, empty, empty,
        )

    natural_capacity = entry_capacity(split.max_rows, r)
    cap = natural_capacity if capacity is None else capacity
    n_entries = torch.div(torch.diff(cu_p), r, rounding_mode="floor")
    cum_entries = torch.cumsum(n_entries, 0)
    doc_first_eid = cum_entries - n_entries
    eid_bound = max(total // r, 1)
    eid = torch.arange(eid_bound, device=device)
    total_entries = cum_entries[-1] if n_docs else torch.zeros((), dtype=torch.int64, device=device)
    e_valid = eid < total_entries
    e_doc = torch.searchsorted(cum_entries, eid, right=True).clamp_max(max(n_docs - 1, 0))
    e_j = eid - doc_first_eid[e_doc] if n_docs else eid
    e_first = cu_p[e_doc] + e_j * r if n_docs else eid * r
    e_last = torch.where(e_valid, e_first + r - 1, total)  # invalid entries sort past every rank
    rank_bounds = _on_device(split.bounds, device)
    owner_first_eid = torch.searchsorted(e_last, rank_bounds)  # [cp + 1]
    # owner: the rank whose range [b_rho, b_rho+1) holds the entry's last row. The ends are a tensor of
    # their own, not the slice rank_bounds[1:]: Inductor's lookup lowering needs the strides of its
    # boundaries, which a view of an unrealised tensor lacks (NotImplementedError: SliceView on CUDA).
    owner = torch.searchsorted(_on_device(split.bounds[1:], device), e_last, right=True).clamp_max(cp - 1)
    slot = eid - owner_first_eid[owner]
    entry_row = torch.where(e_valid, owner * cap + slot, -1)

    if capacity is not None:
        most = int(torch.diff(owner_first_eid).max())
        if most > capacity:
            raise ValueError(f"capacity: a rank owns {most} compressed entries, more than capacity={capacity}")

    slots = torch.arange(cap, device=device)
    local_eid = owner_first_eid[rank] + slots
    group_valid = local_eid < owner_first_eid[rank + 1]
    local_eid = local_eid.clamp_max(eid_bound - 1)
    first_ext = e_first[local_eid] - (start - halo)
    group_j = e_j[local_eid]
    offsets = torch.arange(r, device=device)
    group_rows = first_ext[:, None] + offsets[None, :]
    if layer_kind(r) == "C":  # overlap: group j-1's rows feed the A half of entry j
        prev = torch.where((group_j > 0)[:, None], group_rows - r, -1)
        group_rows = torch.cat((prev, group_rows), dim=1)
    group_rows = torch.where(group_valid[:, None], group_rows, -1)

    n_gathered = cp * cap
    target = torch.where(e_valid, entry_row, n_gathered)  # spare slot swallows invalid eids
    gathered_doc = torch.full((n_gathered + 1,), -1, dtype=torch.int64, device=device)
    gathered_doc.scatter_(0, target, torch.where(e_valid, e_doc, -1))
    gathered_j = torch.zeros(n_gathered + 1, dtype=torch.int64, device=device)
    gathered_j.scatter_(0, target, e_j)
    return RankLayout(
        rank, cp, rows, start, halo, r, cap, packed.max_seqlen_padded // r, doc, pos, real, window_idx,
        group_rows, group_j * r, group_valid, entry_row, doc_first_eid, gathered_doc[:n_gathered],
        gathered_j[:n_gathered],
    )
