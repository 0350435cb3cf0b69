"""Run a sweep: every rank walks the same points in the same order; rank 0 records each one.

Under torchrun the launcher's ranks are used; otherwise :func:`run_sweep` spawns ``nproc`` gloo
ranks itself (:func:`dsv4cp.cp.launch.spawn`: they die with it, and a rank whose spawner is gone
writes nothing). A point of ``cp`` ranks runs on the first ``cp`` ranks (a sub-group, created by all
ranks in the same order and cached); the other ranks skip it. A point needing more ranks than there
are is recorded ``skipped: needs cp=N``.

After each point all ranks exchange their status over a separate gloo control group, so every
rank agrees whether it failed and none is left waiting in a collective its peers abandoned; the
measuring groups are created with ``point_timeout``, so a rank stuck in a collective of a failed
point gives up after that long. After a failed point the measuring groups are created afresh (a
communicator that saw a failure may be unusable). Rank 0 appends one record per point to
``RUN_DIR/records.jsonl`` as soon as the point is done; with ``resume`` the points already
recorded are skipped (and so are recorded errors, unless ``retry_errors``: then a point's new record
takes the place of its failed one, :func:`dsv4cp.records.replace_record`, so the run holds one record
per point), unless their record ran other kernel options than the point runs now: such a record moves to
``RUN_DIR/superseded.jsonl`` and the point is measured again (:func:`supersede_stale_records`). A point
that was being measured when the run died is measured again on resume; if the run died there twice, it
is recorded as an error instead (see :data:`MAX_ATTEMPTS`).

A run directory has one writer: :func:`run_sweep` holds its lock
(:class:`dsv4cp.sweeps.run_lock.RunDirLock`) from its checks to its last record, and a second sweep
into it is refused. ``meta.json`` names the spec and points of the run
(:mod:`dsv4cp.sweeps.identity`); ``resume`` with another spec is refused, naming what differs.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from dsv4cp import kernel_options
from dsv4cp.cp.launch import RankExited, init_from_env, parent_alive, spawn, under_torchrun
from dsv4cp.environment import git_sha, machine_label
from dsv4cp.harness.time import NonFiniteResult
from dsv4cp.model import Machine
from dsv4cp.model.calibration import Calibration
from dsv4cp.model.machine import this_machine
from dsv4cp.profiling.memory import is_out_of_memory
from dsv4cp.records import (
    META_FILE,
    RECORDS_FILE,
    STATUS_OK,
    STATUS_OOM,
    append_record,
    drop_partial_line,
    make_record,
    move_records,
    option_differences,
    read_records,
    replace_record,
    resolved_options,
    write_file_atomically,
    write_meta,
)
from dsv4cp.sweeps.identity import check_resume, identity_fields
from dsv4cp.sweeps.measured_split import measure_under_partition
from dsv4cp.sweeps.meta import run_meta
from dsv4cp.sweeps.run_lock import RunDirLock
from dsv4cp.sweeps.spec import Point, SweepSpec

INFLIGHT_FILE = "inflight.json"
"""RUN_DIR file naming the point being measured (and how many runs died measuring it)."""

SUPERSEDED_FILE = "superseded.jsonl"
"""RUN_DIR file of the records ``--resume`` measured again because their point now runs other kernel
options (kept, never read as part of the run: ``dsv4cp report RUN_DIR/superseded.jsonl`` shows them)."""

MAX_ATTEMPTS = 2
"""A point that was being measured when the run died this many times (a hang past the timeout that
tore the process down, a crash) is recorded as :data:`CRASHED_STATUS` on the next resume instead of
being measured again; once could be a kill or a preemption, so it is retried."""

CRASHED_STATUS = (f"error: the run died while measuring this point {MAX_ATTEMPTS} times "
                  "(crash, kill or collective timeout)")

CONTROL_TIMEOUT_FACTOR = 10
"""The status exchange waits for the slowest rank's whole point (measuring, tracing, checking):
its timeout is this many point timeouts."""


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    """How to run a sweep (the ``dsv4cp sweep`` flags)."""

    out: Path
    """The run directory: ``records.jsonl``, ``meta.json``, ``traces/<point_id>/``."""
    resume: bool = False
    retry_errors: bool = False
    profile: bool = False
    memory_snapshot: bool = False
    """With ``profile``: each point's CUDA allocator history beside its traces."""
    nsys: bool = False
    check: bool = False
    point_timeout_s: float = 600.0
    dist_backend: str = "gloo"
    progress: bool = False
    machine: Machine | None = field(default_factory=this_machine)
    """The bounds' ceilings (``--machine``); None: no bound (a GPU without a preset)."""
    calibration: Calibration | None = None
    """Phase factors the ``balanced`` points' split uses (``--calibration``); None: the model's bounds."""


