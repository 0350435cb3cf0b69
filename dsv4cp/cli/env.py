"""Print versions and devices (the environment every run's meta.json records), which kernel backends are
deterministic per op and direction, what the sparse-attention backend "auto" resolves to per direction,
every backend with whether it can run here and, when it cannot, why (the package is missing, no CUDA
device, Triton's CPU interpreter off), and every kernel option with its value and where that came from
(``explicit``: --kernel-option, ``env``: its DSV4CP_* variable, ``default``).
"""

from __future__ import annotations

import argparse

import torch

from dsv4cp import kernel_options
from dsv4cp.cli.common import add_device_option, add_kernel_option_argument, parse_device
from dsv4cp.environment import environment

HELP = "versions, devices, which kernel backends are usable here (and why not), and the kernel options"

def environment_lines(device: torch.device) -> list[str]:
    """``key: value`` lines of :func:`dsv4cp.environment.environment` on ``device`` (the fields
    ``meta.json`` records, plus the interpreter, platform and every visible device); an optional
    backend that cannot be imported shows as ``missing``."""
    info = environment(device)
    devices = info.pop("devices")
    optional = info.pop("optional_backends")
    info["devices"] = ", ".join(devices) or "cpu"
    info.update({name: version or "missing" for name, version in optional.items()})
    return [f"{key:>17}: {value}" for key, value in info.items()]


def backend_status(name: str, device: torch.device) -> str:
    """``available`` (with its side for a one-sided library) or ``missing (why)`` on ``device``."""
    from dsv4cp import kernels
    from dsv4cp.kernels import cudnn_dsa, flashmla

    if name == "torch":
        return "available (the reference; any device)"
    if name in ("triton", "triton-deterministic"):
        if kernels.triton_available(device):
            return "available" + (" (CPU interpreter: slow, for tests)" if device.type == "cpu" else "")
        if not kernels.HAS_TRITON:
            return "missing (no module triton)"
        if device.type == "cpu":
            return "missing on CPU without TRITON_INTERPRET=1 (set it before starting the command)"
        return "missing (no CUDA device)"
    libraries = {flashmla.NAME: (flashmla, "forward only: pair it, e.g. flashmla+cudnn"),
                 cudnn_dsa.NAME: (cudnn_dsa, "backward only: pair it, e.g. triton+cudnn")}
    if name in libraries:
        module, side = libraries[name]
        if module.available(device):
            return f"available ({side})"
        problems = [p for p in (module.device_problem(device), module.library_problem()) if p]
        return f"missing ({'; '.join(problems)})"
    return "registered (no availability check known to 'dsv4cp env')"


def option_lines() -> list[str]:
    """One line per kernel option: name, value, where it came from, its variable, the op and its doc."""
    rows = kernel_options.describe()
    width = max(len(row["name"]) for row in rows)
    lines = [f"{'kernel options':>12}: name = value (source; variable; op: what it does)"]
    for row in rows:
        lines.append(f"  {row['name']:<{width}} = {row['value']} ({row['source']}; {row['env']}; "
                     f"{row['op']}: {row['doc']}; one of {row['allowed']})")
    return lines


def options_markdown() -> str:
    """The README's table of kernel options, from the registry (its defaults, not this process' values)."""
    lines = ["| option | variable | values | default | op | what it does |", "|---|---|---|---|---|---|"]
    for name, option in kernel_options.OPTIONS.items():
        values = option.allowed.replace(" | ", ", ")  # a bare | would split the cell
        lines.append(f"| `{name}` | `{option.env}` | `{values}` | `{option.text(option.default)}` | "
                     f"{option.op} | {option.doc} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_option(parser)
    add_kernel_option_argument(parser)


def run(args: argparse.Namespace) -> int:
    from dsv4cp.ops import backend_names, resolve_backend

    device = parse_device(args.device)
    print("\n".join(environment_lines(device)))
    from dsv4cp.ops.determinism import registry_lines

    print(f"{'determinism':>17}: on CUDA, per op/backend (on CPU every path is deterministic)")
    print("\n".join(registry_lines()))
    print("\n".join(option_lines()))
    forward, backward = resolve_backend("auto", device).direction_names
    print(f"{'backends':>17}: on {device}; 'auto' -> forward {forward}, backward {backward}")
    for name in backend_names():
        print(f"{name:>22}: {backend_status(name, device)}")
    return 0
