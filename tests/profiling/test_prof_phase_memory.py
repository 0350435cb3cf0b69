"""Per-phase memory: the recorder's bookkeeping against a scripted allocator and a
brute-force replay, its hooks in forward ranges and autograd's backward spans, the host-RSS fallback,
and (GPU) that reading the allocator counters does not synchronise the device."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from conftest import TINY_C, make_layer, packed
from dsv4cp.cli.main import main
from dsv4cp.profiling import nvtx
from dsv4cp.profiling.memory import (
    OUTSIDE_PHASES,
    PhaseMemory,
    default_reader,
    peak_phase_line,
    phase_memory_frame,
    record_phase_memory,
    reset_host_peak_rss,
)
from dsv4cp.profiling.nvtx import Span, nvtx_range, set_enabled

MiB = 2**20


class ScriptedAllocator:
    """A fake allocator: the test says what is allocated; the recorder reads it like the CUDA counters."""

    def __init__(self, current: int = 0) -> None:
        self.current = self.peak = current
        self.reads = 0

    def alloc(self, size: int) -> None:
        self.current += size
        self.peak = max(self.peak, self.current)

    def free(self, size: int) -> None:
        self.current -= size

    def current_and_peak(self) -> tuple[int, int]:
        self.reads += 1
        return self.current, self.peak

    def reset_peak(self) -> None:
        self.peak = self.current


@pytest.fixture(autouse=True)
def restore_switch():
    before = nvtx.is_enabled()
    yield
    set_enabled(before)


def _by_phase(rows: list[PhaseMemory]) -> dict[str, PhaseMemory]:
    return {row.phase: row for row in rows}


@pytest.mark.parametrize("enabled", [True, False])
def test_nested_ranges_and_out_of_order_spans(enabled):
    """Entry/peak/exit per phase, a peak charged to every open phase, spans closing out of order."""
    set_enabled(enabled)  # the listener is told of phases whether NVTX ranges are on or off
    mem = ScriptedAllocator(current=100)
    with record_phase_memory("cpu", reader=mem) as rec:
        mem.alloc(50)  # 150, outside every phase
        mem.free(50)
        with nvtx_range("q_proj.fwd"):  # enters at 100
            mem.alloc(30)
            with nvtx_range("sparse_attn.fwd"):  # enters at 130
                mem.alloc(400)  # 530: the step's peak, inside both
                mem.free(400)
            mem.alloc(10)  # 140
        # exits q_proj at 140
        first, second = Span("sparse_attn.bwd"), Span("kv_proj.bwd")
        first.open()  # 140
        mem.alloc(60)  # 200
        second.open()  # 200
        mem.alloc(20)  # 220
        first.close()  # closes before the span opened after it; 220
        mem.free(80)  # 140
        second.close()  # 140
        mem.alloc(5)
    rows = _by_phase(rec.rows)
    assert list(rows) == ["q_proj.fwd", "sparse_attn.fwd", "sparse_attn.bwd", "kv_proj.bwd", OUTSIDE_PHASES]
    assert rows["q_proj.fwd"] == PhaseMemory("q_proj.fwd", 1, 100, 530, 140)
    assert rows["sparse_attn.fwd"] == PhaseMemory("sparse_attn.fwd", 1, 130, 530, 130)
    assert rows["sparse_attn.bwd"] == PhaseMemory("sparse_attn.bwd", 1, 140, 220, 220)
    assert rows["kv_proj.bwd"] == PhaseMemory("kv_proj.bwd", 1, 200, 220, 140)
    assert rows[OUTSIDE_PHASES].peak_bytes == 150
    assert rec.step_peak_bytes == 530
    assert rec.peak_stack == ("q_proj.fwd", "sparse_attn.fwd")
    assert rec.peak_phase == "sparse_attn.fwd"
    assert nvtx._listener is None  # removed when the region ends


def test_repeated_phase_keeps_first_entry_last_exit_and_max_peak():
    mem = ScriptedAllocator()
    with record_phase_memory("cpu", reader=mem) as rec:
        for size in (10, 70, 20):
            with nvtx_range("allgather.kv.wait"):
                mem.alloc(size)
    row = _by_phase(rec.rows)["allgather.kv.wait"]
    assert row == PhaseMemory("allgather.kv.wait", 3, 0, 100, 100)


def _replay(events: list[tuple[str, object]], start: int) -> dict:
    """Brute force: after every event, every open phase sees the current allocation."""
    current, open_phases = start, []
    peaks: dict[str, int] = {OUTSIDE_PHASES: start}
    entries: dict[str, int] = {}
    exits: dict[str, int] = {}
    calls: dict[str, int] = {}
    best, stack = start, ()
    for kind, value in events:
        if kind == "alloc":
            current += value
        elif kind == "free":
            current -= value
        elif kind == "enter":
            entries.setdefault(value, current)
            calls[value] = calls.get(value, 0) + 1
            open_phases.append(value)
        else:
            del open_phases[len(open_phases) - 1 - open_phases[::-1].index(value)]
            exits[value] = current
        for phase in open_phases or [OUTSIDE_PHASES]:
            peaks[phase] = max(peaks.get(phase, 0), current)
        if current > best:
            best, stack = current, tuple(open_phases)
    rows = [PhaseMemory(p, calls[p], entries[p], peaks[p], exits.get(p)) for p in entries]
    return {"rows": rows + [PhaseMemory(OUTSIDE_PHASES, 0, None, peaks[OUTSIDE_PHASES], None)],
            "peak": best, "stack": stack}


@pytest.mark.parametrize("trial", range(6))
def test_random_timelines_match_a_brute_force_replay(seed, trial):
    rng = random.Random(seed + trial)
    names = ["compress.fwd", "indexer.topk.fwd", "sparse_attn.bwd", "halo.bwd"]
    start = rng.randrange(1, 1000)
    events, live, spans = [], [], []
    for _ in range(200):
        roll = rng.random()
        if roll < 0.35:
            size = rng.randrange(1, 500)
            live.append(size)
            events.append(("alloc", size))
        elif roll < 0.6 and live:
            events.append(("free", live.pop(rng.randrange(len(live)))))
        elif roll < 0.8:
            spans.append(rng.choice(names))  # the same phase may be open twice
            events.append(("enter", spans[-1]))
        elif spans:
            events.append(("exit", spans.pop(rng.randrange(len(spans)))))  # any order
    events += [("exit", name) for name in reversed(spans)]

    mem = ScriptedAllocator(start)
    open_spans: dict[str, list[Span]] = {}
    with record_phase_memory("cpu", reader=mem) as rec:
        for kind, value in events:
            if kind == "alloc":
                mem.alloc(value)
            elif kind == "free":
                mem.free(value)
            elif kind == "enter":
                span = Span(value)
                span.open()
                open_spans.setdefault(value, []).append(span)
            else:
                open_spans[value].pop().close()
    expected = _replay(events, start)
    assert rec.rows == expected["rows"]
    assert rec.step_peak_bytes == expected["peak"]
    assert rec.peak_stack == expected["stack"]


def test_layer_step_reports_every_forward_and_backward_phase_closed():
    """A C layer's forward + backward (autograd's spans included) under the recorder: every phase
    that opens also closes, and the phases of both directions are there."""
    torch.manual_seed(0)
    layer = make_layer(TINY_C, 4, seed=3, dtype=torch.float32)
    pk = packed([40, 24])
    x = torch.randn(pk.total, TINY_C.hidden, requires_grad=True)
    mem = ScriptedAllocator()
    with record_phase_memory("cpu", reader=mem) as rec:
        result = layer(x, pk)
        loss = result.out.square().sum() + (result.indexer_loss if result.indexer_loss is not None else 0)
        loss.backward()
    rows = _by_phase(rec.rows)
    assert {"q_proj.fwd", "compress.fwd", "indexer.topk.fwd", "sparse_attn.fwd", "out_proj.fwd",
            "sparse_attn.bwd", "q_proj.bwd", "compress.bwd", "out_proj.bwd"} <= set(rows)
    assert all(row.exit_bytes is not None for name, row in rows.items() if name != OUTSIDE_PHASES)
    assert rec._open == []  # noqa: SLF001  (nothing left open at the end of the step)
    assert mem.reads == 2 * sum(row.calls for row in rec.rows) + 1  # one reading per event, one at the end


def test_host_rss_fallback_sees_a_block_freed_inside_its_phase():
    if default_reader("cpu") is None or not reset_host_peak_rss():
        pytest.skip("this platform cannot read or reset the peak RSS")
    block_bytes = 256 * MiB
    with record_phase_memory("cpu") as rec:
        with nvtx_range("indexer.topk.fwd"):
            block = torch.ones(block_bytes, dtype=torch.uint8)  # ones: the pages get touched
            assert block[-1] == 1
            del block
    row = _by_phase(rec.rows)["indexer.topk.fwd"]
    assert row.peak_bytes - row.entry_bytes > block_bytes // 2
    assert row.peak_bytes - row.exit_bytes > block_bytes // 2  # freed again: glibc returns large blocks
    assert rec.peak_phase == "indexer.topk.fwd"


def test_frame_and_peak_line():
    rows = [PhaseMemory("sparse_attn.bwd", 1, 2**30, 3 * 2**30, 2**30),
            PhaseMemory(OUTSIDE_PHASES, 0, None, 2**29, None)]
    frame = phase_memory_frame([rows, None, [row.to_dict() for row in rows]])  # rank 1 not measured here
    assert list(frame.columns) == ["rank", "phase", "calls", "entry_gib", "peak_gib", "exit_gib"]
    assert frame["rank"].tolist() == [0, 0, 2, 2]
    assert frame["peak_gib"].tolist() == [3.0, 0.5, 3.0, 0.5]
    assert frame["exit_gib"].isna().tolist() == [False, True, False, True]
    assert frame["entry_gib"].isna().tolist() == [False, True, False, True]
    line = peak_phase_line(1, 3 * 2**30, ("indexer.loss.bwd", "sparse_attn.bwd"))
    assert line == "rank 1: peak 3.00 GiB sits in phase sparse_attn.bwd (open: indexer.loss.bwd > sparse_attn.bwd)"
    assert peak_phase_line(0, 2**30, ()).endswith(f"sits in phase {OUTSIDE_PHASES}")


def test_profile_cli_prints_and_records_the_phase_table(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["profile", "--preset", "tiny", "--ratio", "4", "--tokens", "128", "--backward", "--warmup", "0",
            "--reps", "1", "--memory-phases", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "peak_gib" in printed and "rank 0: peak " in printed and " sits in phase " in printed
    (record,) = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    (mine,) = record["memory_phases"]  # one rank
    phases = {row["phase"] for row in mine["rows"]}
    assert {"sparse_attn.fwd", "sparse_attn.bwd", OUTSIDE_PHASES} <= phases
    assert mine["peak_bytes"] == max(row["peak_bytes"] for row in mine["rows"])


def test_profile_cli_phase_table_of_an_emulated_rank(capsys):
    """One emulated rank of CP = 2 (one process): its own table only, the other rank left out."""
    args = ["profile", "--preset", "tiny", "--ratio", "4", "--tokens", "128", "--backward", "--warmup", "0",
            "--reps", "1", "--cp", "2", "--emulate-rank", "1", "--memory-phases"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "rank 1: peak " in printed and " sits in phase " in printed
    assert "rank 0: peak " not in printed.split("peak_gib")[1]  # the phase lines name rank 1 only


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_readings_do_not_synchronise_and_see_the_allocation():
    """Phase events while a long kernel runs: the kernel must still be running after them (no sync),
    and a 1 GiB block allocated and freed inside the phase must show in its peak."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.empty(2**30, dtype=torch.uint8, device=device)  # freed at once into the cache: no cudaMalloc below
    with record_phase_memory(device) as rec:
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the current stream
        t0 = time.perf_counter()
        with nvtx_range("sparse_attn.fwd"):
            block = torch.empty(2**30, dtype=torch.uint8, device=device)
            del block
        for _ in range(50):
            with nvtx_range("halo.fwd"):
                pass
        host_s = time.perf_counter() - t0
        still_running = not torch.cuda.current_stream(device).query()
    assert still_running, "reading the allocator counters waited for the device"
    assert host_s < 0.2
    row = _by_phase(rec.rows)["sparse_attn.fwd"]
    assert row.peak_bytes - row.entry_bytes >= 2**30
    assert row.exit_bytes == row.entry_bytes
    assert rec.peak_phase == "sparse_attn.fwd"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_peak_equals_the_allocator_peak_of_the_same_step():
    """The maximum over a layer step's intervals is the allocator's own peak for an identical step
    (same shapes, same allocations), and it sits inside a named phase."""
    from dsv4cp.profiling.memory import track_memory

    device = torch.device("cuda", torch.cuda.current_device())
    layer = make_layer(TINY_C, 4, seed=5, dtype=torch.float32).to(device=device, dtype=torch.bfloat16)
    pk = packed([3000, 1096]).to(device)
    x = torch.randn(pk.total, TINY_C.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)

    def step() -> None:
        result = layer(x, pk)
        (result.out.float().square().mean() + result.indexer_loss).backward()

    step()  # compile and warm the caching allocator
    with track_memory(device) as tracked:
        step()
    with record_phase_memory(device) as rec:
        step()
    assert rec.step_peak_bytes == pytest.approx(tracked.result.peak_allocated_bytes, rel=0.01)
    assert rec.peak_phase != OUTSIDE_PHASES
    print(phase_memory_frame([rec.rows]).to_string(index=False))
    print(peak_phase_line(0, rec.step_peak_bytes, rec.peak_stack))
