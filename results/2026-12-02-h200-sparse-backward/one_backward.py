"""One default and one dq-pass Triton sparse backward at the flash shape, for ncu (which profiles the
kernels its -k names). Run from the repository root: python results/2026-12-02-h200-sparse-backward/one_backward.py"""

import torch

from bench.test_bench_sparse_attention import SHAPES, _inputs
from dsv4cp.kernels import sparse_attention_bwd_dq_pass_triton as dqp
from dsv4cp.kernels import sparse_attention_triton as sat

entry = _inputs(SHAPES["flash"])
q, kv, idx, sink, scale = entry["args"]
out, lse = sat.sparse_attention_fwd(q, kv, idx, sink, scale)
dout = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4321)).to(q.dtype)
sat.sparse_attention_bwd(dout, q, kv, idx, sink, scale, out, lse, deterministic=False)
dqp.sparse_attention_bwd_dq_pass(dout, q, kv, idx, sink, scale, out, lse)
torch.cuda.synchronize()
