"""The kernel options registry (:mod:`dsv4cp.kernel_options`): precedence explicit > environment >
default, parsing of each type, errors naming the option, the variable and the value, nesting, and
what-ran notes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dsv4cp import kernel_options as ko


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """Every option's variable unset, whatever the shell running the tests exports."""
    for option in ko.OPTIONS.values():
        monkeypatch.delenv(option.env, raising=False)


def test_every_option_is_complete_and_named_after_its_variable():
    assert len(ko.OPTIONS) == 38
    for name, option in ko.OPTIONS.items():
        assert option.name == name and option.env == "DSV4CP_" + name.upper(), name
        assert option.kind in (ko.CHOICE, ko.FLAG, ko.TILE, ko.SLOWDOWN) and option.op and option.doc, name
        if option.kind == ko.CHOICE:
            assert option.default in option.choices, name
        if option.kind == ko.TILE:
            assert option.default is None and len(option.fields) >= 1, name
        assert option.parse(option.text(option.default), name) == option.default, name


def test_precedence_explicit_over_environment_over_default(monkeypatch):
    assert (ko.get("topk_impl"), ko.source("topk_impl")) == ("chunked", "default")
    monkeypatch.setenv("DSV4CP_TOPK_IMPL", "stream")
    state = lambda: (ko.get("topk_impl"), ko.source("topk_impl"), ko.where("topk_impl"))  # noqa: E731
    assert state() == ("stream", "env", "DSV4CP_TOPK_IMPL")
    with ko.overrides({"topk_impl": "chunked"}):
        assert state() == ("chunked", "explicit", "topk_impl")
    assert ko.get("topk_impl") == "stream"
    monkeypatch.setenv("DSV4CP_TOPK_IMPL", "  ")  # blank: unset
    assert ko.source("topk_impl") == "default"


def test_overrides_nest_and_restore():
    with ko.overrides({"triton_dq_in_dkv": "0", "triton_fwd_config": "64,32,4,2"}):
        with ko.overrides({"triton_dq_in_dkv": True}):
            assert ko.get("triton_dq_in_dkv") is True and ko.get("triton_fwd_config") == (64, 32, 4, 2)
        assert ko.get("triton_dq_in_dkv") is False
    assert ko.get("triton_dq_in_dkv") is True and ko.get("triton_fwd_config") is None
    with pytest.raises(RuntimeError), ko.overrides({"topk_keys": "scores"}):
        raise RuntimeError  # an error inside the block restores too
    assert ko.get("topk_keys") == "packed"


def test_parsing_of_each_type(monkeypatch):
    monkeypatch.setenv("DSV4CP_TRITON_PROBS_SLOTS_ON_M", "0")
    assert ko.get("triton_probs_slots_on_m") is False
    monkeypatch.setenv("DSV4CP_TRITON_SELECT_CONFIG", " 64, 6,4,1 ")
    assert ko.get("triton_select_config") == (64, 6, 4, 1)
    monkeypatch.setenv("DSV4CP_TRITON_SELECT_CONFIG", "auto")
    assert ko.get("triton_select_config") is None
    with ko.overrides({"triton_norm_rope_config": (2, 4), "topk_select": "radix", "triton_dq_in_dkv": 0}):
        assert ko.get("triton_norm_rope_config") == (2, 4)
        assert ko.get("topk_select") == "radix" and ko.get("triton_dq_in_dkv") is False


@pytest.mark.parametrize("name,text,pattern", [
    ("topk_impl", "radix",
     r"^DSV4CP_TOPK_IMPL: must be one of 'chunked', 'stream', got 'radix' \(kernel option topk_impl\)"),
    ("triton_dq_in_dkv", "yes", r"^DSV4CP_TRITON_DQ_IN_DKV: must be '0' or '1', got 'yes'"),
    ("triton_fwd_config", "64,64,4", r"^DSV4CP_TRITON_FWD_CONFIG: expected 'block_h,block_k,num_warps,num_stages' "
                                     r"\(4 integers\) or 'auto', got '64,64,4'"),
    ("triton_norm_rope_config", "a,b", r"^DSV4CP_TRITON_NORM_ROPE_CONFIG: expected 'block_h,num_warps'.*'a,b'"),
])
def test_bad_environment_values_name_variable_option_and_value(monkeypatch, name, text, pattern):
    monkeypatch.setenv(ko.OPTIONS[name].env, text)
    with pytest.raises(ValueError, match=pattern):
        ko.get(name)
    with pytest.raises(ValueError, match=pattern):
        ko.resolved()


