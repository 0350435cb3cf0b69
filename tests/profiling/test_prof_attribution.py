"""The step's unattributed and idle time on synthetic traces with known answers, and
the ranges that give the Triton indexer-score backward and the layer's layout work their own phases."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch
from prof_helpers import _PID0, K, R, write_kineto, write_nsys

from dsv4cp.kernels import triton_available
from dsv4cp.profiling.nsys import load_nsys_files
from dsv4cp.profiling.overlap import (
    ATTRIBUTION_COLUMNS,
    KernelRecord,
    RangeRecord,
    attribution_lines,
    attribution_table,
)
from dsv4cp.profiling.trace import kineto_attribution_table, kineto_overlap_table

GEMM, NCCL, ADD = "sm90_xmma_gemm_bf16", "ncclDevKernel_AllGather_RING_LL", "vectorized_elementwise_kernel"
STEP = "dsv4cp.step"


def _one_step(offset: float) -> tuple[list[K], list[R]]:
    """Step [0, 1000) us with two phases. Kernels launched inside it span [50, 520): busy [50, 300) and
    [400, 520), idle [300, 400). [260, 300) runs only a kernel of no phase (launched in the step,
    outside the phases); [100, 150) one beside a phase's kernel; [410, 450) is communication under a
    phase. A kernel launched after the step
    ([600, 700), no range) lies outside the step's window and counts nowhere."""
    kernels = [
        K(0, 7, 50, 260, GEMM, launch=20),     # q_proj.fwd
        K(0, 7, 260, 300, ADD, launch=150),    # the step itself: unattributed
        K(0, 9, 100, 150, ADD, launch=160),    # the step itself, but beside q_proj's GEMM: not unattributed
        K(0, 7, 400, 500, GEMM, launch=210),   # sparse_attn.bwd (autograd's thread)
        K(0, 8, 410, 450, NCCL, launch=220),   # sparse_attn.bwd, hidden under the GEMM
        K(0, 7, 480, 520, ADD, launch=230),    # sparse_attn.bwd
        K(0, 7, 600, 700, ADD, launch=1100),   # after the step, in no range
    ]
    ranges = [R(0, "step", 0, 1000), R(0, "q_proj.fwd", 10, 100), R(0, "sparse_attn.bwd", 200, 300, tid=2)]
    shift = lambda k: K(k.rank, k.stream, k.start + offset, k.end + offset, k.name, k.launch + offset)  # noqa: E731
    return [shift(k) for k in kernels], [R(r.rank, r.phase, r.start + offset, r.end + offset, r.tid) for r in ranges]


def test_attribution_of_known_steps(tmp_path) -> None:
    first, second = _one_step(0.0), _one_step(2000.0)
    directory = write_kineto(tmp_path, first[0] + second[0], first[1] + second[1])
    table = kineto_attribution_table(directory)  # two steps: per-step figures
    assert list(table.columns) == list(ATTRIBUTION_COLUMNS)
    row = table.iloc[0].to_dict()
    expected = {"rank": 0, "step_ms": 0.47, "busy_ms": 0.37, "unattributed_ms": 0.04, "idle_ms": 0.1,
                "unattributed_pct": 100 * 40 / 470, "idle_pct": 100 * 100 / 470}
    assert row == pytest.approx(expected, abs=1e-9)
    # the step row of the overlap table holds the same unattributed work and idle time (two steps)
    step_row = kineto_overlap_table(directory).set_index("phase").loc[STEP]
    assert step_row["compute_ms"] == pytest.approx(0.18) and step_row["idle_ms"] == pytest.approx(0.2)


def test_attribution_without_a_step_range() -> None:
    kernels = [KernelRecord(3, 7, 1000, 2000, GEMM, False, launch_ns=500),
               KernelRecord(3, 7, 3000, 3500, ADD, False, launch_ns=2500)]
    ranges = [RangeRecord(3, "dsv4cp.q_proj.fwd", 0, 1000)]
    # first kernel start to last kernel end: [1000, 3500); the second kernel is in no range
    row = attribution_table(kernels, ranges, STEP).iloc[0]
    assert (row["step_ms"], row["busy_ms"], row["unattributed_ms"], row["idle_ms"]) == pytest.approx(
        (0.0025, 0.0015, 0.0005, 0.001))
    # a capture window [0, 5000) instead
    row = attribution_table(kernels, ranges, STEP, windows={3: (0, 5000)}).iloc[0]
    assert (row["step_ms"], row["idle_ms"], row["idle_pct"]) == pytest.approx((0.005, 0.0035, 70.0))


