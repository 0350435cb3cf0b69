"""Conventions shared by every ``dsv4cp`` sub-command: option names, help, validation, errors.

One name per meaning: ``--kernel-backend`` is always the sparse-attention kernel backend and
``--dist-backend`` always the torch.distributed backend. Every option has a help line; help shows
every default and keeps example commands in descriptions as written. Every check of user input runs
BEFORE the first measurement or collective, so nothing measured is ever lost to a bad flag.

API (used by ``cli/*.py``):

* :class:`HelpFormatter`: defaults shown, descriptions and epilogs kept as written.
* Exit codes :data:`EXIT_OK` 0, :data:`EXIT_FAILED` 1 (a check failed), :data:`EXIT_USAGE` 2 (bad
  input, like argparse), :data:`EXIT_OOM` 3 (out of memory, or :class:`WouldNotFitError`: refused
  because the estimate does not fit); :data:`EXIT_CODES_HELP` documents them; :func:`run_command`
  maps exceptions to them (``ValueError``, ``OSError``, ``sqlite3.DatabaseError`` -> 2 with one
  ``dsv4cp <cmd>: error: ...`` line; ``torch.OutOfMemoryError`` -> 3; anything else is a bug and keeps
  its traceback). Under torchrun the line starts with ``[rank R]``.
* argparse types: :func:`positive_int`, :func:`non_negative_int`, :func:`positive_float`,
  :func:`int_list` (comma-separated positive ints), :func:`float_in_range` (a bounded number).
* :func:`flag_message`: rewrites ``total: ...`` (a config/packing field) to ``--tokens: ...``
  (the flag the user typed), from the one table :data:`FIELD_FLAGS`.
* Option adders: :func:`add_layer_options` (``--preset --ratio --tokens --lengths --packing
  --doc-len --pad-to-multiple --dtype --kernel-backend --loss --recompute --seed`` and, with
  ``cp=True``, ``--overlap``), :func:`add_timing_options` (``--warmup --reps --l2-flush
  --progress``), :func:`add_dist_backend_option` (``--dist-backend``), :func:`add_device_option`
  (``--device``), :func:`add_machine_options` (``--machine --machine-file --bandwidth``),
  :func:`add_memory_options` (``--force``), :func:`add_renamed_option` (an old flag that now
  fails with a pointer to its new name), :func:`add_kernel_option_argument` (``--kernel-option
  NAME=VALUE``, repeatable; in :func:`add_layer_options` too).
* :func:`kernels_line`: what ran, for a command's output.
* :func:`kernel_option_values`, :func:`kernel_options_in_force`: the ``--kernel-option`` values,
  checked (``ValueError`` naming the flag), and the context that applies them (``dsv4cp.cli.main``
  enters it around every command, before any work).
* Resolvers (raise ``ValueError`` naming the flag): :func:`parse_lengths`, :func:`layer_inputs`
  (config + document lengths + packed offsets from the layer options), :func:`resolve_dtype`,
  :func:`parse_device`, :func:`resolve_dist_backend`, :func:`machine_from_args`,
  :func:`check_output_file`, :func:`check_output_dir`, :func:`check_memory` (estimate vs
  :func:`free_bytes`), :func:`progress_enabled` (then :func:`dsv4cp.profiling.progress.step_progress`
  gives ``benchmark``'s ``on_step``), :func:`check_args_agree` (all ranks parsed the same options:
  call once after ``init_process_group``, before the first real collective).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sqlite3
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4cp import kernel_options
from dsv4cp.config import DTYPE_NAMES, LOSS_VARIANTS, PRESET_NAMES, DSv4Config, default_dtype
from dsv4cp.stopping import exit_code, signal_name, stopping_on_signals

if TYPE_CHECKING:  # imported where used: a command that reads no tensor (sweep --dry-run) never imports torch
    import torch

    from dsv4cp.harness.case import Case
    from dsv4cp.packing import PackedSeqs

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_OOM = 3

EXIT_CODES_HELP = """\
exit codes:
  0  success
  1  a check failed (check-cp: a quantity missed its tolerance; layer, profile: the step's output,
     indexer loss or gradients are not finite; sweep: a point failed), or a spawned rank died (one line
     naming it and its signal)
  2  bad input: usage errors, invalid values, unreadable or unwritable paths, a full disk (one line on
     stderr; what was written before stays whole: a sweep continues with --resume)
  3  out of memory: refused before allocating (the estimate exceeds free memory; --force skips the
     check) or the device ran out while running
  130  interrupted (SIGINT), 143 stopped by SIGTERM, 129 by SIGHUP: the points a sweep recorded stay and
       its ranks are stopped; --resume continues it
