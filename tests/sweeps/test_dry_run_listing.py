"""``dsv4cp sweep SPEC --dry-run``: the listing is the one written before the dry run was made fast (ids,
labels and problems, byte for byte), it imports no torch, and its fast pieces agree with the slow path
(``Point.point_id``, ``Point.label()``, ``point_problem``) on specs drawn at random."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4cp.choices import ATTENTION_BACKEND_HEAD_DIMS
from dsv4cp.sweeps.listing import iter_listing
from dsv4cp.sweeps.spec import iter_points, iter_rows, parse_spec, point_problem
from dsv4cp.sweeps.strict_yaml import load_strict
from tests.sweeps.test_spec_scale import run_cli_reporting

DATA = Path(__file__).resolve().parent / "data"
LISTED = ["dry_run_shapes", "dry_run_rules"]
"""Specs whose listing (``<name>.txt``) was written by the dry run before it was made fast."""

MAX_RSS_KIB = 120 * 1024
"""The dry run of a small spec peaks near 40 MiB; importing torch alone takes it past 250 MiB."""


def _dry_run(spec: Path) -> tuple[str, str, dict]:
    errors, report = run_cli_reporting(["sweep", str(spec), "--dry-run"], subprocess.PIPE, timeout_s=120)
    return report["stdout"], errors, report


@pytest.mark.parametrize("name", LISTED)
def test_dry_run_lists_as_before_without_importing_torch(name):
    stdout, errors, report = _dry_run(DATA / f"{name}.yaml")
    assert stdout == (DATA / f"{name}.txt").read_text()
    assert report["heavy"] == [], f"the dry run imported {report['heavy']}"
    assert report["peak_rss_kib"] < MAX_RSS_KIB, f"the dry run peaked at {report['peak_rss_kib'] / 1024:.0f} MiB"
    cannot = [line for line in stdout.splitlines() if "CANNOT RUN" in line]
    if cannot:  # refused after the list (exit 2), naming the first point that cannot run
        assert report["code"] == 2 and f"point {cannot[0].split()[0]} " in errors
    else:
        assert report["code"] == 0 and errors == ""


def test_the_listing_matches_the_points_it_stands_for():
    for name in LISTED:
        spec = parse_spec(_yaml(DATA / f"{name}.yaml"))
        assert list(iter_listing(spec)) == _slow_listing(spec)


def test_exclude_rules_that_match_nothing_leave_the_rows_unchanged():
    # two ways through the expansion (rules need each point's values by name): the same rows
    spec = _yaml(DATA / "dry_run_shapes.yaml")
    assert list(iter_rows(parse_spec(spec))) == list(iter_rows(parse_spec({**spec, "exclude": [{"seed": 12345}]})))


def test_the_torch_free_backend_names_are_the_registered_ones():
    registry = importlib.import_module("dsv4cp.ops.sparse_attention")._BACKENDS  # the module, not the op
    registered = {name: backend.head_dims for name, backend in registry.items()}
    assert list(registered.items()) == list(ATTENTION_BACKEND_HEAD_DIMS.items())  # names, head dims and order


@pytest.mark.parametrize("package", ["dsv4cp", "dsv4cp.cp"])
def test_names_imported_on_first_use_are_the_defining_modules_and_no_submodule(package):
    module = importlib.import_module(package)
    submodules = {info.name for info in pkgutil.iter_modules(module.__path__)}
    assert not set(module._PUBLIC) & submodules  # an imported submodule would hide the lazy name
    for name, defining in module._PUBLIC.items():
        assert getattr(module, name) is getattr(importlib.import_module(defining), name)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018


_AXIS_VALUES = {
    "preset": ["tiny"],
    "cp": [1, 2, 3, 4],
    "ratio": [0, 4, 8, 16],
    "packing": ["one", "adversarial", "histogram", "fixed:48", "lengths:30,30"],
    "loss": ["sparse", "dense"],
    "overlap": ["none", "async"],
    "kernel_backend": ["auto", "torch", "cudnn", "triton+flashmla"],
    "recompute": [False, True],
    "pass": ["fwd", "fwd+bwd"],
    "dtype": ["fp32", "bf16", "fp64"],
    "seed": [0, 1, 99],
    "partition": ["equal", "balanced", "measured"],
    "cuda_graph": [False, True],
    "kernel_options": [{}, {"topk_impl": "stream"}, {"topk_impl": "chunked", "topk_keys": "scores"}],
    "deterministic": [False, True],
    "compile": [None, "eager", "inductor"],
}


@st.composite
def _specs(draw) -> dict:
    """A spec of a few varied axes, some fixed, tokens or tokens per rank, maybe a zip group and exclude rules."""
    axes = draw(st.lists(st.sampled_from(sorted(_AXIS_VALUES)), min_size=1, max_size=5, unique=True))
    if "cp" not in axes and draw(st.booleans()):  # cp and tokens decide most of what can run: often both varied
        axes.append("cp")
    tokens_axis = draw(st.sampled_from(["tokens", "tokens_per_rank"]))
    varied = {axis: draw(st.lists(st.sampled_from(_AXIS_VALUES[axis]), min_size=1, max_size=3)) for axis in axes}
    if draw(st.booleans()):
        varied[tokens_axis] = draw(st.lists(st.sampled_from([12, 64, 96, 100, 256, 1024]), min_size=1, max_size=3))
        base = {}
    else:
        base = {tokens_axis: draw(st.sampled_from([64, 96, 100, 1024]))}
    fixed = draw(st.lists(st.sampled_from(sorted(set(_AXIS_VALUES) - set(varied))), max_size=3, unique=True))
    if "cp" not in varied and "cp" not in fixed:
        fixed.append("cp")
    base.update({axis: draw(st.sampled_from(_AXIS_VALUES[axis])) for axis in fixed})
    spec = {"name": "drawn", "base": base, "axes": varied}
    same_length = [axis for axis in varied if len(varied[axis]) == len(varied[axes[0]])]
    if len(same_length) >= 2 and draw(st.booleans()):
        spec["zip"] = [same_length[:2]]
    rules = [{axis: draw(st.sampled_from(_AXIS_VALUES[axis]))}
             for axis in draw(st.lists(st.sampled_from(sorted(_AXIS_VALUES)), max_size=2))]
    if rules:
        spec["exclude"] = rules
    return spec


@settings(max_examples=200, deadline=None)
@given(_specs())
def test_fast_listing_agrees_with_the_points_on_drawn_specs(data):
    spec = parse_spec(data)
    slow = _outcome(lambda: _slow_listing(spec))
    assert _outcome(lambda: list(iter_listing(spec))) == slow
    # with a rule that matches nothing, the points are taken by name: the same rows (or the same refusal)
    unmatched = {**data, "exclude": [*data.get("exclude", []), {"seed": 12345}]}
    assert _outcome(lambda: list(iter_rows(parse_spec(unmatched)))) == _outcome(lambda: list(iter_rows(spec)))


def _outcome(listing) -> tuple:
    """What a listing gave: its items, or the message of the ``ValueError`` it raised (a measured split
    at cp 1, or no point left after the rules)."""
    try:
        return ("listed", listing())
    except ValueError as err:
        return ("refused", str(err))


def _slow_listing(spec) -> list[tuple]:
    return [(point.point_id, point.label(), point_problem(point), point.cp) for point in iter_points(spec)]


def _yaml(path: Path) -> dict:
    return load_strict(path.read_text())
