"""Calibration of the cost model on measured phase times: the fit, JSON, the calibrated
per-row costs and balanced split, and the ``dsv4cp model --calibrate / --calibration`` options."""

from __future__ import annotations

import itertools
import json
from dataclasses import astuple

import numpy as np
import pandas as pd
import pytest

from dsv4cp.cli.main import main
from dsv4cp.config import DSv4Config
from dsv4cp.cp.partition import RowSplit
from dsv4cp.model import Machine, estimate, nvtx_ranges
from dsv4cp.model.calibration import (
    MODEL_PHASE_CLASS,
    POINT_FILE,
    Calibration,
    check_profile_point,
    fit,
    measured_class,
    model_class_times,
    read_profile,
    scanned_entries,
)
from dsv4cp.model.partition import compare_policies, partition
from dsv4cp.model.phase_classes import INDEXER_SCANS, PHASE_CLASSES
from dsv4cp.model.row_costs import RowCosts, row_costs, scanned_slots, slice_costs
from dsv4cp.records import RECORDS_FILE, append_record, make_record

TINY = DSv4Config.preset("tiny")
FLASH = DSv4Config.preset("flash")


def _known_factors(seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    return {f"{c}.{d}": float(rng.uniform(0.5, 20.0)) for c in PHASE_CLASSES for d in ("fwd", "bwd")
            if (c, d) != ("indexer", "bwd")}  # the selection has no backward


def _synthetic_profile(est, factors: dict[str, float]) -> pd.DataFrame:
    """A per-phase table as a profile would measure it if every phase took ``factor x bound``: the
    selection's scoring inside ``indexer.topk.fwd``, plus ranges no class covers (ignored by the fit)."""
    rows = []
    for record in est.table().itertuples():
        if record.phase not in MODEL_PHASE_CLASS:
            continue
        ms = record.time_lower_bound_s * 1e3 * factors[f"{MODEL_PHASE_CLASS[record.phase]}.{record.direction}"]
        phase = "indexer.topk" if record.phase == "indexer.score" else record.phase
        rows.append((record.rank, "dsv4cp." + nvtx_ranges(phase, record.direction)[0], ms))
    for rank in range(est.cp):
        rows += [(rank, "dsv4cp.step", 3.0), (rank, "dsv4cp.halo.fwd", 1.0), (rank, "total", 99.0)]
    table = pd.DataFrame(rows, columns=["rank", "phase", "compute_ms"])
    return table.groupby(["rank", "phase"], as_index=False, sort=False)["compute_ms"].sum()


@pytest.mark.parametrize("cp", [1, 2])
def test_fit_recovers_known_factors(cp: int, seed: int) -> None:
    est = estimate(FLASH, 4, [40000, 9000, 16536], cp, Machine())
    factors = _known_factors(seed)
    fitted = fit(_synthetic_profile(est, factors), est, source="synthetic")
    assert fitted.factors.keys() == factors.keys()
    for key, want in factors.items():
        assert fitted.factors[key] == pytest.approx(want, rel=1e-9), key
    # the calibrated per-rank compute is the factor-weighted sum of the bounds
    table = est.table()
    table = table[table["resource"] == "compute"]
    want = [sum(r.time_lower_bound_s * factors[f"{MODEL_PHASE_CLASS[r.phase]}.{r.direction}"]
                for r in table[table["rank"] == rank].itertuples()) for rank in range(cp)]
    np.testing.assert_allclose(fitted.rank_compute_s(est), want, rtol=1e-12)


def test_measured_ranges_map_to_classes() -> None:
    assert measured_class("dsv4cp.indexer.topk.fwd") == ("indexer", "fwd")
    assert measured_class("indexer.score.fwd") == ("loss", "fwd")  # the loss's scores, not the selection's
    assert measured_class("dsv4cp.indexer.score.bwd") == ("loss", "bwd")
    assert measured_class("dsv4cp.sparse_attn.bwd") == ("attention", "bwd")
    assert measured_class("dsv4cp.indexer.compress.bwd") == ("compressors", "bwd")
    for name in ("dsv4cp.step", "total", "dsv4cp.halo.fwd", "dsv4cp.allgather.kv.wait", "dsv4cp.layout.fwd"):
        assert measured_class(name) is None, name


def test_fit_rejects_a_table_of_other_ranks_or_without_phases() -> None:
    est = estimate(TINY, 4, [256], 2, Machine())
    with pytest.raises(ValueError, match="cp=2"):
        fit(pd.DataFrame({"rank": [0], "phase": ["dsv4cp.sparse_attn.fwd"], "compute_ms": [1.0]}), est)
    with pytest.raises(ValueError, match="no phase"):
        fit(pd.DataFrame({"rank": [0], "phase": ["dsv4cp.step"], "compute_ms": [1.0]}), est)
    with pytest.raises(ValueError, match="compute_ms"):
        fit(pd.DataFrame({"rank": [0], "phase": ["dsv4cp.step"]}), est)


def test_json_round_trip_and_bad_files(tmp_path, seed: int) -> None:
    cal = Calibration(factors=_known_factors(seed), machine="h200x2", source="here", fitted={"a": 1})
    path = tmp_path / "cal.json"
    cal.save(path)
    assert Calibration.load(path) == cal
    assert Calibration.load(path).factor("loss", "bwd") == cal.factors["loss.bwd"]
    assert Calibration(factors={}).factor("indexer", "fwd") == 1.0  # not fitted: the bound as is
    bad_files = (({"factors": {"indexer.fwd": -1.0}}, "positive"), ({"factors": {"topk.fwd": 2.0}}, "unknown key"),
                 ({"factors": {"indexer.fwd": float("nan")}}, "finite"), ([1, 2], "JSON object"),
                 ({"schema": 9, "factors": {}}, "schema"), ({"factors": {"loss.fwd": 10**400}}, "finite"),
                 ({"factors": {}, "fitted": 5}, "fitted"))
    for bad, match in bad_files:
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            Calibration.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="--calibration"):
        Calibration.load(path)
    with pytest.raises(ValueError, match="--calibration"):
        Calibration.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="phase class"):
        cal.factor("topk", "fwd")


