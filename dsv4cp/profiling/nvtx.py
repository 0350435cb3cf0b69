"""Named phase ranges: NVTX (domain ``dsv4cp``) plus ``torch.profiler.record_function`` (docs/design.md §5).

Layer code marks a phase with ``with nvtx_range("sparse_attn.fwd"):`` (or the ``ranged`` decorator).
Names come from the fixed table ``PHASES``; an unknown name raises ``ValueError`` at once, so a typo
cannot silently create a new, unanalysed phase. Each range is emitted twice under the same full name
(``dsv4cp.sparse_attn.fwd``):

* as an NVTX push/pop range in the ``dsv4cp`` domain, for Nsight Systems (its SQLite export stores
  it in ``NVTX_EVENTS`` with eventType 59);
* as a ``record_function`` range, so Kineto traces (``torch.profiler``) carry it as a
  ``user_annotation`` event.

The NVTX calls reuse one cached domain and one cached ``EventAttributes`` per name. With no tool
attached the ``nvtx`` package hands out a dummy domain whose calls do nothing; with ranges switched
off (``DSV4CP_NVTX=0`` or ``set_enabled(False)``) ``nvtx_range`` returns a shared null context, and so
it does while ``torch.compile`` traces (Dynamo cannot trace the NVTX calls; the kernels' custom ops open
their ranges inside, when the compiled graph runs them).

A phase listener (:func:`set_phase_listener`; the per-phase memory recorder of
:mod:`dsv4cp.profiling.memory`) is told of every phase entry and exit, also with ranges switched off;
with none installed (the default) ranges cost nothing more.

``capture_range()`` brackets the measured steps with cudaProfilerStart/Stop, for
``nsys profile --capture-range=cudaProfilerApi -t cuda,nvtx,nccl``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

try:
    import nvtx as _nvtx_lib
except ImportError:  # some GPU images lack the package; record_function ranges still work
    _nvtx_lib = None

DOMAIN = "dsv4cp"
"""NVTX domain name, and the prefix of every full range name."""

ENV_VAR = "DSV4CP_NVTX"
"""Environment switch read at import: ``1`` (default) emits ranges, ``0`` makes them no-ops."""

PHASES: tuple[str, ...] = (
    "step",
    # 2 / 3.1 per-step layout: the rank's metadata, the selected entries lowered to key-buffer rows, the key buffer
    "layout.fwd",
    # 3.2 left halo of hidden states (forward send, backward gradient return)
    "halo.fwd", "halo.bwd",
    # projections
    "q_proj.fwd", "q_proj.bwd",
    "kv_proj.fwd", "kv_proj.bwd",
    "out_proj.fwd", "out_proj.bwd",
    # 1.5 attention compressor
    "compress.fwd", "compress.bwd",
    # 1.6 / 3.4 lightning indexer
    "indexer.compress.fwd", "indexer.compress.bwd",
    "indexer.q_proj.fwd", "indexer.q_proj.bwd",
    "indexer.score.fwd", "indexer.score.bwd",
    "indexer.topk.fwd",
    "indexer.loss.fwd", "indexer.loss.bwd",
    # 3.4 forward gathers: launch and wait timed separately
    "allgather.kv.launch", "allgather.kv.wait",
    "allgather.index_k.launch", "allgather.index_k.wait",
    # 4.1 sparse attention
    "sparse_attn.fwd", "sparse_attn.bwd",
    # 3.6 KV reconstruction (selective recompute) in backward
    "kv_rebuild.bwd",
    # 3.5 backward reduce-scatters: launch and wait timed separately
    "reducescatter.kv.launch", "reducescatter.kv.wait",
    "reducescatter.index_k.launch", "reducescatter.index_k.wait",
    # 3.7 MTP rolls
    "mtp.roll.fwd", "mtp.roll.bwd",
)
"""Every phase name layer code may use (without the ``dsv4cp.`` prefix)."""

RANGE_NAMES: tuple[str, ...] = tuple(f"{DOMAIN}.{phase}" for phase in PHASES)
"""Full range names as they appear in traces, in ``PHASES`` order."""

# ARGB colours for the nsys timeline: collectives stand out from forward and backward compute.
_COMM_COLOR = 0xFFE15759
_FWD_COLOR = 0xFF4E79A7
_BWD_COLOR = 0xFFF28E2B
_STEP_COLOR = 0xFF76B7B2


def _color(phase: str) -> int:
    if phase.endswith((".launch", ".wait")):
        return _COMM_COLOR
    if phase.endswith(".bwd"):
        return _BWD_COLOR
    return _FWD_COLOR if phase.endswith(".fwd") else _STEP_COLOR


class _NoNvtx:
    """Stand-in domain when the ``nvtx`` package is not installed."""

    def get_event_attributes(self, message: str, color: int) -> None:
        return None

    def push_range(self, attributes: Any) -> None:
        pass

    def pop_range(self) -> None:
        pass

    def start_range(self, attributes: Any) -> None:
        return None

    def end_range(self, range_id: Any) -> None:
        pass


_DOMAIN_HANDLE: Any = _nvtx_lib.get_domain(DOMAIN) if _nvtx_lib is not None else _NoNvtx()


@dataclass(frozen=True)
class _RangeSpec:
    phase: str
    full_name: str
    attributes: Any  # nvtx EventAttributes, created once; None for a dummy domain


_SPECS: dict[str, _RangeSpec] = {
    phase: _RangeSpec(phase, full, _DOMAIN_HANDLE.get_event_attributes(message=full, color=_color(phase)))
    for phase, full in zip(PHASES, RANGE_NAMES)
}


def _parse_switch(value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be '0' or '1', got {value!r}")
    return value == "1"


_enabled: bool = _parse_switch(os.environ.get(ENV_VAR, "1"))


class PhaseListener(Protocol):
    """Told of phase entries and exits (``phase`` without the prefix), on the thread that runs them
    (autograd's device threads for backward spans)."""

    def enter(self, phase: str) -> None: ...

    def exit(self, phase: str) -> None: ...


_listener: PhaseListener | None = None


def set_phase_listener(listener: PhaseListener | None) -> PhaseListener | None:
    """Install ``listener`` (None: remove it) for every range entered from now on; returns the previous one."""
    global _listener
    previous, _listener = _listener, listener
    return previous


def set_enabled(enabled: bool) -> None:
    """Switch range emission on or off for this process (overrides ``DSV4CP_NVTX``)."""
    global _enabled
    _enabled = bool(enabled)


def is_enabled() -> bool:
    """Whether ``nvtx_range`` currently emits ranges."""
    return _enabled


def full_name(phase: str) -> str:
    """``"sparse_attn.fwd"`` -> ``"dsv4cp.sparse_attn.fwd"``; raises ``ValueError`` for unknown names."""
    return _spec(phase).full_name


def _spec(phase: str) -> _RangeSpec:
    try:
        return _SPECS[phase]
    except KeyError:
        raise ValueError(
            f"range name {phase!r} is not in dsv4cp.profiling.nvtx.PHASES (use e.g. 'sparse_attn.fwd')"
        ) from None


class _ActiveRange:
    """One entry of a range: NVTX push/pop around a ``record_function``."""

    __slots__ = ("_spec", "_record")

    def __init__(self, spec: _RangeSpec) -> None:
        self._spec = spec
        self._record = torch.profiler.record_function(spec.full_name)

    def __enter__(self) -> None:
        _DOMAIN_HANDLE.push_range(self._spec.attributes)
        self._record.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._record.__exit__(*exc)
        _DOMAIN_HANDLE.pop_range()


class _ListenedRange:
    """A range whose entry and exit are also told to a phase listener (outside the NVTX range, so the
    listener's own host time is not charged to the phase)."""

    __slots__ = ("_phase", "_listener", "_inner")

    def __init__(self, spec: _RangeSpec, listener: PhaseListener) -> None:
        self._phase, self._listener = spec.phase, listener
        self._inner = _ActiveRange(spec) if _enabled else None

    def __enter__(self) -> None:
        self._listener.enter(self._phase)
        if self._inner is not None:
            self._inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._inner is not None:
            self._inner.__exit__(*exc)
        self._listener.exit(self._phase)


_NULL_RANGE = contextlib.nullcontext()  # stateless, so one instance serves every disabled call


def nvtx_range(phase: str) -> contextlib.AbstractContextManager[None]:
    """Context manager marking phase ``phase`` (a name from ``PHASES``, without the prefix).

    The name is checked even when ranges are switched off, so typos fail in every configuration.
    """
    spec = _spec(phase)
    if torch.compiler.is_compiling():  # Dynamo cannot trace NVTX or profiler calls (a graph break each)
        return _NULL_RANGE
    if _listener is not None:
        return _ListenedRange(spec, _listener)
    return _ActiveRange(spec) if _enabled else _NULL_RANGE


class Span:
    """A range opened and closed at two independent points (NVTX start/end, eventType 60).

    Unlike ``nvtx_range`` it need not nest with other ranges: backward phases open when autograd
    reaches a region's output and close when it has finished the region's input, while other
    autograd nodes may run in between. ``close`` without ``open``, or twice, does nothing. The phase
    listener that saw the ``open`` is the one told of the ``close``.
    """

    __slots__ = ("_spec", "_range_id", "_record", "_listener")

    def __init__(self, phase: str) -> None:
        self._spec = _spec(phase)
        self._range_id: Any = None
        self._record: Any = None
        self._listener: PhaseListener | None = None

    def open(self) -> None:
        if self._record is not None or self._listener is not None:
            return
        if _listener is not None:
            self._listener = _listener
            _listener.enter(self._spec.phase)
        if not _enabled:
            return
        self._range_id = _DOMAIN_HANDLE.start_range(self._spec.attributes)
        self._record = torch.profiler.record_function(self._spec.full_name)
        self._record.__enter__()

    def close(self) -> None:
        if self._record is not None:
            self._record.__exit__(None, None, None)
            _DOMAIN_HANDLE.end_range(self._range_id)
            self._record = self._range_id = None
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.exit(self._spec.phase)


F = TypeVar("F", bound=Callable[..., Any])


def ranged(phase: str) -> Callable[[F], F]:
    """Decorator form of ``nvtx_range``; the name is checked when the decorator is applied."""
    _spec(phase)

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with nvtx_range(phase):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


@contextlib.contextmanager
def capture_range() -> Iterator[None]:
    """Bracket the measured steps with cudaProfilerStart/Stop (no-op without CUDA).

    The device is synchronised before the stop so every kernel of the measured steps falls inside
    the capture (``nsys profile --capture-range=cudaProfilerApi``).
    """
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