@dataclass(frozen=True)
class SweepSummary:
    """What rank 0 saw: counts of points by outcome."""

    recorded: int
    ok: int
    failed: int
    """Recorded by this run as ``error: ...`` or ``oom``."""
    skipped: int
    resumed: int
    parity_failed: int
    resumed_failed: int
    """Already recorded as ``error: ...`` or ``oom`` by the run resumed (and not retried)."""

    @property
    def any_failed(self) -> bool:
        """Whether a point of the run ended in an error or out of memory."""
        return self.failed + self.resumed_failed > 0


def _is_failure(status: str) -> bool:
    return status == STATUS_OOM or status.startswith("error")


def recorded_statuses(out: Path, retry_errors: bool, points: Sequence[Point] = ()) -> dict[str, str]:
    """Point id -> recorded status of the points in ``out``'s records that a resumed run skips: of the
    ``points``, those whose record ran every kernel option as the point runs it now (the others are
    measured again: :func:`supersede_stale_records`)."""
    now = _options_now(points)
    done, problems = {}, []
    for record in read_records(out / RECORDS_FILE, problems):
        if retry_errors and record["status"].startswith("error"):
            continue
        current = now.get(record["point_id"])
        if current is not None and option_differences(resolved_options(record), current):
            continue
        done[record["point_id"]] = record["status"]
    for problem in problems:  # an invalid line records nothing: its point is measured again
        print(f"--resume: skipped {problem}", file=sys.stderr)
    if problems:
        print(f"--resume: {len(problems)} invalid record line(s) skipped; their points are measured again",
              file=sys.stderr)
    return done


def _options_now(points: Sequence[Point]) -> dict[str, dict[str, str]]:
    """Point id -> every kernel option's value as the point runs now (:func:`_options_of`), computed once
    per distinct set of the points' own options."""
    by_setting: dict[tuple, dict[str, str]] = {}
    now = {}
    for point in points:
        setting = tuple(sorted((point.kernel_options or {}).items()))
        if setting not in by_setting:
            by_setting[setting] = _options_of(point)
        now[point.point_id] = by_setting[setting]
    return now


def supersede_stale_records(out: Path, points: Sequence[Point]) -> int:
    """Move the records of ``out`` whose point ran other kernel options than it runs now (a default changed,
    an option was added or removed, a ``DSV4CP_*`` variable differs) to ``RUN_DIR/superseded.jsonl``, so
    that ``--resume`` measures those points again and the run holds one configuration per point; says on
    stderr, in one line, how many and which options differ. Returns how many moved."""
    now = _options_now(points)
    differing: dict[str, set[str]] = {}

    def stale(record: dict) -> bool:
        current = now.get(record["point_id"])
        found = {} if current is None else option_differences(resolved_options(record), current)
        for name, (old, new) in found.items():
            differing.setdefault(name, set()).add(f"{old} -> {new}")
        return bool(found)

    moved = move_records(out / RECORDS_FILE, out / SUPERSEDED_FILE, stale)
    if moved:
        named = "; ".join(f"{name} {', '.join(sorted(changes))}" for name, changes in sorted(differing.items()))
        print(f"--resume: {moved} recorded point(s) ran other kernel options than they run now ({named}): "
              f"measuring them again; their records moved to {out / SUPERSEDED_FILE}", file=sys.stderr)
    return moved


def check_out_dir(out: Path, resume: bool) -> None:
    """Refuse to mix a new run into a run directory that already holds records (before launching)."""
    records = out / RECORDS_FILE
    if not resume and records.exists() and records.stat().st_size > 0:
        raise ValueError(f"--out: {out} already holds {RECORDS_FILE}; pass --resume to continue it, "
                         f"or choose another directory")


