"""dsv4cp: context-parallel DeepSeek-V4 attention, its kernels, and the tools that measure them."""

from dsv4cp.config import DSv4Config
from dsv4cp.layer import AttentionOutput, DSv4Attention
from dsv4cp.packing import PackedSeqs

__version__ = "0.1.0"
__all__ = ["DSv4Config", "PackedSeqs", "DSv4Attention", "AttentionOutput", "__version__"]
