"""Layer configuration: one dataclass with the public presets (docs/design.md §1.1)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

INDEXER_RATIO = 4
"""Ratio 4 always means the overlapping CSA compressor with the lightning indexer."""

LOSS_VARIANTS = ("sparse", "dense")

DTYPE_NAMES = ("fp64", "fp32", "bf16")
"""The dtype names every command and record uses; :data:`DTYPES` maps them to torch dtypes."""


def __getattr__(name: str) -> object:
    # DTYPES is built on first use: shapes and names (a sweep spec's checks) need this module, not torch.
    if name == "DTYPES":
        import torch

        dtypes = dict(zip(DTYPE_NAMES, (torch.float64, torch.float32, torch.bfloat16), strict=True))
        globals()["DTYPES"] = dtypes
        return dtypes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs (what the model trains in), fp32 elsewhere."""
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def layer_kind(compress_ratio: int) -> str:
    """'W' (window only), 'C' (ratio 4, indexer top-k) or 'H' (any other ratio, all entries)."""
    if compress_ratio == 0:
        return "W"
    return "C" if compress_ratio == INDEXER_RATIO else "H"


@dataclass(frozen=True)
class DSv4Config:
    """Every shape and hyper-parameter of one DeepSeek-V4 attention layer.

    Field names follow docs/design.md's notation where one exists (H = n_heads, D = head_dim,
    P = rope_dim, W = window, K = index_topk, Hi = index_n_heads, Di = index_head_dim).
    Construction validates the values and raises ``ValueError`` naming the offending field.
    """

    hidden: int
    n_heads: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_topk: int
    compress_ratios: tuple[int, ...]
    head_dim: int = 512
    rope_dim: int = 64
    window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    rope_base: float = 10000.0
    """RoPE base of window-only (W) layers; no YaRN."""
    compressed_rope_base: float = 160000.0
    """RoPE base of C/H layers, which also use YaRN."""
    yarn_factor: float = 16.0
    yarn_original_len: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    rms_eps: float = 1e-6
    indexer_loss_coeff: float = 1e-2
    indexer_loss: str = "sparse"
    hadamard: bool = True
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        ratios = self.compress_ratios
        if isinstance(ratios, (str, bytes)) or not hasattr(ratios, "__iter__"):
            raise ValueError(f"compress_ratios: must be a sequence of ints, got {ratios!r}")
        object.__setattr__(self, "compress_ratios", tuple(ratios))
        self._validate()

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides) -> DSv4Config:
        """``flash``, ``pro`` (the public checkpoints) or ``tiny`` (CPU tests); fields can be overridden."""
        if name not in _PRESETS:
            raise ValueError(f"preset: unknown preset {name!r}; choose one of {sorted(_PRESETS)}")
        values = dict(_PRESETS[name])
        values.update(overrides)
        values.setdefault("name", name)
        return cls(**values)

    def replace(self, **changes) -> DSv4Config:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived
    @property
    def nope_dim(self) -> int:
        """N = D - P: the head dims that RoPE leaves alone."""
        return self.head_dim - self.rope_dim

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def rope_base_for(self, compress_ratio: int) -> float:
        return self.rope_base if compress_ratio == 0 else self.compressed_rope_base

    def check_ratio(self, compress_ratio: int) -> None:
        """Raise ``ValueError`` if this config cannot build a layer of ``compress_ratio``."""
        if not isinstance(compress_ratio, int) or isinstance(compress_ratio, bool) or compress_ratio < 0:
            raise ValueError(f"compress_ratio: must be a non-negative int, got {compress_ratio!r}")
        if layer_kind(compress_ratio) == "H" and self.window < compress_ratio:
            raise ValueError(
                f"window: an H layer of compress_ratio {compress_ratio} needs window >= ratio "
                f"(the window must cover an unfinished group), got window={self.window}"
            )

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        positive = (
            "hidden", "n_heads", "q_lora_rank", "o_groups", "o_lora_rank", "index_topk",
            "head_dim", "rope_dim", "window", "index_n_heads", "index_head_dim", "yarn_original_len",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"hadamard: must be True or False, got {self.hadamard!r}")
        if self.index_topk > 2**31 - 1:
            raise ValueError(f"index_topk: must fit int32 indices (<= 2**31 - 1), got {self.index_topk}")
        real_fields = ("rope_base", "compressed_rope_base", "yarn_factor", "yarn_beta_fast", "yarn_beta_slow",
                       "rms_eps", "indexer_loss_coeff")
        for name in real_fields:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number, got {value!r}")
        if self.rope_dim % 2:
            raise ValueError(f"rope_dim: must be even (RoPE rotates pairs), got {self.rope_dim}")
        if self.rope_dim >= self.head_dim:
            raise ValueError(f"rope_dim: must be smaller than head_dim={self.head_dim}, got {self.rope_dim}")
        if self.rope_dim > self.index_head_dim:
            raise ValueError(
                f"index_head_dim: must be >= rope_dim={self.rope_dim} (the indexer rotates its last "
                f"rope_dim dims), got {self.index_head_dim}"
            )
        if self.n_heads % self.o_groups:
            raise ValueError(f"o_groups: must divide n_heads={self.n_heads}, got {self.o_groups}")
        if self.hadamard and self.index_head_dim & (self.index_head_dim - 1):
            raise ValueError(
                f"index_head_dim: must be a power of two when hadamard is on, got {self.index_head_dim}"
            )
        for name in ("rope_base", "compressed_rope_base"):
            if not getattr(self, name) > 1.0:
                raise ValueError(f"{name}: must be > 1, got {getattr(self, name)!r}")
        if not self.yarn_factor >= 1.0:
            raise ValueError(f"yarn_factor: must be >= 1, got {self.yarn_factor!r}")
        if not self.yarn_beta_fast > self.yarn_beta_slow > 0:
            raise ValueError(
                f"yarn_beta_fast: must exceed yarn_beta_slow > 0, got {self.yarn_beta_fast!r} and "
                f"{self.yarn_beta_slow!r}"
            )
        if not self.rms_eps > 0:
            raise ValueError(f"rms_eps: must be > 0, got {self.rms_eps!r}")
        if not (self.indexer_loss_coeff >= 0 and math.isfinite(self.indexer_loss_coeff)):
            raise ValueError(f"indexer_loss_coeff: must be finite and >= 0, got {self.indexer_loss_coeff!r}")
        if self.indexer_loss not in LOSS_VARIANTS:
            raise ValueError(f"indexer_loss: must be one of {LOSS_VARIANTS}, got {self.indexer_loss!r}")
        if not self.compress_ratios:
            raise ValueError("compress_ratios: must list at least one layer")
        for ratio in self.compress_ratios:
            self.check_ratio(ratio)


_FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,) + (0,)
_PRO_RATIOS = (128, 128) + (4, 128) * 29 + (4,) + (0,)

_PRESETS: dict[str, dict] = {
    "flash": dict(
        hidden=4096, n_heads=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_topk=512,
        compress_ratios=_FLASH_RATIOS,
    ),
    "pro": dict(
        hidden=7168, n_heads=128, q_lora_rank=1536, o_groups=16, o_lora_rank=1024, index_topk=1024,
        compress_ratios=_PRO_RATIOS,
    ),
    "tiny": dict(
        hidden=64, n_heads=4, q_lora_rank=32, o_groups=2, o_lora_rank=16, index_topk=8,
        head_dim=32, rope_dim=8, window=8, index_n_heads=2, index_head_dim=16,
        compress_ratios=(0, 0) + (4, 8) * 2 + (4,) + (0,),
    ),
}
PRESET_NAMES = tuple(_PRESETS)
