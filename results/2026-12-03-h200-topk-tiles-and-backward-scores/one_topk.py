"""One chunked top-k (the layer's default path) at the 64K shape of bench/test_bench_indexer.py, for ncu (which
profiles the launches its -k names: the score kernel and the bounded radix select).
Run from the repository root: python results/2026-12-03-h200-topk-tiles-and-backward-scores/one_topk.py"""

import torch

from bench.test_bench_indexer import SHAPES, _inputs, _vis_args
from dsv4cp.ops.indexer import fused_indexer_topk

shape = SHAPES["64k"]
entry = _inputs(shape)
fused_indexer_topk(entry["q"], entry["w"], entry["keys"], *_vis_args(entry), shape.topk)
torch.cuda.synchronize()