def run_sweep(spec: SweepSpec, points: Sequence[Point], options: SweepOptions,
              nproc: int | None = None) -> SweepSummary:
    """Run ``spec`` (expanded once by the caller into ``points``, each checked with
    :func:`~dsv4cp.sweeps.spec.check_points_can_run`) on torchrun's ranks, or on ``nproc`` spawned gloo
    ranks (default: the largest cp of the points still to measure; none are started when every point is
    already recorded).

    Rank 0 (the only one outside torchrun) holds the run directory's lock throughout; before anything
    is measured it refuses a directory another sweep holds, records without ``resume``, and with
    ``resume`` a run of another spec (:func:`dsv4cp.sweeps.identity.check_resume`)."""
    rank = int(os.environ.get("RANK", "0")) if under_torchrun() else 0
    with RunDirLock(options.out) if rank == 0 else contextlib.nullcontext() as lock:
        if lock is not None and lock.taken_over is not None:
            print(f"sweep: {options.out}: taking over the lock of a run that died ({lock.taken_over.describe()})",
                  file=sys.stderr)
        run_id = uuid.uuid4().hex  # stamps this run's in-flight marks: only those are taken back on a stop
        try:
            return _run_holding_lock(spec, points, options, nproc, run_id)
        except KeyboardInterrupt:  # stopped by the user (SIGINT, SIGTERM, SIGHUP): every recorded point stays
            if rank == 0:  # the lock holder, when the stop reaches it (its spawned ranks have exited by then)
                _unmark_interrupted(options.out, run_id)  # the point in flight did not kill the run
            raise


def _run_holding_lock(spec: SweepSpec, points: Sequence[Point], options: SweepOptions,
                      nproc: int | None, run_id: str) -> SweepSummary:
    """:func:`run_sweep`'s work once rank 0 holds the run directory's lock (``run_id``: see :func:`sweep_rank`)."""
    check_out_dir(options.out, options.resume)
    if options.resume:
        check_resume(options.out, dict(spec.source), [point.point_id for point in points])
    if under_torchrun():
        device = init_from_env(options.dist_backend)
        try:
            return sweep_rank(dist.get_rank(), dist.get_world_size(), device, spec, points, options, run_id)
        finally:
            dist.destroy_process_group()
    done = recorded_statuses(options.out, options.retry_errors, points) if options.resume else {}
    pending = [point for point in points if point.point_id not in done]
    if not pending:  # nothing left to measure: no ranks to start
        failed_before = sum(_is_failure(done[point.point_id]) for point in points)
        return SweepSummary(recorded=0, ok=0, failed=0, skipped=0, resumed=len(points), parity_failed=0,
                            resumed_failed=failed_before)
    world = nproc or max(point.cp for point in pending)
    if world == 1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return sweep_rank(0, 1, device, spec, points, options, run_id)
    try:
        return spawn(sweep_rank, world, spec, points, options, run_id, backend=options.dist_backend)[0]
    except RankExited as err:
        raise RankExited(f"{err}; the points recorded so far are kept in {options.out}: --resume "
                         "continues the run") from None


def _mark_inflight(out: Path, point_id: str, run_id: str) -> None:
    """Note (atomically) that run ``run_id`` is measuring ``point_id``, counting the attempts across resumes."""
    previous = _read_inflight(out)
    attempts = previous["attempts"] + 1 if previous and previous["point_id"] == point_id else 1
    _write_inflight(out, point_id, attempts, run_id)


def _unmark_interrupted(out: Path, run_id: str) -> None:
    """Take back the attempt a stop signal ended: the user stopped the point, it did not kill the run, so it
    must not count towards :data:`MAX_ATTEMPTS`. Only an attempt run ``run_id`` added: a stop before this
    run marked anything leaves an earlier run's death counted."""
    inflight = _read_inflight(out)
    if inflight is None or inflight.get("run_id") != run_id:
        return
    if inflight["attempts"] > 1:
        _write_inflight(out, inflight["point_id"], inflight["attempts"] - 1, None)
    else:
        (out / INFLIGHT_FILE).unlink(missing_ok=True)


def _write_inflight(out: Path, point_id: str, attempts: int, run_id: str | None) -> None:
    """``run_id``: the run that is measuring the point now (None: none is, the count is a previous runs')."""
    record = {"point_id": point_id, "attempts": attempts, "run_id": run_id}
    write_file_atomically(out / INFLIGHT_FILE, json.dumps(record).encode())


