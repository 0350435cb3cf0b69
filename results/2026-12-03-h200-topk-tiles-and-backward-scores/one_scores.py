"""One Triton sparse-attention backward (the default: the scores kernel, then the kv and dq passes) at the
flash or pro shape of bench/test_bench_sparse_attention.py, for ncu (which profiles the launch its -k names).
Run from the repository root: python results/2026-12-03-h200-topk-tiles-and-backward-scores/one_scores.py flash|pro"""

import sys

import torch

from bench.test_bench_sparse_attention import SHAPES, _inputs
from dsv4cp.kernels import sparse_attention_bwd_dq_pass_triton as dqp
from dsv4cp.kernels import sparse_attention_triton as sat

entry = _inputs(SHAPES[sys.argv[1]])
q, kv, idx, sink, scale = entry["args"]
out, lse = sat.sparse_attention_fwd(q, kv, idx, sink, scale)
dout = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4321)).to(q.dtype)
dqp.sparse_attention_bwd_dq_pass(dout, q, kv, idx, sink, scale, out, lse)
torch.cuda.synchronize()