"""

DIST_BACKENDS = ("gloo", "nccl")
PROGRESS_MODES = ("auto", "on", "off")
DEFAULT_PRESET = "tiny"
"""Default ``--preset`` of the commands that MEASURE (runs in seconds on a CPU). ``model`` computes
in closed form and defaults to ``flash``, the checkpoint whose cost it is meant to show."""

FIELD_FLAGS: dict[str, str] = {
    "total": "--tokens",
    "packed.total": "--tokens",
    "tokens": "--tokens",
    "lengths": "--lengths",
    "cu_seqlens": "--lengths",
    "cu_seqlens_padded": "--pad-to-multiple",
    "pad_to_multiple": "--pad-to-multiple",
    "doc_len": "--doc-len",
    "packing": "--packing",
    "preset": "--preset",
    "compress_ratio": "--ratio",
    "indexer_loss": "--loss",
    "overlap": "--overlap",
    "backend": "--kernel-backend",
    "machine": "--machine",
    "bandwidth": "--bandwidth",
    "warmup": "--warmup",
    "reps": "--reps",
    "cuda_graph": "--cuda-graph",
    "fresh_batches": "--fresh-batches",
    "path": "PATH",
}
"""Library field names (config, packing, workloads, model) -> the flag a user typed for them."""

_FIELD_PREFIX = re.compile(r"^([a-z_.]+)(\[\d+\])?: ")


def flag_message(message: str) -> str:
    """``message`` with a leading library field name (``total: ...``) replaced by its flag."""
    match = _FIELD_PREFIX.match(message)
    if match is None or match.group(1) not in FIELD_FLAGS:
        return message
    return f"{FIELD_FLAGS[match.group(1)]}{match.group(2) or ''}: {message[match.end():]}"


# ---------------------------------------------------------------------------------------- help
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows ``(default: X)`` after every option that has a meaningful default (not None, not a
    ``store_true`` flag's False) and keeps descriptions and epilogs, with their example commands,
    as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action, argparse._StoreTrueAction):
            return action.help
        return super()._get_help_string(action)


# ---------------------------------------------------------------------------------------- errors
class WouldNotFitError(RuntimeError):
    """The step's estimated peak memory exceeds the device's free memory (exit code 3)."""


_USER_INPUT_ERRORS = (ValueError, OSError, sqlite3.DatabaseError, json.JSONDecodeError)


def _rank_prefix() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""


def run_command(command: str, fn: Callable[[], int | None]) -> int:
    """Run one sub-command; turn bad input and out-of-memory into one stderr line and an exit code.

    Like argparse, a user error is ``dsv4cp <command>: error: <message>`` and exit code 2. Programming
    errors (anything else) keep their traceback: they are bugs to report, not input to fix.
    """
    prog = f"dsv4cp {command}"
    try:
        with stopping_on_signals():
            return int(fn() or 0)
    except WouldNotFitError as err:
        print(f"{prog}: error: {_rank_prefix()}{err}", file=sys.stderr)
        return EXIT_OOM
    except _USER_INPUT_ERRORS as err:
        print(f"{prog}: error: {_rank_prefix()}{_describe(err)}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as err:  # torch.OutOfMemoryError is one
        from dsv4cp.cp.launch import RankExited  # here: a command that never spawns imports no torch for it
        from dsv4cp.profiling.memory import is_out_of_memory

        if isinstance(err, RankExited):
            print(f"{prog}: error: {err}", file=sys.stderr)
            return EXIT_FAILED
        if not is_out_of_memory(err):
            raise
        lines = str(err).strip().splitlines() or [type(err).__name__]
        first = next((line.strip() for line in lines if "memory" in line), lines[0])
        print(f"{prog}: error: {_rank_prefix()}out of memory ({first}); try more ranks (--cp / "
              "--nproc-per-node), --recompute, fewer --tokens or a smaller --preset", file=sys.stderr)
        return EXIT_OOM
    except KeyboardInterrupt as stop:  # SIGINT, SIGTERM or SIGHUP (dsv4cp.stopping)
        name = signal_name(stop)
        print(f"{prog}: interrupted" if name == "SIGINT" else f"{prog}: stopped by {name}", file=sys.stderr)
        return exit_code(stop)


def _describe(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror or err}"
    text = str(err).strip() or type(err).__name__
    if isinstance(err, sqlite3.DatabaseError):
        return f"not a readable SQLite database ({text})"
    return flag_message(text.splitlines()[0])


# ---------------------------------------------------------------------------------------- types
def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative int, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def float_in_range(low: float, high: float, unit: str = "") -> Callable[[str], float]:
    """argparse type: a number in ``[low, high]`` (``unit`` named in the error, e.g. ``" s"``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not low <= value <= high:  # NaN fails both comparisons
            raise argparse.ArgumentTypeError(f"must be from {low:g} to {high:g}{unit}, got {text!r}")
        return value

    return parse


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive ints, e.g. ``1,2,8``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"must be positive ints, got {text!r}")
    return values


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None


