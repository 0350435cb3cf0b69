"""Check that every rank of a group runs on the same inputs, before the first real collective.

Ranks given different document offsets (or configs, or token counts) would each run a valid
computation on a different batch and return garbage with exit code 0; a shape mismatch would hang a
collective. :func:`check_ranks_agree` exchanges one small fingerprint per field and raises the same
``ValueError`` on EVERY rank, naming the first differing field and each rank's value, so no rank
waits on a peer that has already given up.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from dsv4cp.packing import PackedSeqs

_ERROR_FIELD = "<local validation error>"
"""Key under which a rank shares its own validation verdict (never a caller's field name)."""

_SHOWN_CHARS = 120
"""A value is shown in the error up to this many characters (offsets of many documents are long)."""


def fingerprint(value: object) -> str:
    """A digest of ``value`` that is equal on two ranks iff their values are (tensors by content)."""
    digest = hashlib.sha256()
    _feed(digest, value)
    return digest.hexdigest()[:16]


def _feed(digest, value: object) -> None:
    if isinstance(value, PackedSeqs):
        for part in (value.cu_seqlens, value.cu_seqlens_padded, value.total):
            _feed(digest, part)
    elif isinstance(value, torch.Tensor):
        host = value.detach().cpu().contiguous()
        digest.update(f"tensor{tuple(host.shape)}{host.dtype}".encode())
        digest.update(host.view(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b"")
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}(".encode())
        for item in value:
            _feed(digest, item)
        digest.update(b")")
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def _shown(value: object) -> str:
    if isinstance(value, PackedSeqs):
        text = f"lengths {value.lengths()} total {value.total}"
    elif isinstance(value, torch.Tensor):
        text = f"tensor {value.detach().cpu().tolist()}"
    else:
        text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def check_ranks_agree(
    fields: dict[str, object], group: dist.ProcessGroup | None, local_error: ValueError | None = None,
) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all ranks hold equal ``fields`` and none
    rejected its own input.

    Args:
        fields: name -> value; names are what the error reports (a flag such as ``--tokens``, or an
            argument such as ``packed``). Values: PackedSeqs, tensors (compared by content), numbers,
            strings, lists/tuples of those.
        group: the process group; None (one rank) checks nothing.
        local_error: this rank's own validation verdict (e.g. its ``x`` has the wrong number of rows),
            shared in the same exchange: the rank that found it re-raises it, every other rank raises a
            ``ValueError`` naming that rank and its message, so no rank blocks in a later collective
            waiting for a peer that gave up. With one rank it is raised as is.

    One ``all_gather_object`` of ``{name: (fingerprint, short text)}`` per call: a few hundred bytes
    whatever the size of the values. Works on gloo and NCCL (the current CUDA device must be set).
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if local_error is not None:
            raise local_error
        return
    mine = {name: (fingerprint(value), _shown(value)) for name, value in fields.items()}
    if local_error is not None:
        mine[_ERROR_FIELD] = ("error", str(local_error))
    gathered: list[dict[str, tuple[str, str]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if local_error is not None:
        raise local_error
    rejected = [(rank, g[_ERROR_FIELD][1]) for rank, g in enumerate(gathered) if _ERROR_FIELD in g]
    if rejected:
        rank, message = rejected[0]
        raise ValueError(f"rank {rank} rejected its input: {message}")
    names = sorted(set().union(*(g.keys() for g in gathered)))
    for name in names:
        seen: dict[str, list[int]] = {}
        shown: dict[str, str] = {}
        for rank, ranks_fields in enumerate(gathered):
            digest, text = ranks_fields.get(name, ("missing", "<missing>"))
            seen.setdefault(digest, []).append(rank)
            shown[digest] = text
        if len(seen) > 1:
            values = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {shown[d]}"
                               for d, r in seen.items())
            raise ValueError(f"{name}: ranks disagree ({values}); every rank must be given the same value")
