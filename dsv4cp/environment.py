"""Where code runs: its version, the host, the hardware label and the library versions.

One dump, :func:`environment`, printed by ``dsv4cp env`` and written into every run's ``meta.json``
(:func:`dsv4cp.sweeps.meta.run_meta`); one hardware label, :func:`machine_label`, in every record and
benchmark, which ``dsv4cp compare`` matches before comparing.

``git_sha`` comes from the environment variable ``DSV4CP_GIT_SHA`` when it is set (set it where the
code was copied, e.g. onto a GPU machine: the copy may carry no ``.git``, or a stale one), else from
``git rev-parse HEAD`` run in the repository the package was imported from. ``git_dirty`` says
whether tracked files differ from that commit (None when git cannot tell, or the sha came from the
variable).
"""

from __future__ import annotations

import importlib
import os
import platform
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import torch

GIT_SHA_ENV = "DSV4CP_GIT_SHA"

OPTIONAL_PACKAGES = {"flash_mla": "flash_mla", "cudnn_frontend": "cudnn", "nvtx": "nvtx", "hta": "hta"}
"""Optional backends and tools whose versions are listed: name -> importable module."""


def _git(*args: str) -> str | None:
    """Output of a git command in the package's repository, None when git or the repository is missing."""
    repo = Path(__file__).resolve().parents[1]  # dsv4cp/environment.py -> the checkout
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_sha() -> str | None:
    """The commit of the code being run (see the module docstring)."""
    # The variable wins: a copy of the tree (a GPU machine's) may carry a stale .git of another commit.
    return os.environ.get(GIT_SHA_ENV) or _git("rev-parse", "HEAD") or None


def git_dirty() -> bool | None:
    """Whether tracked files differ from HEAD; None when git cannot tell."""
    if os.environ.get(GIT_SHA_ENV):
        return None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def machine_label(device: torch.device | str, world: int | None = None) -> str:
    """Short hardware label that refuses cross-hardware comparisons: the GPU's name, prefixed with the
    rank count ``world`` when given (``NVIDIA H200``, ``2xNVIDIA H200``), or ``cpu-<cores>core`` on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return name if world is None else f"{world}x{name}"
    return f"cpu-{os.cpu_count()}core"


def _driver_version() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def module_version(module_name: str) -> str | None:
    """The version of an importable module (``installed`` when it states none); None when it cannot be
    imported."""
    try:
        module = importlib.import_module(module_name)
    except Exception:  # an optional package may fail to import in many ways: it is then absent
        return None
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            version = metadata.version(module_name)
        except metadata.PackageNotFoundError:
            version = "installed"
    return str(version)


def environment(device: torch.device | str | None = None, world: int = 1) -> dict:
    """Versions and devices of a run on ``world`` ranks of ``device``'s kind (default: CUDA when
    available, else CPU): interpreter, platform, host, code version, hardware, driver, CUDA, torch,
    triton, NCCL and the optional backends (name -> version, None when absent)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    cuda = device.type == "cuda"
    nccl = torch.cuda.nccl.version() if cuda else None
    return {
        "python": platform.python_version(), "platform": platform.platform(), "host": socket.gethostname(),
        "git_sha": git_sha(), "git_dirty": git_dirty(), "machine": machine_label(device, world),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "gpu_name": torch.cuda.get_device_name(device) if cuda else None,
        "gpu_count": world if cuda else 0,
        "driver": _driver_version() if cuda else None,
        "cuda": torch.version.cuda, "torch": torch.__version__, "triton": module_version("triton"),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else (str(nccl) if nccl else None),
        "optional_backends": {name: module_version(module) for name, module in OPTIONAL_PACKAGES.items()},
    }


CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS reuses its workspace deterministically only with a fixed workspace configuration; torch raises in
deterministic mode without ``CUBLAS_WORKSPACE_CONFIG`` set (before the first matrix product)."""


@contextmanager
def deterministic_algorithms(enabled: bool = True) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for the block when ``enabled``, then the previous
    setting; with ``enabled`` False the setting is left as it is.

    Sets ``CUBLAS_WORKSPACE_CONFIG`` (unless already set) so that matrix products are allowed in the mode.
    """
    previous = torch.are_deterministic_algorithms_enabled()
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)
