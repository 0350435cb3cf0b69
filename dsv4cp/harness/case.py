"""The Case: everything that decides what one layer step computes and how it runs (docs/design.md §5).

A Case is built once, from a command's flags (:func:`dsv4cp.cli.common.case_from_args`), from a sweep
point (:func:`dsv4cp.sweeps.measure.point_case`) or directly in a test (its defaults are the tiny preset
on CPU), and every pass over it (timing, parity, replay) builds its layer and inputs from it with
:mod:`dsv4cp.harness.build`: the same Case gives the same weights and inputs bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4cp.choices import OVERLAP_MODES, check_backend_name
from dsv4cp.config import DTYPE_NAMES, DTYPES, DSv4Config
from dsv4cp.cp.partition import RowSplit, as_split
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.packing import PackedSeqs

PASSES = ("fwd", "fwd+bwd")
"""What a step runs: the forward only, or the forward then the backward."""


def check_fresh_batches(fresh_batches: int, cuda_graph: bool) -> None:
    """``ValueError`` naming ``fresh_batches`` when fresh batches are asked for with CUDA-graph replays."""
    if fresh_batches and cuda_graph:
        # a graph replays the tensors it captured (one batch), and a capture always builds the layout
        # (layout_cache bypasses itself while capturing): its replays already pay the layout kernels
        raise ValueError(f"fresh_batches: CUDA-graph replays run the one captured batch, got fresh_batches "
                         f"{fresh_batches} with cuda_graph; time fresh batches eagerly")


def _tiny() -> DSv4Config:
    return DSv4Config.preset("tiny")


@dataclass(frozen=True)
class Case:
    """One layer step: the layer, its batch, its seeds, its precision and device, and how it runs."""

    cfg: DSv4Config = field(default_factory=_tiny)
    """The layer's shapes (a preset with its overrides, the indexer loss variant included)."""
    ratio: int = 4
    """Compression ratio (0: window only)."""
    lengths: tuple[int, ...] = (300,)
    """The documents' real lengths, packed in this order."""
    total: int | None = None
    """Rows of the packed batch (None: the padded documents' sum)."""
    pad_to_multiple: int = 1
    split: tuple[int, ...] | None = None
    """Explicit split points ``0 = b_0 <= ... <= b_cp = T`` over the CP ranks; None: equal slices."""
    seed: int = 0
    """Seeds the weights and every rank's inputs (:mod:`dsv4cp.harness.build`)."""
    dtype: str = "fp32"
    device: str = "cpu"
    """The device type the step runs on (``cpu`` or ``cuda``; a rank takes its own index of it)."""
    direction: str = "fwd+bwd"
    """:data:`PASSES`: forward only, or forward and backward."""
    overlap: str = "none"
    recompute: bool = False
    backend: str = "auto"
    """The sparse-attention backend the layer asks for (as the layer's ``backend``)."""
    kernel_options: KernelOptions = field(default_factory=KernelOptions.resolve)
    """Every kernel option's value, resolved once by the constructor that built the Case (default: the
    options in force where the Case is made); every pass hands them on as arguments: the layer holds them
    (its kernels' both directions), the cost model prices the step under them."""
    deterministic: bool = False
    """Run under ``torch.use_deterministic_algorithms(True)``."""
    compile: str | None = None
    """A ``torch.compile`` backend for the checked or timed layer; None: eager."""
    cuda_graph: bool = False
    """The timed pass times replays of the step captured once in a CUDA graph (:mod:`.time`)."""
    fresh_batches: int = 0
    """0: every step on the Case's one batch; N >= 2: every step on the next of N batches, building its
    layout again (:mod:`.fresh_batches`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        if self.split is not None:
            object.__setattr__(self, "split", tuple(int(b) for b in self.split))
        self.cfg.check_ratio(self.ratio)
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype: must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        if self.direction not in PASSES:
            raise ValueError(f"direction: must be one of {PASSES}, got {self.direction!r}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap: must be one of {OVERLAP_MODES}, got {self.overlap!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: must be 'cpu' or 'cuda', got {self.device!r}")
        check_backend_name(self.backend)
        if not isinstance(self.cuda_graph, bool):
            raise ValueError(f"cuda_graph: must be true or false, got {self.cuda_graph!r}")
        if isinstance(self.fresh_batches, bool) or not isinstance(self.fresh_batches, int) \
                or self.fresh_batches < 0 or self.fresh_batches == 1:
            raise ValueError(f"fresh_batches: must be 0 (one batch) or an int >= 2, got {self.fresh_batches!r}")
        check_fresh_batches(self.fresh_batches, self.cuda_graph)
        if not isinstance(self.kernel_options, KernelOptions):
            raise ValueError(f"kernel_options: must be a KernelOptions, got {type(self.kernel_options).__name__}")

    @property
    def backward(self) -> bool:
        return self.direction == "fwd+bwd"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def packed(self, device: torch.device | str | None = None) -> PackedSeqs:
        return PackedSeqs.from_lengths(self.lengths, self.pad_to_multiple, self.total, device=device)

    def rows(self) -> int:
        """Rows of the packed batch."""
        return self.packed().total

    def row_split(self, cp: int) -> RowSplit:
        """The ranks' row ranges over ``cp`` ranks; an explicit ``split`` is checked here (cp + 1 points from 0
        to T, ascending) so a malformed one raises ``ValueError`` before a rank slices its rows with it, and
        the layer checks the halo before any collective."""
        return as_split(self.split, self.rows(), cp)
