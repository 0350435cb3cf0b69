"""The overlap table on synthetic traces with known answers, through both loaders (Kineto JSON, nsys SQLite)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from prof_helpers import K, R, write_kineto, write_nsys

from dsv4cp.profiling.nsys import nsys_overlap_table
from dsv4cp.profiling.overlap import COLUMNS, TOTAL, KernelRecord, RangeRecord, kernel_table, overlap_table
from dsv4cp.profiling.trace import kineto_overlap_table

GEMM, NCCL = "sm90_xmma_gemm_bf16", "ncclDevKernel_AllGather_RING_LL"


@pytest.fixture(params=["kineto", "nsys"])
def table(request, tmp_path):
    """``table(kernels, ranges)`` -> overlap DataFrame, read back through one of the two formats."""

    def build(kernels: list[K], ranges: list[R]) -> pd.DataFrame:
        if request.param == "kineto":
            return kineto_overlap_table(write_kineto(tmp_path / "kineto", kernels, ranges))
        return nsys_overlap_table(write_nsys(tmp_path / "trace.sqlite", kernels, ranges))

    return build


def row(df: pd.DataFrame, phase: str, rank: int = 0) -> dict:
    name = phase if phase == TOTAL else f"dsv4cp.{phase}"
    hits = df[(df["rank"] == rank) & (df["phase"] == name)]
    assert len(hits) == 1, f"expected one row for rank {rank} phase {name}:\n{df}"
    return hits.iloc[0].to_dict()


def check(actual: dict, **expected: float) -> None:
    for key, value in expected.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(actual[key]), f"{key}: {actual[key]} != nan"
        else:
            assert actual[key] == pytest.approx(value, abs=1e-6), f"{key}: {actual[key]} != {value} in {actual}"


def test_fully_hidden_comm(table):
    df = table(
        [K(0, 7, 20, 120, GEMM, launch=1), K(0, 20, 40, 80, NCCL, launch=11)],
        [R(0, "sparse_attn.fwd", 0, 10), R(0, "allgather.kv.launch", 10, 12)],
    )
    assert list(df.columns) == list(COLUMNS)
    check(row(df, "allgather.kv.launch"), compute_ms=0.0, comm_ms=0.04, overlap_ms=0.04, overlap_ratio=1.0,
          exposed_comm_ms=0.0, idle_ms=0.0)
    check(row(df, "sparse_attn.fwd"), compute_ms=0.1, comm_ms=0.0, overlap_ratio=float("nan"), idle_ms=0.0)
    check(row(df, TOTAL), compute_ms=0.1, comm_ms=0.04, overlap_ms=0.04, overlap_ratio=1.0, exposed_comm_ms=0.0,
          idle_ms=0.0)


def test_fully_exposed_comm(table):
    df = table(
        [K(0, 7, 20, 60, GEMM, launch=1), K(0, 20, 60, 100, NCCL, launch=11)],
        [R(0, "sparse_attn.fwd", 0, 10), R(0, "allgather.kv.launch", 10, 12)],
    )
    check(row(df, "allgather.kv.launch"), comm_ms=0.04, overlap_ms=0.0, overlap_ratio=0.0, exposed_comm_ms=0.04)
    check(row(df, TOTAL), compute_ms=0.04, comm_ms=0.04, overlap_ratio=0.0, exposed_comm_ms=0.04, idle_ms=0.0)


def test_partial_overlap_and_idle_gap(table):
    df = table(
        [K(0, 7, 0, 100, GEMM, launch=1), K(0, 20, 80, 180, NCCL, launch=11), K(0, 7, 200, 250, GEMM, launch=13)],
        [R(0, "sparse_attn.fwd", 0, 10), R(0, "allgather.kv.launch", 10, 12), R(0, "out_proj.fwd", 12, 14)],
    )
    check(row(df, "allgather.kv.launch"), compute_ms=0.0, comm_ms=0.1, overlap_ms=0.02, overlap_ratio=0.2,
          exposed_comm_ms=0.08, idle_ms=0.0)
    check(row(df, "out_proj.fwd"), compute_ms=0.05, idle_ms=0.0)
    # window [0, 250], busy [0, 180] + [200, 250]: 20 us idle
    check(row(df, TOTAL), compute_ms=0.15, comm_ms=0.1, overlap_ms=0.02, overlap_ratio=0.2, exposed_comm_ms=0.08,
          idle_ms=0.02)


def test_two_compute_streams_count_once(table):
    df = table(
        [K(0, 7, 0, 100, GEMM, launch=1), K(0, 8, 50, 150, GEMM, launch=2), K(0, 20, 120, 220, NCCL, launch=11)],
        [R(0, "compress.fwd", 0, 10), R(0, "allgather.kv.launch", 10, 12)],
    )
    check(row(df, "compress.fwd"), compute_ms=0.15, comm_ms=0.0)
    check(row(df, TOTAL), compute_ms=0.15, comm_ms=0.1, overlap_ms=0.03, overlap_ratio=0.3, exposed_comm_ms=0.07,
          idle_ms=0.0)


def test_nested_ranges_innermost_attribution(table):
    df = table(
        [
            K(0, 7, 1000, 1010, GEMM, launch=50),    # step only
            K(0, 7, 1010, 1030, GEMM, launch=150),   # sparse_attn
            K(0, 7, 1030, 1060, GEMM, launch=250),   # topk inside sparse_attn
            K(0, 7, 1070, 1100, GEMM, launch=400),   # sparse_attn again, after a 10 us gap
        ],
        [R(0, "step", 0, 1000), R(0, "sparse_attn.fwd", 100, 500), R(0, "indexer.topk.fwd", 200, 300, tid=2)],
    )
    check(row(df, "step"), compute_ms=0.01, idle_ms=0.01)              # window [1000, 1100]
    check(row(df, "sparse_attn.fwd"), compute_ms=0.05, idle_ms=0.01)   # window [1010, 1100]
    check(row(df, "indexer.topk.fwd"), compute_ms=0.03, idle_ms=0.0)
    check(row(df, TOTAL), compute_ms=0.09, idle_ms=0.01)
    assert list(df["phase"]) == ["dsv4cp.step", "dsv4cp.sparse_attn.fwd", "dsv4cp.indexer.topk.fwd", TOTAL]


def test_straddling_kernels_clipped_when_attributed_by_start(table):
    # no launch information: attribution by start time, per-phase numbers clipped to the range
    df = table(
        [K(0, 7, 50, 150, GEMM), K(0, 20, 120, 180, NCCL)],
        [R(0, "compress.fwd", 0, 100), R(0, "allgather.kv.launch", 100, 200)],
    )
    check(row(df, "compress.fwd"), compute_ms=0.05, idle_ms=0.05)
    # comm [120, 180] overlaps the WHOLE gemm (unclipped) on [120, 150]
    check(row(df, "allgather.kv.launch"), compute_ms=0.0, comm_ms=0.06, overlap_ms=0.03, overlap_ratio=0.5,
          idle_ms=0.02)
    check(row(df, TOTAL), compute_ms=0.1, comm_ms=0.06, overlap_ms=0.03, idle_ms=0.0)


def test_straddling_kernels_whole_when_attributed_by_launch(table):
    df = table(
        [K(0, 7, 50, 150, GEMM, launch=5), K(0, 20, 120, 180, NCCL, launch=15)],
        [R(0, "compress.fwd", 0, 10), R(0, "allgather.kv.launch", 10, 20)],
    )
    check(row(df, "compress.fwd"), compute_ms=0.1, idle_ms=0.0)
    check(row(df, "allgather.kv.launch"), comm_ms=0.06, overlap_ms=0.03, overlap_ratio=0.5)


def test_multiple_ranks(table):
    df = table(
        [
            K(0, 7, 20, 120, GEMM, launch=1), K(0, 20, 40, 80, NCCL, launch=11),    # rank 0: hidden
            K(1, 7, 20, 60, GEMM, launch=1), K(1, 20, 60, 100, NCCL, launch=11),    # rank 1: exposed
        ],
        [
            R(0, "sparse_attn.fwd", 0, 10), R(0, "allgather.kv.launch", 10, 12),
            R(1, "sparse_attn.fwd", 0, 10), R(1, "allgather.kv.launch", 10, 12),
        ],
    )
    assert (df["phase"] == TOTAL).sum() == 2
    assert sorted(df["rank"].unique()) == [0, 1]
    check(row(df, "allgather.kv.launch", rank=0), overlap_ratio=1.0, exposed_comm_ms=0.0)
    check(row(df, "allgather.kv.launch", rank=1), overlap_ratio=0.0, exposed_comm_ms=0.04)
    check(row(df, "sparse_attn.fwd", rank=1), compute_ms=0.04)


def test_kernels_outside_ranges_count_only_in_total(table):
    df = table(
        [K(0, 7, 0, 10, GEMM, launch=1), K(0, 7, 100, 130, GEMM, launch=60)],
        [R(0, "q_proj.fwd", 0, 50)],
    )
    check(row(df, "q_proj.fwd"), compute_ms=0.01)
    check(row(df, TOTAL), compute_ms=0.04, idle_ms=0.09)


def test_kineto_uses_device_ranges_without_launches(tmp_path):
    # kernels with no matching cuda_runtime event: gpu_user_annotation ranges, attribution by start
    kernels = [K(0, 7, 50, 150, GEMM), K(0, 20, 160, 180, NCCL)]
    ranges = [R(0, "compress.fwd", 40, 155), R(0, "allgather.kv.launch", 155, 190)]
    df = kineto_overlap_table(write_kineto(tmp_path, kernels, ranges, gpu_ranges=True))
    check(row(df, "compress.fwd"), compute_ms=0.1)
    check(row(df, "allgather.kv.launch"), comm_ms=0.02)


def test_pure_records_explicit_depth_and_validation():
    kernels = [KernelRecord(0, 7, 0, 1_000, GEMM, is_comm=False, launch_ns=150)]
    # two ranges contain the launch; the explicit depth decides, not the start time
    ranges = [RangeRecord(0, "dsv4cp.a", 100, 200, depth=3), RangeRecord(0, "dsv4cp.b", 120, 180, depth=1)]
    df = overlap_table(kernels, ranges)
    assert df.set_index("phase").loc["dsv4cp.a", "compute_ms"] == pytest.approx(0.001)
    assert df.set_index("phase").loc["dsv4cp.b", "compute_ms"] == 0.0
    kt = kernel_table(kernels, ranges)
    assert kt.iloc[0][["phase", "kernel", "count"]].tolist() == ["dsv4cp.a", GEMM, 1]
    with pytest.raises(ValueError, match="end_ns"):
        KernelRecord(0, 7, 10, 5, GEMM, is_comm=False)
    with pytest.raises(ValueError, match="end_ns"):
        RangeRecord(0, "dsv4cp.a", 10, 5)
    empty = overlap_table([], [])
    assert list(empty.columns) == list(COLUMNS) and empty.empty


def test_capture_window_sets_total_idle():
    kernels = [KernelRecord(0, 7, 100, 200, GEMM, is_comm=False)]
    df = overlap_table(kernels, [], windows={0: (0, 1_000)})
    check(df.iloc[0].to_dict(), compute_ms=0.0001, idle_ms=0.0009)


def test_a_cpu_op_enclosing_a_blocking_collective_hides_none_of_it():
    """On a CPU trace the op that calls a blocking collective (an autograd function, the step) spans it on
    the same thread: that thread is waiting, so only another thread's op hides communication. Counted
    as compute it hid all of it (0% exposed beside a diagnosis blaming exposed communication)."""
    us = 1000
    kernels = [KernelRecord(0, 1, 0, 100 * us, "autograd::function AllGatherKV", False),
               KernelRecord(0, 1, 20 * us, 80 * us, "gloo:all_gather", True),
               KernelRecord(0, 2, 30 * us, 50 * us, "aten::mm", False)]  # another thread: really beside it
    ranges = [RangeRecord(0, "dsv4cp.allgather.kv.fwd", 0, 100 * us)]
    check(row(overlap_table(kernels, ranges), TOTAL), comm_ms=0.06, overlap_ms=0.02, exposed_comm_ms=0.04)
    alone = overlap_table(kernels[:2], ranges)
    check(row(alone, TOTAL), comm_ms=0.06, overlap_ms=0.0, exposed_comm_ms=0.06, compute_ms=0.1)
