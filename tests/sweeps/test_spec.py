"""Sweep specs: expansion (product, zip, exclude, tokens per rank), every validation error, duplicate
YAML keys, run names that would leave runs/, and the points that cannot run (found at expansion)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dsv4cp.records import AXES
from dsv4cp.sweeps.spec import (
    SPEC_KEYS,
    Point,
    RunOptions,
    expand,
    iter_points,
    load_spec,
    make_point,
    parse_spec,
    point_problem,
)
from dsv4cp.sweeps.strict_yaml import MAX_ALIASED_VALUES

SWEEPS = Path(__file__).resolve().parents[2] / "sweeps"


def _spec(**parts) -> dict:
    spec = {"name": "t", "base": {"tokens": 256}}
    spec.update(parts)
    return spec


def test_product_in_written_order_with_base_values():
    points = expand(parse_spec(_spec(base={"tokens": 256, "preset": "tiny", "dtype": "fp64"},
                                     axes={"cp": [1, 2], "ratio": [0, 4, 8]})))
    assert [(p.cp, p.ratio) for p in points] == [(1, 0), (1, 4), (1, 8), (2, 0), (2, 4), (2, 8)]
    assert {p.dtype for p in points} == {"fp64"}
    assert {p.tokens for p in points} == {256}
    assert [p.tokens_per_rank for p in points] == [256] * 3 + [128] * 3


def test_zip_varies_axes_together_and_exclude_drops_matches():
    spec = parse_spec(_spec(
        base={},
        axes={"tokens": [128, 256, 512], "packing": ["one", "fixed:64", "histogram"], "cp": [1, 2]},
        zip=[["tokens", "packing"]],
        exclude=[{"cp": 2, "packing": "fixed:64"}, {"cp": 1, "tokens": 512}],
    ))
    got = [(p.tokens, p.packing, p.cp) for p in expand(spec)]
    assert got == [(128, "one", 1), (128, "one", 2), (256, "fixed:64", 1), (512, "histogram", 2)]


def test_exclude_matches_default_and_derived_axis_values():
    # cp is left at its default 1, and tokens_per_rank follows from tokens and cp: rules still match them
    defaulted = parse_spec(_spec(axes={"ratio": [0, 4]}, exclude=[{"cp": 1, "ratio": 4}]))
    assert [p.ratio for p in expand(defaulted)] == [0]
    derived = parse_spec(_spec(axes={"cp": [1, 2]}, exclude=[{"tokens_per_rank": 128}]))
    assert [(p.cp, p.tokens_per_rank) for p in expand(derived)] == [(1, 256)]


def test_tokens_per_rank_scales_with_cp_and_dedupes_equal_points():
    spec = parse_spec(_spec(base={"tokens_per_rank": 128}, axes={"cp": [1, 2, 4]}))
    assert [(p.cp, p.tokens, p.tokens_per_rank) for p in expand(spec)] == [(1, 128, 128), (2, 256, 128), (4, 512, 128)]
    # the same measurement reached twice (here: by a repeated value) is kept once
    twice = parse_spec(_spec(axes={"cp": [2, 2], "ratio": [4]}))
    assert len(expand(twice)) == 1


def test_point_axes_cover_every_record_axis_and_ids_are_stable():
    point = make_point({"tokens": 256, "cp": 2, "pass": "fwd"})
    axes = point.axes()
    assert tuple(axes) == AXES and axes["pass"] == "fwd" and axes["tokens_per_rank"] == 128
    assert point.point_id == make_point({"cp": 2, "pass": "fwd", "tokens": 256}).point_id
    assert point.point_id != make_point({"tokens": 256, "cp": 2}).point_id  # pass differs
    # tokens not divisible by cp: no tokens_per_rank, and the point cannot run (expansion says so)
    assert make_point({"tokens": 255, "cp": 2}).tokens_per_rank is None


BAD_SPECS = [
    ({"name": "t", "axes": {"cp": [1]}, "bases": {}}, "spec: unknown key 'bases'"),
    (_spec(axes={"cpu": [1]}), "axes: unknown axis 'cpu'"),
    (_spec(base={"tokens": 256, "colour": 1}), "base: unknown axis 'colour'"),
    (_spec(axes={"preset": ["tiny", "huge"]}), "axes.preset[1]: unknown value 'huge'"),
    (_spec(axes={"overlap": ["sometimes"]}), "axes.overlap[0]: unknown value 'sometimes'; allowed: ['none', 'async']"),
    (_spec(axes={"loss": ["sparse", "l2"]}), "axes.loss[1]: unknown value 'l2'"),
    (_spec(axes={"pass": ["bwd"]}), "axes.pass[0]: unknown value 'bwd'"),
    (_spec(axes={"dtype": ["float16"]}), "axes.dtype[0]: unknown value 'float16'"),
    (_spec(axes={"partition": ["zigzag"]}), "axes.partition[0]: unknown value 'zigzag'"),
    (_spec(axes={"packing": ["fixed"]}), "axes.packing[0]: unknown packing 'fixed'"),
    (_spec(axes={"packing": ["fixed:0"]}), "axes.packing[0]: unknown packing 'fixed:0'"),
    (_spec(axes={"packing": ["zigzag"]}), "allowed: one, fixed:<len>, histogram"),
    (_spec(axes={"kernel_backend": ["cuda"]}), "axes.kernel_backend[0]: unknown sparse-attention backend 'cuda'"),
    (_spec(axes={"cp": [0]}), "axes.cp[0]: must be an int >= 1, got 0"),
    (_spec(axes={"cp": [True]}), "axes.cp[0]: must be an int >= 1, got True"),
    (_spec(axes={"ratio": [-4]}), "axes.ratio[0]: must be an int >= 0"),
    (_spec(axes={"recompute": ["yes"]}), "axes.recompute[0]: must be true or false"),
    (_spec(axes={"seed": [1.5]}), "axes.seed[0]: must be an int >= 0"),
    (_spec(axes={"cp": []}), "axes.cp: must be a non-empty list"),
    (_spec(axes={"cp": 2}), "axes.cp: must be a non-empty list"),
    (_spec(axes={"tokens": [256]}), "axes.tokens: also set in base"),
    ({"name": "t", "axes": {"cp": [1, 2]}}, "tokens: give exactly one of tokens and tokens_per_rank"),
    (_spec(base={"tokens": 256, "tokens_per_rank": 128}), "tokens: give exactly one"),
    (_spec(axes={"cp": [1], "ratio": [4]}, zip=[["cp", "ratio", "seed"]]),
     "zip[0]: 'seed' is not one of the varied axes"),
    (_spec(axes={"cp": [1, 2], "ratio": [4]}, zip=[["cp", "ratio"]]), "zip[0]: zipped axes need lists of equal length"),
    (_spec(axes={"cp": [1]}, zip=[["cp"]]), "zip[0]: must list at least two axis names"),
    (_spec(axes={"cp": [1], "ratio": [4], "seed": [0]}, zip=[["cp", "ratio"], ["ratio", "seed"]]),
     "zip[1]: axis 'ratio' is already in another zip group"),
    (_spec(exclude=[{}]), "exclude[0]: an empty rule"),
    (_spec(exclude=[{"cp": "two"}]), "exclude[0].cp: must be an int >= 1"),
    (_spec(exclude=[{"gpu": 1}]), "exclude[0]: unknown axis 'gpu'"),
    (_spec(run={"reps": 0}), "run.reps: must be an int >= 1, got 0"),
    (_spec(run={"warmup": -1}), "run.warmup: must be an int >= 0"),
    (_spec(run={"repeats": 3}), "run: unknown option 'repeats'"),
    (_spec(name=""), "name: must be a non-empty string"),
    (_spec(name="../../evil"), "name: must name one folder inside runs/"),
    (_spec(name="/tmp/evil"), "name: must name one folder inside runs/"),
    (_spec(name="a/b"), "name: must name one folder inside runs/"),
    (_spec(name=".."), "name: must name one folder inside runs/"),
    (_spec(name="a\\b"), "name: must name one folder inside runs/"),
    (_spec(name=7), "name: must be a non-empty string, got 7"),
    ([1, 2], "spec: must be a mapping"),
]
BAD_IDS = [f"{i}-{message.split(':')[0]}" for i, (_, message) in enumerate(BAD_SPECS)]


@pytest.mark.parametrize("data,message", BAD_SPECS, ids=BAD_IDS)
def test_validation_errors_name_the_field_and_value(data, message):
    with pytest.raises(ValueError) as err:
        parse_spec(data)
    assert message in str(err.value)


def test_load_spec_reads_yaml_and_rejects_bad_files(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: {tokens: 64}\naxes:\n  cp: [1, 2]\nrun: {reps: 2}\n")
    spec = load_spec(path)
    assert spec.name == "mine" and spec.run == RunOptions(reps=2)  # the file's stem names an unnamed spec
    assert [p.cp for p in expand(spec)] == [1, 2]
    with pytest.raises(ValueError, match="is not a file"):
        load_spec(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("axes: [cp: 1\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_spec(broken)


@pytest.mark.parametrize("path", sorted(SWEEPS.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_specs_load_and_expand(path):
    spec = load_spec(path)
    points = expand(spec)
    assert spec.name == path.stem and points
    assert all(isinstance(p, Point) for p in points)
    assert [(p.point_id, point_problem(p)) for p in points if point_problem(p)] == []  # every point can run
    if spec.name != "smoke":  # the GPU specs: bf16, few repetitions (the GPU time budget is small)
        assert {p.dtype for p in points} == {"bf16"} and spec.run.reps <= 6


def test_smoke_spec_covers_w_c_h_both_passes_and_two_cp():
    points = expand(load_spec(SWEEPS / "smoke.yaml"))
    assert {p.ratio for p in points} == {0, 4, 8}
    assert {p.direction for p in points} == {"fwd", "fwd+bwd"}
    assert {p.cp for p in points} == {1, 2}
    assert {p.preset for p in points} == {"tiny"}
    assert len({p.packing for p in points}) >= 3


def test_spec_keys_table_names_every_key_a_spec_may_hold():
    with pytest.raises(ValueError) as err:
        parse_spec(_spec(target={}))
    assert str(err.value) == f"spec: unknown key 'target'; allowed: {list(SPEC_KEYS)}"
    assert all(isinstance(text, str) and text for text in SPEC_KEYS.values())


def test_a_name_inside_runs_is_kept():
    assert parse_spec(_spec(name="cp_scaling-2x8.v2")).name == "cp_scaling-2x8.v2"
    assert parse_spec(_spec(name="a..b")).name == "a..b"  # two dots inside a name stay inside runs/


DUPLICATE_KEYS = [
    ("name: t\nbase: {tokens: 64}\naxes: {cp: [1], cp: [2]}\n", "duplicate key 'cp' at line 3 (first given at line 3)"),
    ("name: t\nbase: {tokens: 64}\naxes:\n  cp: [1]\n  ratio: [0]\n  cp: [2]\n",
     "duplicate key 'cp' at line 6 (first given at line 4)"),
    ("name: t\nbase: {tokens: 64}\nname: u\n", "duplicate key 'name' at line 3 (first given at line 1)"),
    ("name: t\nbase: {tokens: 64}\nexclude:\n  - {cp: 1, cp: 2}\n",
     "duplicate key 'cp' at line 4 (first given at line 4)"),
]


@pytest.mark.parametrize("text,message", DUPLICATE_KEYS, ids=["flow", "block", "top-level", "in-a-list"])
def test_a_key_given_twice_is_an_error_naming_key_and_lines(tmp_path, text, message):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_spec(path)
    assert str(err.value) == f"spec: {path}: {message}"


def test_merge_keys_still_override_without_being_duplicates(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("name: t\nshared: &shared {tokens: 64, cp: 1}\n".replace("shared: &shared", "base: &shared")
                    + "exclude:\n  - {<<: *shared, cp: 2}\n")
    spec = load_spec(path)
    assert spec.exclude == ({"tokens": 64, "cp": 2},)  # the explicit key wins over the merged one


def _alias_bomb(levels: int) -> str:
    """A spec whose last anchor stands for 9 ** levels values in about 50 bytes a level."""
    anchors = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    anchors += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "name: t\nbase: {tokens: 64}\ndescription:\n" + "".join(f"  - {anchor}\n" for anchor in anchors)


@pytest.mark.parametrize("levels", [6, 12])  # 12: 9 ** 12 values, beyond any memory if expanded
def test_aliases_expanding_a_spec_beyond_their_bound_are_refused_before_it_is_built(tmp_path, levels):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(levels))
    started = time.monotonic()
    with pytest.raises(ValueError) as err:
        load_spec(path)
    assert time.monotonic() - started < 5  # counted on the written graph, not expanded
    assert str(err.value).startswith(f"spec: {path}: its aliases (*name) expand it by "), str(err.value)[:300]
    assert f"more than the {MAX_ALIASED_VALUES} allowed" in str(err.value)


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("name: t\nbase: {tokens: 64}\ndescription: &loop [1, *loop]\n")
    with pytest.raises(ValueError) as err:
        load_spec(path)
    assert str(err.value) == (f"spec: {path}: an alias refers to a value that contains it (the anchor at line 3): "
                              "it would expand without end")


def test_aliases_within_their_bound_still_load(tmp_path):
    path = tmp_path / "shared.yaml"
    path.write_text("name: t\nbase: {tokens: 64}\naxes: {ratio: [0, 4], seed: [0, 1]}\n"
                    "exclude:\n  - &rule {ratio: 4, seed: 1}\n  - *rule\n")
    assert load_spec(path).exclude == ({"ratio": 4, "seed": 1}, {"ratio": 4, "seed": 1})


def test_a_spec_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: t\ndescription: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"spec: .*latin1.yaml is not UTF-8 text"):
        load_spec(path)


# (spec parts, index of the point that cannot run, the start of the reason)
CANNOT_RUN = [
    ({"base": {"tokens": 255}, "axes": {"cp": [1, 2]}}, 1, "tokens: 255 rows are not divisible by cp=2"),
    ({"base": {"tokens": 8, "ratio": 4}, "axes": {"cp": [1, 2]}}, 1, "tokens: each of the 2 ranks holds 4 rows, "
     "fewer than the halo of 8 rows"),
    ({"base": {"tokens": 256}, "axes": {"ratio": [4, 128]}}, 1, "ratio: 128 with preset 'tiny': window: an H layer"),
    ({"base": {"tokens": 16}, "axes": {"packing": ["one", "lengths:10,10"]}}, 1,
     "packing: 'lengths:10,10' holds 20 tokens, more than tokens=16"),
    ({"base": {"tokens": 256}, "axes": {"kernel_backend": ["torch", "flashmla"]}}, 1,
     "backend: 'flashmla' runs head dim D in (512,), not 32"),
]


@pytest.mark.parametrize("parts,index,reason", CANNOT_RUN, ids=["divisible", "halo", "ratio", "packing", "head-dim"])
def test_points_that_cannot_run_are_found_at_expansion(parts, index, reason):
    points = expand(parse_spec({"name": "t", **parts}))
    problems = [point_problem(p) for p in points]
    assert problems[index].startswith(reason), problems[index]
    assert [i for i, problem in enumerate(problems) if problem is not None] == [index]


def test_no_point_left_after_the_exclude_rules_is_an_error_of_expansion():
    spec = parse_spec(_spec(axes={"cp": [1]}, exclude=[{"cp": 1}]))
    with pytest.raises(ValueError, match="spec 't': no point left after the exclude rules"):
        expand(spec)


def test_repeated_values_are_dropped_before_the_product_as_duplicate_points_were():
    # the same points, each once, in the order of their first appearance
    spec = parse_spec(_spec(base={}, axes={"tokens": [64, 128, 64, 256], "cp": [2, 1, 2], "packing": ["one", "fixed:16",
                                                                                                       "one", "one"]},
                            zip=[["tokens", "packing"]]))
    got = [(p.tokens, p.packing, p.cp) for p in iter_points(spec)]
    assert got == [(64, "one", 2), (64, "one", 1), (128, "fixed:16", 2), (128, "fixed:16", 1), (256, "one", 2),
                   (256, "one", 1)]
    ids = [p.point_id for p in iter_points(spec)]
    assert len(set(ids)) == len(ids)
