"""Report tables: pure functions from the records DataFrame (``load_runs``) to DataFrames.

Every function takes all records (any status), keeps what it needs and returns a new DataFrame; an
empty result means the runs lack what the table needs (e.g. no CP = 1 point for scaling). Times are
milliseconds, memory GiB (2**30 bytes). :func:`write_table` saves one as CSV and markdown.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from dsv4cp import kernel_options as kernel_option_registry
from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import RowSplit
from dsv4cp.model import LayerEstimate, Machine, estimate
from dsv4cp.model.machine import MACHINE_PRESETS
from dsv4cp.model.partition import policy_split
from dsv4cp.profiling.memory import OUTSIDE_PHASES
from dsv4cp.profiling.overlap import COLUMNS as OVERLAP_COLUMNS
from dsv4cp.records import AXES, STATUS_OK
from dsv4cp.report.parity import parity_cell
from dsv4cp.workloads import packing_lengths

GIB = 2**30
PHASE_METRICS: tuple[str, ...] = tuple(c for c in OVERLAP_COLUMNS if c not in ("rank", "phase"))
"""Per-phase columns of a record's ``phases`` rows (the overlap table's)."""

DEFAULT_AXES: tuple[str, ...] = ("preset", "ratio", "cp", "tokens")
"""Axes shown when none varies (a run of one point)."""


# ------------------------------------------------------------------------------------------ helpers
def with_kernel_configuration(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with each record's ``kernel_options`` (every option's value as the point ran) replaced by the
    options whose value differs from today's default (None when none does): the report's tables then name
    what a point set (``{'library_compact_slots': '0'}``, not all 30 options), and a target's
    ``kernel_options`` filter matches as a sweep spec writes it (``null``: the defaults). ``compare`` keeps
    the whole mapping: there a record without an option is another configuration, not the default one."""
    if "kernel_options" not in df:
        return df
    out = df.copy()
    out["kernel_options"] = pd.Series(
        [(kernel_option_registry.non_default(v) or None) if isinstance(v, dict) else v for v in out["kernel_options"]],
        index=out.index, dtype=object)
    return out


def ok_points(df: pd.DataFrame) -> pd.DataFrame:
    """Rows with status ``ok``, with ``tokens`` and ``tokens_per_rank`` both filled where one is
    (``tokens = tokens_per_rank * cp``), so strong and weak scaling can group on either."""
    out = df[df["status"] == STATUS_OK].copy()
    per_rank = out["tokens"] / out["cp"]
    out["tokens_per_rank"] = out["tokens_per_rank"].where(out["tokens_per_rank"].notna(), per_rank)
    out["tokens"] = out["tokens"].where(out["tokens"].notna(), out["tokens_per_rank"] * out["cp"])
    return out.reset_index(drop=True)


def runs_of(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["run"]))


def varying_axes(df: pd.DataFrame) -> list[str]:
    """Axes (in ``AXES`` order, among ``df``'s columns) taking more than one value; ``run`` first when
    the rows come from several runs. Falls back to ``DEFAULT_AXES`` when nothing varies."""
    axes = [a for a in AXES if a in df and df[a].map(str).nunique() > 1]
    if not axes:
        axes = [a for a in DEFAULT_AXES if a in df]
    return (["run"] if "run" in df and df["run"].nunique() > 1 else []) + axes


def point_labels(df: pd.DataFrame, axes: list[str]) -> pd.Series:
    """``"cp=2 tokens=65536"`` per row, from the given axes (``run`` shown bare; ``tokens_per_rank``
    left out when ``tokens`` and ``cp`` are shown, as it follows from them)."""
    if {"tokens", "cp"} <= set(axes):
        axes = [a for a in axes if a != "tokens_per_rank"]

    def label(row: pd.Series) -> str:
        return " ".join(str(row[a]) if a == "run" else f"{a}={_label_value(row[a])}" for a in axes)

    return df.apply(label, axis=1) if len(df) else pd.Series([], dtype=object)


def _label_value(value: object) -> object:
    """An axis value as a label shows it: a whole float (a numeric column holding a NaN) as an int."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def hardware(df: pd.DataFrame) -> str:
    """The runs' hardware for captions: distinct ``machine`` labels (with ``gpu_name`` when known)."""
    labels = []
    for machine, gpu in df[["machine", "gpu_name"]].drop_duplicates().itertuples(index=False):
        text = str(machine) if machine is not None else "unknown machine"
        if gpu and str(gpu) not in text:
            text += f" ({gpu})"
        labels.append(text)
    return ", ".join(dict.fromkeys(labels)) or "unknown machine"


