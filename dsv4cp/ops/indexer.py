"""Lightning-indexer scoring (docs/design.md §1.5, 4.2): ``I[t, j] = sum_h w[t, h] relu(<q[t, h], k[j]>)``.

Two ops, both chunked over queries so neither the per-head score tensor nor the full
``[T, entries]`` fp32 matrix exists beyond a bounded block:

* :func:`indexer_topk`: no-grad selection of the K best visible entries per query.
* :func:`indexer_scores`: differentiable scores at given entries (the indexer loss's prediction);
  :func:`indexer_scores_given`: the same op on scores already computed (the selection's), no forward work.

CUDA inputs run the Triton kernels; :func:`fused_indexer_topk` is the top-k's Triton backend, which
chooses its path from the call's kernel options (``options``, a :class:`~dsv4cp.kernel_options.KernelOptions`:
``topk_impl``, ``topk_select``, ``topk_keys``, the select kernel and the launch pins) and notes what
ran (``indexer_topk`` -> ``triton/chunked/radix``, ``triton/stream``, ...,
or ``torch``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4cp import kernel_options
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.kernels import interpreted, triton_serves
from dsv4cp.kernels.contracts import check_key_row_limit, select_top
from dsv4cp.ops.custom_op_library import note_eager
from dsv4cp.profiling.autograd_ranges import BackwardRegion
from dsv4cp.profiling.nvtx import nvtx_range

CHUNK_ELEMENTS = 32 * 2**20
"""Elements of one chunk's ``[chunk, Hi, keys]`` per-head score block."""

PREFIX_ROWS = 256
"""Most query rows of one torch top-k chunk under ``key_row_limit``: a chunk scores the key rows its
last query may see, so short chunks make each row's cost follow its own causal prefix (at ratio 4 a
chunk of 256 rows scores at most 64 columns a row does not need)."""


def _chunk(per_query: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(per_query, 1))