# ---------------------------------------------------------------------------------------- adders
def add_layer_options(
    parser: argparse.ArgumentParser, *, preset: str = DEFAULT_PRESET, tokens: int = 4096, cp: bool = True,
    dtype: str | None = None,
) -> None:
    """The options that describe one layer step: model, batch, precision, kernels, seed.

    ``cp=True`` adds ``--overlap`` (only meaningful with several ranks). ``dtype`` None means the
    device's default (bf16 on GPU, fp32 on CPU).
    """
    from dsv4cp.ops.sparse_attention import backend_names
    from dsv4cp.workloads import PACKINGS

    parser.add_argument("--preset", choices=PRESET_NAMES, default=preset, help="layer dimensions (config preset)")
    parser.add_argument("--ratio", type=non_negative_int, default=4,
                        help="compress ratio: 0 (W: window only), 4 (C: indexer top-k) or another (H)")
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help=f"packed rows T of the batch (default: the sum of --lengths, else {tokens})")
    parser.add_argument("--lengths", default=None,
                        help="comma-separated document lengths, e.g. 5,127,0,300 (overrides --packing)")
    parser.add_argument("--packing", choices=PACKINGS, default="one", help="how --tokens splits into documents")
    parser.add_argument("--doc-len", type=positive_int, default=None,
                        help="document length of --packing fixed (default: --tokens / 8)")
    parser.add_argument("--pad-to-multiple", type=positive_int, default=1,
                        help="pad every document to a multiple of this many rows")
    device_default = "" if dtype else " (default: bf16 on GPU, fp32 on CPU)"
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=dtype,
                        help=f"parameter and activation dtype{device_default}")
    parser.add_argument("--kernel-backend", default="auto",
                        help=f"sparse-attention kernel backend: one of {', '.join(backend_names())} "
                             "('dsv4cp env' says which are usable here)")
    parser.add_argument("--loss", choices=LOSS_VARIANTS, default="sparse", help="indexer loss variant (C layers)")
    parser.add_argument("--recompute", action="store_true",
                        help="selective recompute: keep less for backward, rebuild it (saves memory)")
    if cp:
        from dsv4cp.cp.comm import OVERLAP_MODES

        parser.add_argument("--overlap", choices=OVERLAP_MODES, default="async",
                            help="overlap CP communication with compute (async) or run it in line (none)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of weights, inputs and packings")
    add_kernel_option_argument(parser)
    parser.set_defaults(_tokens_default=tokens)
    add_renamed_option(parser, "--backend", "--kernel-backend (kernels) or --dist-backend (torch.distributed)")