def test_calibrated_row_costs_scale_each_class() -> None:
    machine = Machine()
    plain = RowCosts.for_layer(FLASH, 4, machine)
    ones = Calibration(factors={f"{c}.{d}": 1.0 for c in PHASE_CLASSES for d in ("fwd", "bwd")})
    same = RowCosts.for_layer(FLASH, 4, machine, calibration=ones)
    np.testing.assert_allclose(astuple(same), astuple(plain), rtol=1e-12)
    doubled = RowCosts.for_layer(FLASH, 4, machine, calibration=Calibration(
        factors={f"{c}.{d}": 2.0 for c in PHASE_CLASSES for d in ("fwd", "bwd")}))
    np.testing.assert_allclose(astuple(doubled), 2 * np.array(astuple(plain)), rtol=1e-12)
    # only the indexer's selection scales with the visible entries (sparse loss): per_visible_entry alone moves
    indexer = RowCosts.for_layer(FLASH, 4, machine, calibration=Calibration(factors={"indexer.fwd": 5.0}))
    assert indexer.per_row == plain.per_row and indexer.per_window_key == plain.per_window_key
    assert indexer.per_compressed_key == plain.per_compressed_key
    assert indexer.per_visible_entry == pytest.approx(5.0 * plain.per_visible_entry, rel=1e-12)
    with pytest.raises(ValueError, match="machine"):
        RowCosts.for_layer(FLASH, 4, calibration=ones)


def _brute_force(prefix: np.ndarray, cp: int) -> float:
    total, best = prefix.size - 1, np.inf
    for inner in itertools.combinations_with_replacement(range(total + 1), cp - 1):
        bounds = (0, *inner, total)
        best = min(best, float(np.max(prefix[list(bounds[1:])] - prefix[list(bounds[:-1])])))
    return best