def _read_inflight(out: Path) -> dict | None:
    path = out / INFLIGHT_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _crashed_point(out: Path, done: set[str]) -> str | None:
    """The point a resumed run records as :data:`CRASHED_STATUS` instead of measuring: the one that
    was being measured when the run died, :data:`MAX_ATTEMPTS` times in a row."""
    inflight = _read_inflight(out)
    if inflight and inflight["attempts"] >= MAX_ATTEMPTS and inflight["point_id"] not in done:
        return inflight["point_id"]
    return None


class _Groups:
    """Measuring sub-groups by cp, created on first use by every rank in the same order."""

    def __init__(self, world: int, backend: str, timeout: datetime.timedelta):
        self.world, self.backend, self.timeout = world, backend, timeout
        self.cache: dict[int, dist.ProcessGroup | None] = {}

    def get(self, cp: int) -> dist.ProcessGroup | None:
        if self.world == 1:
            return None
        if cp not in self.cache:
            self.cache[cp] = dist.new_group(list(range(cp)), timeout=self.timeout, backend=self.backend)
        return self.cache[cp]

    def renew(self) -> None:
        """Forget every group: the next points get fresh communicators."""
        self.cache.clear()


def _check_parent() -> None:
    """Stop a spawned rank whose spawner died before it writes anything: its records would land in a
    run directory another sweep may now hold (the kernel kills such a rank too, a moment later)."""
    if not parent_alive():
        raise RuntimeError("the process that spawned this rank is gone: stopping without writing")


def sweep_rank(rank: int, world: int, device: torch.device, spec: SweepSpec, points: Sequence[Point],
               options: SweepOptions, run_id: str = "") -> SweepSummary:
    """One rank's part of the sweep of ``points`` (all ranks call it with the same ones; only rank 0 writes).
    ``run_id``: the lock holder's name for this run, stamped on each point rank 0 marks in flight, so that
    a stop takes back this run's attempt only (:func:`run_sweep`)."""
    distributed = world > 1
    timeout = datetime.timedelta(seconds=options.point_timeout_s)
    control = dist.new_group(backend="gloo", timeout=timeout * CONTROL_TIMEOUT_FACTOR) if distributed else None
    groups = _Groups(world, options.dist_backend, timeout)
    done: dict[str, str] = {}
    retried: set[str] = set()  # recorded as errors, measured again: their new records replace the failed ones
    crashed: str | None = None
    if rank == 0:
        _check_parent()
        options.out.mkdir(parents=True, exist_ok=True)
        if options.resume:
            drop_partial_line(options.out / RECORDS_FILE)
            supersede_stale_records(options.out, points)
            done = recorded_statuses(options.out, options.retry_errors, points)
            if options.retry_errors:
                retried = {record["point_id"] for record in read_records(options.out / RECORDS_FILE, [])
                           if record["status"].startswith("error")} - set(done)
        if not (options.resume and (options.out / META_FILE).exists()):
            identity = identity_fields(dict(spec.source), [point.point_id for point in points])
            write_meta(options.out, {**run_meta(world, device, dict(spec.source)), **identity})
        crashed = _crashed_point(options.out, set(done)) if options.resume else None
    if distributed:
        shared = [done, crashed]
        dist.broadcast_object_list(shared, src=0, group=control)
        done, crashed = shared
    machine, sha = machine_label(device, world), git_sha() if rank == 0 else None
    counts = dict(recorded=0, ok=0, failed=0, skipped=0, resumed=0, parity_failed=0, resumed_failed=0)
    bar = tqdm(total=len(points), disable=not (options.progress and rank == 0), unit="point", file=sys.stderr)
    try:
        for index, point in enumerate(points):
            bar.set_postfix_str(point.label())
            if point.point_id in done:
                counts["resumed"] += 1
                counts["resumed_failed"] += _is_failure(done[point.point_id])
                bar.update()
                continue
            if point.cp > world:
                status, error, metrics, columns = f"skipped: needs cp={point.cp}", None, {}, {}
            elif point.point_id == crashed:
                status, error, metrics, columns = CRASHED_STATUS, None, {}, {}
            else:
                if rank == 0:
                    _check_parent()
                    _mark_inflight(options.out, point.point_id, run_id)
                status, error, metrics, columns = _run_point(point, rank, device, groups, control, spec, options)
            if rank == 0:
                columns.setdefault("kernel_options", _options_of(point))  # a point not measured: what it would run
                record = make_record(point.axes(), metrics, sweep=spec.name, status=status, machine=machine,
                                     git_sha=sha, error=error, **columns)
                _check_parent()
                if point.point_id not in retried or not replace_record(options.out / RECORDS_FILE, record):
                    append_record(options.out / RECORDS_FILE, record)
                (options.out / INFLIGHT_FILE).unlink(missing_ok=True)
                counts["recorded"] += 1
                kind = "ok" if status == STATUS_OK else "skipped" if status.startswith("skipped") else "failed"
                counts[kind] += 1
                if any(not row["passed"] for row in metrics.get("parity") or []):
                    counts["parity_failed"] += 1
                bar.write(_line(index, len(points), point, record))
            bar.update()
    finally:
        bar.close()
    return SweepSummary(**counts)


