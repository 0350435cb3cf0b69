"""Where a traced step left the GPU idle, and which host code it waited for (a Kineto trace of ``profile
--trace-dir``, one rank).

Every gap between the end of the device's previous work (kernels, copies, memsets) and the start of the
next is charged to the next piece of work. When that work was launched after the gap opened, the device
waited for the host: the gap goes to the host op that launched it (its innermost ``cpu_op``; with
``--stack``, the chain of enclosing ``cpu_op`` names) and to its phase (innermost ``dsv4cp.*`` range).
Otherwise the gap is the device's own (e.g. a stream wait) and is listed as such.

Prints idle per phase, per launching op, and the largest gaps with the host ops that ran between the
previous work's end and the late launch (what the host was busy with).

    python -m bench.idle_gaps results/.../trace-auto/rank0.json.gz [--top 25] [--min-us 5] [--stack]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from dataclasses import dataclass

_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCHES = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class _Span:
    name: str
    start: float  # us
    end: float
    tid: object


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def _spans(events: list[dict], cats: tuple[str, ...]) -> list[tuple[dict, _Span]]:
    return [(e, _Span(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("tid")))
            for e in events if e.get("cat") in cats and e.get("ph") == "X"]


class _Enclosing:
    """Innermost spans (of one thread) containing a time: spans sorted by start, scanned backwards."""

    def __init__(self, spans: list[_Span]) -> None:
        self.by_tid: dict[object, list[_Span]] = defaultdict(list)
        for s in sorted(spans, key=lambda s: (s.start, -s.end)):
            self.by_tid[s.tid].append(s)
        self.starts = {tid: [s.start for s in ss] for tid, ss in self.by_tid.items()}

    def chain(self, tid, t: float) -> list[_Span]:
        """Spans of ``tid`` containing ``t``, outermost first."""
        spans, starts = self.by_tid.get(tid, []), self.starts.get(tid, [])
        found = [s for s in spans[: bisect.bisect_right(starts, t)] if s.end >= t]
        return sorted(found, key=lambda s: (s.start, -s.end))

    def during(self, tid, lo: float, hi: float) -> list[_Span]:
        """Outermost spans of ``tid`` overlapping ``[lo, hi]``."""
        spans, starts = self.by_tid.get(tid, []), self.starts.get(tid, [])
        out: list[_Span] = []
        for s in spans[: bisect.bisect_right(starts, hi)]:
            if s.end > lo and not any(o.start <= s.start and s.end <= o.end for o in out):
                out.append(s)
        return out


def analyse(path: str, min_us: float, top: int, stack: bool) -> str:
    events = _load(path)
    work = sorted(_spans(events, _DEVICE_WORK), key=lambda p: p[1].start)
    launches = {e["args"].get("correlation"): s for e, s in _spans(events, _LAUNCHES)}
    ops = _Enclosing([s for _, s in _spans(events, ("cpu_op",))])
    phases = _Enclosing([s for _, s in _spans(events, ("user_annotation",)) if s.name.startswith("dsv4cp.")])
    by_phase: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    device_own = 0.0
    gaps = []
    busy_until = None
    for event, span in work:
        if busy_until is not None and span.start > busy_until:
            gap = span.start - busy_until
            launch = launches.get(event.get("args", {}).get("correlation"))
            if launch is None or launch.start <= busy_until:
                device_own += gap
            else:
                chain = ops.chain(launch.tid, launch.start)
                op = " > ".join(s.name for s in chain) if stack else (chain[-1].name if chain else "(no op)")
                phase_chain = phases.chain(launch.tid, launch.start)
                phase = phase_chain[-1].name if phase_chain else "(no phase)"
                by_phase[phase] += gap
                by_op[op] += gap
                if gap >= min_us:
                    busy = ops.during(launch.tid, busy_until, launch.start)
                    gaps.append((gap, phase, op, span.name, busy))
        busy_until = span.end if busy_until is None else max(busy_until, span.end)
    total = sum(by_phase.values())
    lines = [f"device idle waiting for the host: {total / 1e3:.3f} ms; idle with the next work already "
             f"launched: {device_own / 1e3:.3f} ms", "", "per phase (ms):"]
    lines += [f"  {v / 1e3:8.3f}  {k}" for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])]
    lines += ["", "per launching host op (ms):"]
    lines += [f"  {v / 1e3:8.3f}  {k}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]]
    lines += ["", f"largest gaps (us) >= {min_us}: phase | launching op | next work | host ops meanwhile"]
    for gap, phase, op, name, busy in sorted(gaps, key=lambda g: -g[0])[:top]:
        meanwhile = ", ".join(f"{s.name} {s.end - s.start:.0f}" for s in busy[:6])
        lines.append(f"  {gap:8.1f}  {phase} | {op} | {name[:60]} | {meanwhile}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Kineto trace (.json or .json.gz) of one rank")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--min-us", type=float, default=5.0)
    parser.add_argument("--stack", action="store_true", help="charge gaps to the chain of enclosing host ops")
    args = parser.parse_args(argv)
    try:
        print(analyse(args.trace, args.min_us, args.top, args.stack))
    except (OSError, ValueError, KeyError) as err:
        print(f"trace: cannot read {args.trace}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
