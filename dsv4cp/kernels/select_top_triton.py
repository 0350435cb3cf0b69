"""Radix-select top-k of fp32 score rows (Triton): the indexer's selection without ``torch.topk``.

Contract: exactly :func:`dsv4cp.kernels.contracts.select_top` for fp32 ``scores [rows, columns]``: per
row the ``keep`` best FINITE columns, ties at the cut going to the LOWEST columns (``-0.0`` ties
``+0.0``), returned in increasing column order, ``-1`` past a row's finite count; ``-inf``, ``+inf`` and
NaN are never chosen. The chunked top-k of :mod:`dsv4cp.kernels.indexer_triton` runs it on each chunk's
fp32 score buffer (``DSV4CP_TOPK_SELECT=radix``, the default on CUDA).

Kernel (``_select_kernel``), one program per row:

1. Keys. Each score maps to an order-preserving unsigned 32-bit key: ``-0.0`` first becomes ``+0.0``;
   then, on the fp32 bits, negative floats flip all bits and non-negative ones flip the sign bit. Finite
   scores get keys in ``[0x00800000, 0xFF7FFFFF]``; non-finite ones get key 0, which no pass counts and
   no store selects. Keys are recomputed from the scores on every pass (a few integer ops: cheaper than
   storing them).
2. Radix passes, digits of ``radix_bits`` bits from the top (default 8: 4 passes; the last digit takes
   the bits left when the width does not divide 32). Each pass walks the row in ``BLOCK`` chunks and
   histograms (``tl.histogram``, ``2^radix_bits`` bins) the digit of the keys whose higher bits equal
   the prefix found so far (``tl.histogram``'s ``mask``, in Triton since 3.4: the other keys cost no
   shared-memory atomic; compiled for sm_90a with Triton 3.6, one ``atom.shared.add`` per member
   element). From the histogram, the largest digit ``d`` with at least ``rem`` keys at or above it
   (``rem``: how many still to take from the prefix group; ``keep`` at first) extends the prefix, and
   the keys above ``d`` are taken (``rem`` shrinks by their count). After the last pass the prefix is
   the exact cut key ``c`` (the ``keep``-th largest key) and ``rem`` how many keys equal to ``c`` to
   take. Early exits: a row with at most ``keep`` finite scores takes them all after pass 1, and a pass
   whose chosen digit holds exactly ``rem`` keys takes that whole group (no further pass).
3. Compaction, in column order: a last pass writes the columns whose key is above the cut, and the
   FIRST ``rem`` columns whose key equals it (a running count of equal keys), compacted by a prefix sum
   of the selected flags plus a running offset. The output is thus already in increasing column order
   (no sort); the rest of the row is padded with ``-1``.

``row_limit = (base, ratio, row0)`` (the causal bound of the indexer's static plan): row ``r`` holds no
finite score at or past column ``base + (row0 + r) // ratio + 1``, so the kernel never reads those
columns (an early causal row of a wide chunk scans only its own prefix).

Cost argument (H200, flash shapes at 64K tokens: ``k = 512``, rows up to 16K columns, the causal
average 8K). A 16K-column row is 64 KB of fp32; with 8-bit digits the kernel reads it at most 5 times
(4 histogram passes + the compaction) and writes ``keep * 8 = 4 KB``. Summed over the 64K query rows a
pass reads ~2 GiB (64K rows x 8K columns x 4 bytes). The first pass comes from HBM (the score kernel
wrote the chunk, up to 1 GiB, far more than the 50 MB L2): ~0.5 ms at ~4 TB/s. The later passes re-read
a row the same program just read: the rows in flight (132 SMs x 4 resident programs, register-bound at
64 registers x 256 threads, x 32 KB for the causal average row, 64 KB at most) are 17-34 MB, inside L2,
so each costs ~0.2-0.3 ms at L2 bandwidth: ~1.5-2 ms for the selection in all if memory-bound, against
``torch.topk`` over packed int64 keys (twice the bytes, ~80 radix digit-count launches). Per
element and pass the kernel spends ~15 integer ops and one shared-memory atomic. The risk is that
atomic: lanes of a warp adding to the same bin serialise, and in pass 1 the top 8 bits (sign and 7
exponent bits) of one row's scores fall into a handful of bins. Wider digits (11-12 bits: the sign, the
exponent and 2-3 mantissa bits) spread pass 1 and need 3 passes instead of 4, but re-initialise and
read back a 2048-4096-bin histogram every step and hold it in registers (Triton 3.6, sm_90a, 8 warps:
10 bits 128 registers, 11 bits 182; 12 bits at 16 warps spills 5 KB per thread), so 8 bits stays the
default on paper; ``bench/test_bench_indexer.py::test_indexer_select_config`` measures them. The torch
path's 8-byte key buffer and ``torch.topk``'s temporaries are gone: the chunk planner counts 4 bytes per
score (:data:`dsv4cp.kernels.indexer_plan.TOPK_RADIX_BYTES_PER_SCORE`), so chunks hold 4x the rows.

Second kernel, ``bounded`` (``_select_bounded_kernel``; kernel option ``topk_select_variant``, the
default; ``plain`` keeps the kernel above). Same contract, same tie rule; it attacks the number of passes over the
row, which is what the measurements price: the sweep of ``SELECT_CONFIGS`` fits a fixed cost per pass
over the rows plus a cost per histogram bin and pass, and the layer's selection took several times the
traffic model above (docs/kernels.md).
Per element and pass the ``plain`` kernel compiles (sm_90a, Triton 3.9) to ~33 SASS instructions in a
histogram pass (int64 key arithmetic, the member test, one branch-guarded ``ATOMS.POPC.INC`` per
member) and pass 1 sends a row into a handful of bins (its scores share sign and exponent bits).

1. Pass 0, no histogram: per lane the largest finite key of the columns it reads (one max per
   element; the ``block_n`` lanes read disjoint columns). The largest lane maximum is the row's largest
   key ``hi``; the ``keep``-th largest lane maximum ``lb`` (found by radix passes over that one register
   block, :func:`_block_bound`) is a lower bound on the cut whenever ``keep`` lanes hold a finite key:
   ``keep`` distinct keys are >= it. On rows much longer than ``block_n`` few keys beyond ``keep`` are
   >= ``lb``: for independent scores about ``-ln(1 - keep / block_n) * block_n`` of them, 589 at
   ``keep = 512, block_n = 2048`` whatever the row length.
2. One pass lists every key >= ``lb`` in column order (columns and scores) into a scratch list of
   ``keep + extra`` entries (:data:`BOUNDED_LIST_EXTRA`, 256). When they fit, every remaining step reads
   the list, not the row: radix passes from the bits ``lb`` and ``hi`` share (every key at or above the
   cut shares them), then the compaction with the tie rule (the first ``need`` keys equal to the cut, in
   list order = column order). Without a bound (``keep`` above the lanes, too few finite scores) ``lb``
   is the smallest finite key; a row reading at most ``keep`` columns skips every pass.
3. When the list overflows (heavy ties, ``keep`` close to ``block_n``): radix passes over the row from
   those shared bits, in the launch's digits (5 bits at the default), until the group at the cut holds at
   most ``rem + extra`` keys; one pass lists that group and every key above it, and the list finishes as
   in 2. A group that ends exact or taken whole on the row is compacted from the row.
5. ``row_range``: a per-row ``[start, stop)`` of the columns that may hold a finite score (the key
   range of the row's document, in a packed batch), so a row scans its own document, not every column
   before its causal limit.
4. uint32 keys (:func:`_raw_keys32`: four integer ops; non-finite scores fall outside the finite key
   range, which every membership test and compare stays inside, so they cost no test of their own), and
   membership as one unsigned compare ``key - start < span``.

So a typical flash row is read twice (pass 0 and the listing) against five times (four histogram passes
and the compaction, fewer on early exits) by ``plain``, with no histogram over the row at all; the
histograms run over the ``block_n`` lane maxima and the ~600-entry list. Compiled (Triton 3.9, sm_90a,
4 warps, 8 bits): ``block_n = 2048`` 166 registers, 1024: 72 (8 bytes of stack), no spill, 1 KB of
shared memory for the histogram (``plain``: 85 registers); per element ~11 SASS instructions in pass 0
and ~42 in the listing (two block scans and their layout conversions through shared memory), per
program ~300 per histogram pass over the lane maxima and ~310 per pass, ~560 for the compaction over
the list (``LIST_BLOCK = 1024``); ``bench/test_bench_indexer.py`` times it against ``plain``
(docs/kernels.md). Scratch: ``[rows, keep + extra]``
int32 + fp32 (the size of the int64 output), beyond the planner's 4 bytes per score.

``return_values=True`` also returns the chosen columns' scores (bit for bit; the ``bounded`` kernel
stores them in its compaction, the ``plain`` path gathers them afterwards), so a caller that needs them
(the indexer loss's prediction) does not recompute them.

Launch: :class:`SelectConfig` (``block_n`` columns per step, digit width, warps, pipeline stages);
keyword ``config`` or the kernel option ``triton_select_config``
(``DSV4CP_TRITON_SELECT_CONFIG="block_n,radix_bits,num_warps,num_stages"``) pins it, else the ladder
(:func:`select_config_ladder`). CPU tensors run on Triton's interpreter (tiny sizes only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4cp import kernel_options
from dsv4cp.kernels._triton_launch import Kernels, pinned_config
from dsv4cp.kernels._triton_launch import interpreted as _interpreted

__all__ = ["BOUNDED_SELECT_CONFIGS", "MAX_RADIX_BITS", "SELECT_CONFIGS", "SELECT_CONFIG_ENV", "SELECT_VARIANTS",
           "SelectConfig", "select_config_ladder", "select_top_triton"]

SELECT_CONFIG_ENV = kernel_options.OPTIONS["triton_select_config"].env
"""The variable of the kernel option ``triton_select_config``: pins the radix select's launch:
``"block_n,radix_bits,num_warps,num_stages"`` (:class:`SelectConfig`)."""

MAX_RADIX_BITS = 12
"""Widest digit: a ``2^12``-bin histogram (16 KB of shared memory; held in registers too, so it spills:
see the cost argument above)."""

SELECT_CONFIGS = [(2048, 8, 4, 2), (2048, 8, 8, 2), (1024, 8, 4, 2), (512, 8, 4, 1)]
"""Compiled ladder of the ``plain`` kernel (``block_n, radix_bits, num_warps, num_stages``), first = default;
any of them fits (compiled for sm_90a with Triton 3.6, no spills).
``bench/test_bench_indexer.py::test_indexer_select_config`` times them with other digit widths (docs/kernels.md)."""

BOUNDED_SELECT_CONFIGS = [(1024, 5, 4, 2), (2048, 8, 4, 2), (512, 8, 4, 1)]
"""Compiled ladder of the ``bounded`` kernel, first = default. Its histograms run over the ``block_n`` lane
maxima and the short list, not the row, so fewer lanes (fewer registers per program, more programs per SM)
and narrower digits (fewer bins per pass) pay until the bound loosens past the list: 1024 lanes list ~710
keys per row of independent scores at ``keep`` = 512, inside the ``keep + BOUNDED_LIST_EXTRA`` = 768 the list
holds.
``bench/test_bench_indexer.py::test_indexer_select_bounded_config`` times the alternatives (docs/kernels.md)."""

SELECT_VARIANTS = ("bounded", "plain")
"""The kernel option ``topk_select_variant``'s words: ``bounded`` (:func:`_select_bounded_kernel`:
uint32 keys, a pass 0 for a lower bound on the cut, the keys above it listed, radix passes over the
list) and ``plain`` (:func:`_select_kernel`: int64 keys, radix passes over the row from the top bit)."""

BOUNDED_LIST_EXTRA = 256
"""Candidates beyond ``keep`` the ``bounded`` kernel's list holds (capped by the launch's ``block_n``: 32
under the interpreter's ladder, so CPU tests take every branch): the keys at or above the lower bound of
pass 0 when they fit, else, after radix passes over the row, the group at the cut and every key above
it; the remaining passes run over that list. Scratch: ``[rows, keep + extra]`` int32 columns and fp32
scores."""

_MAX_COLUMNS = 2**31 - 1
"""Columns are numbered in int32 inside the kernel."""


@dataclass(frozen=True)
class SelectConfig:
    """Radix-select launch: columns per step (a power of two >= 16), digit width in bits (1 to
    :data:`MAX_RADIX_BITS`: ``ceil(32 / radix_bits)`` histogram passes of ``2^radix_bits`` bins; the last
    digit takes the bits left), warps, pipeline stages."""

    block_n: int
    radix_bits: int
    num_warps: int
    num_stages: int


@triton.jit
def _ordered_bits(x):
    """int32 of fp32 ``x`` that compare as signed integers as the floats do, ``-0.0`` tying ``+0.0``
    (the high half of :func:`dsv4cp.kernels.contracts.pack_selection_keys`; also used by the indexer's
    score and streaming top-k kernels)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 -> +0.0 (x + 0.0 may be folded)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negatives flip their magnitude bits


