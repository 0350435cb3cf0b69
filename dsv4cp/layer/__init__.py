"""The DSv4 attention math: projections, RoPE, compressors, indexer, loss and the layer itself."""

from dsv4cp.layer.attention import AttentionOutput, DSv4Attention

__all__ = ["AttentionOutput", "DSv4Attention"]
