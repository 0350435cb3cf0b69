"""The report names the kernel options a point set, not all of them, and its targets' ``null`` filters
match the axes a table holds as NaN."""

from __future__ import annotations

import math

import pandas as pd

from dsv4cp import kernel_options
from dsv4cp.report import tables
from dsv4cp.targets import parse_targets


def test_kernel_options_become_what_differs_from_the_defaults():
    defaults = kernel_options.resolved()
    changed = dict(defaults, library_compact_slots="0")
    unknown = dict(defaults, an_option_of_another_version="x")
    df = pd.DataFrame({"kernel_options": [defaults, changed, None, unknown], "run": ["r"] * 4})
    out = tables.with_kernel_configuration(df)
    assert list(out["kernel_options"]) == [None, {"library_compact_slots": "0"}, None,
                                           {"an_option_of_another_version": "x"}]
    assert df["kernel_options"].iloc[0] is defaults  # the input is left as it was
    assert tables.with_kernel_configuration(df.drop(columns="kernel_options")).columns.tolist() == ["run"]


def test_null_filters_match_missing_values_as_tables_hold_them():
    (target,) = parse_targets([{"name": "t", "metric": "measured_over_bound", "comparison": "<=", "value": 2.0,
                                "where": {"compile": None, "kernel_options": None, "packing": "one"}}])
    assert target.applies_to({"compile": math.nan, "kernel_options": None, "packing": "one"})
    assert target.applies_to({"compile": None, "packing": "one"})
    assert not target.applies_to({"compile": "inductor", "kernel_options": None, "packing": "one"})
    assert not target.applies_to({"compile": math.nan, "kernel_options": {"library_compact_slots": "0"},
                                  "packing": "one"})
