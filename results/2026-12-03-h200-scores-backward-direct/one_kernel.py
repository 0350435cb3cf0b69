"""One launch of a kernel at the 64K flash shapes of bench/test_bench_indexer.py, for ncu (which profiles the
kernel its -k names). Run from the repository root:

    python results/2026-12-03-h200-scores-backward-direct/one_kernel.py scores-bwd LAYOUT K,WARPS,STAGES [ahead|in-step]
    python results/2026-12-03-h200-scores-backward-direct/one_kernel.py topk
"""

import sys

import torch

from bench.test_bench_indexer import SHAPES, _inputs, _selection, _vis_args
from dsv4cp.kernels import indexer_scores_triton as ist
from dsv4cp.ops.indexer import fused_indexer_topk

shape = SHAPES["64k"]
entry = _inputs(shape)
q, w, keys = entry["q"], entry["w"], entry["keys"]
if sys.argv[1] == "scores-bwd":
    idx, grad, _ = _selection(shape, entry)
    cfg = ist.GatherBwdConfig(*map(int, sys.argv[3].split(",")))
    ahead = {"ahead": True, "in-step": False}[sys.argv[4]] if len(sys.argv) > 4 else None  # None: the default
    plan = ist.BackwardPlan.new(q, w, keys, idx, grad.float().contiguous(), "atomic", cfg, layout=sys.argv[2],
                                index_ahead=ahead)
    plan.run_kernel(0)
else:
    fused_indexer_topk(q, w, keys, *_vis_args(entry), shape.topk)
torch.cuda.synchronize()
