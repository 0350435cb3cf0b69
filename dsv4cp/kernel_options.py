"""Kernel options: every switch that chooses a kernel variant or pins a launch, in one typed registry.

Each option (:class:`KernelOption`) has a snake_case name, the ``DSV4CP_*`` environment variable it
honours, a type (a choice of words, a flag, or a tile of N named integers), its allowed values, a
default, the op it affects and a one-line doc. A device-dependent default is the word ``auto``: the
op resolves it (and notes what it chose, below). A tile's ``auto`` is the kernel's launch ladder.

:class:`KernelOptions` holds every option's value, one typed field each, resolved once
(:meth:`KernelOptions.resolve`; from a record's texts: :meth:`KernelOptions.from_resolved`) and handed
down as an argument: the layer holds one, the ops take it as ``options=``, their autograd functions keep it
for backward, the kernels get the values they need as keyword arguments and the custom ops as typed inputs.
Nothing below the harness reads an option from this module's state. Where a value comes from, highest
first: the overrides given to :meth:`~KernelOptions.resolve`, an enclosing :func:`overrides` block (the
callers above the layer), the environment variable, the default. This module is the only place in dsv4cp
that reads those variables (and Triton's own ``TRITON_INTERPRET``); :func:`get`, :func:`resolved` and
:func:`describe` serve the callers above the layer (records, ``dsv4cp env``).

What actually ran (an explicit recorder, not an input: nothing reads it back to choose a kernel): the ops
call :func:`note_backend` with the implementation of each op and direction
(``sparse_attention.fwd`` -> ``triton``, ``indexer_topk`` -> ``triton/chunked/radix/packed``) and the
kernels' launchers with the tile the ladder picked (``sparse_attention.fwd.config`` ->
``block_h=64,block_k=64,num_warps=4,num_stages=2``); :func:`backends_ran` reads them back for a
record. One dict write per call, no device work.

Standard library only (the bottom layer of the import contract).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

__all__ = [
    "OPTIONS",
    "KernelOption",
    "DEFAULT_OPTIONS",
    "KernelOptions",
    "backends_ran",
    "canonical",
    "check_values",
    "configurations",
    "describe",
    "get",
    "note_backend",
    "overrides",
    "parse_assignments",
    "reset_backends_ran",
    "resolved",
    "source",
    "triton_interpret_requested",
    "where",
]

CHOICE, FLAG, TILE, SLOWDOWN = "choice", "flag", "tile", "slowdown"
AUTO = "auto"
OFF = "off"
_FLAG_TEXT = {"0": False, "1": True}


@dataclass(frozen=True)
class KernelOption:
    """One kernel option. ``kind``: :data:`CHOICE` (one of ``choices``), :data:`FLAG` (``0`` / ``1``),
    :data:`TILE` (``len(fields)`` integers, written ``"a,b,..."``, or ``auto``: the launch ladder) or
    :data:`SLOWDOWN` (``off``, or ``<phase>:<fraction>`` with the phase one of ``choices``).
    ``default``: a word of ``choices`` (``auto`` when the op resolves it by device), a bool for a flag,
    None (``auto`` for a tile, ``off`` for a slowdown)."""

    name: str
    env: str
    kind: str
    op: str
    doc: str
    default: str | bool | None = None
    choices: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    rules: tuple[tuple[str, str], ...] = ()
    """A tile's field -> the rule its value keeps (:data:`TILE_RULES`), checked on parsing, so a bad pin fails
    where the options are resolved and names its variable. Fields without one: ``block_*`` a matrix-unit
    tile, ``num_warps`` / ``num_stages`` at least 1, any other integer."""
    trailing_defaults: tuple[int, ...] = ()
    """A tile's last ``len(trailing_defaults)`` fields may be left out (a tile pinned before they existed):
    parsing fills them in with these values, so both spellings are one setting."""

    def parse(self, value: object, origin: str) -> str | bool | tuple[int, ...] | None:
        """``value`` (text, or a Python value of the option's type) as the option's type; ``ValueError``
        starting with ``origin`` (the option's name, or its variable) and naming the value."""
        if self.kind == CHOICE:
            text = str(value).strip() if isinstance(value, str) else value
            if text not in self.choices:
                raise ValueError(f"{origin}: must be one of {', '.join(map(repr, self.choices))}, got {value!r}"
                                 f"{self._also(origin)}")
            return text
        if self.kind == FLAG:
            if isinstance(value, bool):
                return value
            text = value.strip() if isinstance(value, str) else str(value) if isinstance(value, int) else None
            if text not in _FLAG_TEXT:
                raise ValueError(f"{origin}: must be '0' or '1', got {value!r}{self._also(origin)}")
            return _FLAG_TEXT[text]
        if self.kind == SLOWDOWN:
            return self._parse_slowdown(value, origin)
        return self._parse_tile(value, origin)

    def _parse_slowdown(self, value: object, origin: str) -> tuple[str, float] | None:
        if value is None or (isinstance(value, str) and value.strip() == OFF):
            return None
        if isinstance(value, tuple) and len(value) == 2:
            phase, fraction = value
        else:
            phase, _, fraction = str(value).strip().partition(":")
        try:
            fraction = float(fraction)
        except (TypeError, ValueError):
            fraction = math.nan
        if phase not in self.choices or not 0 < fraction <= 100:
            raise ValueError(f"{origin}: expected 'off' or PHASE:FRACTION with PHASE one of "
                             f"{', '.join(map(repr, self.choices))} and 0 < FRACTION <= 100, got {value!r}"
                             f"{self._also(origin)}")
        return phase, fraction

    def _parse_tile(self, value: object, origin: str) -> tuple[int, ...] | None:
        if value is None or (isinstance(value, str) and value.strip() == AUTO):
            return None
        try:
            parts = value.split(",") if isinstance(value, str) else list(value)  # type: ignore[arg-type]
            if any(isinstance(p, (bool, float)) for p in parts):
                raise ValueError
            numbers = tuple(int(p) for p in parts)
            left_out = len(self.fields) - len(numbers)
            if not 0 <= left_out <= len(self.trailing_defaults):
                raise ValueError
        except (TypeError, ValueError):
            counts = f"{len(self.fields) - len(self.trailing_defaults)} to " if self.trailing_defaults else ""
            raise ValueError(f"{origin}: expected '{','.join(self.fields)}' ({counts}{len(self.fields)} integers) "
                             f"or 'auto', got {value!r}{self._also(origin)}") from None
        if left_out:
            numbers += self.trailing_defaults[len(self.trailing_defaults) - left_out:]
        rules = dict(self.rules)
        for field_name, number in zip(self.fields, numbers):
            rule = rules.get(field_name) or _DEFAULT_RULES.get(field_name) or (
                "tile" if field_name.startswith("block_") else None)
            if rule is not None and not TILE_RULES[rule][0](number):
                raise ValueError(f"{origin}.{field_name}: must be {TILE_RULES[rule][1]}, got {number}"
                                 f"{self._also(origin)}")
        return numbers

    def _also(self, origin: str) -> str:
        """The option's name after an error that starts with its variable."""
        return f" (kernel option {self.name})" if origin == self.env else ""

    def text(self, value: str | bool | tuple[int, ...] | None) -> str:
        """``value`` as the text a record stores (the form :meth:`parse` reads back)."""
        if self.kind == FLAG:
            return "1" if value else "0"
        if self.kind == TILE:
            return AUTO if value is None else ",".join(map(str, value))
        if self.kind == SLOWDOWN:
            return OFF if value is None else f"{value[0]}:{value[1]:g}"
        return str(value)

    @property
    def allowed(self) -> str:
        """The allowed values, in words (for ``dsv4cp env`` and the README)."""
        if self.kind == CHOICE:
            return " | ".join(self.choices)
        if self.kind == FLAG:
            return "0 | 1"
        if self.kind == SLOWDOWN:
            return f"off | {' | '.join(self.choices)}:<fraction>"
        required = len(self.fields) - len(self.trailing_defaults)
        optional = "".join(f"[,{name}]" for name in self.fields[required:])
        return f"auto | {','.join(self.fields[:required])}{optional}"


TILE_RULES = {
    "tile": (lambda n: n >= 16 and not n & (n - 1), "a power of two >= 16 (matrix-unit tile)"),
    "power_of_two": (lambda n: n >= 1 and not n & (n - 1), "a power of two"),
    "positive": (lambda n: n >= 1, ">= 1"),
    "non_negative": (lambda n: n >= 0, ">= 0"),
    "flag": (lambda n: n in (0, 1), "0 or 1"),
}
"""Rule name -> (test, what it asks, in words) of a tile's field."""
_DEFAULT_RULES = {"num_warps": "positive", "num_stages": "positive"}


def _tile(name: str, op: str, fields: tuple[str, ...], doc: str, *, trailing_defaults: tuple[int, ...] = (),
          **rules: str) -> KernelOption:
    return KernelOption(name, "DSV4CP_" + name.upper(), TILE, op, doc, None, (), fields, tuple(rules.items()),
                        trailing_defaults)


_KERNEL_TILE = ("block_h", "block_k", "num_warps", "num_stages")
_INDEXER_TILE = ("block_m", "block_n", "num_warps", "num_stages")

OPTIONS: dict[str, KernelOption] = {o.name: o for o in (
    KernelOption("topk_impl", "DSV4CP_TOPK_IMPL", CHOICE, "indexer_topk",
                 "Triton top-k path: score buffers + a selection (chunked) or one streaming pass (stream)",
                 "chunked", ("chunked", "stream")),
    KernelOption("topk_select", "DSV4CP_TOPK_SELECT", CHOICE, "indexer_topk",
                 "chunked top-k's selection: Triton radix select or torch.topk (auto: radix compiled, "
                 "torch under the interpreter)", AUTO, (AUTO, "radix", "torch")),
    KernelOption("topk_keys", "DSV4CP_TOPK_KEYS", CHOICE, "indexer_topk",
                 "torch selection's buffer: int64 keys packed by the score kernel, or fp32 scores",
                 "packed", ("packed", "scores")),
    KernelOption("topk_select_variant", "DSV4CP_TOPK_SELECT_VARIANT", CHOICE, "indexer_topk",
                 "radix select kernel: a lower bound from each lane's maximum, then passes over the few keys "
                 "above it (bounded), or four passes over the row (plain)", "bounded", ("bounded", "plain")),
    _tile("triton_indexer_config", "indexer_topk", _INDEXER_TILE, "pins the indexer score kernel's launch"),
    KernelOption("triton_indexer_head_pairs", "DSV4CP_TRITON_INDEXER_HEAD_PAIRS", FLAG, "indexer_topk",
                 "indexer score kernel (chunked top-k) takes its heads in pairs and keeps the second head's product "
                 "on the matrix unit while the first one's epilogue runs (1), or one head at a time (0)", False),
    _tile("triton_topk_stream_config", "indexer_topk", _INDEXER_TILE, "pins the streaming top-k kernel's launch"),
    _tile("triton_select_config", "indexer_topk", ("block_n", "radix_bits", "num_warps", "num_stages"),
          "pins the radix select kernel's launch"),
    _tile("triton_gather_bwd_config", "indexer_scores", ("block_k", "num_warps", "num_stages", "relaxed_atomics"),
          "pins the gathered indexer scores' backward launch (relaxed_atomics 0 or 1)", relaxed_atomics="flag"),
    KernelOption("triton_scores_bwd_reduce", "DSV4CP_TRITON_SCORES_BWD_REDUCE", CHOICE, "indexer_scores",
                 "indexer scores backward's key-gradient sum: fp32 atomics, or per-slot fp32 / bf16 contributions "
                 "summed per key row in sorted order (deterministic; deterministic mode turns atomic into sorted)",
                 "atomic", ("atomic", "sorted", "sorted-bf16")),
    KernelOption("triton_scores_bwd_layout", "DSV4CP_TRITON_SCORES_BWD_LAYOUT", CHOICE, "indexer_scores",
                 "indexer scores backward's products: the selected keys on the matrix unit's M dimension, ds^T "
                 "reused from the logits' registers (keys_on_m), or the heads on M, ds transposed for the key "
                 "gradient (heads_on_m)", "keys_on_m", ("keys_on_m", "heads_on_m")),
    KernelOption("triton_scores_bwd_index_ahead", "DSV4CP_TRITON_SCORES_BWD_INDEX_AHEAD", FLAG, "indexer_scores",
                 "indexer scores backward (keys on M) loads each step's key-row indices one step ahead (1)", True),
    _tile("triton_scores_bwd_scratch", "indexer_scores", ("mib",),
          "caps the sorted key-gradient reductions' scratch per chunk of queries, in MiB (auto: 2048)", mib="positive"),
    KernelOption("indexer_loss_scores", "DSV4CP_INDEXER_LOSS_SCORES", CHOICE, "indexer_loss",
                 "sparse indexer loss's prediction: the top-k selection's scores of the chosen entries "
                 "(selection; the streaming top-k keeps none, so topk_impl=stream then runs chunked) or those "
                 "entries scored again (recompute)", "selection", ("selection", "recompute")),
    KernelOption("indexer_loss_kl", "DSV4CP_INDEXER_LOSS_KL", CHOICE, "indexer_loss",
                 "sparse indexer loss's KL terms and score gradient: torch ops (torch) or one Triton pass per "
                 "row (triton; CUDA fp32 scores, K <= 4096, else torch)", "triton", ("torch", "triton")),
    _tile("triton_fwd_config", "sparse_attention", _KERNEL_TILE, "pins the Triton attention forward's launch"),
    KernelOption("triton_fwd_logits", "DSV4CP_TRITON_FWD_LOGITS", CHOICE, "sparse_attention",
                 "Triton attention forward's logits: both warpgroups compute all of them (duplicated), each half "
                 "of the slots (split), or kv q^T with the slots on M (slots_on_m)", "split",
                 ("duplicated", "split", "slots_on_m")),
    KernelOption("triton_fwd_index_ahead", "DSV4CP_TRITON_FWD_INDEX_AHEAD", FLAG, "sparse_attention",
                 "Triton attention forward loads each step's kv-row indices one step ahead (1)", True),
    KernelOption("triton_fwd_lazy_rescale", "DSV4CP_TRITON_FWD_LAZY_RESCALE", FLAG, "sparse_attention",
                 "Triton attention forward (split logits) rescales its accumulator only when a head's max rises "
                 "by more than 2^8 (1)", False),
    KernelOption("triton_fwd_warp_specialize", "DSV4CP_TRITON_FWD_WARP_SPECIALIZE", FLAG, "sparse_attention",
                 "Triton attention forward asks Triton to warp-specialize its key loop (1): separate warps for the "
                 "gathers and the products", False),
    _tile("triton_bwd_config", "sparse_attention", _KERNEL_TILE,
          "pins the Triton attention backward's first (dq / scores) kernel"),
    _tile("triton_dkv_config", "sparse_attention", ("block_k", "block_d", "num_warps", "num_stages"),
          "pins the Triton attention backward's dkv kernel"),
    KernelOption("triton_dq_in_dkv", "DSV4CP_TRITON_DQ_IN_DKV", FLAG, "sparse_attention",
                 "Triton attention backward accumulates dq in the dkv kernel (1) or in the dq kernel (0)", True),
    KernelOption("triton_dkv_one_product", "DSV4CP_TRITON_DKV_ONE_PRODUCT", FLAG, "sparse_attention",
                 "Triton attention dkv kernel forms ds^T q + p^T dO as one product over ds and p side by side (1) "
                 "or as two chained products (0)", True),
    KernelOption("library_compact_slots", "DSV4CP_LIBRARY_COMPACT_SLOTS", FLAG, "sparse_attention",
                 "FlashMLA forward and cuDNN backward get each query's valid slots first and their count as "
                 "topk_length, so they skip the empty ones (1), or every slot with -1 where empty (0)", True),
    KernelOption("triton_bwd_index_ahead", "DSV4CP_TRITON_BWD_INDEX_AHEAD", FLAG, "sparse_attention",
                 "Triton attention backward's two kernels load each step's kv-row indices one step ahead (1)", True),
    KernelOption("triton_bwd_dq_pass", "DSV4CP_TRITON_BWD_DQ_PASS", FLAG, "sparse_attention",
                 "Triton attention backward (not deterministic) computes dq in its own pass after the scores "
                 "kernel and the kv gradients in a pass without it (1), or dq beside the kv gradients (0)", True),
    _tile("triton_kv_pass_config", "sparse_attention",
          ("block_k", "block_d", "num_warps", "num_stages", "column_blocks"),
          "pins the kv-gradient pass of the Triton attention backward with its own dq pass (column_blocks: "
          "blocks of block_d columns per program, each slot step's scratch tile read once for all; 1 if left out)",
          trailing_defaults=(1,), column_blocks="positive"),
    _tile("triton_dq_pass_config", "sparse_attention", ("block_h", "block_d", "block_k", "num_warps", "num_stages"),
          "pins the dq pass of the Triton attention backward with its own dq pass"),
    _tile("triton_probs_config", "attention_probs", _KERNEL_TILE, "pins the head-summed probabilities kernel"),
    _tile("triton_lse_config", "attention_probs", _KERNEL_TILE, "pins the log-sum-exp kernel"),
    KernelOption("triton_lse_kernel", "DSV4CP_TRITON_LSE_KERNEL", CHOICE, "attention_probs",
                 "log-sum-exp kernel: whole key rows per slot block (whole_d) or the head dim in pipelined "
                 "chunks over a flat (query, head block, slot block, chunk) loop (d_chunks)",
                 "whole_d", ("whole_d", "d_chunks")),
    _tile("triton_lse_chunk_config", "attention_probs",
          ("block_h", "block_k", "block_d", "num_warps", "num_stages", "programs_per_sm"),
          "pins the d_chunks log-sum-exp kernel (programs_per_sm 0: one program per (query, head block), "
          "else a persistent grid)", programs_per_sm="non_negative"),
    KernelOption("triton_probs_slots_on_m", "DSV4CP_TRITON_PROBS_SLOTS_ON_M", FLAG, "attention_probs",
                 "probabilities kernel puts the slots on the matrix unit's M (1) or the heads (0)", True),
    KernelOption("triton_probs_kernel", "DSV4CP_TRITON_PROBS_KERNEL", CHOICE, "attention_probs",
                 "head-summed probabilities kernel: the head dim in pipelined chunks over a flat (query, slot "
                 "block, chunk) loop (d_chunks) or whole key rows per slot block (whole_d)",
                 "d_chunks", ("d_chunks", "whole_d")),
    _tile("triton_probs_chunk_config", "attention_probs",
          ("block_h", "block_k", "block_d", "num_warps", "num_stages", "slots_on_m", "programs_per_sm"),
          "pins the d_chunks probabilities kernel (slots_on_m 0 or 1; programs_per_sm 0: one program per "
          "(query, slot block), else a persistent grid)", slots_on_m="flag", programs_per_sm="non_negative"),
    _tile("triton_norm_rope_config", "norm_rope", ("block_h", "num_warps"),
          "pins the fused norm / RoPE kernels' launch (powers of two)", block_h="power_of_two",
          num_warps="power_of_two"),
    KernelOption("inject_slowdown", "DSV4CP_INJECT_SLOWDOWN", SLOWDOWN, "sparse_attention",
                 "TESTS THE CI GATE, never for a measurement: PHASE:FRACTION makes each eager forward and backward "
                 "of the phase spin FRACTION x its own host CPU time longer (on a GPU only the host side)",
                 None, ("sparse_attn",)),
)}
"""Every kernel option by name."""


def _default(name: str) -> str | bool | None:
    return OPTIONS[name].default


@dataclass(frozen=True)
class KernelOptions:
    """Every kernel option's value, resolved once (:meth:`resolve`) and handed down as an argument: the
    layer holds one, the ops take it as ``options=``, their autograd functions keep it for backward, and
    each kernel wrapper gets the values it needs. One field per option of :data:`OPTIONS`, of the option's
    type: a choice its word (``auto`` where the op resolves it by device), a flag a bool, a tile a tuple of
    ints (None: ``auto``, the launch ladder); each field's doc is its option's (listed below). Frozen and
    hashable: ``torch.compile`` treats it as a constant, and a cache may key on it.

    ``origins``: the options whose value came from their ``DSV4CP_*`` variable, with that variable (not
    compared): an error about such a value names the variable (:meth:`where`).
    """

    topk_impl: str = _default("topk_impl")
    topk_select: str = _default("topk_select")
    topk_keys: str = _default("topk_keys")
    topk_select_variant: str = _default("topk_select_variant")
    triton_indexer_config: tuple[int, ...] | None = _default("triton_indexer_config")
    triton_indexer_head_pairs: bool = _default("triton_indexer_head_pairs")
    triton_topk_stream_config: tuple[int, ...] | None = _default("triton_topk_stream_config")
    triton_select_config: tuple[int, ...] | None = _default("triton_select_config")
    triton_gather_bwd_config: tuple[int, ...] | None = _default("triton_gather_bwd_config")
    triton_scores_bwd_reduce: str = _default("triton_scores_bwd_reduce")
    triton_scores_bwd_layout: str = _default("triton_scores_bwd_layout")
    triton_scores_bwd_index_ahead: bool = _default("triton_scores_bwd_index_ahead")
    triton_scores_bwd_scratch: tuple[int, ...] | None = _default("triton_scores_bwd_scratch")
    indexer_loss_scores: str = _default("indexer_loss_scores")
    indexer_loss_kl: str = _default("indexer_loss_kl")
    triton_fwd_config: tuple[int, ...] | None = _default("triton_fwd_config")
    triton_fwd_logits: str = _default("triton_fwd_logits")
    triton_fwd_index_ahead: bool = _default("triton_fwd_index_ahead")
    triton_fwd_lazy_rescale: bool = _default("triton_fwd_lazy_rescale")
    triton_fwd_warp_specialize: bool = _default("triton_fwd_warp_specialize")
    triton_bwd_config: tuple[int, ...] | None = _default("triton_bwd_config")
    triton_dkv_config: tuple[int, ...] | None = _default("triton_dkv_config")
    triton_dq_in_dkv: bool = _default("triton_dq_in_dkv")
    triton_dkv_one_product: bool = _default("triton_dkv_one_product")
    library_compact_slots: bool = _default("library_compact_slots")
    triton_bwd_index_ahead: bool = _default("triton_bwd_index_ahead")
    triton_bwd_dq_pass: bool = _default("triton_bwd_dq_pass")
    triton_kv_pass_config: tuple[int, ...] | None = _default("triton_kv_pass_config")
    triton_dq_pass_config: tuple[int, ...] | None = _default("triton_dq_pass_config")
    triton_probs_config: tuple[int, ...] | None = _default("triton_probs_config")
    triton_lse_config: tuple[int, ...] | None = _default("triton_lse_config")
    triton_lse_kernel: str = _default("triton_lse_kernel")
    triton_lse_chunk_config: tuple[int, ...] | None = _default("triton_lse_chunk_config")
    triton_probs_slots_on_m: bool = _default("triton_probs_slots_on_m")
    triton_probs_kernel: str = _default("triton_probs_kernel")
    triton_probs_chunk_config: tuple[int, ...] | None = _default("triton_probs_chunk_config")
    triton_norm_rope_config: tuple[int, ...] | None = _default("triton_norm_rope_config")
    inject_slowdown: tuple[str, float] | None = _default("inject_slowdown")
    origins: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in OPTIONS:  # every value checked (a bad one named) and in its type's one form (hashable)
            object.__setattr__(self, name, OPTIONS[name].parse(getattr(self, name), self.where(name)))

    @classmethod
    def resolve(cls, overrides: Mapping[str, object] | None = None) -> KernelOptions:
        """The options in force: ``overrides`` (name -> value, as text or of the option's type), over the
        values of an enclosing :func:`overrides` block, over the ``DSV4CP_*`` variables, over the defaults.
        The one place where the variables are read. ``ValueError`` naming the option (and the variable)
        and the value for a bad one."""
        given = {name: _option(name).parse(value, name) for name, value in dict(overrides or {}).items()}
        values, origins = {}, []
        for name, option in OPTIONS.items():
            if name in given:
                values[name] = given[name]
            elif name in _EXPLICIT:
                values[name] = _EXPLICIT[name]
            else:
                values[name], from_variable = _from_environment(option)
                if from_variable:
                    origins.append((name, option.env))
        return cls(**values, origins=tuple(origins))

    @classmethod
    def from_resolved(cls, texts: Mapping[str, str]) -> KernelOptions:
        """The options a record stores (``{name: text}``, as :meth:`texts` and :func:`resolved` give them);
        an option it lacks has its default. ``ValueError`` naming an unknown option or a bad value."""
        return cls(**{name: _option(name).parse(text, name) for name, text in texts.items()})

    def texts(self) -> dict[str, str]:
        """Every option's value as text, by name (the registry's order): what a record stores."""
        return {name: option.text(getattr(self, name)) for name, option in OPTIONS.items()}

    def non_default(self) -> dict[str, str]:
        """The options at a value other than their default, as text (:func:`non_default`)."""
        return non_default(self.texts())

    def op_values(self, names: tuple[str, ...]) -> tuple:
        """The values of the options ``names``, in order, as a ``torch.library`` custom op takes them (typed
        inputs a compiled graph holds as constants): a choice its word, a flag a bool, a tile a list of ints
        (``[]`` for ``auto``)."""
        return tuple(list(value or ()) if OPTIONS[name].kind == TILE else value
                     for name in names for value in (getattr(self, name),))

    @classmethod
    def from_op_values(cls, names: tuple[str, ...], values: tuple) -> KernelOptions:
        """The options a custom op's ``values`` of ``names`` (:meth:`op_values`) hold; every other option at
        its default."""
        return cls(**{name: (tuple(value) or None) if OPTIONS[name].kind == TILE else value
                      for name, value in zip(names, values)})

    def where(self, name: str) -> str:
        """What an error about option ``name``'s value starts with: its variable when the value came from
        the environment, else the option's name."""
        return dict(self.origins).get(name, name)


DEFAULT_OPTIONS = KernelOptions()
"""Every option at its default (nothing read from the environment): what an op uses when its caller passes
no options."""

KernelOptions.__doc__ += "\n    Fields:\n\n" + "\n".join(
    f"    * ``{name}``: {option.doc}" for name, option in OPTIONS.items()) + "\n"


_EXPLICIT: dict[str, object] = {}
"""Values set by :func:`overrides` (parsed), by name."""

_BACKENDS_RAN: dict[str, str] = {}


def _option(name: str) -> KernelOption:
    option = OPTIONS.get(name)
    if option is None:
        raise ValueError(f"kernel option: unknown name {name!r}; choose from {', '.join(OPTIONS)}")
    return option


def _from_environment(option: KernelOption) -> tuple[str | bool | tuple[int, ...] | None, bool]:
    """``(value, whether it came from the variable)``: ``option``'s ``DSV4CP_*`` variable parsed (a bad one
    named), else its default. The one reader of the options' variables."""
    text = os.environ.get(option.env, "").strip()
    return (option.parse(text, option.env), True) if text else (option.default, False)


def source(name: str) -> str:
    """Where :func:`get` takes ``name`` from: ``"explicit"``, ``"env"`` or ``"default"``."""
    option = _option(name)
    if name in _EXPLICIT:
        return "explicit"
    return "env" if os.environ.get(option.env, "").strip() else "default"


def where(name: str) -> str:
    """What an error about ``name``'s current value starts with: its variable when the value came from
    the environment, else the option's name."""
    return _option(name).env if source(name) == "env" else name


def get(name: str) -> str | bool | tuple[int, ...] | None:
    """The value of option ``name``: the explicit one, else its ``DSV4CP_*`` variable, else the default.
    A choice is its word, a flag a bool, a tile a tuple of ints (None: ``auto``, the ladder).
    ``ValueError`` naming the option (and the variable) and the value when the variable's is bad."""
    option = _option(name)
    if name in _EXPLICIT:
        return _EXPLICIT[name]  # type: ignore[return-value]
    return _from_environment(option)[0]


def resolved() -> dict[str, str]:
    """Every option's current value as text, by name (JSON-safe, stable order): what a record stores."""
    return KernelOptions.resolve().texts()


def resolved_with(values: Mapping[str, object]) -> dict[str, str]:
    """:func:`resolved` with ``values`` set explicitly over the environment and the defaults."""
    with overrides(values):
        return resolved()


FORMER_DEFAULTS: Mapping[str, tuple[str, ...]] = {
    "topk_select_variant": ("plain",),
    "triton_fwd_index_ahead": ("0",),
    "triton_fwd_split_logits": ("0",),  # removed: now triton_fwd_logits
    "triton_probs_kernel": ("whole_d",),
    "triton_dkv_one_product": ("0",),
    "triton_bwd_index_ahead": ("0",),
}
"""Option -> the values that were its default in an earlier version (for a removed option: its default
then). A record keeps every option's value as its point ran, and its id names what differed from the
defaults of the version that wrote it, so a record written before a default changed holds the old default
without having set it: :func:`configurations` lets such a record keep its id. Add an entry whenever a
default changes or an option goes; ``tests/test_committed_records.py`` fails on a committed record whose
id then no longer matches."""


BEFORE_IT_EXISTED: Mapping[str, str] = {
    "indexer_loss_scores": "recompute",  # the sparse loss scored its entries again until the option came
    "inject_slowdown": "off",  # no slowdown was injected before the option that injects one
    "triton_bwd_dq_pass": "0",  # the backward computed dq beside the kv gradients until its own pass came
    "triton_kv_pass_config": "auto",  # and that pass's tiles were never pinned before it existed
    "triton_dq_pass_config": "auto",
    "triton_scores_bwd_layout": "heads_on_m",  # the scores backward had the heads on M until the option came
    "triton_scores_bwd_index_ahead": "0",  # and loaded no index ahead
    "triton_fwd_warp_specialize": "0",  # the forward's key loop was never warp-specialized before the option
}
"""Option -> the value that describes what ran before the option existed, where that is known (a record
written before then lacks the option). Any other option a record lacks is unknown for it, never today's
default (:func:`dsv4cp.records.resolved_options`). Add an entry only when an option is added whose value
at the earlier code is certain; without one, records written before it pair with no record after."""


def configurations(values: Mapping[str, str]) -> list[dict[str, str]]:
    """Every configuration a record's options ``values`` may have named when it was written: the options
    at a value other than today's default (:func:`non_default`), with and without each of those that holds
    a former default (:data:`FORMER_DEFAULTS`), today's reading first."""
    current = non_default(values)
    former = [name for name, text in current.items() if text in FORMER_DEFAULTS.get(name, ())]
    found = []
    for mask in range(1 << len(former)):
        dropped = {name for bit, name in enumerate(former) if mask >> bit & 1}
        found.append({name: text for name, text in current.items() if name not in dropped})
    return found


def non_default(values: Mapping[str, str]) -> dict[str, str]:
    """The entries of ``values`` (name -> text, as :func:`resolved` gives them) whose value differs from the
    option's default, sorted by name: what sets a configuration apart from the default one (a point's id is
    built on them, so a point that names a default and one that does not are the same point). Unknown
    names are kept (a record written by another version of the registry stays apart)."""
    kept = {}
    for name in sorted(values):
        option = OPTIONS.get(name)
        if option is None or values[name] != option.text(option.default):
            kept[name] = values[name]
    return kept


def configuration(values: Mapping[str, object] | None) -> dict[str, str] | None:
    """The options that differ from their defaults once ``values`` are set over the environment
    (:func:`non_default` of :func:`resolved_with`), None when none does: the kernel configuration a
    point runs, as its id names it. Cached on the values and the variables' current text."""
    settings = tuple(sorted(canonical(values).items())) if values else ()
    found = _configuration(settings, _variables())
    return None if found is None else dict(found)  # the caller's to keep: never the cached one


_VARIABLES = tuple(option.env for option in OPTIONS.values())


def _variables() -> tuple:
    """The options' variables as they stand, raw: a cache key only (a sweep's expansion asks once per point,
    so this is read through the environment's own mapping, without decoding every variable)."""
    data = getattr(os.environ, "_data", None)  # CPython's encoded store behind os.environ
    if data is None:
        return tuple(os.environ.get(name) for name in _VARIABLES)
    return tuple(data.get(key) for key in _encoded_variables())


@functools.lru_cache(maxsize=1)
def _encoded_variables() -> tuple:
    return tuple(os.environ.encodekey(name) for name in _VARIABLES)


@functools.lru_cache(maxsize=256)
def _configuration(settings: tuple[tuple[str, str], ...], environment: tuple[str, ...]) -> dict[str, str] | None:
    return non_default(resolved_with(dict(settings))) or None


def describe() -> list[dict[str, str]]:
    """One row per option: name, value, source, default, allowed, variable, op, doc (``dsv4cp env``)."""
    return [{"name": name, "value": option.text(get(name)), "source": source(name),
             "default": option.text(option.default), "allowed": option.allowed, "env": option.env,
             "op": option.op, "doc": option.doc} for name, option in OPTIONS.items()]


def check_values(values: Mapping[str, object]) -> None:
    """``ValueError`` naming the first unknown name or bad value of ``values`` (name -> value)."""
    canonical(values)


def canonical(values: Mapping[str, object]) -> dict[str, str]:
    """``values`` (name -> value) checked, as ``{name: text}`` sorted by name: one spelling per setting
    (``"0"`` and ``False`` alike), so a point's id does not depend on how a spec wrote it."""
    return {name: _option(name).text(_option(name).parse(value, name)) for name, value in sorted(dict(values).items())}


@contextlib.contextmanager
def overrides(values: Mapping[str, object]) -> Iterator[None]:
    """Set explicit values (names of :data:`OPTIONS`, values as text or of the option's type) for the
    block; all are validated on entry, before anything changes; the previous values come back on exit
    (blocks nest)."""
    parsed = {name: _option(name).parse(value, name) for name, value in dict(values).items()}
    saved = dict(_EXPLICIT)
    _EXPLICIT.update(parsed)
    try:
        yield
    finally:
        _EXPLICIT.clear()
        _EXPLICIT.update(saved)


def parse_assignments(texts: list[str]) -> dict[str, str]:
    """``["NAME=VALUE", ...]`` as a mapping; each name must be an option and each value valid for it
    (``ValueError`` naming it). A later assignment of a name wins."""
    values: dict[str, str] = {}
    for text in texts:
        name, eq, value = text.partition("=")
        name = name.strip()
        if not eq or not name:
            raise ValueError(f"kernel option: expected NAME=VALUE, got {text!r}")
        _option(name).parse(value, name)
        values[name] = value.strip()
    return values


def note_backend(key: str, value: str) -> None:
    """Record that ``key`` (an op and direction, e.g. ``sparse_attention.fwd``, or a launch's
    ``<op>.<kernel>.config``) ran as ``value``."""
    _BACKENDS_RAN[key] = value


def backends_ran() -> dict[str, str]:
    """What ran since :func:`reset_backends_ran`, by key (sorted: stable in a record)."""
    return dict(sorted(_BACKENDS_RAN.items()))


def reset_backends_ran() -> None:
    """Forget what ran (call before the step whose kernels a record describes)."""
    _BACKENDS_RAN.clear()


def triton_interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton for its CPU interpreter (read at triton's first import)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")
