"""Backend names: checked when the layer is built; pairs combine one library's forward with another's
backward; a one-sided library alone is refused with a hint."""

from __future__ import annotations

import pytest
import torch

from dsv4cp import DSv4Attention, DSv4Config
from dsv4cp.ops.sparse_attention import resolve_backend


@pytest.mark.parametrize("name", ["nope", "torch+nope", "torch+torch+torch", "auto+torch"])
def test_unknown_backend_names_fail_at_construction(name: str) -> None:
    with pytest.raises(ValueError, match="backend"):
        DSv4Attention(DSv4Config.preset("tiny"), 4, backend=name)


def test_a_pair_takes_forward_and_backward_from_its_two_sides() -> None:
    pair = resolve_backend("torch+torch", torch.device("cpu"))
    torch_backend = resolve_backend("torch", torch.device("cpu"))
    assert pair.forward is torch_backend.forward and pair.backward is torch_backend.backward


def test_one_sided_backend_alone_is_refused() -> None:
    from dsv4cp.ops.sparse_attention import _BACKENDS, SparseAttentionBackend

    _BACKENDS["forward-only-test"] = SparseAttentionBackend("forward-only-test", lambda *a: None, None, lambda d: True)
    try:
        with pytest.raises(ValueError, match="no backward"):
            resolve_backend("forward-only-test", torch.device("cpu"))
        with pytest.raises(ValueError, match="no backward"):
            resolve_backend("torch+forward-only-test", torch.device("cpu"))
    finally:
        del _BACKENDS["forward-only-test"]
