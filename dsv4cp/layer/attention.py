"""The DeepSeek-V4 hybrid attention layer on packed THD input, with static CP (docs/design.md §1-3)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from dsv4cp.config import DSv4Config, layer_kind
from dsv4cp.cp.agreement import check_ranks_agree
from dsv4cp.cp.comm import OVERLAP_MODES, all_gather_rows, exchange_halo, group_size_and_rank, hold_backward_waits
from dsv4cp.cp.layout import RowSplit, layer_split
from dsv4cp.cp.layout_cache import layout_for
from dsv4cp.cp.recompute import recomputed_attention
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.layer.compressor import Compressor
from dsv4cp.layer.indexer import Indexer
from dsv4cp.layer.indexer_loss import indexer_loss, selection_scores_wanted
from dsv4cp.layer.norm import RMSNorm
from dsv4cp.layer.precision import PrecisionPinned
from dsv4cp.layer.rope import rope_frequencies
from dsv4cp.ops.grouped_linear import head_group_projection
from dsv4cp.ops.indexer import indexer_topk
from dsv4cp.ops.norm_rope import head_norm_rope, rope_tail
from dsv4cp.ops.sparse_attention import check_backend_name, resolve_backend, sparse_attention
from dsv4cp.packing import PackedSeqs
from dsv4cp.profiling.autograd_ranges import BackwardRegion, phase_region
from dsv4cp.profiling.nvtx import nvtx_range


class AttentionOutput(NamedTuple):
    out: torch.Tensor
    """``[L, hidden]``: this rank's rows of the layer output."""
    indexer_loss: torch.Tensor | None
    """This rank's share of the (coefficient-weighted) indexer loss; None for W and H layers."""


