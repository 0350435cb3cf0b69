"""Rank emulation: one process runs as rank ``R`` of a CP group of ``cp`` ranks, on one device, to
measure that rank's compute time and peak memory when fewer devices than ranks are available.

The group is torch's fake process group (backend ``"fake"``, :mod:`torch.testing._internal.distributed.fake_pg`):
every collective completes at once and moves no data, so **communication time is not measured**,
only the rank's own kernels and allocations. What a fake collective leaves in its output differs
between torch versions (2.13 copies this rank's input into every slot; older versions leave the
buffer as allocated, i.e. uninitialised memory that can hold NaN), so the CP collectives of
:mod:`dsv4cp.cp.comm` call the ``fill_*`` functions below right after issuing one: on an emulated
group they overwrite the output with what this rank would plausibly have received, and on any other
group they return at once. The fills:

* all-gathered rows: this rank's own rows in its slot; every peer slot drawn from a seeded normal
  distribution with this rank's per-feature mean and standard deviation (never copies of the local
  rows, which would hand the indexer's top-k exact ties that a real run does not have);
* reduce-scattered gradient rows: this rank's own contribution to its rows (the peers' is unknown);
* halo / MTP-roll rows from a neighbour: seeded normal rows with the statistics of the rows this rank
  sends; ranks without that neighbour receive zeros, as in a real run.

The fill kernels run on the step's stream and are a few element-wise passes over the gathered
buffers (the real run instead waits for the collective); they are counted in the rank's time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv4cp.cp.launch import under_torchrun

FAKE_BACKEND = "fake"

_SEEDS: dict[str, int] = {}
"""Process-group name -> fill seed, for every emulated group of this process."""
_GENERATORS: dict[tuple[str, str], torch.Generator] = {}
"""(group name, device) -> the seeded generator of that group's fills on that device."""


def init_emulated_group(cp: int, rank: int, *, seed: int = 0) -> dist.ProcessGroup:
    """Make this process rank ``rank`` of a fake default process group of ``cp`` ranks; return it.

    ``seed`` seeds the fills of the collectives' outputs (deterministic across runs). Raises
    ``ValueError`` naming the field when ``cp < 2`` or ``rank`` is outside ``[0, cp)``, under
    torchrun (an emulated rank is one process alone; a real multi-rank run must use its real group),
    or when a process group already exists.
    """
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 2:
        raise ValueError(f"cp: rank emulation needs cp >= 2 ranks, got {cp!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"emulate_rank: must be a rank in [0, {cp}), got {rank!r}")
    if under_torchrun():
        raise ValueError("emulate_rank: rank emulation runs as one process on its own, not under torchrun "
                         "(a multi-rank run measures its real ranks)")
    if dist.is_initialized():
        raise ValueError(f"emulate_rank: a process group (backend {dist.get_backend()!r}) already exists "
                         "in this process; rank emulation needs to create its own")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=cp)
    group = dist.group.WORLD
    _SEEDS[group.group_name] = seed
    return group


def destroy_emulated_group(group: dist.ProcessGroup) -> None:
    """Forget ``group``'s fill state and destroy the default process group it is."""
    name = group.group_name
    _SEEDS.pop(name, None)
    for key in [key for key in _GENERATORS if key[0] == name]:
        del _GENERATORS[key]
    dist.destroy_process_group()


def is_emulated(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` was made by :func:`init_emulated_group` (its collectives move no data): a fake
    group this module registered. The backend is checked too, because group names are reused: a real
    group created later in the same process (after an emulated run ended in an error) is named "0" again."""
    if group is None or group.group_name not in _SEEDS:
        return False
    try:
        return dist.get_backend(group) == FAKE_BACKEND
    except (RuntimeError, ValueError):  # a destroyed group
        return False


def emulated_rank(group: dist.ProcessGroup | None) -> int | None:
    """The rank this process emulates in ``group``; None for a real group or no group."""
    return group.rank() if is_emulated(group) else None


def _generator(group: dist.ProcessGroup, device: torch.device) -> torch.Generator:
    key = (group.group_name, str(device))
    if key not in _GENERATORS:
        # one stream of fills per rank: emulating rank 0 and rank 1 does not hand both the same rows
        _GENERATORS[key] = torch.Generator(device=device).manual_seed(_SEEDS[group.group_name] * 1009 + group.rank())
    return _GENERATORS[key]


def _rows_like(reference: torch.Tensor, rows: int, generator: torch.Generator) -> torch.Tensor:
    """``[rows, *reference.shape[1:]]`` rows drawn with ``reference``'s per-feature mean and standard
    deviation (standard normal when it has no rows); integer tensors repeat ``reference``'s rows."""
    shape = (rows, *reference.shape[1:])
    if not reference.is_floating_point():
        if reference.shape[0] == 0:
            return reference.new_zeros(shape)
        repeats = -(-rows // reference.shape[0])
        return reference.repeat(repeats, *([1] * (reference.dim() - 1)))[:rows]
    sample = torch.randn(shape, generator=generator, device=reference.device, dtype=torch.float32)
    if reference.shape[0] > 0:
        flat = reference.detach().float()
        # a floor on the spread: one local row (std 0) must not make exact copies, i.e. indexer ties;
        # kept on the device (a 0-dim tensor, no .item()): the fills run inside the measured step
        spread = torch.maximum(flat.std(dim=0, correction=0), 1e-3 * flat.abs().mean() + 1e-6)
        sample = sample * spread + flat.mean(dim=0)
    return sample.to(reference.dtype)


def fill_all_gather(out: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """On an emulated group: ``out [cp * n, ...]`` := peers' slots drawn like ``local [n, ...]``,
    this rank's slot = ``local``. No-op on any other group."""
    if not is_emulated(group):
        return
    size, rank, n = group.size(), group.rank(), local.shape[0]
    slots = out.view(size, n, *local.shape[1:])
    with torch.no_grad():
        slots.copy_(_rows_like(local, size * n, _generator(group, local.device)).view_as(slots))
        slots[rank].copy_(local)


def fill_reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """On an emulated group: ``out [n, ...]`` := this rank's own rows of ``full [cp * n, ...]``."""
    if not is_emulated(group):
        return
    with torch.no_grad():
        out.copy_(full.reshape(group.size(), *out.shape)[group.rank()])


def emulated_shift(send: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """What :func:`dsv4cp.cp.comm.p2p_shift` receives from rank - ``step`` on an emulated group: rows
    drawn like ``send``, or zeros where that rank does not exist (the edges)."""
    if 0 <= group.rank() - step < group.size():
        with torch.no_grad():
            return _rows_like(send, send.shape[0], _generator(group, send.device))
    return torch.zeros_like(send)