def test_bad_explicit_values_fail_on_entry_and_change_nothing():
    with pytest.raises(ValueError, match=r"^topk_keys: must be one of 'packed', 'scores', got 'int64'$"):
        with ko.overrides({"topk_impl": "stream", "topk_keys": "int64"}):
            pass
    assert ko.get("topk_impl") == "chunked"
    with pytest.raises(ValueError, match=r"^triton_fwd_config: expected .* got \(64, 1.5, 4, 1\)"):
        ko.check_values({"triton_fwd_config": (64, 1.5, 4, 1)})
    with pytest.raises(ValueError, match=r"^kernel option: unknown name 'topk'; choose from topk_impl, topk_select"):
        ko.overrides({"topk": "stream"}).__enter__()


def test_parse_assignments():
    assert ko.parse_assignments(["topk_impl=stream", " triton_fwd_config = 64,32,4,2 ", "topk_impl=chunked"]) == {
        "topk_impl": "chunked", "triton_fwd_config": "64,32,4,2"}
    with pytest.raises(ValueError, match=r"^kernel option: unknown name 'nope'; choose from .*triton_norm_rope_config"):
        ko.parse_assignments(["nope=1"])
    with pytest.raises(ValueError, match=r"^kernel option: expected NAME=VALUE, got 'topk_impl'"):
        ko.parse_assignments(["topk_impl"])
    with pytest.raises(ValueError, match=r"^triton_dq_in_dkv: must be '0' or '1', got 'maybe'"):
        ko.parse_assignments(["triton_dq_in_dkv=maybe"])


def test_resolved_and_describe(monkeypatch):
    monkeypatch.setenv("DSV4CP_TOPK_SELECT", "torch")
    with ko.overrides({"triton_lse_config": "16,16,4,1"}):
        values = ko.resolved()
        rows = {row["name"]: row for row in ko.describe()}
    assert list(values) == list(ko.OPTIONS) and json.loads(json.dumps(values)) == values
    assert values["topk_select"] == "torch" and values["triton_lse_config"] == "16,16,4,1"
    assert values["triton_dq_in_dkv"] == "1" and values["triton_fwd_config"] == "auto"
    assert (rows["topk_select"]["source"], rows["topk_select"]["default"]) == ("env", "auto")
    assert (rows["triton_lse_config"]["source"], rows["triton_lse_config"]["value"]) == ("explicit", "16,16,4,1")
    assert rows["topk_impl"]["source"] == "default" and rows["topk_impl"]["allowed"] == "chunked | stream"
    assert set(rows["topk_impl"]) == {"name", "value", "source", "default", "allowed", "env", "op", "doc"}


def test_backends_ran_notes():
    ko.reset_backends_ran()
    ko.note_backend("sparse_attention.fwd", "triton")
    ko.note_backend("indexer_topk", "torch")
    ko.note_backend("sparse_attention.fwd", "flashmla")
    assert ko.backends_ran() == {"indexer_topk": "torch", "sparse_attention.fwd": "flashmla"}
    ko.reset_backends_ran()
    assert ko.backends_ran() == {}


def test_kernel_options_fields_are_the_registry():
    """One field per option, of its default, in the registry's order (``origins`` last, not compared)."""
    fields = [f.name for f in dataclasses.fields(ko.KernelOptions)]
    assert fields == [*ko.OPTIONS, "origins"]
    defaults = ko.KernelOptions()
    for name, option in ko.OPTIONS.items():
        assert getattr(defaults, name) == option.default, name
        assert f"``{name}``: {option.doc}" in ko.KernelOptions.__doc__, name