def add_kernel_option_argument(parser: argparse.ArgumentParser) -> None:
    """``--kernel-option NAME=VALUE`` (repeatable): a kernel option (:mod:`dsv4cp.kernel_options`) set for
    the whole command, over its ``DSV4CP_*`` variable."""
    parser.add_argument("--kernel-option", action="append", default=None, metavar="NAME=VALUE",
                        help="set a kernel option for this command, e.g. topk_impl=stream (repeatable; "
                             "'dsv4cp env' lists them)")


def kernel_option_values(args: argparse.Namespace) -> dict[str, str]:
    """The ``--kernel-option`` assignments (none when the command has no such flag); ``ValueError``
    starting with the flag, naming the bad name or value."""
    try:
        return kernel_options.parse_assignments(list(getattr(args, "kernel_option", None) or []))
    except ValueError as err:
        raise ValueError(f"--kernel-option: {str(err).removeprefix('kernel option: ')}") from None


@contextlib.contextmanager
def kernel_options_in_force(args: argparse.Namespace):
    """A context in which the command's ``--kernel-option`` values hold. For a command that has the
    flag, every option's value (its variable's included) is checked on entry: a bad one fails before
    the command starts."""
    values = kernel_option_values(args)
    with kernel_options.overrides(values):
        if hasattr(args, "kernel_option"):
            kernel_options.resolved()
        yield


def kernels_line(backends: dict[str, str]) -> str:
    """What ran (:func:`dsv4cp.kernel_options.backends_ran`) as one output line."""
    return "kernels: " + (", ".join(f"{key}={value}" for key, value in backends.items()) or "none noted")


def add_timing_options(parser: argparse.ArgumentParser, *, warmup: int = 3, reps: int = 10) -> None:
    """``--warmup``, ``--reps``, ``--l2-flush``, ``--progress`` (docs/design.md §5 timing protocol)."""
    parser.add_argument("--warmup", type=non_negative_int, default=warmup, help="untimed steps before timing")
    parser.add_argument("--reps", type=positive_int, default=reps, help="timed steps (median, p20, p80 reported)")
    parser.add_argument("--l2-flush", action="store_true", help="zero a 256 MiB buffer before each step (GPU)")
    parser.add_argument("--progress", choices=PROGRESS_MODES, default="auto",
                        help="progress bar with ETA on stderr, rank 0 only; auto: only when stderr is a terminal")