def _options_of(point: Point) -> dict[str, str]:
    """Every kernel option's value with ``point``'s own in force (:func:`dsv4cp.kernel_options.resolved`)."""
    with kernel_options.overrides(point.kernel_options or {}):
        return kernel_options.resolved()


def _run_point(point: Point, rank: int, device: torch.device, groups: _Groups, control, spec: SweepSpec,
               options: SweepOptions) -> tuple[str, str | None, dict, dict]:
    """Measure ``point`` on the first ``point.cp`` ranks; every rank returns the agreed outcome: status,
    error, metrics and the record's other measured columns (:func:`dsv4cp.records.make_record` keywords)."""
    group = groups.get(point.cp)
    outcome: tuple[str, str | None] = (STATUS_OK, None)
    metrics: dict = {}
    columns: dict = {}
    if rank < point.cp:
        trace_dir = options.out / "traces" / point.point_id if options.profile else None
        try:
            measurement = measure_under_partition(point, group, device, spec.run, machine=options.machine,
                                                  trace_dir=trace_dir, nsys=options.nsys, check=options.check,
                                                  calibration=options.calibration,
                                                  memory_snapshot=options.memory_snapshot)
            metrics = measurement.metrics
            columns = {"resolved_backends": measurement.resolved_backends,
                       "kernel_options": measurement.kernel_options, "backends": measurement.backends}
        except Exception as err:  # recorded, and the sweep goes on: one bad point must not end a run
            status = STATUS_OOM if is_out_of_memory(err) else f"error: {type(err).__name__}: {_first_line(err)}"
            if isinstance(err, NonFiniteResult):  # "error: non-finite output, ... on rank r"
                status = f"error: {_first_line(err)}"
            outcome = (status, f"rank {rank}: {_first_line(err)}")
        if device.type == "cuda" and outcome[0] != STATUS_OK:
            torch.cuda.empty_cache()
    outcomes = [outcome]
    if control is not None:
        outcomes = [None] * dist.get_world_size(control)
        dist.all_gather_object(outcomes, outcome, group=control)
    failed = [o for o in outcomes[: point.cp] if o[0] != STATUS_OK]
    if not failed:
        return STATUS_OK, None, metrics, columns
    groups.renew()
    return _root_cause(failed)[0], "; ".join(o[1] for o in failed), {}, {}


def _root_cause(failed: list[tuple[str, str]]) -> tuple[str, str]:
    """The outcome that names why a point failed: an OOM, else an error other than a collective
    timeout (a rank that timed out was waiting for the rank that failed), else the first one."""
    ooms = [o for o in failed if o[0] == STATUS_OOM]
    causes = [o for o in failed if "timed out" not in o[0].lower() and "timeout" not in o[0].lower()]
    return (ooms or causes or failed)[0]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def _line(index: int, total: int, point: Point, record: dict) -> str:
    """One printed line per recorded point."""
    status = record["status"]
    if status == STATUS_OK:
        bounds = [f"{record[column]:.3g} ms at the {words}" for column, words in (
            ("bound_ms", "physical limits"), ("bound_measured_ms", "measured ceilings")) if record[column] is not None]
        status = f"{record['time_ms_median']:.4g} ms" + (f" (model bound {', '.join(bounds)})" if bounds else "")
    return f"[{index + 1}/{total}] {point.point_id} {point.label()}: {status}"


def default_nproc(points: Sequence[Point]) -> int:
    """Ranks to spawn without torchrun for a new run: the largest cp of its points."""
    return max(point.cp for point in points)
