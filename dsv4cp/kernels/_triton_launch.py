"""Build and launch machinery shared by the Triton kernel modules (:mod:`.sparse_attention_triton`,
:mod:`.indexer_triton`, :mod:`.indexer_topk_triton`, :mod:`.select_top_triton`,
:mod:`.attention_probs_triton`, :mod:`.norm_rope_triton`, :mod:`.compress_pool_triton`).

* :class:`Kernels`: one module's kernel bodies (plain functions), built lazily per execution mode: a
  compiled ``triton.jit`` kernel for CUDA tensors, an interpreted one for CPU tensors (and for every
  tensor when triton itself was imported under ``TRITON_INTERPRET=1``: its language library is then
  interpreted); and launches that try a ladder of configurations, moving on when compilation raises
  ``OutOfResources``, and cache the one that fits per shape class.
* :func:`check_tiles`, :func:`pinned`, :func:`pinned_config`: launch configurations pinned by keyword
  arguments (or a config object), else by a tile kernel option (:mod:`dsv4cp.kernel_options`: the
  integer fields of a config dataclass); errors name where the pin came from.
* :func:`config_text`: a configuration as ``field=value,...``, what :meth:`Kernels.launch` notes as the
  launch that ran (:func:`dsv4cp.kernel_options.note_backend`, key ``<op>.<kind>.config``).

Imports triton: only the kernel modules, themselves imported lazily, import this module.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from dsv4cp import kernel_options
from dsv4cp.kernels import interpreted, triton_interpreting

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - very old triton

    class OutOfResources(Exception):
        pass


class Kernels:
    """One module's kernels. ``bodies``: name -> plain function; ``built``: ``(name, interpreted)`` ->
    built kernel; ``chosen``: ``(kind, *shape class)`` -> the configuration that fitted. ``label`` starts
    the error messages (e.g. ``"indexer triton"``); ``op`` names the launches in what ran
    (``<op>.<kind>.config``, e.g. ``sparse_attention.fwd.config``)."""

    def __init__(self, label: str, *bodies, op: str) -> None:
        self.label = label
        self.op = op
        self.bodies: dict[str, object] = {}
        self.built: dict[tuple[str, bool], object] = {}
        self.chosen: dict[tuple, object] = {}
        self.register(*bodies)

    def register(self, *bodies) -> None:
        """Add kernel bodies, each under its function name."""
        self.bodies.update({f.__name__: f for f in bodies})

    def build(self, name: str, device: torch.device):
        """The kernel ``name`` compiled for CUDA, or interpreted for CPU tensors (and for every tensor when
        triton itself was imported under ``TRITON_INTERPRET=1``: its language library is then interpreted)."""
        interpret = interpreted(device)
        if interpret and not triton_interpreting():
            raise RuntimeError(
                f"{self.label}: CPU tensors need Triton's interpreter, but triton was imported without "
                "TRITON_INTERPRET=1; set it in the environment before anything imports triton"
            )
        key = (name, interpret)
        if key not in self.built:
            if interpret:
                from triton.runtime.interpreter import InterpretedFunction

                self.built[key] = InterpretedFunction(self.bodies[name])
            else:
                self.built[key] = triton.jit(self.bodies[name])
        return self.built[key]

    def launch(self, kind: str, key: tuple, ladder: list, pinned, launch) -> None:
        """Run ``launch(cfg)`` with the pinned config, the cached one, or the first config of the ladder
        that fits the device (compilation raising OutOfResources, before anything runs, moves to the next);
        notes the configuration that ran as ``<op>.<kind>.config``."""
        if pinned is not None:
            launch(pinned)
            self._note(kind, pinned)
            return
        cache_key = (kind, *key)
        if cache_key in self.chosen:
            launch(self.chosen[cache_key])
            self._note(kind, self.chosen[cache_key])
            return
        error = None
        for cfg in ladder:
            try:
                launch(cfg)
            except OutOfResources as exc:
                error = exc
                continue
            self.chosen[cache_key] = cfg
            self._note(kind, cfg)
            return
        raise RuntimeError(f"{self.label} {kind}: no configuration fits this device: {error}") from error

    def _note(self, kind: str, cfg) -> None:
        kernel_options.note_backend(f"{self.op}.{kind}.config", config_text(cfg))


def check_tiles(cfg, prefix: str = "") -> None:
    """Every ``block_*`` field of the configuration ``cfg`` must be a power of two >= 16 (matrix-unit
    tile); the error names the field after ``prefix``."""
    for name in cfg.__dataclass_fields__:
        value = getattr(cfg, name)
        if name.startswith("block_") and (value < 16 or value & (value - 1)):
            raise ValueError(f"{prefix}{name}: must be a power of two >= 16 (matrix-unit tile), got {value}")


def pinned_config(config, cls, name: str = "config"):
    """``config`` (the keyword argument ``name``: a ``cls``, or a tile kernel option's integers in field
    order) as a ``cls``, or None (the ladder); checked: ``block_*`` tiles (:func:`check_tiles`),
    ``num_warps`` and ``num_stages`` >= 1. Errors start with ``name``."""
    if config is None:
        return None
    cfg = config if isinstance(config, cls) else cls(*config)
    check_tiles(cfg, prefix=f"{name}.")
    if cfg.num_warps < 1 or cfg.num_stages < 1:
        raise ValueError(f"{name}: num_warps and num_stages must be >= 1, got {cfg}")
    return cfg


def pinned(cls, default, tile: tuple[int, ...] | None = None, **overrides):
    """A pinned config from keyword arguments (unset fields from ``default``), else from ``tile`` (a tile
    kernel option's integers in field order), else None (the ladder)."""
    if any(v is not None for v in overrides.values()):
        cfg = cls(**{k: (overrides[k] if overrides.get(k) is not None else getattr(default, k))
                     for k in cls.__dataclass_fields__})
    else:
        cfg = None if tile is None else cls(*tile)
    if cfg is not None:
        check_tiles(cfg)
    return cfg


_TEXTS: dict[object, str] = {}


def config_text(cfg) -> str:
    """``cfg`` (a config dataclass) as ``field=value,...`` (cached: a launch formats nothing twice)."""
    text = _TEXTS.get(cfg)
    if text is None:
        text = _TEXTS[cfg] = ",".join(f"{f.name}={int(getattr(cfg, f.name))}" for f in dataclasses.fields(cfg))
    return text
