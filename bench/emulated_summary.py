"""Per-rank compute time and peak memory of emulated CP ranks against CP = 1, from profile records.

    python -m bench.emulated_summary CP1_RUN LABEL=RUN [LABEL=RUN ...]

``CP1_RUN``: the run directory of a real CP = 1 profile. Each ``LABEL=RUN``: a run directory holding
one ``dsv4cp profile --cp N --emulate-rank R`` record per rank of one configuration (its latest
record per rank is used). Prints, per configuration, every rank's compute time and peak memory, the
max/mean of the compute times, and max-rank time and peak over CP = 1's. Communication is NOT in
these times (emulated ranks run their collectives as no-ops): max-rank time / CP = 1 is a lower
bound of the real CP = N / CP = 1 step-time ratio.
"""

from __future__ import annotations

import sys

from dsv4cp.records import read_records


def _latest_ok(run: str) -> list[dict]:
    records = [r for r in read_records(run) if r["status"] == "ok"]
    if not records:
        raise SystemExit(f"{run}: no record with status ok")
    return records


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        raise SystemExit(__doc__)
    cp1 = [r for r in _latest_ok(argv[0]) if r["cp"] == 1 and r["emulated_rank"] is None]
    if not cp1:
        raise SystemExit(f"{argv[0]}: no real CP = 1 record")
    base = cp1[-1]
    base_ms, base_peak = base["time_ms_median"], base["peak_allocated_bytes"][0]
    print(f"CP = 1 (real): {base_ms:.1f} ms, peak {base_peak / 2**30:.2f} GiB  [{base['point_id']}]")
    print("emulated ranks: compute time and memory only, communication NOT measured")
    for item in argv[1:]:
        label, run = item.split("=", 1)
        per_rank: dict[int, dict] = {}
        for record in _latest_ok(run):
            if record["emulated_rank"] is not None:
                per_rank[record["emulated_rank"]] = record  # the latest record of each rank
        if not per_rank:
            print(f"{label}: no emulated record in {run}")
            continue
        cp = next(iter(per_rank.values()))["cp"]
        missing = sorted(set(range(cp)) - set(per_rank))
        ranks = sorted(per_rank)
        times = [per_rank[r]["time_ms_median"] for r in ranks]
        peaks = [per_rank[r]["peak_allocated_bytes"][r] for r in ranks]
        cells = ", ".join(f"rank {r} {t:.1f} ms / {p / 2**30:.2f} GiB" for r, t, p in zip(ranks, times, peaks))
        print(f"{label} (cp {cp}, partition {per_rank[ranks[0]]['partition']}): {cells}")
        if missing:
            print(f"  ranks {missing} not measured: no max/mean")
            continue
        mean = sum(times) / len(times)
        print(f"  max/mean {max(times) / mean:.3f}; max-rank time / CP = 1 {max(times) / base_ms:.3f} "
              f"(compute only: a lower bound of the real ratio); max peak / CP = 1 peak "
              f"{max(peaks) / base_peak:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
