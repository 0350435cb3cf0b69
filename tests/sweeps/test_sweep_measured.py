"""A ``partition: measured`` sweep point on real gloo ranks: the rounds run, the best split is measured and
recorded with the refitted calibration; a measured point at cp 1 is refused when the spec is read."""

from __future__ import annotations

import pytest
import yaml

from dsv4cp.cli.main import main
from dsv4cp.records import read_records
from dsv4cp.sweeps.spec import make_point


def test_measured_point_records_its_best_split(tmp_path):
    spec = tmp_path / "measured.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "measured", "run": {"warmup": 0, "reps": 2},
        "base": {"preset": "tiny", "dtype": "fp32", "kernel_backend": "torch", "ratio": 4, "cp": 2,
                 "tokens": 512, "packing": "one"},
        "axes": {"partition": ["balanced", "measured"]},
    }))
    out = tmp_path / "run"
    assert main(["sweep", str(spec), "--out", str(out), "--nproc", "2", "--progress", "off"]) == 0
    balanced, measured = read_records(out)
    assert balanced["partition"] == "balanced" and measured["partition"] == "measured"
    assert measured["status"] == "ok" and measured["calibration"].startswith("measured split of")
    assert measured["split"][0] == 0 and measured["split"][-1] == 512 and len(measured["split"]) == 3
    assert all(t > 0 for t in measured["rank_time_ms_median"])


def test_measured_needs_two_ranks():
    with pytest.raises(ValueError, match="partition: a measured split needs cp >= 2"):
        make_point({"preset": "tiny", "cp": 1, "tokens": 256, "partition": "measured"})