@triton.jit
def _radix_keys(x):
    """Order-preserving unsigned keys (int64 in ``[0, 2^32)``) of fp32 ``x``: ``-0.0`` as ``+0.0``;
    non-finite scores get 0, below every finite key (``>= 0x00800000``)."""
    key = _ordered_bits(x).to(tl.int64) + 2147483648  # + 2^31: the same order on [0, 2^32), unsigned
    return tl.where(tl.abs(x) < float("inf"), key, 0)  # false for +-inf and NaN


def _select_kernel(
    SCORES, OUT,
    COLUMNS, KEEP, stride_s, stride_o, LIMIT_BASE, LIMIT_RATIO, ROW0,
    HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, BINS: tl.constexpr,
):
    """Top-``KEEP`` columns of row ``r = program id``.

    SCORES ``[rows, COLUMNS]`` fp32 (rows ``stride_s`` apart, columns contiguous), OUT ``[rows, KEEP]``
    int64 (rows ``stride_o`` apart; ``1 <= KEEP <= COLUMNS``). Digits of BITS bits (``BINS = 2^BITS``),
    from the top; the last one takes the bits left. HAS_LIMIT: only columns below
    ``LIMIT_BASE + (ROW0 + r) // LIMIT_RATIO + 1`` (clamped to ``[0, COLUMNS]``) are read.
    """
    row = tl.program_id(0).to(tl.int64)
    src = SCORES + row * stride_s
    dst = OUT + row * stride_o
    if HAS_LIMIT:
        n = tl.minimum(tl.maximum(LIMIT_BASE + (ROW0 + row) // LIMIT_RATIO + 1, 0), COLUMNS).to(tl.int32)
    else:
        n = COLUMNS
    lanes = tl.arange(0, BLOCK)
    bins = tl.arange(0, BINS)

    # Radix passes. prefix: the cut's digits found so far (in place, lower bits 0); rem: keys still to
    # take from the group sharing them. Leaving the loop: take keys >= lo, and the first `need` == cut.
    # Every loop-carried value is a typed 0-d tensor (a literal or an int argument equal to 1 would be a
    # constexpr, whose type a loop may not change).
    prefix = tl.zeros([], tl.int64)
    rem = tl.zeros([], tl.int32) + KEEP
    top = tl.zeros([], tl.int32) + 32  # this pass's digit: key bits [shift, top)
    lo = tl.zeros([], tl.int64) + 1
    cut = tl.zeros([], tl.int64) - 1
    need = tl.zeros([], tl.int32)
    searching = tl.zeros([], tl.int32) == 0
    while searching:
        shift = tl.maximum(top - BITS, 0)
        digit_mask = (tl.full([], 1, tl.int64) << (top - shift)) - 1
        group_mask = 4294967296 - (tl.full([], 1, tl.int64) << top)  # the bits above this pass's digit
        hist = tl.zeros([BINS], tl.int32)
        for c0 in range(0, n, BLOCK):
            cols = c0 + lanes
            key = _radix_keys(tl.load(src + cols, mask=cols < n, other=float("-inf")))
            member = (key != 0) & ((key & group_mask) == prefix)
            hist += tl.histogram(((key >> shift) & digit_mask).to(tl.int32), BINS, mask=member)
        total = tl.sum(hist)
        at_or_above = total - tl.cumsum(hist, 0) + hist  # keys of the group with a digit >= bin
        d = tl.max(tl.where(at_or_above >= rem, bins, -1))  # >= 0 unless total <= rem
        above = tl.sum(tl.where(bins > d, hist, 0))
        in_d = tl.sum(tl.where(bins == d, hist, 0))
        # pass 1 only (a later group always holds more than rem keys): every finite key is taken
        take_all = total <= rem
        prefix = prefix | (tl.maximum(d, 0).to(tl.int64) << shift)
        rem = rem - above
        group_done = (in_d == rem) & ~take_all  # the whole group at digit d is taken: no tie to resolve
        exact = (shift == 0) & ~take_all & ~group_done  # the cut key: the first rem keys equal to it
        lo = tl.where(take_all, 1, tl.where(group_done, prefix, tl.where(exact, prefix + 1, lo)))
        cut = tl.where(exact, prefix, cut)
        need = tl.where(exact, rem, need)
        searching = ~(take_all | group_done | exact)
        top = shift

    # Compaction in column order: the selected columns, then -1 padding.
    written = tl.zeros([], tl.int32)
    tied = tl.zeros([], tl.int32)
    for c0 in range(0, n, BLOCK):
        cols = c0 + lanes
        key = _radix_keys(tl.load(src + cols, mask=cols < n, other=float("-inf")))
        tie = (key == cut).to(tl.int32)
        tie_rank = tied + tl.cumsum(tie, 0) - tie  # equal keys in earlier columns
        chosen = (key != 0) & ((key >= lo) | ((tie != 0) & (tie_rank < need)))
        flags = chosen.to(tl.int32)
        slot = written + tl.cumsum(flags, 0) - 1
        tl.store(dst + slot, cols.to(tl.int64), mask=chosen)
        written += tl.sum(flags)
        tied += tl.sum(tie)
    for j0 in range(0, KEEP, BLOCK):
        slot = j0 + lanes
        tl.store(dst + slot, tl.full([BLOCK], -1, tl.int64), mask=(slot >= written) & (slot < KEEP))



_FINITE_LO = tl.constexpr(0x00800001)
"""Smallest uint32 key of a finite score (:func:`_raw_keys32` of ``-FLT_MAX``)."""

_FINITE_HI = tl.constexpr(0xFF7FFFFF)
"""Largest uint32 key of a finite score (``+FLT_MAX``); ``+inf`` and NaN map above it, ``-inf`` and
negative NaN below :data:`_FINITE_LO`."""


@triton.jit
def _raw_keys32(x):
    """Order-preserving uint32 keys of fp32 ``x`` (the order of :func:`_radix_keys` in 32-bit lanes): a
    non-negative float's bits with the sign bit set, a negative one's bits negated (its magnitude below
    2^31, so ``-0.0`` lands on ``+0.0``'s key): four integer ops. Finite scores map into
    ``[_FINITE_LO, _FINITE_HI]``; the kernel's ranges stay inside it, which keeps non-finite scores out
    without a test of their own."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits ^ -2147483648, -bits).to(tl.uint32, bitcast=True)


@triton.jit
def _low_bits(width):
    """uint32 mask of the ``width`` (0-d int32 in ``[0, 32]``) lowest bits."""
    return ((tl.full([], 1, tl.int64) << width.to(tl.int64)) - 1).to(tl.uint32)


@triton.jit
def _bit_length(v):
    """Bits needed to write the 0-d uint32 ``v`` (0 for 0, 32 when its top bit is set): a binary search,
    five scalar steps (no count-leading-zeros under the interpreter)."""
    t = tl.zeros([], tl.int32)
    for step in tl.static_range(5):
        s = 16 >> step
        t = tl.where((v >> (t + s).to(tl.uint32)) != 0, t + s, t)
    return t + (v != 0).to(tl.int32)


@triton.jit
def _radix_passes(src, first, n, prefix, top, rem, small, lanes, bins, BLOCK: tl.constexpr, BITS: tl.constexpr,
                  BINS: tl.constexpr):
    """Histogram passes over the keys of fp32 ``src[first:n]`` (0-d uint32 ``prefix``: the group's bits
    ``[top, 32)``, lower bits 0; ``rem``: keys still to take from the group; every key above the group
    is taken, every key below it is not). Each pass narrows the group to the digit holding the cut. Stops
    when the group at the chosen digit is taken whole (``group_done``), when the cut key is exact
    (``top == 0``), when fewer finite keys than ``rem`` exist (``take_all``: only on a first pass whose
    group holds every finite key), or, with ``small >= 0``, once the group holds at most ``rem + small``
    keys. Returns ``(prefix, top, rem, group_done, take_all)``."""
    group_done = tl.zeros([], tl.int32) != 0
    take_all = tl.zeros([], tl.int32) != 0
    fits = tl.zeros([], tl.int32) != 0
    while (top > 0) & ~group_done & ~take_all & ~fits:
        shift = tl.maximum(top - BITS, 0)
        # members: the finite keys of [prefix, prefix + 2^top) = [start, start + span): one unsigned
        # compare of key - start
        start = tl.maximum(prefix, _FINITE_LO)
        end = tl.minimum(prefix.to(tl.int64) + (tl.full([], 1, tl.int64) << top.to(tl.int64)), _FINITE_HI + 1)
        span = (end - start.to(tl.int64)).to(tl.uint32)
        digit_mask = _low_bits(top - shift)
        ushift = shift.to(tl.uint32)
        hist = tl.zeros([BINS], tl.int32)
        for c0 in range(first, n, BLOCK):
            cols = c0 + lanes
            key = _raw_keys32(tl.load(src + cols, mask=cols < n, other=float("-inf")))
            hist += tl.histogram(((key >> ushift) & digit_mask).to(tl.int32), BINS, mask=(key - start) < span)
        total = tl.sum(hist)
        at_or_above = total - tl.cumsum(hist, 0) + hist  # keys of the group with a digit >= bin
        d = tl.max(tl.where(at_or_above >= rem, bins, -1))  # >= 0 unless total < rem
        above = tl.sum(tl.where(bins > d, hist, 0))
        in_d = tl.sum(tl.where(bins == d, hist, 0))
        # total == rem ends as a group taken whole (below); total < rem only without a bound
        take_all = total < rem
        prefix = prefix | (tl.maximum(d, 0).to(tl.uint32) << ushift)
        rem = rem - above
        group_done = (in_d == rem) & ~take_all  # the whole group at digit d is taken: no tie to resolve
        fits = (small >= 0) & (in_d - rem <= small)
        top = shift
    return prefix, top, rem, group_done, take_all


@triton.jit
def _compact(src, cols_src, first, n, lo, cut, need, dst, vdst, cap, lanes, FROM_LIST: tl.constexpr,
             COLS_INT64: tl.constexpr, WITH_VALUES: tl.constexpr, BLOCK: tl.constexpr):
    """Write, in order, the entries of fp32 ``src[first:n]`` whose key is in ``[lo, _FINITE_HI]`` and the
    first ``need`` whose key equals ``cut`` (0-d; ``need`` 0: none): their columns to ``dst`` (int64 when
    COLS_INT64, else int32) and, WITH_VALUES, their scores to ``vdst``, the first ``cap`` of them only.
    FROM_LIST: entry ``i``'s column is ``cols_src[i]`` (int32), else ``i``. Returns how many were chosen
    (more than ``cap`` when they did not fit)."""
    room = _FINITE_HI - lo  # lo <= key <= _FINITE_HI: one unsigned compare of key - lo
    written = tl.zeros([], tl.int32)
    tied = tl.zeros([], tl.int32)
    for c0 in range(first, n, BLOCK):
        idx = c0 + lanes
        inside = idx < n
        x = tl.load(src + idx, mask=inside, other=float("-inf"))
        key = _raw_keys32(x)
        if need > 0:
            tie = (key == cut).to(tl.int32)  # the cut is finite
            tie_rank = tied + tl.cumsum(tie, 0) - tie  # equal keys in earlier entries
            chosen = ((key - lo) <= room) | ((tie != 0) & (tie_rank < need))
            tied += tl.sum(tie)
        else:
            chosen = (key - lo) <= room
        flags = chosen.to(tl.int32)
        slot = written + tl.cumsum(flags, 0) - 1
        kept = chosen & (slot < cap)
        if FROM_LIST:
            cols = tl.load(cols_src + idx, mask=kept, other=0)
        else:
            cols = idx
        if COLS_INT64:
            tl.store(dst + slot, cols.to(tl.int64), mask=kept)
        else:
            tl.store(dst + slot, cols, mask=kept)
        if WITH_VALUES:
            tl.store(vdst + slot, x, mask=kept)
        written += tl.sum(flags)
    return written


@triton.jit
def _block_bound(keys, k, hi, bins, BITS: tl.constexpr, BINS: tl.constexpr):
    """A lower bound on the ``k``-th largest of the uint32 ``keys`` (one register block; at least ``k``
    finite, non-finite ones below ``_FINITE_LO``; ``hi`` their largest): radix passes over the block from
    the bits its smallest finite key shares with ``hi``, until the group at the cut is taken whole or
    the cut is exact. Returns the group's smallest possible key: at least ``k`` keys are >= it, and it is
    <= the ``k``-th largest."""
    lo_key = tl.min(tl.where(keys >= _FINITE_LO, keys, 0xFFFFFFFF))
    top = _bit_length(lo_key ^ hi)
    prefix = hi & ~_low_bits(top)
    rem = tl.zeros([], tl.int32) + k
    done = tl.zeros([], tl.int32) != 0
    while (top > 0) & ~done:
        shift = tl.maximum(top - BITS, 0)
        start = tl.maximum(prefix, _FINITE_LO)
        end = tl.minimum(prefix.to(tl.int64) + (tl.full([], 1, tl.int64) << top.to(tl.int64)), _FINITE_HI + 1)
        span = (end - start.to(tl.int64)).to(tl.uint32)
        ushift = shift.to(tl.uint32)
        hist = tl.histogram(((keys >> ushift) & _low_bits(top - shift)).to(tl.int32), BINS, mask=(keys - start) < span)
        at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist
        d = tl.max(tl.where(at_or_above >= rem, bins, 0))  # the group holds at least rem keys
        above = tl.sum(tl.where(bins > d, hist, 0))
        in_d = tl.sum(tl.where(bins == d, hist, 0))
        prefix = prefix | (d.to(tl.uint32) << ushift)
        rem = rem - above
        done = in_d == rem
        top = shift
    return prefix


def _select_bounded_kernel(
    SCORES, OUT, VALUES, LIST_COLS, LIST_VALUES, RANGE_START, RANGE_STOP,
    COLUMNS, KEEP, stride_s, stride_o, stride_v, stride_l, LIMIT_BASE, LIMIT_RATIO, ROW0,
    HAS_LIMIT: tl.constexpr, HAS_RANGE: tl.constexpr, WITH_VALUES: tl.constexpr, BLOCK: tl.constexpr,
    LIST_BLOCK: tl.constexpr, EXTRA: tl.constexpr, BITS: tl.constexpr, BINS: tl.constexpr,
):
    """Top-``KEEP`` columns of row ``r = program id``, radix passes started below the bits every
    candidate shares, finished on a short list of candidates (the ``bounded`` variant; see the module
    docstring).

    SCORES ``[rows, COLUMNS]`` fp32 (rows ``stride_s`` apart, columns contiguous), OUT ``[rows, KEEP]``
    int64 (rows ``stride_o`` apart; ``1 <= KEEP <= COLUMNS``); WITH_VALUES: VALUES ``[rows, KEEP]`` fp32
    (rows ``stride_v`` apart) gets the chosen columns' scores, bit for bit (0.0 in the ``-1`` slots).
    LIST_COLS ``[rows, KEEP + EXTRA]`` int32 / LIST_VALUES fp32 (rows ``stride_l`` apart): scratch for
    the candidate list. HAS_LIMIT: only columns below ``LIMIT_BASE + (ROW0 + r) // LIMIT_RATIO + 1``
    (clamped to ``[0, COLUMNS]``) are read; HAS_RANGE: only columns in ``[RANGE_START[r], RANGE_STOP[r])``
    (int64 ``[rows]``, clamped) as well. BLOCK entries per step over the row, LIST_BLOCK over the list
    (``<= BLOCK``). Digits of BITS bits (``BINS = 2^BITS``); the last one takes the bits left.
    """
    row = tl.program_id(0).to(tl.int64)
    src = SCORES + row * stride_s
    if HAS_LIMIT:
        n = tl.minimum(tl.maximum(LIMIT_BASE + (ROW0 + row) // LIMIT_RATIO + 1, 0), COLUMNS).to(tl.int32)
    else:
        n = tl.zeros([], tl.int32) + COLUMNS
    first = tl.zeros([], tl.int32)
    if HAS_RANGE:
        n = tl.minimum(n, tl.maximum(tl.load(RANGE_STOP + row), 0).to(tl.int32))
        first = tl.minimum(tl.maximum(tl.load(RANGE_START + row), 0).to(tl.int32), n)
    lanes = tl.arange(0, BLOCK)
    bins = tl.arange(0, BINS)

    # A row reading at most KEEP columns takes every finite one: no pass at all.
    take_all = n - first <= KEEP
    # Pass 0 (no atomics): per lane the largest key of the columns it reads.
    lane_max = tl.zeros([BLOCK], tl.uint32)
    for c0 in range(first, tl.where(take_all, first, n), BLOCK):
        cols = c0 + lanes
        key = _raw_keys32(tl.load(src + cols, mask=cols < n, other=float("-inf")))
        lane_max = tl.maximum(lane_max, tl.where(key <= _FINITE_HI, key, 0))  # non-finite: as -inf
    hi = tl.max(lane_max)  # the largest finite key (below _FINITE_LO: none)
    take_all = take_all | (hi < _FINITE_LO)
    # The lanes read disjoint columns, so each lane's maximum is a distinct key of the row: when at
    # least KEEP lanes hold a finite key, KEEP keys are >= the KEEP-th largest lane maximum, so the cut
    # is too; few more keys than KEEP are above it on rows much longer than BLOCK.
    bound_ok = ~take_all & (tl.sum((lane_max >= _FINITE_LO).to(tl.int32)) >= KEEP)
    lb = tl.zeros([], tl.uint32) + _FINITE_LO
    if bound_ok:
        lb = _block_bound(lane_max, KEEP, hi, bins, BITS, BINS)
    # Every key >= lb, in column order, into the list (capacity KEEP + EXTRA).
    cap = KEEP + EXTRA
    lcols = LIST_COLS + row * stride_l
    lvals = LIST_VALUES + row * stride_l
    m = tl.zeros([], tl.int32)
    if ~take_all:
        m = _compact(src, src, first, n, lb, lb, 0, lcols, lvals, cap, lanes, False, False, True, BLOCK)
    listed = ~take_all & (m <= cap)
    # Radix passes over the list, or (it overflowed) over the row until the group at the cut fits the
    # list, which is then filled with that group and every key above it. The group: keys sharing the
    # leading bits of lb and hi (every key at or above the cut is in it); rem: how many to take from it.
    top = tl.where(take_all, 0, _bit_length(lb ^ hi))
    prefix = hi & ~_low_bits(top)
    rem = tl.zeros([], tl.int32) + KEEP
    group_done = tl.zeros([], tl.int32) != 0
    if ~take_all & ~listed:
        prefix, top, rem, group_done, all_finite = _radix_passes(src, first, n, prefix, top, rem, EXTRA, lanes, bins,
                                                                 BLOCK, BITS, BINS)
        take_all = take_all | all_finite
        listed = ~take_all & ~group_done & (top > 0)
        if listed:
            m = _compact(src, src, first, n, prefix, prefix, 0, lcols, lvals, cap, lanes, False, False, True, BLOCK)
    dst = OUT + row * stride_o
    vdst = VALUES + row * stride_v
    if listed:
        list_lanes = tl.arange(0, LIST_BLOCK)
        prefix, top, rem, group_done, all_finite = _radix_passes(lvals, 0, m, prefix, top, rem, -1, list_lanes, bins,
                                                                 LIST_BLOCK, BITS, BINS)
        take_all = all_finite  # without a bound the list holds every finite key: perhaps fewer than KEEP
        exact = ~take_all & ~group_done
        lo = tl.where(take_all, _FINITE_LO, tl.where(group_done, prefix, prefix + 1)).to(tl.uint32)
        written = _compact(lvals, lcols, 0, m, lo, tl.where(exact, prefix, 0), tl.where(exact, rem, 0), dst, vdst,
                           KEEP, list_lanes, True, True, WITH_VALUES, LIST_BLOCK)
    else:
        # Take keys >= lo, and the first `need` keys equal to `cut` (ties at the cut: the lowest columns).
        exact = ~take_all & ~group_done
        lo = tl.where(take_all, _FINITE_LO, tl.where(group_done, prefix, prefix + 1)).to(tl.uint32)
        written = _compact(src, src, first, n, lo, tl.where(exact, prefix, 0), tl.where(exact, rem, 0), dst, vdst, KEEP,
                           lanes, False, True, WITH_VALUES, BLOCK)
    for j0 in range(0, KEEP, BLOCK):
        slot = j0 + lanes
        pad = (slot >= written) & (slot < KEEP)
        tl.store(dst + slot, tl.full([BLOCK], -1, tl.int64), mask=pad)
        if WITH_VALUES:
            tl.store(vdst + slot, tl.zeros([BLOCK], tl.float32), mask=pad)


_KERNELS = Kernels("select top triton", _select_kernel, _select_bounded_kernel, op="indexer_topk")


def select_config_ladder(interpreted: bool, variant: str = "plain") -> list[SelectConfig]:
    """Launch configurations of the ``variant`` kernel tried in order (the first that compiles is kept). Per
    program: one ``[BLOCK]`` fp32 tile and its keys in registers, a ``2^radix_bits``-bin histogram; any of
    these fits."""
    if variant not in SELECT_VARIANTS:
        raise ValueError(f"variant: must be one of {', '.join(map(repr, SELECT_VARIANTS))}, got {variant!r}")
    if interpreted:  # numpy runs the steps: small ones keep the CPU tests fast and still multi-step
        return [SelectConfig(32, 8, 4, 1)]
    return [SelectConfig(*c) for c in (BOUNDED_SELECT_CONFIGS if variant == "bounded" else SELECT_CONFIGS)]


def _pinned(config: SelectConfig | None) -> SelectConfig | None:
    """``config`` (a :class:`SelectConfig` or the kernel option ``triton_select_config``'s integers), else
    None (the ladder); checked."""
    if config is not None and not isinstance(config, (SelectConfig, tuple)):
        raise ValueError(f"config: must be a SelectConfig, got {type(config).__name__}")
    config = pinned_config(config, SelectConfig)
    if config is not None and not 1 <= config.radix_bits <= MAX_RADIX_BITS:
        raise ValueError(f"config.radix_bits: must be in [1, {MAX_RADIX_BITS}], got {config.radix_bits}")
    return config


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_inputs(scores, keep, row_limit) -> None:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores: must be a [rows, columns] tensor, got {shape}")
    if scores.dtype != torch.float32:
        raise ValueError(f"scores: dtype must be fp32, got {scores.dtype}")
    rows, columns = scores.shape
    if columns > _MAX_COLUMNS:
        raise ValueError(f"scores: at most {_MAX_COLUMNS} columns, got {columns}")
    if columns > 1 and rows > 0 and scores.stride(1) != 1:
        raise ValueError(f"scores: columns must be contiguous (stride 1), got strides {scores.stride()}")
    if scores.device.type not in ("cuda", "cpu"):
        raise ValueError(f"scores: device must be cuda (or cpu under the Triton interpreter), got {scores.device}")
    if not _is_int(keep) or not 0 <= keep <= columns:
        raise ValueError(f"keep: must be an int in [0, {columns}] (the columns), got {keep!r}")
    if row_limit is not None:
        ok = isinstance(row_limit, tuple) and len(row_limit) == 3 and all(_is_int(v) for v in row_limit)
        if not ok or row_limit[1] < 1 or row_limit[2] < 0:
            raise ValueError(f"row_limit: must be a tuple (base, ratio >= 1, row0 >= 0) of ints, got {row_limit!r}")


@torch.no_grad()
def select_top_triton(
    scores: torch.Tensor,
    keep: int,
    *,
    row_limit: tuple[int, int, int] | None = None,
    config: SelectConfig | None = None,
    variant: str | None = None,
    return_values: bool = False,
    row_range: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The ``keep`` best finite columns of each row of ``scores``, by radix select (one program per row).

    Args:
        scores: ``[rows, columns]`` fp32, columns contiguous (rows may be any stride apart: a view of a
            reused buffer), on CUDA (or CPU under Triton's interpreter).
        keep: columns to keep per row, ``0 <= keep <= columns``.
        row_limit: ``(base, ratio, row0)``: the caller guarantees that row ``r`` holds no finite score at
            or past column ``base + (row0 + r) // ratio + 1`` (clamped to ``[0, columns]``); those
            columns are then never read. None: every column is read.
        config: pin the launch (a config or the kernel option ``triton_select_config``'s integers;
            default: the variant's :func:`select_config_ladder`).
        variant: ``"bounded"`` or ``"plain"`` (:data:`SELECT_VARIANTS`; default: the kernel option
            ``topk_select_variant``'s).
        return_values: also return the chosen columns' scores.
        row_range: ``(start, stop)``, integer ``[rows]`` tensors on the scores' device: the caller
            guarantees that row ``r`` holds no finite score outside columns ``[start[r], stop[r])``
            (clamped to ``[0, columns]``; with ``row_limit`` too, the narrower bound holds). The
            ``bounded`` kernel then never reads those columns (a row of one packed document scans its
            own key range only); ``plain`` reads them (the answer is the same).

    Returns: ``[rows, keep]`` int64 columns in increasing order, ``-1`` past a row's finite count: the
    contract of :func:`dsv4cp.kernels.contracts.select_top` (ties at the cut to the lowest columns,
    ``-0.0`` ties ``+0.0``, non-finite scores never chosen). With ``return_values``, ``(columns,
    values)``: ``values [rows, keep]`` fp32 holds ``scores[r, columns[r, j]]`` bit for bit (``-0.0``
    stays ``-0.0``), 0.0 where the column is ``-1``.
    """
    _check_inputs(scores, keep, row_limit)
    _check_row_range(row_range, scores)
    chosen_variant = _variant(variant)
    if not isinstance(return_values, bool):
        raise ValueError(f"return_values: must be a bool, got {return_values!r}")
    pinned = _pinned(config)
    rows, columns = scores.shape
    out = torch.empty(rows, keep, dtype=torch.int64, device=scores.device)
    bounded = chosen_variant == "bounded"
    values = torch.empty(rows, keep if return_values and bounded else 0, dtype=torch.float32,
                         device=scores.device)
    if rows > 0 and keep > 0:
        if bounded:
            _bounded_launch(scores, out, values, keep, row_limit, row_range, pinned)
        else:
            _plain_launch(scores, out, values, keep, row_limit, pinned)
    if not return_values:
        return out
    if not bounded:  # the plain kernel writes columns only: gather their scores
        values = torch.where(out >= 0, scores.gather(1, out.clamp_min(0)), 0.0)
    return out, values


def _variant(variant: str | None) -> str:
    if variant is None:
        return kernel_options.OPTIONS["topk_select_variant"].default  # type: ignore[return-value]  (a word)
    if variant not in SELECT_VARIANTS:
        raise ValueError(f"variant: must be one of {', '.join(map(repr, SELECT_VARIANTS))}, got {variant!r}")
    return variant


def _plain_launch(scores, out, values, keep, row_limit, pinned) -> None:
    rows, columns = scores.shape
    base, ratio, row0 = row_limit if row_limit is not None else (0, 1, 0)
    dev = scores.device
    kernel = _KERNELS.build("_select_kernel", dev)

    def launch(cfg: SelectConfig) -> None:
        kernel[(rows,)](
            scores, out, columns, keep, scores.stride(0), out.stride(0), base, ratio, row0,
            HAS_LIMIT=row_limit is not None, BLOCK=cfg.block_n, BITS=cfg.radix_bits, BINS=1 << cfg.radix_bits,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _KERNELS.launch("select", (dev.type,), select_config_ladder(_interpreted(dev)), pinned, launch)


def _check_row_range(row_range, scores: torch.Tensor) -> None:
    if row_range is None:
        return
    rows = scores.shape[0]
    ok = isinstance(row_range, tuple) and len(row_range) == 2 and all(
        isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == rows and not t.dtype.is_floating_point
        and t.dtype != torch.bool and t.device == scores.device for t in row_range)
    if not ok:
        got = [(tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
               for t in row_range] if isinstance(row_range, tuple) else type(row_range).__name__
        raise ValueError(f"row_range: must be (start, stop), integer [{rows}] tensors on {scores.device}, got {got}")


def _bounded_launch(scores, out, values, keep, row_limit, row_range, pinned) -> None:
    rows, columns = scores.shape
    base, ratio, row0 = row_limit if row_limit is not None else (0, 1, 0)
    dev = scores.device
    kernel = _KERNELS.build("_select_bounded_kernel", dev)
    with_values = values.shape[1] > 0
    # one list width for every config of the ladder: the extra candidates are capped by the smallest step
    ladder = select_config_ladder(_interpreted(dev), "bounded")
    extra = min([BOUNDED_LIST_EXTRA] + [c.block_n for c in ladder]
                + ([pinned.block_n] if pinned is not None else []))
    list_cols = torch.empty(rows, keep + extra, dtype=torch.int32, device=dev)
    list_values = torch.empty(rows, keep + extra, dtype=torch.float32, device=dev)

    start, stop = (t.to(torch.int64).contiguous() for t in row_range) if row_range is not None else (out, out)

    def launch(cfg: SelectConfig) -> None:
        kernel[(rows,)](
            scores, out, values if with_values else out, list_cols, list_values, start, stop, columns, keep,
            scores.stride(0), out.stride(0), values.stride(0) if with_values else 0, list_cols.stride(0), base, ratio,
            row0, HAS_LIMIT=row_limit is not None, HAS_RANGE=row_range is not None, WITH_VALUES=with_values,
            BLOCK=cfg.block_n,
            LIST_BLOCK=min(cfg.block_n, triton.next_power_of_2(keep + extra)), EXTRA=extra,
            BITS=cfg.radix_bits, BINS=1 << cfg.radix_bits, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _KERNELS.launch("select-bounded", (dev.type,), ladder, pinned, launch)