def test_attribution_of_a_rank_without_kernels() -> None:
    row = attribution_table([], [RangeRecord(1, STEP, 0, 1000)], STEP).iloc[0]
    # nothing launched: the window is the range itself, all of it idle
    assert (row["rank"], row["step_ms"], row["busy_ms"], row["idle_pct"]) == (1, 0.001, 0.0, 100.0)


def test_copies_and_memsets_are_device_work(tmp_path) -> None:
    """A copy between two kernels (the clone of a non-inplace masked_fill) fills the gap: not idle."""
    base = 1_700_000_000_000.0
    events = [{"ph": "X", "cat": "user_annotation", "name": STEP, "pid": 1, "tid": 1, "ts": base, "dur": 50.0,
               "args": {}},
              {"ph": "X", "cat": "user_annotation", "name": "dsv4cp.indexer.loss.fwd", "pid": 1, "tid": 1,
               "ts": base + 5, "dur": 30.0, "args": {}}]
    device_work = [("kernel", GEMM, 100, 200), ("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 200, 260),
                   ("gpu_memset", "Memset (Device)", 260, 270), ("kernel", ADD, 270, 300)]
    for corr, (category, name, start, end) in enumerate(device_work, start=1):
        events.append({"ph": "X", "cat": category, "name": name, "pid": 0, "tid": 7, "ts": base + start,
                       "dur": float(end - start), "args": {"stream": 7, "correlation": corr}})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": base + 6 + corr, "dur": 0.5, "args": {"correlation": corr}})
    (tmp_path / "rank0.json").write_text(json.dumps({"traceEvents": events}))
    row = kineto_attribution_table(tmp_path).iloc[0]
    assert (row["step_ms"], row["busy_ms"], row["idle_ms"], row["unattributed_ms"]) == pytest.approx(
        (0.2, 0.2, 0.0, 0.0))
    phase = kineto_overlap_table(tmp_path).set_index("phase").loc["dsv4cp.indexer.loss.fwd"]
    assert phase["compute_ms"] == pytest.approx(0.2)


def test_copies_and_memsets_are_device_work_in_nsys_exports(tmp_path) -> None:
    """The same scenario as an nsys export: copies and memsets come from their own CUPTI tables."""
    path = write_nsys(tmp_path / "rank0.sqlite", [K(0, 7, 100, 200, GEMM, launch=7), K(0, 7, 270, 300, ADD, launch=8)],
                      [R(0, "step", 0, 50), R(0, "indexer.loss.fwd", 5, 35)])
    gpid = _PID0 << 24  # rank 0's process, as write_nsys numbers them
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL,
            deviceId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
            copyKind INTEGER NOT NULL, bytes INTEGER NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INTEGER NOT NULL, end INTEGER NOT NULL,
            deviceId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
            value INTEGER NOT NULL, bytes INTEGER NOT NULL);
    """)
    for table, start, end, corr in (("MEMCPY", 200_000, 260_000, 3), ("MEMSET", 260_000, 270_000, 4)):
        conn.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_{table} VALUES (?,?,?,?,?,?,?,?)",
                     (start, end, 0, 7, corr, gpid, 8, 64))
    for corr, launch in ((3, 9_000), (4, 10_000)):
        conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,?,?,?,?,?)",
                     (launch, launch + 500, 1, gpid | 1, corr, 1, 0))
    conn.commit()
    conn.close()
    kernels, ranges = load_nsys_files(path)
    row = attribution_table(kernels, ranges, STEP).iloc[0]
    assert (row["step_ms"], row["busy_ms"], row["idle_ms"], row["unattributed_ms"]) == pytest.approx(
        (0.2, 0.2, 0.0, 0.0))
    assert {k.name for k in kernels} == {GEMM, ADD, "Memcpy", "Memset"}


def test_attribution_lines_give_the_verdicts() -> None:
    kernels = [KernelRecord(0, 7, 0, 940, GEMM, False, launch_ns=10),
               KernelRecord(0, 7, 940, 1000, ADD, False, launch_ns=20),
               KernelRecord(1, 7, 0, 900, GEMM, False, launch_ns=10)]
    ranges = [RangeRecord(r, STEP, 0, 100) for r in (0, 1)] + [RangeRecord(r, "dsv4cp.q_proj.fwd", 5, 15)
                                                               for r in (0, 1)]
    lines = attribution_lines(attribution_table(kernels, ranges, STEP))
    # rank 0: 60 of 1000 ns unattributed (6% > 5%), nothing idle; rank 1: all attributed, idle 0%
    assert lines[0] == ("rank 0: step 0.001 ms, unattributed 0.000 ms (6.0% of the step; target <= 5%: missed), "
                        "idle 0.000 ms (0.0% of the step; target <= 3%: met)")
    assert "unattributed 0.000 ms (0.0% of the step; target <= 5%: met)" in lines[1]


def test_per_step_figures_follow_the_steps_in_the_trace(tmp_path) -> None:
    """One step or two identical ones: the same per-step figures (the count comes from the trace)."""
    one = kineto_attribution_table(write_kineto(tmp_path / "one", *_one_step(0.0))).iloc[0]
    first, second = _one_step(0.0), _one_step(2000.0)
    two = kineto_attribution_table(write_kineto(tmp_path / "two", first[0] + second[0], first[1] + second[1])).iloc[0]
    assert two.to_dict() == pytest.approx(one.to_dict(), abs=1e-9)


# ------------------------------------------------------------------------- ranges in the layer's code
@pytest.mark.skipif(not triton_available("cpu"), reason="triton cannot run on this CPU (TRITON_INTERPRET)")
def test_triton_indexer_score_backward_has_its_phase(monkeypatch, seed) -> None:
    """The Triton kernels' autograd function opens no range: the op marks its backward
    ``indexer.score.bwd`` (on CPU the op would take the torch path; force the Triton one)."""
    import dsv4cp.ops.indexer as ops_indexer
    from dsv4cp.kernels.indexer_scores_triton import indexer_scores_triton

    gen = torch.Generator().manual_seed(seed)
    t, hi, di, g, k = 6, 2, 16, 10, 4
    q = torch.randn(t, hi, di, generator=gen, requires_grad=True)
    w = torch.randn(t, hi, generator=gen, requires_grad=True)
    keys = torch.randn(g, di, generator=gen, requires_grad=True)
    idx = torch.randint(-1, g, (t, k), generator=gen)
    upstream = torch.randn(t, k, generator=gen)
    monkeypatch.setattr(ops_indexer, "triton_serves", lambda x: True)

    grads = []
    for scores in (ops_indexer.indexer_scores, indexer_scores_triton):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            (scores(q, w, keys, idx) * upstream).sum().backward()
        grads.append([p.grad for p in (q, w, keys)])
        for p in (q, w, keys):
            p.grad = None
        if scores is ops_indexer.indexer_scores:
            events = prof.events()
            ranges = [e.time_range for e in events if e.name == "dsv4cp.indexer.score.bwd"]
            backward = [e.time_range for e in events if e.name == "_TritonIndexerScoresBackward"]
            assert len(ranges) == 1 and len(backward) == 1
            assert ranges[0].start <= backward[0].start and backward[0].end <= ranges[0].end
    # the markers change no number: the same gradients as the kernels' function called directly
    for marked, direct in zip(*grads):
        assert marked.abs().sum() > 0 and torch.equal(marked, direct)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_layer_step_leaves_no_indexer_kernel_outside_the_phases(tmp_path, seed) -> None:
    """A flash C layer step on the GPU, 4K tokens, Triton kernels (the configuration of the layer's GPU
    tests): the indexer-score backward and the layout work run in their phases; what stays outside is
    printed (the layer input's gradient sums), with the step's attribution lines."""
    from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
    from dsv4cp.harness.build import randomize_
    from dsv4cp.profiling.overlap import UNATTRIBUTED, kernel_table
    from dsv4cp.profiling.trace import capture_trace, load_kineto_dir

    cfg = DSv4Config.preset("flash")
    packed = PackedSeqs.from_lengths([3000, 77, 1019], total=4096, device="cuda")
    layer = DSv4Attention(cfg, 4, backend="triton")
    randomize_(layer, torch.Generator().manual_seed(seed))
    layer = layer.to(device="cuda", dtype=torch.bfloat16)
    inputs = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(packed.total, cfg.hidden, generator=inputs, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    upstream = torch.randn(packed.total, cfg.hidden, generator=inputs, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        result = layer(x, packed)
        torch.autograd.backward([result.out, result.indexer_loss], [upstream, None])

    capture_trace(step, tmp_path, steps=1, warmup=1)
    kernels = kernel_table(*load_kineto_dir(tmp_path))
    outside = kernels[kernels["phase"].isin([STEP, UNATTRIBUTED])]
    print(outside.to_string(index=False))
    print("\n".join(attribution_lines(kineto_attribution_table(tmp_path))))
    assert not outside["kernel"].str.contains("_gather_").any()
    phases = kernels.groupby("phase")["time_ms"].sum()
    assert phases["dsv4cp.indexer.score.bwd"] > 0 and phases["dsv4cp.layout.fwd"] > 0
