"""Compile the head-summed probabilities and log-sum-exp kernels for sm_90 without a GPU; print resources.

For each launch configuration of ``_head_probs_kernel`` (``whole_d``), ``_head_probs_chunked_kernel``
(``d_chunks``) and ``_lse_chunked_kernel`` at the flash shape (bf16, H = 64 (``--heads``), D = 512; the
launch's 16-byte divisibility specialisation of pointers and strides): shared memory, registers per
thread, spill bytes (stack and local memory, from ``cuobjdump -res-usage``), the gathered-key buffers
the software pipeline keeps (from the TTGIR) and how many programs fit one H200 multiprocessor (228 KB
shared, 1 KB reserved per program; 64K registers). The figures in the kernels' docstring come from
this script.

Not collected by pytest; run from the repository root (no GPU needed, a few seconds per config)::

    python -m bench.compile_attention_probs_sm90            # the ladders and the bench's variants
    python -m bench.compile_attention_probs_sm90 --chunk 64,128,64,8,7,1,2 --lse-chunk 64,128,64,4,7,2

Prepend another Triton to ``PYTHONPATH`` to check the figures of the GPU machine's version.
"""

from __future__ import annotations

import re
from dataclasses import astuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.cubin_resources import heads_parser, parse_heads_and_print_target, resource_usage
from dsv4cp.kernels import attention_probs_triton as probs
from dsv4cp.kernels.sparse_attention_triton import KernelConfig

SHARED_PER_SM = 228 * 1024
RESERVED_PER_PROGRAM = 1024
REGISTERS_PER_SM = 65536
D = 512

_POINTERS = {"Q": "*bf16", "KEYS": "*bf16", "IDX": "*i64", "LDEN": "*fp32", "OUT": "*fp32"}
_FP32_POINTERS = {**_POINTERS, "Q": "*fp32", "KEYS": "*fp32"}
_WHOLE_D_ARGS = ["H", "N", "KT", "stride_qt", "stride_qh", "stride_kn", "stride_it", "stride_lt", "stride_lh",
                 "stride_ot"]
_CHUNK_ARGS = ["H", "N", "KT", "N_ITEMS", "N_SB", "N_HB", "stride_qt", "stride_qh", "stride_kn", "stride_it",
               "stride_lt", "stride_lh", "stride_ot"]
_LSE_CHUNK_ARGS = ["H", "N", "KT", "N_ITEMS", "N_SB", "N_HB", "stride_qt", "stride_qh", "stride_kn", "stride_it"]
_LSE_POINTERS = ("Q", "KEYS", "IDX", "LSE")


def _signature(ints: list[str], constexprs: dict, fp32: bool, lse: bool) -> tuple[dict, dict]:
    """Triton signature and divisibility attributes (pointers, strides and KT divisible by 16)."""
    pointers = _FP32_POINTERS if fp32 else _POINTERS
    if lse:  # Q, KEYS, IDX, then the fp32 output
        pointers = {**{k: pointers[k] for k in _LSE_POINTERS[:3]}, "LSE": "*fp32"}
    sig = {**pointers, "qk_scale2": "fp32", **{name: "i32" for name in ints}, **{k: "constexpr" for k in constexprs}}
    aligned = [i for i, name in enumerate(sig) if name in pointers or name.startswith("stride") or name == "KT"]
    return sig, {(i,): [["tt.divisibility", 16]] for i in aligned}


