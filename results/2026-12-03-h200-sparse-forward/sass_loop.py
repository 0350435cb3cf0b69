"""The order of the waits, barriers, products and row copies in the default forward's key loop, compiled for
sm_90 without a GPU (split logits, indices ahead, ``64,64,8,2``, the flash shape's heads and head dim): the
launch is captured as ``bench.sparse_attention_resources`` does and its SASS read with the ``cuobjdump`` that
ships with triton; prints the loop's synchronising, matrix and copy instructions in order.

Run from the repository root on any machine with triton (no ``TRITON_INTERPRET``):
python results/2026-12-03-h200-sparse-forward/sass_loop.py
"""

import re
from unittest import mock

import torch
import triton

from bench.cubin_resources import cuobjdump
from bench.sparse_attention_resources import _Recorder, compile_launch
from dsv4cp.kernels import sparse_attention_fwd_triton as fwd

KEPT = re.compile(r"\b(DEPBAR|LDGDEPBAR|BAR\.SYNC|WARPGROUP\.\w+|HGMMA\.\S+|LDGSTS\S*|BRA)\b")


def main() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 64, 512, generator=g).bfloat16()
    kv = torch.randn(20480, 512, generator=g).bfloat16()
    idx = torch.randint(0, 20480, (4, 640), generator=g, dtype=torch.int32)
    launches, compiled = [], []
    compile_fn = triton.compile

    def keep(*args, **kwargs):
        compiled.append(compile_fn(*args, **kwargs))
        return compiled[-1]

    with mock.patch.object(fwd, "_build", lambda name, device: _Recorder(name, launches)), \
            mock.patch.object(fwd, "_dot_f32", lambda q: False), \
            mock.patch.object(fwd, "_precision", lambda q: "tf32"), mock.patch.object(triton, "compile", keep):
        fwd.sparse_attention_fwd(q, kv, idx, torch.zeros(64), 512**-0.5, logits="split", index_ahead=True,
                                 block_h=64, block_k=64, num_warps=8, num_stages=2)
        print("triton", triton.__version__, compile_launch(launches[0]))
    (sass,) = cuobjdump(compiled[-1], "-sass")
    lines = [line.split(";")[0].strip() for line in sass.splitlines() if line.strip().startswith("/*")]
    back = [i for i, line in enumerate(lines) if re.search(r"BRA 0x([0-9a-f]+)", line)
            and int(re.search(r"BRA 0x([0-9a-f]+)", line).group(1), 16) < int(line[2:6], 16)]
    end = back[0]
    start_address = re.search(r"BRA 0x([0-9a-f]+)", lines[end]).group(1)
    start = next(i for i, line in enumerate(lines) if line.startswith(f"/*{start_address[-4:]}*/"))
    run, previous = 0, None
    for line in lines[start:end + 1]:
        found = KEPT.search(line)
        if not found:
            continue
        name = found.group(1)
        if name == previous:
            run += 1
            continue
        if previous is not None and run > 1:
            print(f"    ... {run} x {previous}")
        print(line)
        previous, run = name, 1
    if run > 1:
        print(f"    ... {run} x {previous}")


if __name__ == "__main__":
    main()
