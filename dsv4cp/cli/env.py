"""Print versions, devices and which kernel backends import on this machine."""

from __future__ import annotations

import argparse
import importlib
import platform

import torch

HELP = "versions, devices and available backends"

_OPTIONAL = ("triton", "nvtx", "flash_mla", "cudnn", "pandas", "matplotlib")


def environment() -> dict[str, str]:
    """Environment metadata (also recorded with every benchmark result)."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "devices": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "cpu",
    }
    for name in _OPTIONAL:
        try:
            module = importlib.import_module(name)
            info[name] = getattr(module, "__version__", "installed")
        except Exception as err:  # an optional package may fail in many ways; report, do not crash
            info[name] = f"missing ({type(err).__name__})"
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    from dsv4cp.ops import backend_names, resolve_backend

    for key, value in environment().items():
        print(f"{key:>12}: {value}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"{'backends':>12}: {', '.join(backend_names())} (auto -> {resolve_backend('auto', device).name} on {device})")
    return 0