@pytest.mark.parametrize("scan", INDEXER_SCANS)
@pytest.mark.parametrize("lengths,cp", [([30], 3), ([9, 14, 1], 3), ([22, 0, 6], 4), ([40], 2)])
def test_calibrated_balanced_split_is_optimal(lengths: list[int], cp: int, scan: str, seed: int) -> None:
    """Balanced on calibrated costs is the brute-force optimum of those costs (which differ from the
    uncalibrated ones: an indexer 50x slower than its bound moves the split), on every indexer scan."""
    machine = Machine()
    cal = Calibration(factors={**_known_factors(seed), "indexer.fwd": 50.0}, indexer_scan=scan)
    cu = np.concatenate(([0], np.cumsum(lengths)))
    costs = RowCosts.for_layer(TINY, 4, machine, calibration=cal)
    prefix = np.concatenate(([0.0], np.cumsum(row_costs(costs, cu, int(cu[-1]), TINY, 4))))
    split = partition(lengths, cp, TINY, 4, policy="balanced", machine=machine, calibration=cal, min_rows=1)
    assert float(slice_costs(prefix, split).max()) <= _brute_force(prefix, cp) * (1 + 1e-12)


def test_calibration_moves_the_split_of_a_long_document() -> None:
    """A slower indexer (measured, as on the H200) gives the rank holding the document's end fewer rows
    than the bound-balanced split does, and the calibrated policy table balances calibrated times."""
    machine = Machine()
    cal = Calibration(factors={"indexer.fwd": 6.0, "projections.fwd": 1.8, "projections.bwd": 1.6,
                               "attention.fwd": 1.4, "attention.bwd": 6.0})
    plain = compare_policies(FLASH, 4, [65536], 2, machine, align=8).set_index("policy")
    calibrated = compare_policies(FLASH, 4, [65536], 2, machine, align=8, calibration=cal).set_index("policy")
    assert calibrated.loc["balanced", "split"][1] > plain.loc["balanced", "split"][1]
    assert calibrated.loc["equal", "compute_imbalance"] > plain.loc["equal", "compute_imbalance"]
    assert calibrated.loc["balanced", "compute_imbalance"] < 1.002


FLASH_64K = {"preset": "flash", "ratio": 4, "tokens": 65536, "packing": "one", "loss": "sparse"}


def _record(*, cp: int, phases: list[dict] | None = None, **axes) -> dict:
    """A complete ``ok`` record (every column, its own point id) of FLASH_64K changed by ``axes``, carrying
    a profile's per-phase rows: what ``profile --out`` or a sweep writes, as the record loader reads it."""
    point = {**FLASH_64K, "pass": "fwd", "cp": cp, **axes}
    return make_record(point, {"phases": phases}, sweep="calibration-test", status="ok", machine="cpu-test",
                       git_sha=None)


def _write_records(path, records: list[dict]) -> None:
    for record in records:
        append_record(path, record)