class DSv4Attention(PrecisionPinned):
    """One DSv4 attention layer; ``compress_ratio`` picks W (0), C (4) or H (any other) behaviour.

    Args:
        cfg: shapes and hyper-parameters.
        compress_ratio: the layer's compression ratio.
        backend: sparse-attention backend ("auto", "torch", "triton", ...).
        overlap: "none" (synchronous collectives) or "async" (all-gathers overlapped with the query
            projections, backward reduce-scatters with the query-path backward).
        recompute: selective recompute; keep neither the query up-projection nor the key buffer for
            backward, rebuild them there from the saved parts (docs/design.md §3.6). Same results.
        kernel_options: the layer's kernel options (:class:`~dsv4cp.kernel_options.KernelOptions`), resolved
            once by the caller; None: :meth:`~dsv4cp.kernel_options.KernelOptions.resolve` here (the
            ``DSV4CP_*`` variables over the defaults). Held at construction, like the backend: the
            layer's kernels are part of its configuration, a compiled layer sees one constant, and its
            forward's signature stays that of the other layers. Every op of the layer takes it as an
            argument (its submodules get it per call) and its autograd functions keep it for backward.
        check_ranks: before each step, check with one tiny collective that every rank of ``cp_group``
            got the same ``packed`` offsets, split and dtype (a mismatch otherwise returns garbage
            silently) and that no rank rejected its own input (e.g. ``x`` with the wrong rows on one
            rank); all ranks raise a ``ValueError``. Off by default: it costs a host sync. Without it,
            input that differs between ranks raises only on the ranks that see the fault, and their
            peers wait in the first collective until the launcher stops them.

    Parameters carry DeepSeek's checkpoint names (``wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b,
    attn_sink, compressor.*, indexer.*``); linear weights are ``[out, in]``. Module casts keep
    ``attn_sink`` fp32 and the ``rope_freqs`` buffer fp64 (or finer): see :mod:`dsv4cp.layer.precision`.
    """

    pinned_dtypes = {"attn_sink": torch.float32, "rope_freqs": torch.float64}

    def __init__(
        self, cfg: DSv4Config, compress_ratio: int, *, backend: str = "auto", overlap: str = "none",
        recompute: bool = False, check_ranks: bool = False, kernel_options: KernelOptions | None = None,
    ):
        super().__init__()
        cfg.check_ratio(compress_ratio)
        check_backend_name(backend)
        if kernel_options is not None and not isinstance(kernel_options, KernelOptions):
            raise ValueError(f"kernel_options: must be a KernelOptions, got {type(kernel_options).__name__}")
        self.kernel_options = KernelOptions.resolve() if kernel_options is None else kernel_options
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap: must be one of {OVERLAP_MODES}, got {overlap!r}")
        self.cfg, self.compress_ratio, self.kind = cfg, compress_ratio, layer_kind(compress_ratio)
        self.backend, self.overlap, self.recompute = backend, overlap, recompute
        self.check_ranks = check_ranks
        h, d = cfg.n_heads, cfg.head_dim
        self.wq_a = nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.wkv = nn.Linear(cfg.hidden, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_eps)
        self.wo_a = nn.Linear(h // cfg.o_groups * d, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor = Compressor(cfg.hidden, d, compress_ratio, cfg.rms_eps) if compress_ratio else None
        self.indexer = Indexer(cfg) if self.kind == "C" else None
        self.register_buffer("rope_freqs", rope_frequencies(cfg, compress_ratio), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Linear weights ~ N(0, 1/fan_in); norm weights 1; sink and ``ape`` 0 (as trained from)."""
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight.device.type != "meta":
                module.weight.normal_(0.0, module.in_features**-0.5, generator=generator)

    # ------------------------------------------------------------------ forward
    def forward(
        self, x: torch.Tensor, packed: PackedSeqs, cp_group: dist.ProcessGroup | None = None,
        split: RowSplit | None = None,
    ) -> AttentionOutput:
        """Run the layer on this rank's rows, with its ``kernel_options``.

        Args:
            x: ``[b_{rho+1} - b_rho, hidden]``, this rank's contiguous slice ``[b_rho, b_{rho+1})`` of
                the packed layer input, in the parameters' dtype.
            packed: the WHOLE batch's document offsets (identical on every rank).
            cp_group: the context-parallel process group; None means one rank.
            split: the ranks' split points ``b`` (identical on every rank, e.g. from
                :func:`dsv4cp.model.partition.partition`); None means equal slices of ``T / cp`` rows.
        """
        cp, rank = group_size_and_rank(cp_group)
        if not self.check_ranks:
            split = self._check_inputs(x, packed, cp, rank, split)
        else:  # one tiny collective per step: a batch or input rejected on any rank fails on all of them
            try:
                split, rejected = self._check_inputs(x, packed, cp, rank, split), None
            except ValueError as err:
                rejected = err
            check_ranks_agree({"packed": packed, "split": split, "x.dtype": str(getattr(x, "dtype", x))},
                              cp_group, local_error=rejected)
        with nvtx_range("layout.fwd"):  # built on the batch's first step, then shared
            layout = layout_for(packed, self.cfg, self.compress_ratio, rank, cp, split=split)
        freqs, cfg = self.rope_freqs, self.cfg
        h, d = cfg.n_heads, cfg.head_dim
        positions = layout.local_pos

        x_ext = exchange_halo(x, layout.halo, cp_group)
        kv_ext = phase_region("kv_proj", self._kv, x_ext, layout.ext_pos)

        # Launch the gathers of compressed keys first so they fly while the queries are computed.
        index_keys = compressed = None
        if self.indexer is not None:
            local_keys = phase_region("indexer.compress", self.indexer.keys, x_ext.detach(), layout, freqs,
                                      self.kernel_options)
            index_keys = all_gather_rows(local_keys, cp_group, self.overlap, name="index_k")
        if self.compressor is not None:
            local_kv = phase_region("compress", self.compressor, x_ext, layout, freqs, self.kernel_options)
            compressed = all_gather_rows(local_kv, cp_group, self.overlap, name="kv")

        def queries(latent: torch.Tensor, weight: torch.Tensor, sl: slice = slice(None)) -> torch.Tensor:
            q = nn.functional.linear(latent, weight).view(latent.shape[0], h, d)
            return head_norm_rope(q, positions[sl], freqs, cfg.rms_eps, options=self.kernel_options)

        # Backward order (docs/design.md §3.5), fixed by graph edges: each reduce-scatter is launched once its
        # gradient is complete and before the query path's backward starts (``ahead_of``); its wait
        # is held until the query path's backward has reached x (``hold_backward_waits``), and the
        # compressor backward that consumes the scattered rows runs after the wait.
        q_region = BackwardRegion("q_proj.bwd")
        with nvtx_range("q_proj.fwd"):
            latent = self.q_norm(self.wq_a(q_region.input(hold_backward_waits(x, index_keys, compressed))))
            # Without recompute the query up-projection runs here, while the gathers fly.
            if self.recompute:
                latent = q_path_end = q_region.output(latent)
                q = None
            else:
                q = q_path_end = q_region.output(queries(latent, self.wq_b.weight))
        if self.indexer is not None:
            index_region = BackwardRegion("indexer.q_proj.bwd")  # trained by the indexer loss only
            with nvtx_range("indexer.q_proj.fwd"):
                index_q, index_w = index_region.outputs(
                    *self.indexer.queries(latent.detach(), x.detach(), positions, freqs, self.kernel_options)
                )
            index_keys_all = index_keys.wait(ahead_of=q_path_end)
            with nvtx_range("indexer.topk.fwd"):
                local_doc = layout.local_doc
                # the loss's prediction may be the selection's own scores ([L, K] fp32, freed after the loss)
                with_scores = selection_scores_wanted(cfg.indexer_loss, self.kernel_options)
                selected = indexer_topk(
                    index_q, index_w, index_keys_all,
                    lambda sl: layout.visible_mask(local_doc[sl], positions[sl]), cfg.index_topk,
                    visibility=(local_doc, layout.visible_entries(), layout.gathered_doc, layout.gathered_j),
                    key_row_limit=layout.key_row_limit,  # static chunk plan: no device read
                    return_scores=with_scores, options=self.kernel_options,
                )
                selected, selection_scores = selected if with_scores else (selected, None)

        idx, compressed_all, lowered = layout.window_idx, None, None
        if compressed is not None:
            compressed_all = compressed.wait(ahead_of=q_path_end)
            with nvtx_range("layout.fwd"):  # the selected entries as key-buffer rows
                entries = selected if self.indexer is not None else layout.all_visible_idx()
                lowered = torch.where(entries >= 0, entries + layout.ext_rows, -1).to(torch.int32)
                idx = torch.cat((idx, lowered), dim=1)
        if self.recompute:
            backend = resolve_backend(self.backend, x.device, head_dim=cfg.head_dim)
            out, lse, q, key_buffer = recomputed_attention(
                latent, self.wq_b.weight, queries, kv_ext, compressed_all, idx, self.attn_sink,
                cfg.softmax_scale, backend,
                on_compressed_grad=compressed.launch_backward if compressed is not None else None,
                options=self.kernel_options,
            )
        else:
            with nvtx_range("layout.fwd"):
                key_buffer = kv_ext if compressed_all is None else torch.cat((kv_ext, compressed_all), dim=0)
            out, lse = sparse_attention(q, key_buffer, idx, self.attn_sink, cfg.softmax_scale, backend=self.backend,
                                        options=self.kernel_options)

        loss = None
        if self.indexer is not None:
            scored = selected if cfg.indexer_loss == "sparse" else layout.all_visible_idx  # dense: by row chunk
            with nvtx_range("indexer.loss.fwd"):
                loss = indexer_loss(
                    variant=cfg.indexer_loss, q=q, key_buffer=key_buffer, window_idx=layout.window_idx,
                    compressed_offset=layout.ext_rows, scored_entries=scored, attention_lse=lse,
                    sink=self.attn_sink, scale=cfg.softmax_scale, index_q=index_q, index_w=index_w,
                    index_keys=index_keys_all, real=layout.real, global_real_tokens=packed.real_tokens,
                    coeff=cfg.indexer_loss_coeff, selection_scores=selection_scores,
                    scored_key_rows=lowered if cfg.indexer_loss == "sparse" else None,  # the attention's rows
                    options=self.kernel_options,
                )
        return AttentionOutput(phase_region("out_proj", self._project_out, out, positions), loss)

    def _kv(self, x_ext: torch.Tensor, ext_positions: torch.Tensor) -> torch.Tensor:
        """The one key/value row per token: ``RoPE(RMSNorm(wkv x))``."""
        return rope_tail(self.kv_norm(self.wkv(x_ext))[:, None], ext_positions, self.rope_freqs,
                         options=self.kernel_options)[:, 0]

    def _project_out(self, out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo the query rotation on each head's output, then the grouped low-rank projection."""
        cfg = self.cfg
        wo_a = self.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)  # the heads of a group are consecutive
        latent = head_group_projection(out, wo_a, positions, self.rope_freqs, options=self.kernel_options).flatten(1)
        return self.wo_b(latent)

    def _check_inputs(
        self, x: torch.Tensor, packed: PackedSeqs, cp: int, rank: int, split: RowSplit | None
    ) -> RowSplit:
        """Reject bad input on every rank before any collective is issued (no rank may hang); returns
        the validated split."""
        if not isinstance(packed, PackedSeqs):
            raise ValueError(f"packed: must be a PackedSeqs, got {type(packed).__name__}")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.cfg.hidden:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: must be [rows, hidden={self.cfg.hidden}], got {shape}")
        if x.dtype != self.wq_a.weight.dtype:
            raise ValueError(f"x: dtype must match the parameters ({self.wq_a.weight.dtype}), got {x.dtype}")
        if x.device != self.wq_a.weight.device:
            raise ValueError(f"x: must be on the parameters' device {self.wq_a.weight.device}, got {x.device}")
        if packed.cu_seqlens_padded.device != x.device:
            raise ValueError(f"packed: offsets must be on x's device {x.device}, got {packed.cu_seqlens_padded.device}")
        if split is None and packed.total % cp:
            raise ValueError(f"packed.total: {packed.total} rows are not divisible by cp={cp}")
        split, _ = layer_split(packed, self.cfg, self.compress_ratio, cp, split)
        resolve_backend(self.backend, x.device, head_dim=self.cfg.head_dim)  # fails here, not after the gathers
        if x.shape[0] != split.rows(rank):
            raise ValueError(
                f"x: holds {x.shape[0]} rows but rank {rank} of the split {split.bounds} of "
                f"packed.total={packed.total} over cp={cp} ranks holds {split.rows(rank)} rows"
            )
        return split

    def extra_repr(self) -> str:
        return (
            f"kind={self.kind}, compress_ratio={self.compress_ratio}, backend={self.backend!r}, "
            f"overlap={self.overlap!r}, recompute={self.recompute}"
            + (f", kernel_options={values}" if (values := self.kernel_options.non_default()) else "")
        )
