"""Context-parallel communication microbenchmarks on 2 ranks (DESIGN 3.2, 3.4, 3.7): the halo exchange,
the all-gather of compressed KV and indexer keys with its backward reduce-scatter, and the MTP rolls,
each through the project's own differentiable op (:mod:`dsv4cp.cp.comm`, :mod:`dsv4cp.cp.mtp`).

Cases (``overlap="none"``: every call completes its collective):

* ``halo.fwd`` / ``halo.fwd_bwd``: :func:`exchange_halo` of ``x [L, hidden]`` by ``Hw`` rows (the C
  layer's halo), then the backward that returns the halo's gradient;
* ``allgather.kv.*`` / ``allgather.index_k.*``: :func:`all_gather_rows` of ``[capacity, D]`` (resp.
  ``Di``) compressed rows and ``.wait()``; ``fwd_bwd`` adds the backward, a reduce-scatter of the
  gathered rows' gradient;
* ``mtp.roll_left.fwd``: :func:`roll_left` of five token fields (ids, labels, positions, loss and padding
  masks) by one row; ``mtp.roll_hidden.fwd_bwd``: :func:`roll_hidden_left` of ``h [L, hidden]`` and its
  backward.

Shapes (T tokens of one document over 2 ranks, L = T / 2 rows per rank, C layer ratio 4):

* ``flash``: the flash preset (hidden 4096, D 512, Di 128, Hw 128), T = 16384, bf16, 2 NCCL ranks
  (GPU only, needs 2 GPUs);
* ``tiny``:  the tiny preset (hidden 64, D 32, Di 16, Hw 8), T = 64, fp32, 2 gloo ranks on CPU (2 NCCL
  ranks where 2 GPUs exist).

How the times are taken: a module-scoped fixture spawns the 2 ranks once per shape
(:func:`dsv4cp.cp.launch.spawn`) and times every case INSIDE the ranks with
:func:`dsv4cp.profiling.timing.benchmark` (DESIGN 5: warm-up, a barrier before every repetition, CUDA
events or ``perf_counter``, then the max over ranks of each repetition). Each test hands those times to
pytest-benchmark through ``benchmark.extra_info`` (``median_ms``, ``p20_ms``, ``p80_ms``, ``times_ms``),
which ``dsv4cp compare`` reads in preference to pytest-benchmark's ``stats``. pytest-benchmark's own
``stats`` time only the parent's hand-over of the finished result (microseconds): the parent process is
not a rank and cannot time a collective; read them as bookkeeping, never as the collective's cost.

GB/s: the bytes one rank receives in the case (``bytes`` in ``extra_info``; forward plus backward for
``fwd_bwd``) over the median time, i.e. NCCL's algorithm bandwidth. The cases compute nothing (0 FLOPs).
Spawning the ranks costs a few seconds on CPU, paid by the first test of each shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from bench.common import GPU_ONLY, HAS_CUDA
from dsv4cp.config import INDEXER_RATIO, DSv4Config
from dsv4cp.cp.comm import all_gather_rows, exchange_halo
from dsv4cp.cp.launch import spawn
from dsv4cp.cp.layout import entry_capacity, halo_rows
from dsv4cp.cp.mtp import roll_hidden_left, roll_left
from dsv4cp.environment import machine_label
from dsv4cp.packing import PackedSeqs
from dsv4cp.profiling.timing import benchmark as time_in_ranks

WORLD = 2
TWO_GPUS = HAS_CUDA and torch.cuda.device_count() >= WORLD


@dataclass(frozen=True)
class Shape:
    name: str
    preset: str
    tokens: int


SHAPES = {"tiny": Shape("tiny", "tiny", 64), "flash": Shape("flash", "flash", 16384)}
SHAPE_PARAMS = [
    pytest.param("tiny", id="tiny"),
    pytest.param("flash", id="flash", marks=[*GPU_ONLY, pytest.mark.skipif(not TWO_GPUS, reason="needs 2 GPUs")]),
]
CASES = ("halo.fwd", "halo.fwd_bwd", "allgather.kv.fwd", "allgather.kv.fwd_bwd", "allgather.index_k.fwd",
         "allgather.index_k.fwd_bwd", "mtp.roll_left.fwd", "mtp.roll_hidden.fwd_bwd")


def _dist_backend() -> str:
    return "nccl" if TWO_GPUS else "gloo"


def _reps() -> tuple[int, int]:
    """(timed repetitions, warm-up calls) per case."""
    return (20, 5) if TWO_GPUS else (5, 2)


def _rows(rank: int, tag: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s seeded random rows: any rank can rebuild a peer's to check what it received."""
    generator = torch.Generator().manual_seed(1000 * tag + rank)
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def _rank_cases(rank: int, world: int, device: torch.device, shape_name: str) -> dict[str, dict]:
    """Runs on every rank: checks each case's result once, then times it (max over ranks)."""
    shape = SHAPES[shape_name]
    cfg = DSv4Config.preset(shape.preset)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    group = dist.group.WORLD
    rows = shape.tokens // world
    halo = halo_rows(cfg, INDEXER_RATIO, world)
    capacity = entry_capacity(rows, INDEXER_RATIO)
    packed = PackedSeqs.from_lengths([shape.tokens], device=device)
    el = torch.finfo(dtype).bits // 8

    x = _rows(rank, 1, (rows, cfg.hidden), dtype, device)
    x_prev = _rows(rank - 1, 1, (rows, cfg.hidden), dtype, device) if rank > 0 else None
    grad_ext = _rows(rank, 2, (halo + rows, cfg.hidden), dtype, device)

    def halo_fwd():
        return exchange_halo(x, halo, group)

    def halo_fwd_bwd():
        leaf = x.detach().requires_grad_(True)
        exchange_halo(leaf, halo, group).backward(grad_ext)
        return leaf.grad

    cases: dict[str, tuple[Callable[[], object], float, dict]] = {
        "halo.fwd": (halo_fwd, halo * cfg.hidden * el, {"halo": halo, "hidden": cfg.hidden}),
        "halo.fwd_bwd": (halo_fwd_bwd, 2 * halo * cfg.hidden * el, {"halo": halo, "hidden": cfg.hidden}),
    }

    gathered_checks = {}
    for name, width, tag in (("kv", cfg.head_dim, 3), ("index_k", cfg.index_head_dim, 4)):
        local = _rows(rank, tag, (capacity, width), dtype, device)
        upstream = _rows(rank, tag + 10, (world * capacity, width), dtype, device)
        received = (world - 1) * capacity * width * el

        def gather_fwd(local=local, name=name):
            return all_gather_rows(local, group, "none", name=name).wait()

        def gather_fwd_bwd(local=local, upstream=upstream, name=name):
            leaf = local.detach().requires_grad_(True)
            all_gather_rows(leaf, group, "none", name=name).wait().backward(upstream)
            return leaf.grad

        info = {"capacity": capacity, "width": width}
        cases[f"allgather.{name}.fwd"] = (gather_fwd, received, info)
        cases[f"allgather.{name}.fwd_bwd"] = (gather_fwd_bwd, 2 * received, info)
        gathered_checks[name] = (gather_fwd, width, tag)

    ids_gen = torch.Generator().manual_seed(7)  # token fields: identical recipe on every rank, own slice
    token_ids = torch.randint(0, 2**15, (shape.tokens,), generator=ids_gen)[rank * rows:(rank + 1) * rows]
    fields = {
        "input_ids": token_ids.to(device), "labels": token_ids.roll(-1).to(device),
        "position_ids": torch.arange(rank * rows, (rank + 1) * rows, device=device),
        "loss_mask": torch.ones(rows, dtype=torch.bool, device=device),
        "padding_mask": torch.zeros(rows, dtype=torch.bool, device=device),
    }
    field_bytes = sum(t.element_size() for t in fields.values())
    grad_h = _rows(rank, 5, (rows, cfg.hidden), dtype, device)

    def roll_fields():
        return roll_left(fields, packed, 1, group)

    def roll_hidden_fwd_bwd():
        leaf = x.detach().requires_grad_(True)
        roll_hidden_left(leaf, packed, 1, group).backward(grad_h)
        return leaf.grad

    cases["mtp.roll_left.fwd"] = (roll_fields, field_bytes, {"fields": len(fields), "depth": 1})
    cases["mtp.roll_hidden.fwd_bwd"] = (roll_hidden_fwd_bwd, 2 * cfg.hidden * el,
                                        {"hidden": cfg.hidden, "depth": 1})
    assert tuple(cases) == CASES

    # ---- what each op delivers, checked once before timing (peers' rows rebuilt from their seeds)
    ext = halo_fwd()
    want_halo = x_prev[-halo:] if x_prev is not None else torch.zeros_like(x[:halo])
    torch.testing.assert_close(ext[:halo], want_halo, rtol=0, atol=0)
    torch.testing.assert_close(ext[halo:], x, rtol=0, atol=0)
    for gather_fwd, width, tag in gathered_checks.values():
        want = torch.cat([_rows(r, tag, (capacity, width), dtype, device) for r in range(world)])
        torch.testing.assert_close(gather_fwd(), want, rtol=0, atol=0)
    rolled = roll_fields()
    last = rank == world - 1
    torch.testing.assert_close(rolled["position_ids"][:-1], fields["position_ids"][1:])
    assert int(rolled["position_ids"][-1]) == (0 if last else (rank + 1) * rows)
    assert bool(rolled["padding_mask"][-1]) == last

    reps, warmup = _reps()
    results = {}
    for name, (fn, nbytes, info) in cases.items():
        timing = time_in_ranks(fn, warmup=warmup, reps=reps, group=group, device=device)
        results[name] = {"timing": timing.to_dict(), "bytes": float(nbytes), "info": info,
                         "device": machine_label(device), "dtype": str(dtype), "rows_per_rank": rows}
    return results