def test_kernel_options_resolve_precedence_and_errors(monkeypatch):
    """Overrides over an enclosing block over the variable over the default; a variable's bad value named
    by the variable, an override's by the option; the result hashable and equal to ``resolved()``."""
    assert ko.KernelOptions.resolve() == ko.KernelOptions()
    monkeypatch.setenv("DSV4CP_TOPK_IMPL", "stream")
    monkeypatch.setenv("DSV4CP_TRITON_FWD_CONFIG", "64,32,8,3")
    got = ko.KernelOptions.resolve()
    assert (got.topk_impl, got.triton_fwd_config, got.where("topk_impl")) == ("stream", (64, 32, 8, 3),
                                                                              "DSV4CP_TOPK_IMPL")
    assert got.texts() == ko.resolved() and hash(got) == hash(ko.KernelOptions.resolve())
    with ko.overrides({"topk_impl": "chunked", "triton_dq_in_dkv": "0"}):
        inner = ko.KernelOptions.resolve({"triton_dq_in_dkv": True})
    assert (inner.topk_impl, inner.triton_dq_in_dkv, inner.where("topk_impl")) == ("chunked", True, "topk_impl")
    monkeypatch.setenv("DSV4CP_TRITON_DQ_IN_DKV", "yes")
    with pytest.raises(ValueError, match=r"^DSV4CP_TRITON_DQ_IN_DKV: .*'yes' \(kernel option triton_dq_in_dkv\)"):
        ko.KernelOptions.resolve()
    with pytest.raises(ValueError, match=r"^triton_fwd_logits: .*'wide'"):
        ko.KernelOptions.resolve({"triton_fwd_logits": "wide", "triton_dq_in_dkv": "1"})
    with pytest.raises(ValueError, match=r"^kernel option: unknown name 'fast'"):
        ko.KernelOptions.resolve({"fast": "1"})


def test_kernel_options_from_resolved_round_trips_a_record():
    """A record's ``kernel_options`` (every option as text, or only some) give back the options it ran;
    values in their one form (a list tile becomes a tuple: hashable)."""
    options = ko.KernelOptions(topk_impl="stream", triton_bwd_config=[32, 64, 8, 2], triton_dkv_one_product="0")
    assert options.triton_bwd_config == (32, 64, 8, 2) and options.triton_dkv_one_product is False
    assert ko.KernelOptions.from_resolved(options.texts()) == options
    assert ko.KernelOptions.from_resolved({"topk_impl": "stream"}).non_default() == {"topk_impl": "stream"}
    assert options.non_default() == ko.non_default(options.texts())
    with pytest.raises(ValueError, match=r"^triton_bwd_config: expected .*'1,2'"):
        ko.KernelOptions.from_resolved({"triton_bwd_config": "1,2"})


def test_the_injected_slowdown_is_off_by_default_parsed_and_recorded(monkeypatch):
    assert ko.get("inject_slowdown") is None and ko.resolved()["inject_slowdown"] == "off"
    assert "inject_slowdown" not in (ko.configuration({}) or {})  # off: no point id names it
    monkeypatch.setenv("DSV4CP_INJECT_SLOWDOWN", " sparse_attn:0.25 ")
    assert ko.KernelOptions.resolve().inject_slowdown == ("sparse_attn", 0.25)
    assert ko.resolved()["inject_slowdown"] == "sparse_attn:0.25"
    for bad in ("q_proj:0.2", "sparse_attn:0", "sparse_attn:-1", "sparse_attn:x", "sparse_attn", "sparse_attn:nan"):
        with pytest.raises(ValueError, match=r"^inject_slowdown: expected 'off' or PHASE:FRACTION"):
            ko.canonical({"inject_slowdown": bad})


def test_an_injected_slowdown_lengthens_only_its_phase_by_its_fraction():
    import time

    from dsv4cp.profiling.injection import injected_slowdown

    def cpu_ms(phase: str, setting) -> float:
        start = time.process_time()
        with injected_slowdown(phase, setting):
            deadline = time.process_time() + 0.02
            while time.process_time() < deadline:  # 20 ms of CPU work
                pass
        return (time.process_time() - start) * 1e3

    assert cpu_ms("sparse_attn", None) < 25  # off
    assert 29 < cpu_ms("sparse_attn", ("sparse_attn", 0.5)) < 35  # 20 ms + 50 %
    assert cpu_ms("q_proj", ("sparse_attn", 0.5)) < 25  # another phase: untouched