@torch.no_grad()
def indexer_topk(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: Callable[[slice], torch.Tensor], k: int,
    visibility: tuple[torch.Tensor, ...] | None = None, key_row_limit: tuple[int, int] | None = None,
    return_scores: bool = False, *, options: KernelOptions = DEFAULT_OPTIONS,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``keys`` with the ``k`` highest scores among those visible, per query.

    Args:
        q: ``[T, Hi, Di]`` indexer queries; ``w``: ``[T, Hi]`` head weights; ``keys``: ``[G, Di]``.
        visible: maps a slice of queries to their ``[len, G]`` bool visibility mask.
        k: entries to keep.
        visibility: the same visibility as ``(query_doc, query_limit, key_doc, key_j)`` tensors: key g
            is visible to query t iff ``key_doc[g] == query_doc[t] >= 0`` and ``key_j[g] <
            query_limit[t]``. With it, CUDA inputs go to the fused Triton kernel.
        key_row_limit: ``(base, ratio)``: query row t sees no key row at or past ``base + t // ratio +
            1`` (``RankLayout.key_row_limit``); lets the Triton kernel plan its chunks without reading
            the device (see :func:`dsv4cp.kernels.indexer_plan.plan_static_chunks`). The torch path
            then scores each chunk of at most :data:`PREFIX_ROWS` query rows ``[s, e)`` against key
            rows ``[0, min(G, base + (e - 1) // ratio + 1))`` only, so its work follows the rows'
            causal prefix like the Triton plan's; without it every chunk scores all ``G`` rows.
        return_scores: also return the scores of the chosen entries, as the selection saw them (the
            indexer loss's prediction at those entries, without scoring them again).
        options: the kernel options of the Triton path (:func:`fused_indexer_topk`).
    Returns: ``[T, k]`` int64 key rows in increasing order, ``-1`` where fewer than ``k`` are
        visible. Among equal scores at the cut the lower key rows win (keys must be in entry order,
        gaps allowed), so every CP layout selects the same entries. A NaN or infinite score is never
        selected (as if invisible; the indexer loss reports it, docs/design.md §4.5). With
        ``return_scores``, ``(rows, scores)``: ``scores [T, k]`` (fp32; fp64 for fp64 inputs on the torch
        path) the selection's score at each chosen row, 0.0 where the row is ``-1``; not differentiable
        (:func:`indexer_scores` is).
    Raises:
        ValueError: ``key_row_limit`` is not None nor a tuple ``(base >= 0, ratio >= 1)`` of ints, or
            ``return_scores`` not a bool.
    """
    check_key_row_limit(key_row_limit)
    if not isinstance(return_scores, bool):
        raise ValueError(f"return_scores: must be a bool, got {return_scores!r}")
    if visibility is not None and triton_serves(q) and torch.compiler.is_compiling():
        limit = None if key_row_limit is None else list(key_row_limit)  # the custom ops: .indexer_library
        op = torch.ops.dsv4cp.indexer_topk_scores if return_scores else torch.ops.dsv4cp.indexer_topk
        return op(q, w, keys, *visibility, k, limit, *options.op_values(TOPK_OPTION_NAMES))
    if visibility is not None and triton_serves(q):
        return fused_indexer_topk(q, w, keys, *visibility, k, key_row_limit=key_row_limit,
                                  return_scores=return_scores, options=options)
    note_eager("indexer_topk", "torch")
    t, hi, _ = q.shape
    g = keys.shape[0]
    work = torch.promote_types(q.dtype, torch.float32)
    out = torch.full((t, k), -1, dtype=torch.int64, device=q.device)
    out_scores = torch.zeros((t, k) if return_scores else (0, 0), dtype=work, device=q.device)
    if g == 0:
        return (out, out_scores) if return_scores else out
    keys_w = keys.to(work)
    if key_row_limit is None:
        max_rows = t

        def width(stop: int) -> int:
            return g
    else:
        base, ratio = key_row_limit
        max_rows = PREFIX_ROWS

        def width(stop: int) -> int:  # key rows [0, width) hold every key visible to the rows before stop
            return min(g, base + (stop - 1) // ratio + 1)
    s = 0
    while s < t:
        # bound the block by the widest the chunk can get (its longest candidate's width), then take
        # the width its real end needs: chunks grow narrower in rows as the prefix widens
        step = min(max_rows, _chunk(hi * width(min(s + max_rows, t))))
        e = min(s + step, t)
        cols = width(e)
        rows = slice(s, e)
        dots = torch.einsum("chd,gd->chg", q[rows].to(work), keys_w[:cols]).relu_()
        scores = torch.einsum("chg,ch->cg", dots, w[rows].to(work))
        scores.masked_fill_(~visible(rows)[:, :cols], float("-inf"))
        keep = min(k, cols)
        chosen = select_top(scores, keep)
        out[rows, :keep] = chosen
        if return_scores:
            out_scores[rows, :keep] = torch.where(chosen >= 0, scores.gather(1, chosen.clamp_min(0)), 0.0)
        s = e
    return (out, out_scores) if return_scores else out


TOPK_IMPLS = ("chunked", "stream")

TOPK_OPTION_NAMES = ("topk_impl", "topk_select", "topk_keys", "topk_select_variant", "triton_indexer_config",
                     "triton_topk_stream_config", "triton_select_config", "triton_indexer_head_pairs")
"""The kernel options of the top-k: its custom ops (:mod:`.indexer_library`) take their values as arguments."""
SCORES_OPTION_NAMES = ("triton_gather_bwd_config", "triton_scores_bwd_reduce", "triton_scores_bwd_scratch",
                       "triton_scores_bwd_layout", "triton_scores_bwd_index_ahead")
"""The kernel options of the scores' backward, taken as arguments by the scores' custom ops."""


@torch.no_grad()
def fused_indexer_topk(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, query_doc: torch.Tensor, query_limit: torch.Tensor,
    key_doc: torch.Tensor, key_j: torch.Tensor, k: int, chunk: int | None = None, *,
    budget_bytes: int | None = None, config=None, key_row_limit: tuple[int, int] | None = None,
    impl: str | None = None, select: str | None = None, keys_mode: str | None = None,
    select_variant: str | None = None, return_scores: bool = False, options: KernelOptions = DEFAULT_OPTIONS,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`indexer_topk` on the Triton kernels, from visibility tensors (the contract of
    :func:`dsv4cp.kernels.indexer_triton.indexer_topk_triton`, whose arguments these are).

    Each keyword left None takes its kernel option from ``options``. The path: ``impl`` (else
    ``topk_impl``): ``"chunked"`` (score buffers + a
    selection) or ``"stream"`` (:func:`dsv4cp.kernels.indexer_topk_triton.indexer_topk_stream`, one pass;
    ``chunk`` and ``budget_bytes`` do not apply, ``config`` (else ``triton_topk_stream_config``) pins its
    tiles; ``k`` above its
    ``MAX_STREAM_K`` runs chunked). The chunked selection: ``select`` (else ``topk_select``; ``auto``:
    ``radix`` for compiled kernels, ``torch`` under the interpreter) and, on the torch selection, the
    buffer ``keys_mode`` (else ``topk_keys``); the radix select's kernel: ``select_variant`` (else
    ``topk_select_variant``); the chunked score kernel's pin: ``config`` (else ``triton_indexer_config``),
    the radix select's: ``triton_select_config``; its head loop: ``triton_indexer_head_pairs`` (the
    streaming kernel keeps one head at a time). Every keyword is checked whichever path runs.
    ``return_scores``: also the chosen rows' scores (see :func:`indexer_topk`); the streaming kernel keeps
    none, so it then runs chunked. Notes ``indexer_topk`` -> ``triton/stream``, ``triton/chunked/radix``
    (``.../radix/bounded`` for that kernel) or ``triton/chunked/torch/<keys>``.
    """
    chosen_impl = _choice(impl, options.topk_impl, "impl", TOPK_IMPLS)
    chosen_select = _choice(select, options.topk_select, "select", ("auto", "radix", "torch"))
    chosen_keys = _choice(keys_mode, options.topk_keys, "keys_mode", ("packed", "scores"))
    chosen_variant = _choice(select_variant, options.topk_select_variant, "select_variant", ("bounded", "plain"))
    if chosen_select == "auto":
        chosen_select = "torch" if interpreted(q.device) else "radix"
    if chosen_impl == "stream" and not return_scores:
        from dsv4cp.kernels import indexer_topk_triton as stream  # lazy: imports triton

        if not isinstance(k, int) or k <= stream.MAX_STREAM_K:  # larger running lists do not fit on chip
            kernel_options.note_backend("indexer_topk", "triton/stream")
            return stream.indexer_topk_stream(q, w, keys, query_doc, query_limit, key_doc, key_j, k,
                                              config=options.triton_topk_stream_config if config is None else config,
                                              key_row_limit=key_row_limit)
    from dsv4cp.kernels.indexer_triton import indexer_topk_triton  # lazy: imports triton

    path = ("radix" if chosen_variant == "plain" else "radix/bounded") if chosen_select == "radix" else \
        f"torch/{chosen_keys}"
    kernel_options.note_backend("indexer_topk", f"triton/chunked/{path}")
    return indexer_topk_triton(q, w, keys, query_doc, query_limit, key_doc, key_j, k, chunk, select=chosen_select,
                               keys_mode=chosen_keys, budget_bytes=budget_bytes,
                               config=options.triton_indexer_config if config is None else config,
                               select_config=options.triton_select_config, key_row_limit=key_row_limit,
                               select_variant=chosen_variant, return_scores=return_scores,
                               head_pairs=options.triton_indexer_head_pairs)


def _choice(explicit: str | None, option_value: str, keyword: str, allowed: tuple[str, ...]) -> str:
    """``explicit`` (the keyword ``keyword``, checked against ``allowed``), else the kernel option's value."""
    if explicit is None:
        return option_value
    if explicit not in allowed:
        raise ValueError(f"{keyword}: must be one of {', '.join(map(repr, allowed))}, got {explicit!r}")
    return explicit


def _gather_dots(q, keys, idx):
    gathered = keys[idx.clamp_min(0)]  # [c, K, Di]
    return gathered, torch.einsum("chd,ckd->chk", q, gathered)


class _IndexerScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, keys, idx):
        with nvtx_range("indexer.score.fwd"):
            return _IndexerScores._forward(ctx, q, w, keys, idx)

    @staticmethod
    def _forward(ctx, q, w, keys, idx):
        t, hi, _ = q.shape
        work = torch.promote_types(q.dtype, torch.float32)
        out = torch.empty(idx.shape, dtype=work, device=q.device)
        step = _chunk(hi * idx.shape[1] * 2)
        for s in range(0, t, step):
            e = min(s + step, t)
            _, dots = _gather_dots(q[s:e].to(work), keys.to(work), idx[s:e])
            out[s:e] = torch.einsum("chk,ch->ck", dots.relu(), w[s:e].to(work))
        ctx.save_for_backward(q, w, keys, idx)
        return out

    @staticmethod
    def backward(ctx, grad):
        note_eager("indexer_scores.bwd", "torch")
        with nvtx_range("indexer.score.bwd"):
            return _IndexerScores._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        q, w, keys, idx = ctx.saved_tensors
        t, hi, _ = q.shape
        work = grad.dtype
        dq = torch.empty(q.shape, dtype=work, device=q.device)
        dw = torch.empty(w.shape, dtype=work, device=q.device)
        dkeys = torch.zeros(keys.shape, dtype=work, device=q.device)
        keys_w = keys.to(work)
        step = _chunk(hi * idx.shape[1] * 4)
        for s in range(0, t, step):
            e = min(s + step, t)
            q_c, g_c = q[s:e].to(work), grad[s:e] * (idx[s:e] >= 0)
            gathered, dots = _gather_dots(q_c, keys_w, idx[s:e])
            dw[s:e] = torch.einsum("chk,ck->ch", dots.relu(), g_c)
            ddots = (dots > 0) * w[s:e].to(work)[..., None] * g_c[:, None, :]
            dq[s:e] = torch.einsum("chk,ckd->chd", ddots, gathered)
            dgathered = torch.einsum("chk,chd->ckd", ddots, q_c)
            dkeys.index_add_(0, idx[s:e].clamp_min(0).reshape(-1), dgathered.reshape(-1, keys.shape[1]))
        return dq.to(q.dtype), dw.to(w.dtype), dkeys.to(keys.dtype), None


def scores_backward_keywords(options: KernelOptions) -> dict:
    """The Triton scores' backward settings of ``options``, as :func:`indexer_scores_triton` takes them."""
    scratch = options.triton_scores_bwd_scratch
    return {"bwd_config": options.triton_gather_bwd_config, "reduce": options.triton_scores_bwd_reduce,
            "scratch_bytes": None if scratch is None else scratch[0] * 2**20,
            "layout": options.triton_scores_bwd_layout, "index_ahead": options.triton_scores_bwd_index_ahead}


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, *,
                   options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """Differentiable scores ``[T, K]`` (fp32, fp64 for fp64) of queries at key rows ``idx [T, K]``.

    ``q [T, Hi, Di]``, ``w [T, Hi]``, ``keys [G, Di]``; slots with ``idx == -1`` hold meaningless
    values and receive no gradient: the caller masks them. CUDA inputs run on the Triton kernels, whose
    backward sums the key gradient as the kernel option ``triton_scores_bwd_reduce`` of ``options`` says
    (with its launch pin and scratch: ``triton_gather_bwd_config``, ``triton_scores_bwd_scratch``; fp32 atomics
    by default; in deterministic mode a fixed-order sorted reduction instead; see :mod:`.determinism`).
    """
    if triton_serves(q):
        from dsv4cp.kernels.indexer_scores_triton import indexer_scores_triton  # lazy: imports triton

        note_eager("indexer_scores.fwd", "triton")
        if torch.compiler.is_compiling():  # one opaque node per direction: .indexer_library
            return torch.ops.dsv4cp.indexer_scores_fwd(q, w, keys, idx, *options.op_values(SCORES_OPTION_NAMES))
        # the kernels' autograd function opens no range of its own: mark its backward here
        region = BackwardRegion("indexer.score.bwd")
        q, w, keys = (region.input(t) for t in (q, w, keys))
        with nvtx_range("indexer.score.fwd"):
            return region.output(indexer_scores_triton(q, w, keys, idx, **scores_backward_keywords(options)))
    note_eager("indexer_scores.fwd", "torch")
    return _IndexerScores.apply(q, w, keys, idx)


class _GivenScores(torch.autograd.Function):
    """:class:`_IndexerScores` with the forward's result handed in: the same saved tensors and backward."""

    @staticmethod
    def forward(ctx, q, w, keys, idx, scores):
        ctx.save_for_backward(q, w, keys, idx)
        return scores.view_as(scores)

    @staticmethod
    def backward(ctx, grad):
        note_eager("indexer_scores.bwd", "torch")
        with nvtx_range("indexer.score.bwd"):
            return (*_IndexerScores._backward(ctx, grad), None)


class _GivenScoresTriton(torch.autograd.Function):
    """The Triton scores' backward for scores handed in: the custom op ``dsv4cp::indexer_scores_bwd`` (the
    compiled :func:`indexer_scores`' backward: the eager one's kernels, reduction, launch pin and scratch)
    with the forward's kernel options (their values as the custom op takes them), eager and compiled alike."""

    @staticmethod
    def forward(ctx, q, w, keys, idx, scores, options: tuple):
        ctx.save_for_backward(q.contiguous(), w.contiguous(), keys.contiguous(), idx.contiguous())
        ctx.options = options
        return scores.view_as(scores)

    @staticmethod
    def backward(ctx, grad):
        q, w, keys, idx = ctx.saved_tensors
        dq, dw, dkeys = torch.ops.dsv4cp.indexer_scores_bwd(grad, q, w, keys, idx, *ctx.options)
        return dq, dw, dkeys, None, None, None


def indexer_scores_given(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor,
                         scores: torch.Tensor, *, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """:func:`indexer_scores` whose forward returns ``scores`` (no kernel, no copy: a view) and whose
    backward is :func:`indexer_scores`' own on the same backend: the torch reference's, or the Triton
    kernels' (their key-gradient reduction, launch pin and scratch from ``options``,
    deterministic mode as it stands when the backward runs).

    ``scores [T, K]``: the scores at ``idx`` already computed (e.g. by ``indexer_topk(...,
    return_scores=True)``), in the dtype :func:`indexer_scores` returns for these inputs (fp32; fp64 for
    fp64 inputs on the torch path); its values at ``-1`` slots are the caller's to mask. Gradients flow to
    ``q``, ``w`` and ``keys`` as through :func:`indexer_scores` (none to ``scores``). With scores bit for
    bit those :func:`indexer_scores` would compute, every gradient is bit for bit its own; otherwise the
    gradients are :func:`indexer_scores`' for the upstream gradient the given scores lead to.

    Raises:
        ValueError: ``scores`` not a tensor of ``idx``'s shape on ``q``'s device, or of another dtype.
    """
    triton = triton_serves(q)
    expected = torch.float32 if triton else torch.promote_types(q.dtype, torch.float32)
    if not isinstance(scores, torch.Tensor):
        raise ValueError(f"scores: must be a tensor, got {type(scores).__name__}")
    if scores.shape != idx.shape or scores.device != q.device:
        raise ValueError(f"scores: must be {list(idx.shape)} (idx's shape) on {q.device}, got "
                         f"{list(scores.shape)} on {scores.device}")
    if scores.dtype != expected:
        raise ValueError(f"scores: dtype must be {expected} (what indexer_scores returns for {q.dtype} "
                         f"inputs here), got {scores.dtype}")
    scores = scores.detach()
    if triton:  # no note of a forward: none runs (the backward notes its kernels as indexer_scores' does)
        if not torch.compiler.is_compiling():  # as indexer_scores_triton: every setting checked before any work
            from dsv4cp.kernels.indexer_scores_triton import check_settings  # lazy: imports triton

            check_settings(q, w, keys, idx, **scores_backward_keywords(options))
        # the custom op opens the backward's phase range itself
        return _GivenScoresTriton.apply(q, w, keys, idx, scores, options.op_values(SCORES_OPTION_NAMES))
    return _GivenScores.apply(q, w, keys, idx, scores)