def _max_gib(values: object) -> float:
    """Largest per-rank byte count of a list metric, in GiB; NaN when unmeasured."""
    if not isinstance(values, list):
        return math.nan
    known = [v for v in values if v is not None]
    return max(known) / GIB if known else math.nan


def _spread(values: object) -> float:
    """Largest minus smallest per-rank time of a list metric; NaN unless every rank was measured (an
    emulated rank's record holds None for the others)."""
    if not isinstance(values, list) or not values or any(v is None for v in values):
        return math.nan
    return max(values) - min(values)


def group_key(df: pd.DataFrame, axes: list[str]) -> pd.Series:
    """One hashable key per row over ``axes`` (strings, so None, bools and ints group safely)."""
    keys = ["|".join(map(str, values)) for values in df[axes].itertuples(index=False)]
    return pd.Series(keys, index=df.index, dtype=object)


# ------------------------------------------------------------------------------------------ tables
def headline(df: pd.DataFrame) -> pd.DataFrame:
    """Per point (every status): the axes that vary, status, time median [p20, p80], tokens/s,
    TFLOP/s per GPU, MFU, measured/bound at the physical limits (``measured_over_bound``) and at the measured
    ceilings of ``bound_machine`` (``measured_over_measured_bound``), peak GiB (max over ranks), exposed
    comm % of comm time and parity with CP = 1 (``sweep --check``; blank when not checked), and when a
    record holds a value no measurement can (blank in its column), ``invalid``: which and why."""
    axes = varying_axes(df)
    out = df[axes + ["status"]].copy()
    for column in ("time_ms_median", "time_ms_p20", "time_ms_p80", "tokens_per_s", "tflops_per_gpu", "mfu",
                   "measured_over_bound", "measured_over_measured_bound"):
        out[column] = pd.to_numeric(df[column], errors="coerce")
    out["bound_machine"] = df["bound_machine"]  # whose ceilings measured/bound is against (None: no bound)
    out["peak_gib"] = df["peak_allocated_bytes"].map(_max_gib)
    comm = pd.to_numeric(df["comm_ms"], errors="coerce")
    exposed = pd.to_numeric(df["exposed_comm_ms"], errors="coerce")
    out["exposed_comm_pct"] = (100.0 * exposed / comm).where(comm > 0)
    out["parity"] = df["parity"].map(parity_cell)
    if "invalid" in df and df["invalid"].notna().any():  # blanked above: say which and why
        out["invalid"] = df["invalid"].map(invalid_cell)
    return out.reset_index(drop=True)


def invalid_cell(invalid: object) -> str:
    """A record's impossible values (``load_runs``' ``invalid``: metric -> why) in one cell."""
    return "; ".join(f"{name}: {why}" for name, why in invalid.items()) if isinstance(invalid, dict) else ""