def compile_resources(body, constexprs: dict, ints: list[str], num_warps: int, num_stages: int,
                      fp32: bool = False, lse: bool = False) -> dict:
    """Resources of ``body`` compiled for sm_90 with ``constexprs`` (bf16 q and keys, else fp32; ``lse``:
    the log-sum-exp kernels' pointers)."""
    sig, attrs = _signature(ints, constexprs, fp32, lse)
    kernel = triton.compile(ASTSource(triton.jit(body), sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    usage = resource_usage(kernel)
    shared = kernel.metadata.shared
    regs = usage["REG"]
    by_shared = SHARED_PER_SM // (shared + RESERVED_PER_PROGRAM)
    by_regs = REGISTERS_PER_SM // (max(regs, 1) * 32 * num_warps)
    buffers = re.findall(r"memdesc<(\d+)x\d+x\d+x(?:bf16|f32)", kernel.asm["ttgir"])
    return {"shared_kb": shared / 1024, "regs": regs, "spill": usage["STACK"] + usage["LOCAL"],
            "buffers": max(map(int, buffers)) if buffers else 0, "programs_per_sm": min(by_shared, by_regs)}


def whole_d(cfg: KernelConfig, heads: int, slots_on_m: bool = True) -> dict:
    constexprs = {"D": D, "BLOCK_D": D, "BLOCK_H": cfg.block_h, "BLOCK_K": cfg.block_k,
                  "ONE_HEAD_BLOCK": heads <= cfg.block_h, "SLOTS_ON_M": slots_on_m, "PRECISION": "tf32",
                  "DOT_F32": False}
    return compile_resources(probs._head_probs_kernel, constexprs, _WHOLE_D_ARGS, cfg.num_warps, cfg.num_stages)


def d_chunks(cfg: probs.ChunkConfig, fp32: bool = False) -> dict:
    constexprs = {"D": D, "BLOCK_H": cfg.block_h, "BLOCK_K": cfg.block_k, "BLOCK_DC": cfg.block_d,
                  "SLOTS_ON_M": bool(cfg.slots_on_m), "PRECISION": "ieee" if fp32 else "tf32", "DOT_F32": False}
    return compile_resources(probs._head_probs_chunked_kernel, constexprs, _CHUNK_ARGS, cfg.num_warps, cfg.num_stages,
                             fp32)


def lse_chunks(cfg: probs.LseChunkConfig) -> dict:
    constexprs = {"D": D, "BLOCK_H": cfg.block_h, "BLOCK_K": cfg.block_k, "BLOCK_DC": cfg.block_d,
                  "PRECISION": "tf32", "DOT_F32": False}
    return compile_resources(probs._lse_chunked_kernel, constexprs, _LSE_CHUNK_ARGS, cfg.num_warps, cfg.num_stages,
                             lse=True)


def _row(kind: str, cfg, res: dict) -> str:
    return (f"{kind:8s} {','.join(map(str, astuple(cfg))):20s} shared {res['shared_kb']:6.1f} KB  "
            f"regs {res['regs']:3d}  spill {res['spill']:4d} B  gathered buffers {res['buffers']}  "
            f"programs/SM {res['programs_per_sm']}")


def main(argv: list[str] | None = None) -> None:
    parser = heads_parser(__doc__, "query heads (64 flash, 128 pro): the ladders'")
    parser.add_argument("--chunk", action="append", default=[],
                        help="a d_chunks config 'block_h,block_k,block_d,num_warps,num_stages,slots_on_m,"
                             "programs_per_sm' (repeatable; default: the ladders and the bench's variants)")
    parser.add_argument("--lse-chunk", action="append", default=[],
                        help="a d_chunks log-sum-exp config 'block_h,block_k,block_d,num_warps,num_stages,"
                             "programs_per_sm' (repeatable)")
    args = parse_heads_and_print_target(parser, argv, D)
    heads = args.heads
    if args.chunk or args.lse_chunk:
        for text in args.chunk:
            cfg = probs.ChunkConfig(*(int(v) for v in text.split(",")))
            print(_row("d_chunks", cfg, d_chunks(cfg)))
        for text in args.lse_chunk:
            cfg = probs.LseChunkConfig(*(int(v) for v in text.split(",")))
            print(_row("lse", cfg, lse_chunks(cfg)))
        return
    import torch

    from bench.test_bench_attention_probs import CHUNK_VARIANTS, LSE_CHUNK_VARIANTS

    for cfg in probs._ladder(D, heads, torch.bfloat16, head_loop=heads > 64)[:3]:
        print(_row("whole_d", cfg, whole_d(cfg, heads)))
    variants = (probs.ChunkConfig(*v) for v in CHUNK_VARIANTS)
    for cfg in dict.fromkeys([*probs._chunk_ladder(D, heads, torch.bfloat16), *variants]):
        print(_row("d_chunks", cfg, d_chunks(cfg)))
    for cfg in probs._chunk_ladder(D, heads, torch.float32):
        print(_row("fp32", cfg, d_chunks(cfg, fp32=True)))
    lse_variants = (probs.LseChunkConfig(*v) for v in LSE_CHUNK_VARIANTS)
    for cfg in dict.fromkeys([*probs._lse_chunk_ladder(D, heads, torch.bfloat16), *lse_variants]):
        print(_row("lse", cfg, lse_chunks(cfg)))


if __name__ == "__main__":
    main()
