"""Every timed repetition's time is recorded (``time_ms_samples``, max over ranks per repetition), and
the record's median and p20..p80 are those of exactly these samples: ``profile --out`` and the sweep
share :func:`dsv4cp.sweeps.measure.measure_point`'s metrics."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4cp.cli.main import main
from dsv4cp.records import check_record, read_records

REPS = 5


pytestmark = pytest.mark.usefixtures("single_process")  # tests/conftest.py


def test_profile_records_every_repetitions_time(tmp_path, seed, capsys):
    out = tmp_path / "run"
    assert main(["profile", "--preset", "tiny", "--tokens", "128", "--ratio", "4", "--kernel-backend", "torch",
                 "--warmup", "0", "--reps", str(REPS), "--progress", "off", "--seed", str(seed % 1000),
                 "--out", str(out)]) == 0
    (record,) = read_records(out)
    samples = record["time_ms_samples"]
    assert len(samples) == REPS and all(t > 0 for t in samples) and len(set(samples)) > 1
    p20, median, p80 = np.percentile(samples, [20, 50, 80])
    assert (record["time_ms_p20"], record["time_ms_median"], record["time_ms_p80"]) == pytest.approx((p20, median, p80))
    assert check_record(record) is None
    assert f"median {record['time_ms_median']:.3f} ms" in capsys.readouterr().out
