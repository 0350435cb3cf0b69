"""The names that a step's and a command's choices may take, without torch: what a sweep spec or a flag is
checked against.

A sweep spec is loaded, expanded and checked point by point (``dsv4cp sweep SPEC --dry-run``) before
anything runs, and that path imports no torch (seconds and hundreds of MB). So the names it checks live
here, in the bottom layer, and the modules that implement them import them from here:

* :data:`OVERLAP_MODES`: the CP collectives' modes (:mod:`dsv4cp.cp.comm`);
* :data:`COMPILE_BACKENDS`: the layer's ``torch.compile`` backends (:mod:`dsv4cp.profiling.compilation`);
* :data:`ATTENTION_BACKEND_HEAD_DIMS`: the built-in sparse-attention backends and the head dims each
  runs (the registry of :mod:`dsv4cp.ops.sparse_attention` registers these names; a test holds the two
  equal), with the name and head-dim checks that registry shares;
* :data:`MACHINE_PRESETS`: the machines whose ceilings a bound is computed for (``--machine``;
  :mod:`dsv4cp.model.machine`).

Standard library only.
"""

from __future__ import annotations

from collections.abc import Collection

OVERLAP_MODES = ("none", "async")
"""``none``: a collective completes where it is issued; ``async``: the forward all-gather is waited for
where its rows are needed and the backward reduce-scatter's wait is held back (:mod:`dsv4cp.cp.comm`)."""

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""``torch.compile`` backends: Inductor (generated kernels), AOTAutograd without codegen (traces forward
and backward, runs them eagerly: a tracing check that is fast on CPU), and Dynamo's graphs run eagerly."""

MACHINE_PRESETS = ("h200x2", "internode", "cpu", "cpu-estimate")
"""The machine presets of :meth:`dsv4cp.model.machine.Machine.preset`."""

ATTENTION_BACKEND_HEAD_DIMS: dict[str, tuple[int, ...] | None] = {
    "torch": None,
    "triton": None,
    "triton-deterministic": None,
    "flashmla": (512,),
    "cudnn": (512,),
}
"""Built-in sparse-attention backend -> the head dims D it runs (None: any). FlashMLA's and cuDNN's DSA
kernels exist for D = 512 only; "auto" passes over a backend for other head dims."""


def check_backend_name(name: object, known: Collection[str] = ATTENTION_BACKEND_HEAD_DIMS) -> None:
    """``ValueError`` for a name no backend of ``known`` (or pair ``forward+backward`` of them) answers to;
    ``auto`` names the automatic choice."""
    parts = (name.split("+") if "+" in name else [name]) if isinstance(name, str) else [name]
    unknown = [p for p in parts if p not in known and not (p == "auto" and len(parts) == 1)]
    if not isinstance(name, str) or len(parts) > 2 or unknown:
        raise ValueError(f"backend: unknown sparse-attention backend {name!r}; choose from {['auto', *known]} "
                         f"or a pair 'forward+backward'")


def check_runs_head_dim(name: str, head_dims: tuple[int, ...] | None, head_dim: int | None) -> None:
    """``ValueError`` when the backend ``name``, which runs ``head_dims`` (None: any), cannot run ``head_dim``."""
    if head_dim is not None and head_dims is not None and head_dim not in head_dims:
        raise ValueError(f"backend: {name!r} runs head dim D in {head_dims}, not {head_dim}; "
                         "use 'auto', 'triton' or 'torch'")


def check_head_dim(name: str, head_dim: int) -> None:
    """``ValueError`` when a built-in backend ``name`` (valid: :func:`check_backend_name`) names explicitly
    cannot run ``head_dim`` on any device ("auto" passes over such backends)."""
    for part in [] if name == "auto" else name.split("+"):
        check_runs_head_dim(part, ATTENTION_BACKEND_HEAD_DIMS[part], head_dim)
