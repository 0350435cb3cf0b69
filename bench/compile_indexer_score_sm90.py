"""Compile the indexer score kernel (``_score_kernel`` of :mod:`dsv4cp.kernels.indexer_triton`) for sm_90a
without a GPU, one head at a time and in head pairs (``HEAD_PAIRS``, kernel option
``triton_indexer_head_pairs``), and print per tile: registers per thread, spill bytes, shared memory, the
wgmma instructions (``HGMMA``) and their waits (``WARPGROUP.DEPBAR.LE gsb0, N``: at most N wgmma groups
still in flight after it) and the head loop's order of products, waits and epilogues read off the SASS.

The build is the flash shape's launch on the radix path (bf16, Di = 128, fp32 scores, ``IN_RANGE_ONLY``)
with the runtime's specialisation (pointers, strides and integers 16-divisible). In the loop summary
``P<n>`` is a run of n wgmma instructions, ``W<n>`` a wait for at most n groups in flight, ``E`` a run of
epilogue instructions (``FMNMX`` / ``FFMA``); ``in flight at the loop's end`` says whether the loop's last
product is issued after its last wait (so it runs under the code that follows it). ptxas serialises every
wgmma of a kernel (a wait after each one) when an instruction reads the registers of one in flight: that
shows as ``W0`` after every ``P1``.

Not collected by pytest; run from the repository root (no GPU, no ``TRITON_INTERPRET``; about ten seconds
per build)::

    python -m bench.compile_indexer_score_sm90 [--tiles 64,128,4,3 64,128,8,3]
"""

from __future__ import annotations

import argparse
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.cubin_resources import cuobjdump
from dsv4cp.kernels import indexer_triton as it

TILES = ("64,128,4,3", "64,128,8,3", "64,128,8,2", "128,128,8,3")
_SIGNATURE = {"Q": "*bf16", "WT": "*fp32", "KEYS": "*bf16", "QDOC": "*i32", "QLIM": "*i32", "KDOC": "*i32",
              "KJ": "*i32", "OUT": "*fp32", "RLO": "*i64", "RHI": "*i64", "M": "i32", "NCOL": "i32", "COL0": "i32",
              "N_KB": "i32", "HI": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_wh": "i32",
              "stride_kn": "i32", "stride_ot": "i32"}
_STEP = re.compile(r"\b(HGMMA|WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)|FMNMX|FFMA)\b")
_BRANCH = re.compile(r"/\*([0-9a-f]{4,})\*/.*\bBRA (0x[0-9a-f]+)")


def build(block_m: int, block_n: int, num_warps: int, num_stages: int, head_pairs: bool):
    """``_score_kernel`` compiled for sm_90a at the tile, as the GPU runtime specialises the flash launch."""
    constexprs = {"DI": 128, "BLOCK_D": 128, "BLOCK_M": block_m, "BLOCK_N": block_n, "PRECISION": "tf32",
                  "DOT_F32": False, "PACKED": False, "IN_RANGE_ONLY": True, "HEAD_PAIRS": head_pairs, "COMPILED": True}
    signature = {**_SIGNATURE, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(_SIGNATURE))}
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options({"num_warps": num_warps, "num_stages": num_stages})
    return triton.compile(ASTSource(triton.jit(it._score_kernel), signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def head_loop(sass: str) -> tuple[str, bool]:
    """The summary of the SASS loop that holds the most wgmma (the head loop) and whether its last product
    is still in flight at the loop's end."""
    lines = [line.split(";")[0] for line in sass.splitlines()]
    address = [int(m.group(1), 16) if (m := re.search(r"/\*([0-9a-f]{4,})\*/", line)) else -1 for line in lines]
    best, best_count = (0, 0), -1
    for i, line in enumerate(lines):
        found = _BRANCH.search(line)
        if found and int(found.group(2), 16) < int(found.group(1), 16):
            start = address.index(int(found.group(2), 16))
            count = sum("HGMMA" in body for body in lines[start:i])
            if count > best_count:
                best, best_count = (start, i), count
    steps: list[list] = []
    for line in lines[best[0]:best[1]]:
        found = _STEP.search(line)
        if not found:
            continue
        kind = "P" if found.group(1) == "HGMMA" else "E" if found.group(1) in ("FMNMX", "FFMA") else \
            f"W{int(found.group(2), 16)}"
        if steps and steps[-1][0] == kind and kind != "W0":
            steps[-1][1] += 1
        else:
            steps.append([kind, 1])
    text = " ".join(f"P{n}" if kind == "P" else kind for kind, n in steps)
    last_product = max((i for i, (kind, _) in enumerate(steps) if kind == "P"), default=-1)
    last_wait = max((i for i, (kind, _) in enumerate(steps) if kind.startswith("W")), default=-1)
    return text, last_product > last_wait


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", nargs="+", default=list(TILES), help="block_m,block_n,num_warps,num_stages")
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90a")
    for tile in args.tiles:
        block_m, block_n, num_warps, num_stages = map(int, tile.split(","))
        for head_pairs in (False, True):
            kernel = build(block_m, block_n, num_warps, num_stages, head_pairs)
            usage, sass = cuobjdump(kernel, "-res-usage", "-sass")
            found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
            waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
            loop, in_flight = head_loop(sass)
            print(f"{tile} {'head pairs' if head_pairs else 'one head  '}: {found['REG']} registers, "
                  f"{int(found['STACK']) + int(found['LOCAL'])} B spilled, {kernel.metadata.shared // 1024} KB shared, "
                  f"{sass.count('HGMMA')} HGMMA, waits {sorted({int(w, 16) for w in waits})} x {len(waits)}")
            print(f"    head loop: {loop}  (in flight at the loop's end: {'yes' if in_flight else 'no'})")


if __name__ == "__main__":
    main()