@pytest.fixture(scope="module")
def rank_results() -> Callable[[str], dict[str, dict]]:
    """``get(shape_name)``: every case's in-rank results for the shape, from one 2-rank spawn per shape."""
    cache: dict[str, dict[str, dict]] = {}

    def get(shape_name: str) -> dict[str, dict]:
        if shape_name not in cache:
            cache[shape_name] = spawn(_rank_cases, WORLD, shape_name, backend=_dist_backend())[0]
        return cache[shape_name]

    return get


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape_name", SHAPE_PARAMS)
def test_cp_comm(benchmark, rank_results, shape_name, case):
    result = rank_results(shape_name)[case]
    timing = result["timing"]
    median_ms = timing["median_ms"]
    assert timing["reps"] == _reps()[0] and median_ms > 0
    benchmark.group = f"cp_comm.{case}.{shape_name}"
    benchmark.extra_info.update(
        case=case, shape=shape_name, preset=SHAPES[shape_name].preset, tokens=SHAPES[shape_name].tokens,
        world=WORLD, dist_backend=_dist_backend(), rows_per_rank=result["rows_per_rank"], dtype=result["dtype"],
        **result["info"],
        device=result["device"], timer="in-rank max over ranks (dsv4cp.profiling.timing.benchmark)",
        rounds=timing["reps"], median_ms=median_ms, p20_ms=timing["p20_ms"], p80_ms=timing["p80_ms"],
        times_ms=timing["times_ms"], flops=0.0, bytes=result["bytes"], tflops=0.0,
        gbps=result["bytes"] / (median_ms * 1e-3) / 1e9,
    )
    benchmark.pedantic(lambda: result, rounds=1, iterations=1)  # the hand-over only (module docstring)
