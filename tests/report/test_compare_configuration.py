"""``dsv4cp compare`` pairs two records only when they ran the same kernels, resolved as ``sweep --resume``
and the report resolve them (:func:`dsv4cp.records.configuration_differences`): an option's other value or
another backend makes a point not comparable, naming what differs; an old record lacking an option is
comparable where what ran before the option existed is known
(:data:`dsv4cp.kernel_options.BEFORE_IT_EXISTED`), and unknown otherwise.

The runs are written with the project's record writer (:func:`dsv4cp.records.make_record`), their times
drawn from the test's seed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from report_helpers import grid, point_metrics

from dsv4cp import kernel_options
from dsv4cp.cli.main import main
from dsv4cp.records import append_record, configuration_differences, configuration_key, make_record, read_records
from dsv4cp.report.compare import config_differences

POINTS = grid(cp=[1, 2], tokens=[4096, 16384])
BACKENDS = {"sparse_attention.fwd": "triton", "sparse_attention.bwd": "triton"}
SWITCHABLE = sorted(name for name, option in kernel_options.OPTIONS.items()
                    if option.kind in (kernel_options.CHOICE, kernel_options.FLAG))
"""Options with a finite set of values: one can be moved to another value it may hold."""


def _write(run_dir: Path, seed: int, options: dict[str, str], backends: dict[str, str]) -> Path:
    """One ``ok`` record per point, every one run with ``options`` and ``backends``; the points' ids name the
    options the version that ran them had to set (not those at a former default: it was the default then)."""
    rng = np.random.default_rng(seed)
    named = kernel_options.configurations(options)[-1] or None
    for axes in POINTS:
        record = make_record({**axes, "kernel_options": named}, point_metrics(rng, axes, profiled=False),
                             sweep="synthetic", status="ok", machine="2xNVIDIA H200", git_sha="0" * 40,
                             kernel_options=options, backends=backends)
        append_record(run_dir / "records.jsonl", record)
    return run_dir


def _other_value(name: str, value: str, rng: np.random.Generator) -> str:
    option = kernel_options.OPTIONS[name]
    values = option.choices if option.kind == kernel_options.CHOICE else ("0", "1")
    return str(rng.choice([v for v in values if v != value]))


def _compare(tmp_path: Path, seed: int, base: tuple[dict, dict], new: tuple[dict, dict], capsys) -> tuple[int, str]:
    a = _write(tmp_path / "base", seed, *base)
    b = _write(tmp_path / "new", seed + 1, *new)
    assert len(read_records(a)) == len(read_records(b)) == len(POINTS)
    code = main(["compare", str(a), str(b)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _ids(run_dir: Path) -> set[str]:
    return {record["point_id"] for record in read_records(run_dir)}


@pytest.mark.parametrize("offset", range(4))
def test_another_resolved_option_or_backend_is_not_comparable_and_named(tmp_path, seed, offset, capsys):
    rng = np.random.default_rng(seed + offset)
    now = kernel_options.resolved()
    name = str(rng.choice(SWITCHABLE))
    other = {**now, name: _other_value(name, now[name], rng)}
    code, text = _compare(tmp_path / "options", seed, (now, BACKENDS), (other, BACKENDS), capsys)
    assert code == 2 and f"none of the {len(POINTS)} matched points is comparable" in text
    assert f"configuration differs: kernel_options.{name} {now[name]} -> {other[name]}" in text
    # one point id, other kernels: a record written while an option's default was another value
    name = str(rng.choice(sorted(set(kernel_options.FORMER_DEFAULTS) & set(now))))
    then = {**now, name: kernel_options.FORMER_DEFAULTS[name][0]}
    code, text = _compare(tmp_path / "former", seed, (then, BACKENDS), (now, BACKENDS), capsys)
    assert _ids(tmp_path / "former" / "base") == _ids(tmp_path / "former" / "new")
    assert code == 2 and f"configuration differs: kernel_options.{name} {then[name]} -> {now[name]}" in text
    op = str(rng.choice(sorted(BACKENDS)))
    code, text = _compare(tmp_path / "backends", seed, (now, BACKENDS), (now, {**BACKENDS, op: "torch"}), capsys)
    assert code == 2 and f"configuration differs: backends.{op} triton -> torch" in text


@pytest.mark.parametrize("offset", range(4))
def test_an_old_record_lacking_an_option_is_comparable_only_where_what_ran_before_it_is_known(
        tmp_path, seed, offset, capsys):
    rng = np.random.default_rng(seed + offset)
    now = kernel_options.resolved()
    known = str(rng.choice(sorted(kernel_options.BEFORE_IT_EXISTED)))
    ran = {**now, known: kernel_options.BEFORE_IT_EXISTED[known]}  # what the old code ran, stated by a new record
    old = {k: v for k, v in ran.items() if k != known}
    code, text = _compare(tmp_path / "known", seed, (old, BACKENDS), (ran, BACKENDS), capsys)
    assert code == 0 and f"{len(POINTS)} compared" in text and "NOT COMPARABLE" not in text
    unknown = str(rng.choice(sorted(set(now) - set(kernel_options.BEFORE_IT_EXISTED))))
    old = {k: v for k, v in now.items() if k != unknown}
    code, text = _compare(tmp_path / "unknown", seed, (old, BACKENDS), (now, BACKENDS), capsys)
    assert code == 2 and f"configuration differs: kernel_options.{unknown} unknown -> {now[unknown]}" in text


@pytest.mark.parametrize("offset", range(4))
def test_differences_are_empty_exactly_when_the_configuration_keys_agree(seed, offset):
    """Random pairs of configurations (options moved, dropped, backends changed, unknown): compare's
    differences and the resume's key give one verdict, and compare names each resolved difference."""
    rng = np.random.default_rng(seed + offset)
    now = kernel_options.resolved()

    def drawn() -> dict:
        options = dict(now)
        for name in rng.choice(SWITCHABLE, size=int(rng.integers(0, 2)), replace=False):
            options[str(name)] = _other_value(str(name), options[str(name)], rng)
        for name in rng.choice(sorted(now), size=int(rng.integers(0, 2)), replace=False):
            del options[str(name)]
        backends = None if rng.random() < 0.2 else {**BACKENDS, "sparse_attention.bwd": str(rng.choice(["triton",
                                                                                                        "torch"]))}
        return {"kernel_options": None if rng.random() < 0.1 else options, "backends": backends,
                "fresh_batches": int(rng.integers(0, 2))}

    for _ in range(50):
        a, b = drawn(), drawn()
        differences = configuration_differences(a, b)
        assert (not differences) == (configuration_key(a) == configuration_key(b)), (a, b)
        assert len(config_differences(a, b)) == len(differences)
        assert config_differences(a, b, ignored=("kernel_options", "backends", "fresh_batches")) == []
