"""Targets declared in a spec: validated when the spec loads, judged by the report (met / missed / n.a.)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from report_helpers import TIME_RATIO_TARGET, grid, write_run

from dsv4cp.cli.main import main
from dsv4cp.records import point_id, read_records
from dsv4cp.report import load_runs, write_report
from dsv4cp.report import targets as report_targets
from dsv4cp.sweeps.spec import load_spec, parse_spec
from dsv4cp.targets import METRICS, parse_targets

ROOT = Path(__file__).parents[2]
SPEC = {"name": "t", "base": {"preset": "tiny", "tokens": 256}, "axes": {"cp": [1, 2]}}


@pytest.mark.parametrize("entry, message", [
    ({"metric": "speed", "comparison": "<=", "value": 1}, "targets[0].metric: unknown metric 'speed'"),
    ({"metric": "time_ms", "comparison": "~", "value": 1}, "targets[0].comparison: unknown comparison '~'"),
    ({"metric": "time_ms", "comparison": "<=", "value": "fast"}, "targets[0].value: must be a finite number"),
    ({"metric": "time_ms", "comparison": "<=", "value": 1, "where": {"gpu": 1}},
     "targets[0].where: unknown axis 'gpu'"),
    ({"metric": "time_ms", "comparison": "<=", "value": 1, "where": {"packing": "bogus"}}, "targets[0].where.packing"),
    ({"metric": "time_ms", "comparison": "<=", "value": 1, "pair": {"cp": [2, 1]}}, "a metric of one point"),
    ({"metric": "time_ratio", "comparison": "<=", "value": 1}, "targets[0].pair: 'time_ratio' needs one axis"),
    ({"metric": "time_ratio", "comparison": "<=", "value": 1, "pair": {"cp": [2, 2]}}, "two different values"),
    ({"metric": "time_ratio", "comparison": "<=", "value": 1, "pair": {"cpu": [2, 1]}},
     "targets[0].pair: unknown axis 'cpu'"),
    ({"metric": "scaling_efficiency", "comparison": ">=", "value": 0.5, "pair": {"overlap": ["async", "none"]}},
     "scaling_efficiency pairs points on cp"),
    ({"metric": "time_ms", "comparison": "<=", "value": 1, "limit": 2}, "targets[0]: unknown key 'limit'"),
])
def test_a_bad_target_is_refused_when_the_spec_loads(entry, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        parse_spec({**SPEC, "targets": [entry]})


def test_targets_need_distinct_names_and_a_list():
    same = {"metric": "time_ms", "comparison": "<=", "value": 1}
    with pytest.raises(ValueError, match="two targets are named 'time_ms'"):
        parse_targets([same, same])
    with pytest.raises(ValueError, match="targets: must be a list"):
        parse_spec({**SPEC, "targets": {"metric": "time_ms"}})


def test_shipped_specs_declare_their_targets():
    for name in ("cp_scaling", "overlap", "partition", "packing", "kernels", "smoke"):
        spec = load_spec(ROOT / "sweeps" / f"{name}.yaml")
        assert spec.targets, name
        for target in spec.targets:
            assert target.metric in METRICS
    ratios = {t.metric: t for t in load_spec(ROOT / "sweeps" / "cp_scaling.yaml").targets}
    assert ratios["time_ratio"].value == 0.52 and ratios["memory_ratio"].value == 0.52
    assert ratios["time_ratio"].pair == ("cp", 2, 1)
    smoke = {t.metric for t in load_spec(ROOT / "sweeps" / "smoke.yaml").targets}
    assert {"scaling_efficiency", "parity_failures"} <= smoke


def test_targets_met_missed_and_by_how_much(tmp_path, seed):
    points = grid(cp=[1, 2], tokens=[65536], packing=["histogram"], overlap=["async"])
    targets = [TIME_RATIO_TARGET,
               {"metric": "scaling_efficiency", "pair": {"cp": [2, 1]}, "comparison": ">=", "value": 0.9},
               {"metric": "memory_ratio", "pair": {"cp": [2, 1]}, "comparison": "<=", "value": 0.6},
               {"metric": "exposed_comm_fraction", "where": {"cp": 2}, "comparison": "<=", "value": 0.5}]
    met = write_run(tmp_path / "met", points, seed=seed, targets=targets)
    missed = write_run(tmp_path / "missed", points, seed=seed, targets=targets,
                       slowdown={point_id(points[1]): 1.3})  # CP = 2 at ~0.53x of CP = 1 -> ~0.69x
    table = report_targets.evaluate(load_runs([met, missed]))
    for run, path in (("met", met), ("missed", missed)):
        one, two = read_records(path)
        rows = table[table["run"] == run].set_index("target")
        time_ratio = two["time_ms_median"] / one["time_ms_median"]
        row = rows.loc[TIME_RATIO_TARGET["name"]]
        assert row["measured"] == pytest.approx(time_ratio)
        assert row["point_id"] == two["point_id"] and row["partner_id"] == one["point_id"]
        assert row["verdict"] == (report_targets.MET if time_ratio <= 0.55 else report_targets.MISSED)
        efficiency = one["time_ms_median"] / (2 * two["time_ms_median"])
        assert rows.loc["scaling_efficiency", "measured"] == pytest.approx(efficiency)
        assert rows.loc["memory_ratio", "measured"] == pytest.approx(
            max(two["peak_allocated_bytes"]) / max(one["peak_allocated_bytes"]))
        assert rows.loc["exposed_comm_fraction", "measured"] == pytest.approx(two["exposed_comm_ms"] / two["comm_ms"])
    slow = table[(table["run"] == "missed") & (table["target"] == TIME_RATIO_TARGET["name"])].iloc[0]
    assert slow["verdict"] == report_targets.MISSED
    assert slow["miss_pct"] == pytest.approx(100 * (slow["measured"] / 0.55 - 1))
    low = table[(table["run"] == "missed") & (table["target"] == "scaling_efficiency")].iloc[0]
    assert low["verdict"] == report_targets.MISSED and low["miss_pct"] == pytest.approx(
        100 * (1 - low["measured"] / 0.9))
    assert table[table["verdict"] == report_targets.MET]["miss_pct"].map(math.isnan).all()


def test_targets_not_applicable_say_why(tmp_path, seed):
    targets = [TIME_RATIO_TARGET,
               {"name": "exposed", "metric": "exposed_comm_fraction", "where": {"cp": 2}, "comparison": "<=",
                "value": 0.1},
               {"name": "parity", "metric": "parity_failures", "where": {"cp": 2}, "comparison": "==", "value": 0},
               {"name": "nowhere", "metric": "time_ms", "where": {"preset": "pro"}, "comparison": "<=", "value": 1}]
    only_cp2 = grid(cp=[2], tokens=[65536], packing=["histogram"], overlap=["async"])
    run = write_run(tmp_path / "u", only_cp2, seed=seed, profiled=False, targets=targets)
    table = report_targets.evaluate(load_runs(run)).set_index("target")
    assert (table["verdict"] == report_targets.NOT_APPLICABLE).all()
    assert table.loc[TIME_RATIO_TARGET["name"], "reason"] == "no measured partner with cp = 1"
    assert "not profiled" in table.loc["exposed", "reason"]
    assert "not checked" in table.loc["parity", "reason"]
    assert table.loc["nowhere", "reason"] == "no measured point it applies to"


def test_a_run_without_declared_targets_judges_none(tmp_path, seed):
    run = write_run(tmp_path / "plain", grid(cp=[1, 2], tokens=[1024]), seed=seed)
    assert report_targets.evaluate(load_runs(run)).empty
    summary = write_report(load_runs(run), tmp_path / "r").read_text()
    assert "No target declared" in summary and "Issue" not in summary


def test_summary_states_a_missed_target_by_how_much_and_that_its_point_was_not_profiled(tmp_path, seed):
    points = grid(cp=[1, 2], tokens=[65536], packing=["histogram"], overlap=["async"])
    run = write_run(tmp_path / "slow", points, seed=seed, slowdown={point_id(points[1]): 1.4},
                    targets=[TIME_RATIO_TARGET])
    summary = write_report(load_runs(run), tmp_path / "r").read_text()
    row = report_targets.evaluate(load_runs(run)).iloc[0]
    (line,) = [ln for ln in summary.splitlines() if TIME_RATIO_TARGET["name"] in ln]
    assert f"**{row['measured']:.4g}**: MISSED by {row['miss_pct']:.1f}%" in line
    assert "not profiled: `sweep --profile` gives the diagnosis" in line  # records without traces


def test_a_spec_file_with_a_bad_target_fails_to_load_naming_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nbase: {preset: tiny, tokens: 256}\naxes: {cp: [1, 2]}\n"
                    "targets:\n  - {metric: time_ratio, pair: {cp: [2, 1]}, comparison: '=<', value: 0.5}\n")
    with pytest.raises(ValueError, match=r"targets\[0\]\.comparison: unknown comparison '=<'"):
        load_spec(path)


def test_a_malformed_target_in_meta_json_is_an_input_error_naming_the_file(tmp_path, seed, capsys):
    run = write_run(tmp_path / "run", grid(cp=[1, 2], tokens=[1024]), seed=seed,
                    targets=[{"metric": "speed", "comparison": "<=", "value": 1}])
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "meta.json: spec.targets[0].metric: unknown metric 'speed'" in err