def test_read_profile_forms(tmp_path) -> None:
    """A trace's table with the point beside it, a sweep's trace under its run's records, a records file
    (its ok record at the cp, the one of the asked point first); a trace naming no point is refused."""
    table = pd.DataFrame({"rank": [0, 0], "phase": ["dsv4cp.sparse_attn.fwd", "total"], "compute_ms": [2.0, 3.0]})
    table.to_csv(tmp_path / "overlap.csv", index=False)
    bare = read_profile(tmp_path)
    pd.testing.assert_frame_equal(bare.table, table)
    with pytest.raises(ValueError, match=f"does not say which point.*no {POINT_FILE}"):
        check_profile_point(bare, FLASH_64K)
    (tmp_path / POINT_FILE).write_text(json.dumps({**FLASH_64K, "cp": 1}))
    check_profile_point(read_profile(tmp_path / "overlap.csv"), FLASH_64K)

    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    sweep = [_record(cp=1), _record(cp=1, tokens=4096)]
    _write_records(run / RECORDS_FILE, sweep)
    (run / "traces" / sweep[1]["point_id"]).mkdir()
    table.to_csv(run / "traces" / sweep[1]["point_id"] / "overlap.csv", index=False)
    assert read_profile(run / "traces" / sweep[1]["point_id"]).point["tokens"] == 4096  # its own record, not the first

    records = tmp_path / "profile" / "records.jsonl"
    records.parent.mkdir()
    phases = table.to_dict("records")
    _write_records(records, [_record(cp=1), _record(cp=2, tokens=8, phases=phases), _record(cp=2, phases=phases)])
    found = read_profile(records, cp=2, want=FLASH_64K)
    pd.testing.assert_frame_equal(found.table, table)
    assert found.point["tokens"] == 65536
    assert read_profile(records, cp=2).point["tokens"] == 8  # nothing asked: the first
    with pytest.raises(ValueError, match="cp=1"):
        read_profile(records, cp=1)
    with pytest.raises(ValueError, match="no such"):
        read_profile(tmp_path / "absent.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        read_profile(tmp_path / "empty")


@pytest.mark.parametrize(("field", "value"), [("tokens", 4096), ("preset", "tiny"), ("ratio", 128),
                                              ("packing", "histogram"), ("loss", "dense")])
def test_calibrate_refuses_another_points_profile(tmp_path, capsys, field: str, value) -> None:
    """A profile of another configuration or batch size is refused (exit 2) naming both points,
    before any fit or output file."""
    est = estimate(FLASH, 4, [65536], 1, Machine())
    _synthetic_profile(est, dict.fromkeys(_all_keys(), 2.0)).to_csv(tmp_path / "overlap.csv", index=False)
    (tmp_path / POINT_FILE).write_text(json.dumps({**FLASH_64K, field: value, "cp": 1}))
    out = tmp_path / "cal.json"
    argv = ["model", "--preset", "flash", "--ratio", "4", "--tokens", "65536", "--cp", "1", "--machine", "h200x2",
            "--calibrate", str(tmp_path), "--calibration-out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"measured {field}={value!r}, not {field}={FLASH_64K[field]!r}" in err
    assert "asked for (preset=flash ratio=4 tokens=65536 packing=one loss=sparse)" in err
    assert err.count("\n") == 1
    assert not out.exists()


def test_calibrate_warns_on_a_factor_below_one(tmp_path, capsys, seed: int) -> None:
    """A phase measured faster than its lower bound is flagged on stderr (naming the factor and the
    machine); factors of 1 or more are not."""
    est = estimate(FLASH, 4, [65536], 1, Machine())
    rng = np.random.default_rng(seed)
    factors = {key: float(rng.uniform(1.0, 5.0)) for key in _all_keys()}
    (tmp_path / POINT_FILE).write_text(json.dumps({**FLASH_64K, "cp": 1}))
    argv = ["model", "--preset", "flash", "--ratio", "4", "--tokens", "65536", "--cp", "1", "--machine", "h200x2",
            "--calibrate", str(tmp_path), "--calibration-out", str(tmp_path / "cal.json")]
    _synthetic_profile(est, factors).to_csv(tmp_path / "overlap.csv", index=False)
    assert main(argv) == 0
    assert "warning" not in capsys.readouterr().err
    slow = dict(factors, **{"attention.bwd": 0.25})
    _synthetic_profile(est, slow).to_csv(tmp_path / "overlap.csv", index=False)
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: calibration factor(s) below 1 (attention.bwd 0.25)" in err and "machine h200x2" in err


def _all_keys() -> list[str]:
    return [f"{c}.{d}" for c in PHASE_CLASSES for d in ("fwd", "bwd")]


def test_model_cli_calibrate_then_balance(tmp_path, capsys, seed: int) -> None:
    """``--calibrate`` fits the profile at the command's point and writes the JSON; ``--calibration``
    balances on it (the split moves) and says so; bad flag combinations fail before any work."""
    est = estimate(FLASH, 4, [65536], 1, Machine())
    factors = {**_known_factors(seed), "indexer.fwd": 30.0}
    profile = tmp_path / "overlap.csv"
    _synthetic_profile(est, factors).to_csv(profile, index=False)
    (tmp_path / POINT_FILE).write_text(json.dumps({**FLASH_64K, "cp": 1}))
    out = tmp_path / "cal.json"
    point = ["model", "--preset", "flash", "--ratio", "4", "--tokens", "65536", "--machine", "h200x2"]
    assert main([*point, "--cp", "1", "--calibrate", str(tmp_path), "--calibration-out", str(out)]) == 0
    assert "calibration written" in capsys.readouterr().out
    assert Calibration.load(out).factor("indexer", "fwd") == pytest.approx(30.0, rel=1e-9)
    assert main([*point, "--cp", "2", "--partition", "balanced", "--align", "8"]) == 0
    plain = capsys.readouterr().out
    assert main([*point, "--cp", "2", "--partition", "balanced", "--align", "8", "--calibration", str(out)]) == 0
    calibrated = capsys.readouterr().out
    assert "calibrated phase times" in calibrated and "calibrated phase times" not in plain
    split = [line for line in calibrated.splitlines() if line.startswith("split points")]
    assert split and split != [line for line in plain.splitlines() if line.startswith("split points")]
    assert main([*point, "--cp", "1", "--calibrate", str(tmp_path)]) == 2
    assert "--calibration-out" in capsys.readouterr().err
    assert main([*point, "--cp", "2", "--calibration", str(tmp_path / "missing.json")]) == 2
    assert "--calibration" in capsys.readouterr().err


def test_scanned_slots_closed_form() -> None:
    for ratio in (1, 4, 7):
        want = np.cumsum([0] + [t // ratio + 1 for t in range(59)])
        np.testing.assert_array_equal(scanned_slots(np.arange(60), ratio), want)


@pytest.mark.parametrize("scan", ["prefix", "all"])
def test_scanned_indexer_rows_match_the_model_count(scan: str) -> None:
    """The indexer's per-row cost on a scan, summed over each rank's rows (documents of every size, a
    tail padding segment, equal slices), is the per-entry price times the model's scanned slots; an
    unequal split pads every rank's slots, which only the model's count sees (it scans more)."""
    machine = Machine()
    lengths, total = [37, 5, 0, 90, 3], 160
    split = RowSplit.equal(total, 4)
    cal = Calibration(factors={}, indexer_scan=scan)
    costs = RowCosts.for_layer(TINY, 4, machine, calibration=cal)
    assert costs.per_visible_entry == 0.0
    indexer_only = RowCosts(0.0, per_prefix_entry=costs.per_prefix_entry, per_batch_entry=costs.per_batch_entry)
    cu = np.concatenate(([0], np.cumsum(lengths)))
    prefix = np.concatenate(([0.0], np.cumsum(row_costs(indexer_only, cu, total, TINY, 4))))
    est = estimate(TINY, 4, lengths, 4, machine, total=total, split=split)
    per_entry = costs.per_prefix_entry + costs.per_batch_entry
    np.testing.assert_allclose(slice_costs(prefix, split), per_entry * scanned_entries(est, scan), rtol=1e-12)
    if scan == "prefix":  # the slots of the earlier ranks, other documents' included, then its own bound
        assert scanned_entries(est, scan)[3] == sum(3 * 10 + t // 4 + 1 for t in range(40))
    unequal = estimate(TINY, 4, lengths, 4, machine, total=total, split=RowSplit((0, 70, 90, 130, 160)))
    assert unequal.counts.capacity == 18
    assert scanned_entries(unequal, scan).sum() > scanned_entries(est, scan).sum()


@pytest.mark.parametrize("scan", ["prefix", "all"])
def test_fit_on_a_scan_recovers_the_indexer_factor(scan: str, seed: int) -> None:
    """A profile whose indexer time is ``f x`` the scan's bound fits ``f`` on that scan, not on another."""
    est = estimate(FLASH, 4, [30000, 9000, 26536], 2, Machine())
    times = model_class_times(est, scan)
    rows = [(r.rank, f"dsv4cp.{'indexer.topk' if r.phase_class == 'indexer' else 'sparse_attn'}.{r.direction}",
             7.0 * r.bound_ms) for r in times[times["phase_class"] == "indexer"].itertuples()]
    measured = pd.DataFrame(rows, columns=["rank", "phase", "compute_ms"])
    assert fit(measured, est, indexer_scan=scan).factor("indexer", "fwd") == pytest.approx(7.0, rel=1e-9)
    by_rank = fit(measured, est).factor("indexer", "fwd")  # on visible entries: another factor
    assert by_rank != pytest.approx(7.0, rel=1e-3)


def test_sweep_point_split_uses_the_calibration() -> None:
    """A sweep point's balanced split follows the calibration (the ``--calibration`` of ``dsv4cp sweep``
    and ``profile``); its equal split ignores it; records carry the split and the calibration."""
    from dsv4cp.records import METRICS
    from dsv4cp.sweeps.measure import point_inputs, point_split
    from dsv4cp.sweeps.spec import Point

    cal = Calibration(factors={"indexer.fwd": 40.0}, source="test", indexer_scan="prefix")
    point = Point(preset="flash", ratio=4, cp=2, tokens=65536, partition="balanced")
    cfg, lengths = point_inputs(point)
    plain, calibrated = point_split(point, cfg, lengths, Machine()), point_split(point, cfg, lengths, Machine(), cal)
    assert calibrated.rows(0) > plain.rows(0)  # a slower indexer: rank 1, at the document's end, gets fewer rows
    equal = Point(preset="flash", ratio=4, cp=2, tokens=65536)
    assert point_split(equal, cfg, lengths, Machine(), cal) == RowSplit.equal(65536, 2)
    assert {"split", "calibration"} <= set(METRICS)


def test_a_calibration_applies_only_with_its_machine() -> None:
    """Factors are measured over one machine's bounds: balancing on another machine's is refused."""
    cal = Calibration(factors={"indexer.fwd": 3.0}, machine="h200x2")
    RowCosts.for_layer(TINY, 4, Machine(), "fwd", cal)  # the default machine is h200x2
    with pytest.raises(ValueError, match="calibration.machine"):
        RowCosts.for_layer(TINY, 4, Machine(name="other"), "fwd", cal)


def test_calibrate_fits_only_the_asked_packing_and_says_which_pass(tmp_path, capsys, seed: int) -> None:
    """From a sweep's records the record of the asked packing is fitted (forward + backward first) and the
    calibration's source names the pass it measured; a folder holding only another packing's record, or
    a one-document trace asked for a histogram batch, is refused naming the field and both values."""
    est = estimate(FLASH, 4, [65536], 1, Machine())
    phases = _synthetic_profile(est, _known_factors(seed)).to_dict("records")
    one = _record(cp=1, seed=0, phases=phases)
    histogram = _record(cp=1, seed=0, packing="histogram", phases=phases, **{"pass": "fwd+bwd"})
    _write_records(tmp_path / RECORDS_FILE, [one, histogram])
    point = ["model", "--preset", "flash", "--ratio", "4", "--tokens", "65536", "--cp", "1", "--machine", "h200x2",
             "--packing", "histogram", "--calibration-out", str(tmp_path / "cal.json")]
    assert main([*point, "--calibrate", str(tmp_path)]) == 0
    capsys.readouterr()
    assert "packing=histogram loss=sparse pass=fwd+bwd" in json.loads((tmp_path / "cal.json").read_text())["source"]
    (tmp_path / RECORDS_FILE).unlink()
    _write_records(tmp_path / RECORDS_FILE, [one])
    assert main([*point, "--calibrate", str(tmp_path), "--calibration-out", str(tmp_path / "other.json")]) == 2
    assert "measured packing='one', not packing='histogram'" in capsys.readouterr().err
    trace = tmp_path / "trace"
    trace.mkdir()
    pd.DataFrame(phases).to_csv(trace / "overlap.csv", index=False)
    (trace / POINT_FILE).write_text(json.dumps({**FLASH_64K, "cp": 1, "seed": 0}))
    assert main([*point, "--calibrate", str(trace), "--calibration-out", str(tmp_path / "trace.json")]) == 2
    assert "measured packing='one', not packing='histogram'" in capsys.readouterr().err
    assert not (tmp_path / "other.json").exists() and not (tmp_path / "trace.json").exists()


def test_read_profile_reads_records_through_the_record_loader(tmp_path) -> None:
    """A records file is read by ``read_records``: a line that is not a valid record (not JSON, a partial
    record without its point id) is skipped with a warning naming its file and line, never fitted; a file
    of nothing else holds no profile."""
    table = pd.DataFrame({"rank": [0], "phase": ["dsv4cp.sparse_attn.fwd"], "compute_ms": [2.0]})
    records = tmp_path / RECORDS_FILE
    records.write_text("{not json\n" + json.dumps({"status": "ok", "cp": 1, "phases": table.to_dict("records")})
                       + "\n")
    with pytest.warns(UserWarning, match=f"{RECORDS_FILE}:1: ") as caught:
        with pytest.raises(ValueError, match="has no ok record with per-phase times"):
            read_profile(records, cp=1)
    assert any(f"{RECORDS_FILE}:2: " in str(warning.message) for warning in caught)
    append_record(records, _record(cp=1, phases=table.to_dict("records")))
    with pytest.warns(UserWarning, match=f"{RECORDS_FILE}:1: "):
        found = read_profile(records, cp=1, want=FLASH_64K)
    pd.testing.assert_frame_equal(found.table, table)
    assert found.point["point_id"] == _record(cp=1)["point_id"]
