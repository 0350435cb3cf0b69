"""``sweep --resume`` of a committed older run at this head: a point whose record ran other kernel options
than it runs now (a default changed since, an option was added) is measured again, never taken as "already
there"; the old records are kept beside the run, and one line says how many and which options differ.

The measurement itself is replaced by a stand-in (the committed runs are H200 points of 16K-256K tokens):
what is tested is which points the resume measures."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from dsv4cp import kernel_options
from dsv4cp.records import (
    STATUS_OK,
    configuration_key,
    option_differences,
    read_meta,
    read_records,
    resolved_options,
)
from dsv4cp.sweeps import runner
from dsv4cp.sweeps.runner import SUPERSEDED_FILE, SweepOptions, run_sweep
from dsv4cp.sweeps.spec import expand, parse_spec

RESULTS = Path(__file__).resolve().parents[2] / "results"
OLD_RUN = RESULTS / "2026-12-01-h200-cost-growth" / "run"
"""A sweep written at b3e30c4, before several defaults changed (and options were added)."""
BASELINE = RESULTS / "baselines" / "cpu-ci" / "smoke"
"""The CPU CI baseline (its spec: the smoke sweep)."""


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / run.name
    shutil.copytree(run, out, ignore=shutil.ignore_patterns("traces"))
    return out


def _measured(monkeypatch) -> list[str]:
    """Replace the measurement with a stand-in that records which points were measured."""
    measured: list[str] = []

    def stand_in(point, *args, **kwargs):
        measured.append(point.point_id)
        metrics = {"time_ms_median": 2.0, "time_ms_p20": 1.0, "time_ms_p80": 3.0, "bound_ms": 1.0}
        return STATUS_OK, None, metrics, {"kernel_options": runner._options_of(point)}

    monkeypatch.setattr(runner, "_run_point", stand_in)
    return measured


def _resume(out: Path) -> runner.SweepSummary:
    spec = parse_spec(read_meta(out)["spec"])
    points = expand(spec)
    return run_sweep(spec, points, SweepOptions(out=out, resume=True), nproc=1)


def test_resuming_an_old_run_measures_again_every_point_whose_kernels_changed(tmp_path, monkeypatch, capsys):
    out = _copy(OLD_RUN, tmp_path)
    stored = read_records(out)
    now = kernel_options.resolved()
    changed = {r["point_id"] for r in stored if option_differences(resolved_options(r), now)}
    assert len(stored) == 5 and changed == {r["point_id"] for r in stored}  # every default point ran older kernels
    measured = _measured(monkeypatch)

    summary = _resume(out)

    assert sorted(measured) == sorted(changed) and summary.resumed == 0 and summary.recorded == 5
    after = read_records(out)
    assert sorted(r["point_id"] for r in after) == sorted(changed)  # one record per point, all measured now
    assert all(resolved_options(r) == now for r in after)
    assert read_records(out / SUPERSEDED_FILE) == stored  # nothing recorded is lost
    line, = [line for line in capsys.readouterr().err.splitlines() if "ran other kernel options" in line]
    assert line.startswith("--resume: 5 recorded point(s) ran other kernel options than they run now (")
    # options added since the run are unknown in its records, never read as today's defaults, unless what ran
    # before the option existed is known (the loss scored its entries again)
    for name in ("triton_dkv_one_product unknown -> 1", "indexer_loss_scores recompute -> selection",
                 "triton_probs_kernel unknown -> d_chunks"):
        assert name in line

    # resumed again at the same head: nothing changed, nothing is measured again
    measured.clear()
    again = _resume(out)
    assert measured == [] and again.resumed == 5 and len(read_records(out)) == 5


def test_a_run_at_todays_options_resumes_without_measuring_until_an_option_changes(tmp_path, monkeypatch, capsys):
    # a run written at this head's defaults: the CI baseline's smoke spec swept here (by the stand-in)
    out = tmp_path / "smoke"
    spec = parse_spec(read_meta(BASELINE)["spec"])
    measured = _measured(monkeypatch)
    run_sweep(spec, expand(spec), SweepOptions(out=out), nproc=1)
    stored = read_records(out)  # cp = 2 points recorded as skipped: one rank here
    measured.clear()
    assert _resume(out).resumed == len(stored) and measured == []
    assert not (out / SUPERSEDED_FILE).exists()

    # a default changes, as a commit changes one: the old default joins FORMER_DEFAULTS, so ids stay
    name = "triton_dkv_one_product"
    option = kernel_options.OPTIONS[name]
    monkeypatch.setitem(kernel_options.OPTIONS, name, dataclasses.replace(option, default=not option.default))
    monkeypatch.setattr(kernel_options, "FORMER_DEFAULTS",
                        {**kernel_options.FORMER_DEFAULTS, name: (option.text(option.default),)})
    kernel_options._configuration.cache_clear()
    assert [p.point_id for p in expand(parse_spec(read_meta(out)["spec"]))] == read_meta(out)["point_ids"]
    summary = _resume(out)
    kernel_options._configuration.cache_clear()
    assert summary.resumed == 0 and summary.recorded == len(stored)  # no stored point reused
    assert sorted(measured) == sorted(r["point_id"] for r in stored if r["cp"] == 1)  # one rank: cp 2 is skipped
    assert (f"--resume: {len(stored)} recorded point(s) ran other kernel options than they run now "
            f"({name} {option.text(option.default)} -> {option.text(not option.default)}): measuring them again"
            in capsys.readouterr().err)


def test_one_id_of_four_kernel_sets_has_four_configuration_keys():
    # the flash C 64K one-document point (auto, fwd+bwd): the same axes measured at four kernel sets
    runs = ["2026-12-01-h200-cost-growth/run", "2026-12-02-h200-indexer-attention-variants/layer/profile-auto-one",
            "2026-12-02-h200-indexer-attention-variants/final/profile-auto-one",
            "2026-12-02-h200-layer-defaults/layer/sweep"]
    found = {}
    for run in runs:
        for record in read_records(RESULTS / run):
            if record["point_id"] == "8dd88e6e6397":
                found[run] = (configuration_key(record), record["time_ms_median"])
    assert sorted(found) == sorted(runs)
    assert len({key for key, _ in found.values()}) == 4


@pytest.mark.parametrize("stored, expected", [
    ({"a": "1", "b": "x"}, {}),
    ({"a": "0", "b": "x"}, {"a": ("0", "1")}),
    ({"b": "x"}, {"a": ("unknown", "1")}),  # an option missing from a record is unknown, not today's default
    ({"a": "1", "b": "x", "gone": "0"}, {"gone": ("0", "unknown")}),
    (None, {"kernel_options": ("unknown", "recorded")}),
])
def test_option_differences_name_every_option_that_differs(stored, expected):
    assert option_differences(stored, {"a": "1", "b": "x"}) == expected


def test_an_option_added_since_a_record_is_unknown_unless_what_ran_before_it_is_known():
    record = {"kernel_options": {"topk_impl": "chunked"}}
    options = resolved_options(record)
    assert options["inject_slowdown"] == "off" and options["indexer_loss_scores"] == "recompute"
    assert "triton_dkv_one_product" not in options  # unknown: its value before it existed is not recorded
    now = {**options, "triton_dkv_one_product": "1"}
    assert option_differences(options, now) == {"triton_dkv_one_product": ("unknown", "1")}
    assert configuration_key(record) == configuration_key({"kernel_options": {**record["kernel_options"],
                                                                               "inject_slowdown": "off"}})
