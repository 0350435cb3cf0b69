"""Run every Triton kernel once at the flash shape and print the compiler's resource report."""

from __future__ import annotations

import torch

from dsv4cp.kernels import sparse_attention_bwd, sparse_attention_fwd
from dsv4cp.kernels.report import compiled_resources


def main(tokens: int = 4096, heads: int = 64, dim: int = 512, kt: int = 640) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    kv = torch.randn(tokens + tokens // 4, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    idx = torch.randint(0, kv.shape[0], (tokens, kt), device="cuda", generator=gen, dtype=torch.int32)
    sink = torch.zeros(heads, device="cuda")
    out, lse = sparse_attention_fwd(q, kv, idx, sink, dim**-0.5)
    sparse_attention_bwd(torch.randn_like(out), q, kv, idx, sink, dim**-0.5, out, lse)
    sparse_attention_bwd(torch.randn_like(out), q, kv, idx, sink, dim**-0.5, out, lse, deterministic=True)
    torch.cuda.synchronize()
    for row in compiled_resources():
        print(row)


if __name__ == "__main__":
    main()
