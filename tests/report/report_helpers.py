"""Synthetic run directories for the report and compare tests, written with ``dsv4cp.records``.

Times follow a simple model with seeded multiplicative noise, so every figure is random (never all
equal, never zero) yet reproducible: T = base_ms * tokens/65536 * (1/cp + comm share) * (1 + noise).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from dsv4cp.records import append_record, make_record, point_id, write_meta

GIB = 2**30
PHASE_NAMES = ("dsv4cp.q_proj.fwd", "dsv4cp.allgather.kv.launch", "dsv4cp.sparse_attn.fwd", "dsv4cp.sparse_attn.bwd")


def _phases(rng: np.random.Generator, time_ms: float, cp: int, overlap: str) -> list[dict]:
    """Rank 0's overlap rows: compute split over phases, communication only in the all-gather."""
    shares = rng.dirichlet(np.ones(len(PHASE_NAMES) - 1))
    comm = 0.0 if cp == 1 else 0.08 * time_ms
    hidden = 0.9 if overlap == "async" else 0.1
    rows = []
    compute_iter = iter(shares * time_ms * 0.9)
    for name in PHASE_NAMES:
        is_comm = "allgather" in name
        c = comm if is_comm else 0.0
        rows.append({
            "rank": 0, "phase": name, "compute_ms": 0.0 if is_comm else float(next(compute_iter)),
            "comm_ms": c, "overlap_ms": c * hidden, "overlap_ratio": hidden if c > 0 else float("nan"),
            "exposed_comm_ms": c * (1 - hidden), "idle_ms": float(rng.uniform(0.01, 0.1)),
        })
    total_comm = sum(r["comm_ms"] for r in rows)
    rows.append({
        "rank": 0, "phase": "total", "compute_ms": sum(r["compute_ms"] for r in rows), "comm_ms": total_comm,
        "overlap_ms": total_comm * hidden, "overlap_ratio": hidden if total_comm > 0 else float("nan"),
        "exposed_comm_ms": total_comm * (1 - hidden), "idle_ms": 0.3,
    })
    return rows


def point_metrics(rng: np.random.Generator, axes: dict, *, slowdown: float = 1.0, noise: float = 0.01,
                  profiled: bool = True) -> dict:
    """Metrics of one point in the ``records.METRICS`` schema, scaled by ``slowdown``."""
    cp, tokens = axes["cp"], axes["tokens"]
    comm_share = 0.0 if cp == 1 else (0.02 if axes.get("overlap") == "async" else 0.08)
    median = 400.0 * tokens / 65536 * (1.0 / cp + comm_share) * slowdown * (1 + noise * rng.standard_normal())
    ranks = [median * (1 + 0.05 * rng.random()) for _ in range(cp)]
    bound = median / (4.0 + rng.random())
    flops = 8e13 * tokens / 65536
    metrics = {
        "time_ms_median": median, "time_ms_p20": median * (1 - noise), "time_ms_p80": median * (1 + noise),
        "rank_time_ms_median": ranks, "imbalance_max_over_mean": max(ranks) / (sum(ranks) / cp),
        "tokens_per_s": tokens / (median / 1e3), "tflops_per_gpu": flops / cp / (median / 1e3) / 1e12,
        "mfu": flops / cp / (median / 1e3) / 7e14, "model_flops": flops, "bound_ms": bound,
        "measured_over_bound": median / bound,
        "peak_allocated_bytes": [int(50 * GIB * tokens / 65536 / cp * (1 + 0.02 * rng.random())) for _ in range(cp)],
        "device_used_bytes": [int(60 * GIB * tokens / 65536 / cp) for _ in range(cp)],
    }
    if profiled:
        phases = _phases(rng, median, cp, axes.get("overlap", "async"))
        total = phases[-1]
        metrics.update(phases=phases, comm_ms=total["comm_ms"], exposed_comm_ms=total["exposed_comm_ms"],
                       overlap_ratio=total["overlap_ratio"])
    return metrics


BASE_AXES = {"preset": "flash", "ratio": 4, "pass": "fwd+bwd", "dtype": "bf16", "loss": "sparse",
             "kernel_backend": "auto", "recompute": False, "seed": 0, "partition": "equal"}


def grid(**axes: list) -> list[dict]:
    """Cartesian product of the given axes over ``BASE_AXES``, with ``tokens_per_rank`` filled."""
    names = list(axes)
    points = []
    for values in itertools.product(*axes.values()):
        point = {**BASE_AXES, **dict(zip(names, values))}
        point["tokens_per_rank"] = point["tokens"] // point["cp"]
        points.append(point)
    return points


def write_run(run_dir: Path, points: list[dict], *, seed: int, machine: str = "2xNVIDIA H200",
              slowdown: dict[str, float] | None = None, statuses: dict[int, str] | None = None,
              noise: float = 0.01, profiled: bool = True, targets: list[dict] | None = None) -> Path:
    """A run directory with one record per point (``statuses``: index -> non-ok status) and meta.

    ``slowdown`` maps a point_id to a time factor; the same ``seed`` gives the same noise, so two runs
    written with one seed differ exactly by their slowdowns. ``targets``: the spec's ``targets:`` list
    recorded in meta.json (what the report judges)."""
    rng = np.random.default_rng(seed)
    for index, axes in enumerate(points):
        status = (statuses or {}).get(index, "ok")
        factor = (slowdown or {}).get(point_id(axes), 1.0)
        metrics = point_metrics(rng, axes, slowdown=factor, noise=noise, profiled=profiled) if status == "ok" else {}
        record = make_record(axes, metrics, sweep="synthetic", status=status, machine=machine, git_sha="0" * 40,
                             error=None if status == "ok" else status)
        append_record(run_dir / "records.jsonl", record)
    write_meta(run_dir, {"machine": machine, "gpu_name": "NVIDIA H200" if "H200" in machine else None,
                         "gpu_count": 2, "git_sha": "0" * 40, "git_dirty": False,
                         "spec": {"name": "synthetic", **({"targets": targets} if targets else {})}})
    return run_dir


SCALING_POINTS = grid(cp=[1, 2], tokens=[16384, 65536], overlap=["none", "async"], packing=["histogram", "one"])
"""A strong-scaling sweep including the strong-scaling target configuration (64K, histogram, async)."""

TIME_RATIO_TARGET = {"name": "CP = 2 time / CP = 1 time", "metric": "time_ratio", "pair": {"cp": [2, 1]},
                     "where": {"tokens": 65536}, "comparison": "<=", "value": 0.55}
"""A pair target as a spec declares it."""
