"""Fire-and-forget fp32 reductions into global memory straight from a tensor's own register layout.

``tl.atomic_add`` makes Triton's coalescing pass give the added values a blocked layout with 16-byte
vectors per thread, so a tile computed by the matrix unit (the wgmma accumulator layout) is first moved
through shared memory (a layout conversion with its barriers) before its atomics issue. In the
accumulator layout every thread holds pairs of adjacent columns (8 bytes) of two rows, and the four
threads of a row quad hold 32 contiguous bytes: an 8-byte vector reduction per pair covers whole 32-byte
sectors from the registers as they are. :func:`red_add_f32` issues those, through inline PTX
(``red.relaxed.gpu.global.add.v2.f32``, sm_90), on whatever layout its operand has, so no conversion is
inserted. Inline PTX does not run under Triton's CPU interpreter: kernels keep ``tl.atomic_add`` there.

Imports triton: only kernel modules import this module.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Operands (pack = 2: two elements per invocation, in the thread's register order): $0, $1 dummy outputs;
# $2, $3 the two addresses; $4, $5 the two values; $6, $7 their masks (nonzero: add). A pair becomes one
# 8-byte vector reduction only when both are on, the second address is the first's next float and the
# first is 8-byte aligned; otherwise each element on gets its own 4-byte reduction. Relaxed, GPU scope:
# atomicity is all a sum needs, and the kernel's end orders it before any reader.
_RED_V2_F32 = tl.constexpr("""{
 .reg .pred pa, pb, pv, pn;
 .reg .b64 nx, al;
 setp.ne.b32 pa, $6, 0;
 setp.ne.b32 pb, $7, 0;
 add.s64 nx, $2, 4;
 setp.eq.s64 pv, nx, $3;
 and.b64 al, $2, 7;
 setp.eq.and.s64 pv, al, 0, pv;
 and.pred pv, pv, pa;
 and.pred pv, pv, pb;
 @pv red.relaxed.gpu.global.add.v2.f32 [$2], {$4, $5};
 not.pred pn, pv;
 and.pred pa, pa, pn;
 and.pred pb, pb, pn;
 @pa red.relaxed.gpu.global.add.f32 [$2], $4;
 @pb red.relaxed.gpu.global.add.f32 [$3], $5;
 mov.b32 $0, 0;
 mov.b32 $1, 0;
}""")


@triton.jit
def red_add_f32(ptrs, values, mask):
    """``*ptrs += values`` where ``mask``, as relaxed GPU-scope fp32 reductions issued from ``values``'
    own layout (pairs of adjacent elements as one 8-byte vector when contiguous and aligned).
    ``ptrs`` float32 pointers, ``values`` fp32, ``mask`` bool, all of one shape."""
    # the addresses as integers: the op broadcasts its operands pairwise, and a pointer beside a float is refused
    tl.inline_asm_elementwise(_RED_V2_F32, "=r,=r,l,l,f,f,r,r", [ptrs.to(tl.int64), values, mask.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=2)
