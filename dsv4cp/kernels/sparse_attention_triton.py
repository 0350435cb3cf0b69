"""The Triton sparse-attention kernels' public names, in one place: the forward
(:mod:`.sparse_attention_fwd_triton`), the backward (:mod:`.sparse_attention_bwd_triton`) and their
launch planning (:mod:`.sparse_attention_launch`). ``dsv4cp.kernels`` loads it lazily (it imports triton).
"""

from __future__ import annotations

from dsv4cp.kernels.sparse_attention_bwd_triton import BackwardPlan, backward_plan, sparse_attention_bwd
from dsv4cp.kernels.sparse_attention_fwd_triton import sparse_attention_fwd
from dsv4cp.kernels.sparse_attention_launch import (
    BWD_SCRATCH_BYTES,
    BWD_SCRATCH_MIN_CHUNK_ROWS,
    BWD_SCRATCH_MIN_CHUNKS,
    DQ_IN_DKV_ENV,
    MAX_HEAD_DIM,
    DkvConfig,
    KernelConfig,
    OutOfResources,
)

__all__ = [
    "BWD_SCRATCH_BYTES",
    "BWD_SCRATCH_MIN_CHUNKS",
    "BWD_SCRATCH_MIN_CHUNK_ROWS",
    "DQ_IN_DKV_ENV",
    "MAX_HEAD_DIM",
    "BackwardPlan",
    "DkvConfig",
    "KernelConfig",
    "OutOfResources",
    "backward_plan",
    "sparse_attention_bwd",
    "sparse_attention_fwd",
]
