"""Compile the sparse indexer loss's fused KL kernel (``_kl_rows_kernel``) for sm_90 without a GPU; print
its resources at the flash shape (K = 512, BLOCK_K = 512) and the other tile widths: registers per
thread, shared memory and spill bytes (``cuobjdump -res-usage``), with and without the gradient. The
figures in :mod:`dsv4cp.kernels.indexer_kl_triton`'s docstring come from this script.

Not collected by pytest; run from the repository root (no GPU needed, about a second per build)::

    python -m bench.compile_indexer_kl_sm90
"""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.cubin_resources import resource_usage
from dsv4cp.kernels import indexer_kl_triton as kl

_SIGNATURE = {"TARGET": "*fp32", "SCORES": "*fp32", "VALID": "*i1", "WEIGHT": "*fp32", "ROW_LOSS": "*fp32",
              "DSCORES": "*fp32", "K": "i32", "stride_tt": "i32", "stride_st": "i32", "stride_vt": "i32",
              "stride_dt": "i32"}


def resources(block_k: int, num_warps: int, write_grad: bool) -> dict:
    """Registers per thread, shared bytes and spill bytes of the kernel built for sm_90 (16-byte aligned
    pointers, strides and K, as the JIT specialises the layer's contiguous K = 512 tensors)."""
    constexprs = {"TINY": kl._TINY, "BLOCK_K": block_k, "WRITE_GRAD": write_grad}
    sig = {**_SIGNATURE, **{name: "constexpr" for name in constexprs}}
    aligned = [i for i, name in enumerate(sig) if sig[name].startswith("*") or name.startswith("stride") or name == "K"]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    kernel = triton.compile(ASTSource(triton.jit(kl._kl_rows_kernel), sig, constexprs, attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    usage = resource_usage(kernel)
    vector_loads = len(re.findall(r"ld\.global(?:\.\w+)*\.v[24]", kernel.asm["ptx"]))
    return {"regs": usage["REG"], "shared": kernel.metadata.shared, "spill": usage["STACK"] + usage["LOCAL"],
            "vector_loads": vector_loads}


def main() -> None:
    for block_k in (512, 1024, 4096):
        (cfg,) = kl._ladder(block_k)
        for write_grad in (True, False):
            found = resources(block_k, cfg.num_warps, write_grad)
            print(f"BLOCK_K={block_k:5d} num_warps={cfg.num_warps} grad={int(write_grad)}: {found['regs']} registers, "
                  f"{found['shared']} B shared, {found['spill']} B spilled, {found['vector_loads']} vector loads")


if __name__ == "__main__":
    main()
