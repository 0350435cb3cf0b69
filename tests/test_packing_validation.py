"""PackedSeqs validates in its own constructor (every way of building one), from_tensors takes what
from_lengths takes, and moving a validated batch to a device reads nothing back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import seed_of
from dsv4cp.packing import PackedSeqs


def _random_batch(seed: int) -> PackedSeqs:
    g = np.random.default_rng(seed)
    lengths = g.integers(0, 50, size=int(g.integers(1, 8))).tolist()
    return PackedSeqs.from_lengths(lengths, pad_to_multiple=int(g.integers(1, 5)), total=None)


def _fields(pk: PackedSeqs) -> dict:
    return {"cu_seqlens": pk.cu_seqlens, "cu_seqlens_padded": pk.cu_seqlens_padded, "total": pk.total,
            "max_seqlen_padded": pk.max_seqlen_padded, "real_tokens": pk.real_tokens}


def test_constructor_rejects_decreasing_offsets() -> None:
    """The case that used to run and return finite output."""
    offsets = torch.tensor([0, 300, 200, 512])
    with pytest.raises(ValueError, match=r"^cu_seqlens: must be non-decreasing, got cu_seqlens\[1\]=300 > "):
        PackedSeqs(cu_seqlens=offsets, cu_seqlens_padded=offsets, total=512, max_seqlen_padded=312, real_tokens=512)


def _bad_fields(name: str, base: dict) -> dict:
    """``base`` with field ``name`` made invalid in one way (the offsets are 2+ documents)."""
    cu, cu_p = base["cu_seqlens"], base["cu_seqlens_padded"]
    bad = dict(base)
    if name == "decreasing":
        bad["cu_seqlens_padded"] = cu_p.flip(0) + 0 * cu_p
        bad["cu_seqlens_padded"][0] = 0
    elif name == "negative":
        bad["cu_seqlens"] = cu - 1
    elif name == "int32":
        bad["cu_seqlens"] = cu.to(torch.int32)
    elif name == "float":
        bad["cu_seqlens_padded"] = cu_p.double()
    elif name == "2-D":
        bad["cu_seqlens"] = cu[None, :]
    elif name == "list":
        bad["cu_seqlens_padded"] = cu_p.tolist()
    elif name == "length":
        bad["cu_seqlens_padded"] = torch.cat((cu_p, cu_p[-1:] + 1))
    elif name == "device":
        bad["cu_seqlens_padded"] = cu_p.to("meta")
    elif name == "padded_short":  # every document padded to 0 rows but the last
        bad["cu_seqlens_padded"] = torch.where(torch.arange(len(cu_p)) < len(cu_p) - 1, 0, cu_p[-1])
    elif name == "total_short":
        bad["total"] = int(cu_p[-1]) - 1
    elif name == "total_float":
        bad["total"] = float(base["total"])
    elif name == "max_seqlen":
        bad["max_seqlen_padded"] = base["max_seqlen_padded"] + 1
    elif name == "real_tokens":
        bad["real_tokens"] = base["real_tokens"] - 1
    return bad


BAD = {
    "decreasing": "cu_seqlens_padded: must be non-decreasing", "negative": "cu_seqlens: must start at 0",
    "int32": "cu_seqlens: must be an int64 tensor", "float": "cu_seqlens_padded: must be an int64 tensor",
    "2-D": "cu_seqlens: must be 1-D", "list": "cu_seqlens_padded: must be a torch.Tensor",
    "length": "cu_seqlens_padded: must have the same length", "device": "cu_seqlens_padded: must be on cu_seqlens'",
    "padded_short": "cu_seqlens_padded: document 0 is padded to 0 rows", "total_short": "total: must be >=",
    "total_float": "total: must be an int", "max_seqlen": "max_seqlen_padded: must be the int",
    "real_tokens": "real_tokens: must be the int",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_constructor_rejects_each_bad_field(name: str) -> None:
    g = np.random.default_rng(seed_of("bad packing", name))
    lengths = (g.integers(1, 40, size=int(g.integers(2, 6))) + 1).tolist()  # >= 2 docs, none empty
    base = _fields(PackedSeqs.from_lengths(lengths, pad_to_multiple=int(g.integers(2, 5))))
    PackedSeqs(**base)  # the control: the untouched fields are valid
    with pytest.raises(ValueError, match="^" + BAD[name]):
        PackedSeqs(**_bad_fields(name, base))


@pytest.mark.parametrize("kind", ["list", "tuple", "numpy", "numpy int32", "tensor int32", "numpy scalars"])
def test_from_tensors_takes_what_from_lengths_takes(kind: str) -> None:
    want = _random_batch(seed_of("from_tensors kinds", kind))
    cu, cu_p = want.cu_seqlens.tolist(), want.cu_seqlens_padded.tolist()
    convert = {
        "list": list, "tuple": tuple, "numpy": np.asarray, "numpy int32": lambda v: np.asarray(v, dtype=np.int32),
        "tensor int32": lambda v: torch.tensor(v, dtype=torch.int32),
        "numpy scalars": lambda v: [np.int64(i) for i in v],
    }[kind]
    got = PackedSeqs.from_tensors(convert(cu), convert(cu_p), total=want.total)
    assert _fields(got).keys() == _fields(want).keys()
    for name, value in _fields(want).items():
        other = _fields(got)[name]
        assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value, name
    assert got.cu_seqlens.dtype == torch.int64 and got.cu_seqlens.device.type == "cpu"


@pytest.mark.parametrize(("offsets", "field"), [
    (np.array([0.0, 3.0]), "cu_seqlens"), ([0, 3.0], r"cu_seqlens\[1\]"), (np.array([[0, 3]]), "cu_seqlens"),
    ("0,3", "cu_seqlens"), (3, "cu_seqlens"), ([0, True], r"cu_seqlens\[1\]"),
])
def test_from_tensors_rejects_non_integer_offsets(offsets, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        PackedSeqs.from_tensors(offsets)


def test_to_moves_a_validated_batch_without_reading_it() -> None:
    """A meta tensor holds no data, so any validation read of the moved offsets would raise."""
    pk = _random_batch(seed_of("packing to"))
    moved = pk.to("meta")
    assert moved.cu_seqlens.device.type == moved.cu_seqlens_padded.device.type == "meta"
    assert (moved.total, moved.max_seqlen_padded, moved.real_tokens) == (pk.total, pk.max_seqlen_padded,
                                                                         pk.real_tokens)
    back = PackedSeqs.from_lengths(pk.lengths(), total=pk.total, device="meta")  # the factories move likewise
    assert back.cu_seqlens.device.type == "meta"
    assert torch.equal(pk.to("cpu").cu_seqlens_padded, pk.cu_seqlens_padded)
