"""``bench.idle_gaps`` on a hand-built Kineto trace: a gap whose next kernel was launched late goes to the
launching op and its phase; a gap with the next kernel already launched is the device's own."""

from __future__ import annotations

import json

from bench.idle_gaps import analyse


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1 if cat != "kernel" else 0,
            "tid": tid, "args": args}


def test_late_launches_are_charged_to_their_op_and_phase(tmp_path):
    events = [
        _x("user_annotation", "dsv4cp.kv_proj.fwd", 0, 100),
        _x("cpu_op", "aten::mm", 1, 5),
        _x("cuda_runtime", "cudaLaunchKernel", 2, 1, correlation=1),
        _x("kernel", "gemm", 10, 10, tid=7, correlation=1),  # ends at 20
        _x("cpu_op", "aten::pow", 20, 15),  # the host is still busy when the GPU runs dry
        _x("cpu_op", "aten::mul", 40, 8),
        _x("cuda_runtime", "cudaLaunchKernel", 45, 1, correlation=2),
        _x("kernel", "mul_kernel", 50, 5, tid=7, correlation=2),  # 30 us gap, launched late
        _x("cuda_runtime", "cudaLaunchKernel", 51, 1, correlation=3),  # launched while mul_kernel runs
        _x("kernel", "add_kernel", 62, 3, tid=7, correlation=3),  # 7 us gap of the device's own
    ]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    text = analyse(str(path), min_us=1.0, top=5, stack=False)
    assert "device idle waiting for the host: 0.030 ms" in text
    assert "already launched: 0.007 ms" in text
    assert "0.030  dsv4cp.kv_proj.fwd" in text and "0.030  aten::mul" in text
    gap_line = next(line for line in text.splitlines() if line.strip().startswith("30.0"))
    assert "mul_kernel" in gap_line and "aten::pow 15" in gap_line and "aten::mul 8" in gap_line
