"""What ``meta.json`` records about a run: the :func:`dsv4cp.environment.environment` fields that
:data:`dsv4cp.records.META_FIELDS` holds (code version, host, hardware and library versions), when the
run started, and its spec."""

from __future__ import annotations

import torch

from dsv4cp import kernel_options
from dsv4cp.environment import environment
from dsv4cp.records import META_FIELDS, utc_now


def run_meta(world: int, device: torch.device, spec: dict) -> dict:
    """The meta.json fields of a run on ``world`` ranks of ``device``'s kind (see dsv4cp.records)."""
    env = environment(device, world)
    return {"time_utc": utc_now(), **{name: env[name] for name in META_FIELDS if name in env}, "spec": spec,
            "kernel_options": kernel_options.resolved()}