def add_dist_backend_option(parser: argparse.ArgumentParser) -> None:
    """``--dist-backend`` (torch.distributed), default nccl with CUDA, else gloo."""
    parser.add_argument("--dist-backend", choices=DIST_BACKENDS, default=None,
                        help="torch.distributed backend (default: nccl when CUDA is available, else gloo)")


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device``: cpu or cuda[:N]."""
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available, else cpu)")


def add_machine_options(parser: argparse.ArgumentParser) -> None:
    """``--machine``, ``--machine-file``, ``--bandwidth``: the ceilings that bounds are computed for."""
    from dsv4cp.choices import MACHINE_PRESETS  # not through dsv4cp.model, which imports torch

    parser.add_argument("--machine", choices=MACHINE_PRESETS, default=None,
                        help="hardware ceilings of the bounds (default: the one a --calibration was fitted "
                             "against, else the machine this runs on: h200x2 on an H200, cpu-estimate without "
                             "CUDA, none on another GPU); 'cpu' measures this host's in about a second")
    parser.add_argument("--machine-file", type=Path, default=None,
                        help="JSON of ceilings instead of --machine: name, peak_flops (FLOP/s), hbm_bandwidth, "
                             "allgather_busbw, p2p_bandwidth (B/s)")
    parser.add_argument("--bandwidth", type=positive_float, default=None,
                        help="communication bandwidth in GB/s replacing the machine's (all-gather bus and P2P)")


def add_memory_options(parser: argparse.ArgumentParser) -> None:
    """``--force``: skip the peak-memory estimate check."""
    parser.add_argument("--force", action="store_true",
                        help="run even when the estimated peak memory exceeds the device's free memory")


class _Renamed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed: use {self.const}")


def add_renamed_option(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """A hidden ``old`` flag that fails with 'renamed: use NEW' instead of 'unrecognized arguments'."""
    parser.add_argument(old, action=_Renamed, const=new, nargs="?", help=argparse.SUPPRESS)


# ---------------------------------------------------------------------------------------- resolvers
def parse_lengths(text: str | None, flag: str = "--lengths") -> list[int] | None:
    """Comma-separated non-negative document lengths, or None when not given."""
    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}: must be comma-separated ints, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ValueError(f"{flag}: must be non-negative ints, at least one, got {text!r}")
    return values


@dataclass(frozen=True)
class LayerInputs:
    """What the layer options describe: the config, the documents and their packed offsets (CPU)."""

    cfg: DSv4Config
    lengths: list[int]
    packed: PackedSeqs
    packing: str
    """``lengths`` when --lengths was given, else the --packing name."""


def layer_inputs(args: argparse.Namespace, cp: int = 1) -> LayerInputs:
    """Resolve :func:`add_layer_options`' values for ``cp`` ranks (the adversarial packing straddles
    their boundaries); every error names its flag."""
    from dsv4cp.packing import PackedSeqs
    from dsv4cp.workloads import pack_lengths

    cfg = DSv4Config.preset(args.preset, indexer_loss=args.loss)
    cfg.check_ratio(args.ratio)
    lengths = parse_lengths(args.lengths)
    if lengths is not None:
        packing = "lengths"
        tokens = args.tokens if args.tokens is not None else sum(lengths)
        if tokens < 1:
            raise ValueError(f"--lengths: the documents hold no token, got {args.lengths!r}")
    else:
        packing = args.packing
        tokens = args.tokens if args.tokens is not None else args._tokens_default
        doc_len = args.doc_len
        if doc_len is None and args.packing == "fixed":
            doc_len = max(1, tokens // 8)
        lengths = pack_lengths(tokens, args.packing, doc_len=doc_len, seed=args.seed, cp=cp, ratio=args.ratio)
    try:
        packed = PackedSeqs.from_lengths(lengths, pad_to_multiple=args.pad_to_multiple, total=tokens)
    except ValueError as err:
        if str(err).startswith("total:"):  # --tokens smaller than the documents
            raise ValueError(f"--tokens: {tokens} is fewer than the padded documents' "
                             f"{PackedSeqs.from_lengths(lengths, args.pad_to_multiple).total} rows") from None
        raise
    from dsv4cp.ops.sparse_attention import check_backend_name

    check_backend_name(args.kernel_backend)  # its "backend:" message becomes "--kernel-backend:"
    return LayerInputs(cfg, lengths, packed, packing)


def case_from_args(
    args: argparse.Namespace, inputs: LayerInputs, *, device: torch.device, dtype: torch.dtype | str, backward: bool,
    split: tuple[int, ...] | None = None, compile: str | None = None,
) -> Case:
    """The :class:`~dsv4cp.harness.case.Case` the layer options describe (resolved by :func:`layer_inputs`),
    with the command's ``--kernel-option`` values over the environment and the defaults, resolved here once;
    the options a command lacks (``--overlap``, ``--deterministic``) take the Case's defaults."""
    from dsv4cp.config import DTYPES
    from dsv4cp.harness.case import Case

    dtype_name = dtype if isinstance(dtype, str) else dict(zip(DTYPES.values(), DTYPE_NAMES))[dtype]
    return Case(
        cfg=inputs.cfg, ratio=args.ratio, lengths=tuple(inputs.lengths), total=inputs.packed.total,
        pad_to_multiple=args.pad_to_multiple, split=split, seed=args.seed, dtype=dtype_name, device=device.type,
        direction="fwd+bwd" if backward else "fwd", overlap=getattr(args, "overlap", "none"),
        recompute=args.recompute, backend=args.kernel_backend,
        kernel_options=kernel_options.KernelOptions.resolve(kernel_option_values(args)),
        deterministic=getattr(args, "deterministic", False), compile=compile,
    )


def resolve_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    from dsv4cp.config import DTYPES

    return DTYPES[args.dtype] if args.dtype else default_dtype(device)


