"""dsv4cp: context-parallel DeepSeek-V4 attention, its kernels, and the tools that measure them."""

from dsv4cp.lazy_exports import lazy_exports

__version__ = "0.1.0"
__all__ = ["DSv4Config", "PackedSeqs", "DSv4Attention", "AttentionOutput", "__version__"]

_PUBLIC = {"DSv4Config": "dsv4cp.config", "PackedSeqs": "dsv4cp.packing", "DSv4Attention": "dsv4cp.layer",
           "AttentionOutput": "dsv4cp.layer"}
"""Public name -> the module defining it, imported on first use: importing one submodule (a sweep spec's
dry run reads no tensor) must not import torch."""

__getattr__ = lazy_exports(__name__, _PUBLIC)
