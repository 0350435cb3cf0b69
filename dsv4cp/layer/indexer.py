"""The lightning indexer of C layers (docs/design.md §1.5): its own queries, keys and head weights."""

from __future__ import annotations

import torch
from torch import nn

from dsv4cp.config import INDEXER_RATIO, DSv4Config
from dsv4cp.cp.layout import RankLayout
from dsv4cp.kernel_options import DEFAULT_OPTIONS, KernelOptions
from dsv4cp.layer.compressor import Compressor
from dsv4cp.layer.hadamard import hadamard_rotate
from dsv4cp.ops.norm_rope import rope_tail


class Indexer(nn.Module):
    """Parameters ``wq_b [Hi*Di, q_lora]``, ``weights_proj [Hi, hidden]`` and a ratio-4 ``compressor``.

    Callers pass DETACHED inputs: the indexer is trained by its own loss only.
    """

    def __init__(self, cfg: DSv4Config):
        super().__init__()
        self.heads, self.dim, self.hadamard = cfg.index_n_heads, cfg.index_head_dim, cfg.hadamard
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden, self.heads, bias=False)
        self.compressor = Compressor(cfg.hidden, self.dim, INDEXER_RATIO, cfg.rms_eps, rotate=cfg.hadamard)
        self.weight_scale = self.heads**-0.5 * self.dim**-0.5

    def queries(
        self, latent: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
        options: KernelOptions = DEFAULT_OPTIONS,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``latent [L, q_lora]``, ``x [L, hidden]`` -> queries ``[L, Hi, Di]`` and head weights ``[L, Hi]``
        (``options``: the layer's kernel options)."""
        q = self.wq_b(latent).view(latent.shape[0], self.heads, self.dim)
        q = rope_tail(q, positions, freqs, options=options)  # fused on CUDA: the torch rotation's cat/stack: ~8 ms
        if self.hadamard:
            q = hadamard_rotate(q)
        return q, self.weights_proj(x) * self.weight_scale

    def keys(self, x_ext: torch.Tensor, layout: RankLayout, freqs: torch.Tensor,
             options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
        """This rank's owned indexer keys ``[capacity, Di]``."""
        return self.compressor(x_ext, layout, freqs, options)
