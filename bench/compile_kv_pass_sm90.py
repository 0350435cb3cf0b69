"""Compile the kv pass of the sparse-attention backward with its own dq pass for sm_90 without a GPU; print
its resources per tile.

For each kv-pass tile (``block_k,block_d,num_warps,num_stages[,column_blocks]``) at the flash (H = 64) or
pro (H = 128, ``--heads``) shape (bf16, D = 512, the launch's 16-byte divisibility specialisation of
pointers and integers): registers per thread, spill bytes (stack and local memory, from ``cuobjdump
-res-usage``), shared memory, wgmma instructions, the fp32 atomics' PTX instructions (their vector width)
and how many programs fit one H200 multiprocessor (228 KB shared, 1 KB reserved per program; 64K
registers). The default candidates are today's ladder head and the tiles whose programs cover several
column blocks (``column_blocks``: each step's ``[ds | p]`` tile and row indices loaded once for all of
them); the last line is the benchmark's atomics-alone kernel (``bench/sweep_sparse_attention_dq_pass.py``),
whose atomics must be the pass's.

Not collected by pytest; run from the repository root (no GPU needed, a few seconds per tile)::

    python -m bench.compile_kv_pass_sm90
    python -m bench.compile_kv_pass_sm90 --heads 128 --tile 64,128,8,3,2
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import astuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.cubin_resources import cuobjdump, heads_parser, parse_heads_and_print_target
from bench.sweep_sparse_attention_dq_pass import ATOMICS_TILE, _atomics_alone_kernel
from dsv4cp.kernels import sparse_attention_bwd_dq_pass_triton as dqp

SHARED_PER_SM = 228 * 1024
RESERVED_PER_PROGRAM = 1024
REGISTERS_PER_SM = 65536
D = 512
CANDIDATES = [(64, 128, 8, 3), (64, 128, 8, 2, 2), (64, 128, 8, 3, 2), (64, 128, 8, 2, 4), (64, 128, 8, 3, 4),
              (64, 256, 8, 2, 2)]
"""The tiles printed by default: the ladder's head, then whole-row programs (2 or 4 blocks of 128 columns,
2 of 256)."""

_POINTERS = {"Q": "*bf16", "DOUT": "*bf16", "IDX": "*i32", "TOPK": "*i32", "PDS": "*bf16", "DKV": "*fp32"}
_INTEGERS = ["H", "N", "KT", "T0", "SCRATCH_ROW", "stride_qt", "stride_qh", "stride_it", "stride_dt", "stride_dh"]


_ATOMICS_POINTERS = {"IDX": "*i32", "TOPK": "*i32", "DKV": "*fp32"}
_ATOMICS_INTEGERS = ["N", "KT", "T0", "stride_it"]


def resources(cfg: dqp.KvPassConfig, heads: int) -> dict:
    """Resources of ``_kv_pass_kernel`` at ``cfg`` compiled for sm_90 (every pointer and integer marked
    divisible by 16, as the flash and pro shapes' are; no topk_length)."""
    constexprs = {"D": D, "BLOCK_DC": cfg.block_d, "BLOCK_HK": max(16, triton.next_power_of_2(heads)),
                  "BLOCK_K": cfg.block_k, "COLUMN_BLOCKS": cfg.column_blocks, "HAS_TOPK": False,
                  "PRECISION": "tf32", "DOT_F32": False}
    return _compiled(triton.jit(dqp._kv_pass_kernel), _POINTERS, _INTEGERS, constexprs, cfg.num_warps,
                     cfg.num_stages)


def atomics_alone_resources() -> dict:
    """The same figures for the benchmark's atomics-alone kernel at its launch (:data:`ATOMICS_TILE`)."""
    block_k, block_d, num_warps, num_stages = ATOMICS_TILE
    constexprs = {"D": D, "BLOCK_DC": block_d, "BLOCK_K": block_k, "HAS_TOPK": False}
    return _compiled(_atomics_alone_kernel, _ATOMICS_POINTERS, _ATOMICS_INTEGERS, constexprs, num_warps, num_stages)


def _compiled(fn, pointers: dict, integers: list[str], constexprs: dict, num_warps: int, num_stages: int) -> dict:
    sig = {**pointers, **{name: "i32" for name in integers}, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if sig[name] != "constexpr"}
    kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    usage, sass = cuobjdump(kernel, "-res-usage", "-sass")
    found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    regs, shared = int(found["REG"]), kernel.metadata.shared
    by_shared = SHARED_PER_SM // (shared + RESERVED_PER_PROGRAM)
    by_regs = REGISTERS_PER_SM // (max(regs, 1) * 32 * num_warps)
    atomics = Counter(re.findall(r"\b(?:red|atom)\.global[\w.]*", kernel.asm["ptx"]))
    return {"regs": regs, "spill": int(found["STACK"]) + int(found.get("LOCAL", 0)), "shared_kb": shared / 1024,
            "wgmma": len(re.findall(r"\bHGMMA", sass)), "programs_per_sm": min(by_shared, by_regs),
            "atomics": " ".join(f"{name} x{count}" for name, count in sorted(atomics.items()))}


def _text(res: dict) -> str:
    return (f"regs {res['regs']:3d}  spill {res['spill']:4d} B  shared {res['shared_kb']:6.1f} KB  "
            f"wgmma {res['wgmma']:3d}  programs/SM {res['programs_per_sm']}  {res['atomics']}")


def main(argv: list[str] | None = None) -> int:
    parser = heads_parser(__doc__)
    parser.add_argument("--tile", action="append", default=[],
                        help="a kv-pass tile 'block_k,block_d,num_warps,num_stages[,column_blocks]' (repeatable; "
                             "default: the candidates)")
    args = parse_heads_and_print_target(parser, argv, D)
    tiles = [tuple(int(v) for v in text.split(",")) for text in args.tile] or CANDIDATES
    for tile in tiles:
        cfg = dqp.KvPassConfig(*tile)
        name = ",".join(map(str, astuple(cfg)))
        try:
            text = _text(resources(cfg, args.heads))
        except Exception as exc:  # noqa: BLE001 - a tile over the limits must not end the list
            text = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        print(f"kv pass {name:18s} {text}", flush=True)
    print(f"atomics alone {','.join(map(str, ATOMICS_TILE)):12s} {_text(atomics_alone_resources())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