def parse_device(text: str | None, flag: str = "--device") -> torch.device:
    """``cpu`` or ``cuda[:N]`` that exists here; None means cuda when available, else cpu."""
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag}: must be cpu or cuda[:N], got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag}: must be cpu or cuda[:N], got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{flag}: {text} requested but no CUDA device is available (use --device cpu)")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{flag}: {text} requested but only {count} CUDA device(s) exist")
    return device


def resolve_dist_backend(args: argparse.Namespace, *, distributed: bool) -> str:
    """The torch.distributed backend to use, checked BEFORE ``init_process_group``.

    ``distributed`` says whether this run uses torch.distributed at all: an explicit
    ``--dist-backend`` on a run that does not is refused rather than silently ignored.
    """
    import torch

    cuda = torch.cuda.is_available()
    backend = args.dist_backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ValueError("--dist-backend: nccl needs CUDA GPUs and none is available here; use --dist-backend gloo")
    if args.dist_backend is not None and not distributed:
        raise ValueError(f"--dist-backend: {args.dist_backend} has no effect on a single-process run; "
                         "launch with torchrun --nproc-per-node N, or drop the flag")
    return backend


def machine_from_args(args: argparse.Namespace, calibration=None):
    """The :class:`~dsv4cp.model.machine.Machine` of ``--machine`` / ``--machine-file`` / ``--bandwidth``;
    without either flag the preset that ``calibration`` (a ``--calibration``) was fitted against, whose
    bounds its factors scale, else the machine this process runs on
    (:func:`~dsv4cp.model.machine.this_machine`): None (no bound) on a GPU without a preset."""
    from dsv4cp.model.machine import GB, MACHINE_PRESETS, Machine, no_machine_reason, this_machine

    bandwidth = None if args.bandwidth is None else args.bandwidth * GB
    if args.machine_file is None and args.machine is None:
        fitted_on = getattr(calibration, "machine", "")
        machine = Machine.preset(fitted_on) if fitted_on in MACHINE_PRESETS else this_machine()
        if machine is None and bandwidth is not None:
            raise ValueError(f"--bandwidth: replaces a machine's communication ceilings, and there is none: "
                             f"{no_machine_reason()}")
        return machine if machine is None or bandwidth is None else machine.with_bandwidth(bandwidth)
    if args.machine_file is None:
        return Machine.preset(args.machine, bandwidth)
    try:
        values = json.loads(Path(args.machine_file).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--machine-file: {args.machine_file} is not valid JSON ({err})") from None
    machine = Machine.from_dict(values, source=f"--machine-file {args.machine_file}")
    return machine if bandwidth is None else machine.with_bandwidth(bandwidth)


def check_output_file(path: str | Path | None, flag: str) -> Path | None:
    """Validate that ``path`` can be written (its folder exists and is writable) before any work."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag}: {path} is a directory, expected a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag}: folder {parent} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag}: {path} is not writable")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: folder {parent} is not writable")
    return path


def check_output_dir(path: str | Path | None, flag: str) -> Path | None:
    """Create ``path`` (and parents) if needed and check it is a writable folder, before any work."""
    if path is None:
        return None
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag}: {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{flag}: cannot create {path} ({err.strerror or err})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: {path} is not writable")
    return path


def check_memory(
    inputs: LayerInputs, ratio: int, cp: int, *, backward: bool, dtype: torch.dtype, recompute: bool,
    device: torch.device, force: bool,
) -> int:
    """Refuse (:class:`WouldNotFitError`) a step whose estimated peak exceeds free memory.

    Returns the estimate in bytes per rank. ``force`` skips the refusal (the estimate is still made).
    """
    from dsv4cp.model.memory import peak_bytes_estimate

    direction = "fwd+bwd" if backward else "fwd"
    estimate = peak_bytes_estimate(inputs.cfg, ratio, inputs.packed, cp, direction, dtype, recompute)
    free = free_bytes(device)
    if force or free is None or estimate <= free:
        return estimate
    fits = [f"--tokens about {_tokens_that_fit(inputs, ratio, cp, direction, dtype, recompute, free)}"]
    if not recompute:
        with_recompute = peak_bytes_estimate(inputs.cfg, ratio, inputs.packed, cp, direction, dtype, True)
        if with_recompute <= free:
            fits.append(f"--recompute ({with_recompute / 2**30:.1f} GiB)")
    for more in (2 * cp, 4 * cp, 8 * cp):
        if inputs.packed.total % more == 0:
            need = peak_bytes_estimate(inputs.cfg, ratio, inputs.packed, more, direction, dtype, recompute)
            if need <= free:
                fits.append(f"cp {more} ranks ({need / 2**30:.1f} GiB each)")
                break
    raise WouldNotFitError(
        f"estimated peak {estimate / 2**30:.1f} GiB per rank exceeds the {free / 2**30:.1f} GiB free on {device}; "
        f"what fits: {'; '.join(fits)} (or --force to try anyway)"
    )


def _tokens_that_fit(inputs: LayerInputs, ratio, cp, direction, dtype, recompute, free) -> int:
    """The largest one-document token count (a multiple of 1024 * cp) whose estimate fits in ``free``."""
    from dsv4cp.model.memory import peak_bytes_estimate
    from dsv4cp.packing import PackedSeqs

    step = 1024 * cp
    low, high = 0, max(1, inputs.packed.total // step)
    while low < high:  # the estimate grows with tokens: bisect on multiples of `step`
        mid = (low + high + 1) // 2
        packed = PackedSeqs.from_lengths([mid * step])
        if peak_bytes_estimate(inputs.cfg, ratio, packed, cp, direction, dtype, recompute) <= free:
            low = mid
        else:
            high = mid - 1
    return low * step


def free_bytes(device: torch.device) -> int | None:
    """Memory free for this step: CUDA ``mem_get_info``; on CPU ``MemAvailable`` of /proc/meminfo
    (None where that file does not exist: the check is then skipped)."""
    import torch

    from dsv4cp.profiling.memory import proc_field_bytes

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return proc_field_bytes("/proc/meminfo", "MemAvailable")


def progress_enabled(mode: str, rank: int = 0) -> bool:
    """Whether to draw a progress bar: rank 0 only; ``auto`` when stderr is a terminal (as tqdm, pytest)."""
    if rank != 0 or mode == "off":
        return False
    return mode == "on" or sys.stderr.isatty()


def check_args_agree(args: argparse.Namespace, group) -> None:
    """Raise ``ValueError`` on every rank unless all ranks of ``group`` parsed the same options.

    Call once per run, before the first real collective (a rank given other offsets would otherwise
    run and return garbage). Options that may legitimately differ per rank are left out.
    """
    from dsv4cp.cp.agreement import check_ranks_agree

    fields = {
        "--" + name.replace("_", "-"): value for name, value in sorted(vars(args).items())
        if not name.startswith("_") and name not in ("progress", "device")
    }
    check_ranks_agree({k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                       for k, v in fields.items()}, group)


def torchrun_world(cp_flag: int | None) -> int:
    """torchrun's world size; ``ValueError`` naming ``--cp`` when the flag asks for another (under torchrun
    the ranks are the processes, so the flag can only repeat their number)."""
    world = int(os.environ["WORLD_SIZE"])
    if cp_flag is not None and cp_flag != world:
        raise ValueError(f"--cp: {cp_flag} differs from torchrun's world size {world}; drop --cp under torchrun")
    return world


def gather_torchrun_ranks(args: argparse.Namespace, backend: str,
                          measure: Callable[[int, int, torch.device], object]) -> tuple[int, list]:
    """Under torchrun: join the process group, check every rank parsed the same options, run
    ``measure(rank, world, device)`` on each rank, gather the results on every rank and leave the group.
    Returns this rank and the rank-major results (the group is destroyed also when ``measure`` raises)."""
    import torch.distributed as dist

    from dsv4cp.cp.launch import init_from_env

    device = init_from_env(backend)
    try:
        check_args_agree(args, dist.group.WORLD)
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = measure(rank, world, device)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
    finally:
        dist.destroy_process_group()
    return rank, gathered