def phase_breakdown(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (profiled point, rank, phase) of the points' overlap tables, plus ``busy_ms`` =
    compute + exposed comm (the phase's share of the rank's step). Points without ``phases`` are left out."""
    points = ok_points(df)
    axes = varying_axes(points)
    rows = []
    for _, point in points.iterrows():
        if not isinstance(point["phases"], list):
            continue
        for phase in point["phases"]:
            row = {a: point[a] for a in axes}
            row["rank"] = phase.get("rank", 0)
            row["phase"] = phase.get("phase")
            row.update({m: phase.get(m) for m in PHASE_METRICS})
            rows.append(row)
    out = pd.DataFrame(rows, columns=[*axes, "rank", "phase", *PHASE_METRICS])
    out[list(PHASE_METRICS)] = out[list(PHASE_METRICS)].apply(pd.to_numeric, errors="coerce")
    out["busy_ms"] = out["compute_ms"] + out["exposed_comm_ms"]
    return out


def scaling(df: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Scaling efficiency against the CP = 1 point of the same configuration.

    ``kind="strong"``: total ``tokens`` fixed; speedup T(1)/T(cp), efficiency T(1)/(cp * T(cp)).
    ``kind="weak"``: ``tokens_per_rank`` fixed; efficiency T(1)/T(cp) (speedup is not defined).
    Only configurations measured at CP = 1 and at least one other CP appear.
    """
    if kind not in ("strong", "weak"):
        raise ValueError(f"kind: must be 'strong' or 'weak', got {kind!r}")
    points = ok_points(df)
    free = {"cp", "tokens_per_rank"} if kind == "strong" else {"cp", "tokens"}
    axes = varying_axes(points)
    ratios = ["speedup", "efficiency"] if kind == "strong" else ["efficiency"]
    rows = []
    for _, group in points.groupby(group_key(points, ["run", *(a for a in AXES if a not in free)]), sort=False):
        base = group[group["cp"] == 1]
        if base.empty or group["cp"].nunique() < 2:
            continue
        t1 = float(base["time_ms_median"].iloc[0])
        for _, point in group.sort_values("cp").iterrows():
            t, cp = float(point["time_ms_median"]), int(point["cp"])
            row = {**{a: point[a] for a in axes}, "time_ms_median": t, "t1_ms": t1}
            if kind == "strong":
                row.update(speedup=t1 / t, efficiency=t1 / (cp * t))
            else:
                row.update(efficiency=t1 / t)
            rows.append(row)
    return pd.DataFrame(rows, columns=[*axes, "time_ms_median", "t1_ms", *ratios])


def overlap_comparison(df: pd.DataFrame) -> pd.DataFrame:
    """Overlap modes side by side per configuration: median time and exposed comm per mode
    (``time_ms_median[none]``, ...), and ``async_speedup`` = T(none) / T(async) where both were
    measured. Only configurations measured in two or more modes appear."""
    points = ok_points(df)
    shown = [a for a in varying_axes(points) if a != "overlap"]
    rows = []
    key = group_key(points, ["run", *(a for a in AXES if a != "overlap")])
    for _, group in points.groupby(key, sort=False):
        if group["overlap"].nunique() < 2:
            continue
        row = {a: group[a].iloc[0] for a in shown}
        for _, point in group.iterrows():
            row[f"time_ms_median[{point['overlap']}]"] = point["time_ms_median"]
            row[f"exposed_comm_ms[{point['overlap']}]"] = point["exposed_comm_ms"]
        if "time_ms_median[none]" in row and "time_ms_median[async]" in row:
            row["async_speedup"] = row["time_ms_median[none]"] / row["time_ms_median[async]"]
        rows.append(row)
    return pd.DataFrame(rows)


def _groups_varying_in(df: pd.DataFrame, axis: str):
    """``(shown, group)`` per configuration of the ok points that agree on every axis but ``axis``:
    ``shown`` the values of the other varying axes (the table's key columns), ``group`` its points."""
    points = ok_points(df)
    shown = [a for a in varying_axes(points) if a != axis]
    for _, group in points.groupby(group_key(points, ["run", *(a for a in AXES if a != axis)]), sort=False):
        yield {a: group[a].iloc[0] for a in shown}, group


def _time_and_memory(row: dict, point: pd.Series, name: str) -> None:
    row[f"time_ms_median[{name}]"] = point["time_ms_median"]
    row[f"peak_gib[{name}]"] = _max_gib(point["peak_allocated_bytes"])


def _ratios(row: dict, base: str, other: str) -> None:
    row["time_ratio"] = row[f"time_ms_median[{other}]"] / row[f"time_ms_median[{base}]"]
    row["memory_ratio"] = row[f"peak_gib[{other}]"] / row[f"peak_gib[{base}]"]


def determinism_cost(df: pd.DataFrame) -> pd.DataFrame:
    """What bitwise replay costs per configuration: median time and peak memory (GiB, max over ranks) of the
    eager-default and the deterministic point (``[default]``, ``[deterministic]``), the backend each
    resolved to, and the ratios deterministic / default. Only configurations measured both ways appear."""
    rows = []
    for row, group in _groups_varying_in(df, "deterministic"):
        modes = {bool(point["deterministic"]): point for _, point in group.iterrows()}
        if set(modes) != {False, True}:
            continue
        for flag, name in ((False, "default"), (True, "deterministic")):
            _time_and_memory(row, modes[flag], name)
            row[f"backend[{name}]"] = (modes[flag]["resolved_backends"] or {}).get("sparse_attention")
        _ratios(row, "default", "deterministic")
        rows.append(row)
    return pd.DataFrame(rows)


def determinism_lines(cost: pd.DataFrame) -> list[str]:
    """The summary's sentence on the cost of determinism (nothing when no configuration ran both ways)."""
    if cost.empty:
        return []
    return ["## Cost of determinism", "",
            f"Deterministic / default over {len(cost)} configuration(s): time x{cost['time_ratio'].min():.2f} to "
            f"x{cost['time_ratio'].max():.2f}, peak memory x{cost['memory_ratio'].min():.2f} to "
            f"x{cost['memory_ratio'].max():.2f} (table determinism_cost).", ""]


def compile_cost(df: pd.DataFrame) -> pd.DataFrame:
    """What ``torch.compile`` gives per configuration: one row per compiled point (its ``compile``
    backend) beside the eager point of the same configuration: median step time and peak memory of
    each (``[eager]``, ``[compiled]``), the compiling first step's wall time (``compile_s``, timed apart
    from the steps), the graph breaks Dynamo counted, and the ratios compiled / eager. Configurations
    without both an eager and a compiled point do not appear."""
    rows = []
    for shown, group in _groups_varying_in(df, "compile"):
        eager = group[group["compile"].isna()]
        if eager.empty:
            continue
        for _, point in group[group["compile"].notna()].iterrows():
            row = {**shown, "compile": point["compile"]}
            _time_and_memory(row, eager.iloc[0], "eager")
            _time_and_memory(row, point, "compiled")
            row["compile_s"], row["graph_breaks"] = point["compile_s"], point["graph_breaks"]
            _ratios(row, "eager", "compiled")
            rows.append(row)
    return pd.DataFrame(rows)


def compile_lines(cost: pd.DataFrame) -> list[str]:
    """The summary's sentences on the compiled layer, one per compiled point (nothing when none was
    measured beside its eager point)."""
    if cost.empty:
        return []
    lines = ["## The layer under torch.compile", ""]
    for _, row in cost.iterrows():
        compiled, eager = row["time_ms_median[compiled]"], row["time_ms_median[eager]"]
        lines.append(f"- `{row['compile']}`: step x{row['time_ratio']:.2f} of eager ({compiled:.1f} "
                     f"against {eager:.1f} ms), peak memory x{row['memory_ratio']:.2f}, "
                     f"first (compiling) step {row['compile_s']:.1f} s, {int(row['graph_breaks'])} graph break(s).")
    return [*lines, "", "(table compile_cost)", ""]


def on_cpu(df: pd.DataFrame) -> pd.Series:
    """Per row, whether the point ran on CPU (its ``machine`` label is ``cpu-<n>core``), where the
    record's ``peak_allocated_bytes`` holds the host process's peak RSS instead of the allocator peak."""
    return df["machine"].map(lambda m: isinstance(m, str) and m.startswith("cpu"))


PEAK_PHASE_HOLDERS = 3
"""Phases named per rank as holding the memory live at its peak."""


def memory(df: pd.DataFrame) -> pd.DataFrame:
    """Peak memory per point, max over ranks, in GiB, next to cp and tokens (total and per rank):
    ``peak_allocated_gib`` (the CUDA allocator's peak; blank on CPU), ``peak_rss_gib`` (the host
    process's peak resident set: what a CPU point measures; blank on GPU), ``device_used_gib`` and,
    where the point recorded ``memory_phases``, ``peak_phase``: the phase holding the peak on the
    rank with the largest one."""
    points = ok_points(df)
    axes = list(dict.fromkeys([*varying_axes(points), "cp", "tokens", "tokens_per_rank"]))
    out = points[axes].copy()
    peak = points["peak_allocated_bytes"].map(_max_gib)
    cpu = on_cpu(points)
    out["peak_allocated_gib"] = peak.where(~cpu)
    out["peak_rss_gib"] = peak.where(cpu)
    out["device_used_gib"] = points["device_used_bytes"].map(_max_gib)
    out["peak_phase"] = points["memory_phases"].map(_peak_phase_of_max_rank)
    return out.sort_values([a for a in ("run", "cp", "tokens") if a in out]).reset_index(drop=True)


def _peak_phase_of_max_rank(per_rank: object) -> str | None:
    measured = [r for r in per_rank if isinstance(r, dict)] if isinstance(per_rank, list) else []
    if not measured:
        return None
    return _innermost(max(measured, key=lambda r: r["peak_bytes"])["peak_stack"])


def _innermost(stack: list[str]) -> str:
    return stack[-1].removeprefix("dsv4cp.") if stack else OUTSIDE_PHASES


def memory_peaks(df: pd.DataFrame) -> pd.DataFrame:
    """Where each rank's memory peak sits, per point that recorded ``memory_phases`` (``--memory-phases``):
    ``peak_gib`` (allocator on GPU, RSS on CPU, as ``memory_kind`` says), ``peak_phase`` (the innermost
    phase open at the peak), ``open_phases`` (outermost first) and ``held_by``: the phases entered before
    the peak phase and closed by then that left the most memory allocated (exit minus entry, GiB), i.e.
    the largest allocations still live when the peak phase starts."""
    points = ok_points(df)
    axes = list(dict.fromkeys([*varying_axes(points), "cp"]))
    columns = [*axes, "rank", "memory_kind", "peak_gib", "peak_phase", "open_phases", "held_by"]
    rows = []
    for (_, point), cpu in zip(points.iterrows(), on_cpu(points)):
        per_rank = point["memory_phases"]
        if not isinstance(per_rank, list):
            continue
        for rank, mine in enumerate(per_rank):
            if not isinstance(mine, dict):
                continue  # a rank this (emulated) run did not measure
            stack = list(mine["peak_stack"])
            rows.append({**{a: point[a] for a in axes}, "rank": rank,
                         "memory_kind": "host RSS (CPU)" if cpu else "CUDA allocator",
                         "peak_gib": mine["peak_bytes"] / GIB, "peak_phase": _innermost(stack),
                         "open_phases": " > ".join(p.removeprefix("dsv4cp.") for p in stack),
                         "held_by": _held_by(mine["rows"], stack)})
    return pd.DataFrame(rows, columns=columns)


def _held_by(rows: list[dict], stack: list[str]) -> str:
    """``"sparse_attn.fwd +2.1 GiB, ..."``: the closed phases before the peak phase with the largest
    positive exit - entry, from the recorded rows (in order of first entry)."""
    peak_phase = stack[-1] if stack else None
    names = [row["phase"] for row in rows]
    before = rows[: names.index(peak_phase)] if peak_phase in names else rows
    left = [(row["phase"], (row["exit_bytes"] - row["entry_bytes"]) / GIB) for row in before
            if row["phase"] not in stack and row["entry_bytes"] is not None and row["exit_bytes"] is not None]
    largest = sorted((item for item in left if item[1] > 0), key=lambda item: -item[1])[:PEAK_PHASE_HOLDERS]
    return ", ".join(f"{phase.removeprefix('dsv4cp.')} +{gib:.3g} GiB" for phase, gib in largest)


def imbalance(df: pd.DataFrame) -> pd.DataFrame:
    """Per point, by packing: max/mean of the per-rank median times and the spread in ms."""
    points = ok_points(df)
    axes = list(dict.fromkeys(["packing", *varying_axes(points), "cp"]))
    out = points[axes].copy()
    out["imbalance_max_over_mean"] = pd.to_numeric(points["imbalance_max_over_mean"], errors="coerce")
    out["rank_spread_ms"] = points["rank_time_ms_median"].map(_spread)
    return out.sort_values([a for a in ("run", "packing", "cp") if a in out]).reset_index(drop=True)


MODEL_AXES: tuple[str, ...] = ("preset", "ratio", "cp", "tokens", "packing", "pass")
"""Axes the cost model needs to rebuild a point's batch."""


def point_estimate(point: pd.Series, machine: Machine | None = None, padding: bool = True) -> LayerEstimate:
    """The cost model of one record's point (it must hold every axis of :data:`MODEL_AXES`): the
    document lengths the sweep packed (``workloads.packing_lengths`` with the point's seed) and the
    rows each rank measured (the record's ``split``, else, for older records, the point's partition
    policy as the sweep computes it); ``machine``: the ceilings of the bounds (default: the record's
    bound machine, :func:`record_machine`); ``padding=False``: without the capacity padding of the
    gathered buffer (``estimate``)."""
    cp, tokens, ratio = int(point["cp"]), int(point["tokens"]), int(point["ratio"])
    lengths = packing_lengths(point["packing"], tokens, cp=cp, ratio=ratio, seed=int(point["seed"] or 0))
    loss, policy = point["loss"], point["partition"]
    cfg = DSv4Config.preset(point["preset"], **({"indexer_loss": loss} if isinstance(loss, str) else {}))
    recorded = point.get("split")
    if isinstance(recorded, (list, tuple)) and len(recorded) == cp + 1:
        split = RowSplit(tuple(int(b) for b in recorded)).validate(tokens, cp, field="split")
    else:
        split = policy_split(cfg, ratio, lengths, cp, policy if isinstance(policy, str) else "equal",
                             machine or record_machine(point), total=tokens, direction=point["pass"],
                             kernel_options=kernel_option_registry.KernelOptions.resolve())  # as the sweep priced it
    return estimate(cfg, ratio, lengths, cp, machine or record_machine(point), total=tokens, split=split,
                    padding=padding, selection_scores=record_selection_scores(point))


def record_selection_scores(point: pd.Series) -> bool:
    """Whether a record's indexer loss took the selection's scores: its ``indexer_loss_scores`` option; a
    record without it was written before the option existed, when the loss always scored its entries again."""
    options = point.get("kernel_options")
    return isinstance(options, dict) and options.get("indexer_loss_scores") == "selection"


def record_machine(point: pd.Series) -> Machine:
    """The ceilings of a record's bound where they are a preset, else h200x2 (records written before
    ``bound_machine`` were all bounded on it)."""
    named = point.get("bound_machine")
    return Machine.preset(named if isinstance(named, str) and named in MACHINE_PRESETS else "h200x2")


def model_imbalance(df: pd.DataFrame) -> pd.DataFrame:
    """Per point, by packing: the cost model's imbalance (max / mean over ranks of FLOPs and of the
    time bound) for the point's packing, beside the measured per-rank time imbalance.

    The model sees the same document lengths the sweep packed (``workloads.packing_lengths`` with the
    point's seed) and the same row split (the point's ``partition``), so a gap between the columns is the
    part the FLOP count does not explain. Points missing an axis the model needs are left out."""
    points = ok_points(df).dropna(subset=list(MODEL_AXES))
    axes = list(dict.fromkeys(["packing", *varying_axes(points), "cp"]))
    rows = []
    for _, point in points.iterrows():
        summary = point_estimate(point).summary(point["pass"])
        rows.append({**{a: point[a] for a in axes}, "model_flops_imbalance": summary.flops_imbalance,
                     "model_time_imbalance": summary.time_imbalance,
                     "measured_imbalance": point["imbalance_max_over_mean"]})
    out = pd.DataFrame(rows, columns=[*axes, "model_flops_imbalance", "model_time_imbalance", "measured_imbalance"])
    return out.sort_values([a for a in ("run", "packing", "cp") if a in out]).reset_index(drop=True)


def measured_vs_bound(df: pd.DataFrame) -> pd.DataFrame:
    """Per point: measured time against the cost model's lower bounds (``bound_ms`` at the hardware's
    physical limits, ``bound_measured_ms`` at the measured ceilings of ``bound_machine``), FLOPs and
    achieved rates. A record from before the physical bound has only the second (its ``bound_ms`` empty)."""
    points = ok_points(df)
    axes = varying_axes(points)
    if "cp" in points and "cp" not in axes:  # the plot colours points by cp even when all share one
        axes.append("cp")
    out = points[axes].copy()
    for column in ("time_ms_median", "bound_ms", "measured_over_bound", "bound_measured_ms",
                   "measured_over_measured_bound", "tflops_per_gpu", "mfu"):
        out[column] = pd.to_numeric(points[column], errors="coerce")
    out["model_tflop"] = pd.to_numeric(points["model_flops"], errors="coerce") / 1e12
    out["bound_machine"] = points["bound_machine"]  # whose ceilings the bound is (None: no bound)
    return out


def failures(df: pd.DataFrame) -> pd.DataFrame:
    """Points that did not measure (oom, error, skipped) with their status. Only a point's latest record
    in its run counts: an error that ``sweep --resume --retry-errors`` measured again is not listed."""
    latest = ~df.duplicated(["run", "point_id"], keep="last")
    bad = df[(df["status"] != STATUS_OK) & latest]
    return bad[[*varying_axes(df), "status"]].reset_index(drop=True)


# ------------------------------------------------------------------------------------------ output
def to_markdown(table: pd.DataFrame) -> str:
    """A GitHub markdown table: floats to 4 significant digits, NaN as blank, every other value as
    written (a hex git sha stays text); ``_(empty)_`` for an empty table."""
    if table.empty:
        return "_(empty)_\n"
    shown = table.copy()
    for column in shown.select_dtypes("float").columns:
        shown[column] = shown[column].map(lambda v: "" if pd.isna(v) else f"{v:.4g}")
    return shown.to_markdown(index=False, disable_numparse=True) + "\n"


def write_table(table: pd.DataFrame, directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``name.csv`` and ``name.md`` into ``directory`` (created); returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    csv, md = directory / f"{name}.csv", directory / f"{name}.md"
    table.to_csv(csv, index=False)
    md.write_text(to_markdown(table))
    return csv, md

