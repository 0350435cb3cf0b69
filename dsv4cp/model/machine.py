"""Hardware ceilings for the roofline lower bounds, and the machine this process runs on.

Two sets of ceilings bound a point: the machine's own (a preset's are measured on the hardware: the
``h200x2`` matrix ceiling is the 784 TFLOP/s a tuned bf16 matrix product reached on an H200) give
``bound_measured_ms``; the hardware's physical limits (:func:`physical_limits`: the H200 spec sheet's 989
TFLOP/s, 4.8 TB/s, 450 GB/s per NVLink direction) give ``bound_ms``, the one no kernel can beat.

:func:`this_machine` is the one default of every bound (the ``--machine`` of the CLI, a sweep's
points, the analytic model): the ``h200x2`` preset on an H200, the ``cpu-estimate`` preset on a host
without CUDA, and no machine (no bound) on a GPU without a preset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsv4cp.choices import MACHINE_PRESETS  # the presets' names: a --machine flag is checked without torch

GB = 1e9
"""Bandwidths are quoted in decimal GB/s, as NCCL's tests do."""


@dataclass(frozen=True)
class Machine:
    """Throughput ceilings of one GPU and its links.

    Attributes:
        name: a label carried into tables.
        peak_flops: dense bf16 matrix throughput (FLOP/s); 784e12 measured on an H200.
        hbm_bandwidth: device-memory bandwidth (B/s); a device copy ran at 4.26e12.
        allgather_busbw: collective BUS bandwidth (B/s) in NCCL's convention, used for all-gathers and
            reduce-scatters alike: a collective whose full (gathered) buffer is ``S`` bytes over ``n``
            ranks takes ``(n - 1) / n * S / busbw``. 258e9 measured between two NVLinked H200 at
            256 MiB per rank (smaller messages reach less: 183e9 at 16 MiB, 34e9 at 1 MiB).
        p2p_bandwidth: point-to-point bandwidth per direction (B/s), for the halo; 256e9 measured.
    """

    name: str = "h200x2"
    peak_flops: float = 784e12
    hbm_bandwidth: float = 4.26e12
    allgather_busbw: float = 258e9
    p2p_bandwidth: float = 256e9

    def __post_init__(self) -> None:
        for field in ("peak_flops", "hbm_bandwidth", "allgather_busbw", "p2p_bandwidth"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{field}: must be a positive number, got {value!r}")

    @classmethod
    def preset(cls, name: str = "h200x2", bandwidth: float | None = None) -> Machine:
        """``h200x2`` (two NVLinked H200, the measured ceilings), ``internode`` (same GPUs, every
        collective and the halo limited to ``bandwidth`` B/s per GPU, default 40e9), ``cpu`` (this
        host's ceilings, measured now by :func:`measure_host`) or ``cpu-estimate`` (fixed CPU ceilings,
        :data:`CPU_ESTIMATE`: the same on every rank and every run).

        ``bandwidth`` (B/s), when given, replaces both communication ceilings of any preset.
        """
        if name not in MACHINE_PRESETS:
            raise ValueError(f"machine: unknown preset {name!r}; choose one of {MACHINE_PRESETS}")
        machine = measure_host() if name == "cpu" else CPU_ESTIMATE if name == "cpu-estimate" else cls()
        if name == "internode":
            machine = machine.with_bandwidth(INTERNODE_BANDWIDTH if bandwidth is None else bandwidth, "internode")
        elif bandwidth is not None:
            machine = machine.with_bandwidth(bandwidth)
        return machine

    @classmethod
    def from_dict(cls, values: object, source: str = "machine") -> Machine:
        """A machine from a mapping of its fields (a ``--machine-file`` JSON); every ceiling required."""
        if not isinstance(values, dict):
            raise ValueError(f"{source}: must be a JSON object of ceilings, got {type(values).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}; fields are {sorted(fields)}")
        missing = sorted(fields - {"name"} - set(values))
        if missing:
            raise ValueError(f"{source}: missing ceiling(s) {missing}")
        return cls(**{"name": "file", **values})

    def with_bandwidth(self, bandwidth: float, name: str | None = None) -> Machine:
        """The same GPU with all-gather bus bandwidth and P2P bandwidth both set to ``bandwidth`` B/s."""
        if not (isinstance(bandwidth, (int, float)) and bandwidth > 0):
            raise ValueError(f"bandwidth: must be a positive number of bytes/s, got {bandwidth!r}")
        label = name or f"{self.name}@{bandwidth / GB:g}GB/s"
        return dataclasses.replace(self, name=label, allgather_busbw=float(bandwidth), p2p_bandwidth=float(bandwidth))

    def collective_time(self, total_bytes: float, ranks: int) -> float:
        """All-gather / reduce-scatter time of a ``total_bytes`` buffer over ``ranks`` ranks (bus-bw rule)."""
        if ranks <= 1:
            return 0.0
        return (ranks - 1) / ranks * total_bytes / self.allgather_busbw


INTERNODE_BANDWIDTH = 40 * GB
"""Default per-GPU inter-node bandwidth of the ``internode`` preset (an example figure)."""


LOOPBACK_BANDWIDTH = 0.5 * GB
"""Communication ceiling of the ``cpu`` machines: gloo all-gather bus bandwidth between two local
processes, measured on the 2-core development host (0.57 GB/s at 16 MiB, 0.33 GB/s at 64 MiB)."""

CPU_ESTIMATE = Machine(name="cpu-estimate", peak_flops=40e9, hbm_bandwidth=8 * GB,
                       allgather_busbw=LOOPBACK_BANDWIDTH, p2p_bandwidth=LOOPBACK_BANDWIDTH)
"""An ESTIMATE of a small CPU host's ceilings, fixed so that every rank of a run (each its own process)
derives the same bounds and the same balanced split: :func:`measure_host` gave 26-31 GFLOP/s (fp32
matrix product) and 5.2-6.4 GB/s (copy) on the shared 2-core development host; the figures are rounded
up so the bound stays below what such a host reaches. ``--machine cpu`` measures the host instead."""

H200_SPEC = Machine(name="h200 spec", peak_flops=989e12, hbm_bandwidth=4.8e12, allgather_busbw=450 * GB,
                    p2p_bandwidth=450 * GB)
"""The H200's physical limits, from its spec sheet: 989 TFLOP/s dense bf16 matrix throughput (1979 with 2:4
sparsity, which the layer does not use), 4.8 TB/s HBM3e, NVLink 900 GB/s = 450 GB/s per direction (the
all-gather bus bandwidth and the point-to-point bandwidth can reach at most that)."""

SPEC_SHEETS: dict[str, Machine] = {"h200x2": H200_SPEC, "internode": H200_SPEC}
"""The physical limits of the GPU of each preset that has one (a CPU has no spec sheet here)."""


def physical_limits(machine: Machine) -> Machine:
    """``machine`` at the physical limits of its hardware: what ``bound_ms`` is computed at, where
    ``bound_measured_ms`` is at ``machine``'s own (measured) ceilings.

    For a machine of a preset with a spec sheet (:data:`SPEC_SHEETS`, by the name before any ``@`` that
    :meth:`Machine.with_bandwidth` appends): the sheet's matrix peak and HBM bandwidth, and the sheet's link
    bandwidth where the machine's communication ceilings are ``h200x2``'s measured ones; a bandwidth the
    machine states (``internode``, ``--bandwidth``) is its link's limit and is kept. Any other machine (a
    CPU, a ``--machine-file``) has no spec sheet here: its own ceilings are its limits, so its two bounds
    agree."""
    preset = machine.name.split("@")[0]
    sheet = SPEC_SHEETS.get(preset)
    if sheet is None:
        return machine
    measured_links = Machine()  # the h200x2 preset: its communication ceilings were measured
    links_measured = (machine.allgather_busbw, machine.p2p_bandwidth) == (measured_links.allgather_busbw,
                                                                         measured_links.p2p_bandwidth)
    return dataclasses.replace(
        machine, name=f"{machine.name} spec", peak_flops=sheet.peak_flops, hbm_bandwidth=sheet.hbm_bandwidth,
        allgather_busbw=sheet.allgather_busbw if links_measured else machine.allgather_busbw,
        p2p_bandwidth=sheet.p2p_bandwidth if links_measured else machine.p2p_bandwidth)


GPU_PRESETS: dict[str, str] = {"H200": "h200x2"}
"""The preset of each GPU model with measured ceilings, by a word of ``torch.cuda.get_device_name()``."""


def record_preset(bound_machine: object, machine_label: object) -> str | None:
    """The preset of the machine a record was measured on: its bound's machine (``bound_machine``) when
    that is a preset, else the preset of the GPU its ``machine`` label names (:data:`GPU_PRESETS`:
    ``2xNVIDIA H200`` -> ``h200x2``), ``cpu-estimate`` for a CPU label (``cpu-2core``); None when neither
    says (another GPU, no label)."""
    if isinstance(bound_machine, str) and bound_machine in MACHINE_PRESETS and bound_machine != "cpu":
        return bound_machine
    if not isinstance(machine_label, str):
        return None
    if machine_label.startswith("cpu"):
        return CPU_ESTIMATE.name
    return next((preset for word, preset in GPU_PRESETS.items() if word in machine_label.upper()), None)


def this_machine() -> Machine | None:
    """The machine this process runs on: the preset of its GPU (:data:`GPU_PRESETS`), the
    :data:`CPU_ESTIMATE` without CUDA, or None (no bound) on a GPU without a preset
    (:func:`no_machine_reason` says which)."""
    if _gpu_name() is None:
        return CPU_ESTIMATE
    gpu = _gpu_name().upper()
    preset = next((p for word, p in GPU_PRESETS.items() if word in gpu), None)
    return None if preset is None else Machine.preset(preset)


def no_machine_reason() -> str:
    """Why :func:`this_machine` gave no machine, for a message (one clause)."""
    return (f"no bound: the GPU {_gpu_name()!r} has no preset of measured ceilings (presets: {sorted(GPU_PRESETS)}); "
            "pass --machine or --machine-file")


def _gpu_name() -> str | None:
    """The name of this process's GPU (the torchrun ``LOCAL_RANK``'s, as every rank's device is), None without CUDA."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def resolve_machine(machine: Machine | None) -> Machine:
    """``machine``, else :func:`this_machine`; ``ValueError`` naming ``machine`` where neither exists."""
    machine = machine if machine is not None else this_machine()
    if machine is None:
        raise ValueError(f"machine: {no_machine_reason()}")
    return machine


def measure_host(matmul_size: int = 1024, copy_bytes: int = 64 * 2**20) -> Machine:
    """This host's ceilings, measured in about a second: fp32 matrix-product FLOP/s (best of 5) and
    memory bandwidth from a large copy (read + write bytes, best of 5); communication is
    :data:`LOOPBACK_BANDWIDTH`. The CPU runs at the threads torch uses now."""
    import time

    import torch

    a = torch.randn(matmul_size, matmul_size)
    b = torch.randn(matmul_size, matmul_size)
    src = torch.ones(copy_bytes // 4)
    dst = torch.empty_like(src)

    def best(fn) -> float:
        fn()  # first call pays for page faults and thread start
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    flops = 2.0 * matmul_size**3 / best(lambda: torch.mm(a, b))
    bandwidth = 2.0 * copy_bytes / best(lambda: dst.copy_(src))
    return Machine(name=f"cpu ({torch.get_num_threads()} threads, measured)", peak_flops=flops,
                   hbm_bandwidth=bandwidth, allgather_busbw=LOOPBACK_BANDWIDTH, p2p_bandwidth=LOOPBACK_BANDWIDTH)
