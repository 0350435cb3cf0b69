"""The slot compaction's Triton kernel against its torch reference (Triton's interpreter on CPU, the
compiled kernel on CUDA): random slots with ~30% empty, repeated rows, optional ``topk_length`` (0, short,
past ``Kt``), ragged ``Kt`` and output widths; bitwise equal outputs and counts."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

from dsv4cp.kernels import triton_available
from dsv4cp.kernels._library import compact_slots_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not triton_available(DEVICE):
    pytest.skip(f"triton cannot run on {DEVICE} here", allow_module_level=True)

from dsv4cp.kernels.compact_slots_triton import compact_slots_triton  # noqa: E402


def _case(seed: int, t: int, kt: int, with_length: bool):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 1000, (t, kt), generator=g)
    idx[torch.rand(t, kt, generator=g) < 0.3] = -1
    if t > 1:
        idx[1] = -1  # a row with no valid slot
    if t > 3:
        idx[3] = idx[0]
    length = None
    if with_length:
        length = torch.randint(0, kt + 5, (t,), generator=g, dtype=torch.int32)
        length[0] = 0
    return idx.to(torch.int32).to(DEVICE), None if length is None else length.to(DEVICE)


@pytest.mark.parametrize("t,kt,slots", [(1, 1, 1), (5, 7, 64), (9, 70, 128), (6, 200, 256), (4, 640, 640),
                                        (3, 33, 33)])
@pytest.mark.parametrize("with_length", [False, True])
def test_kernel_matches_torch(t, kt, slots, with_length):
    seed = 100 + t * 7 + kt + slots + with_length
    print(f"seed {seed}")
    idx, length = _case(seed, t, kt, with_length)
    got, got_length = compact_slots_triton(idx, length, slots)
    want, want_length = compact_slots_torch(idx, length, slots)
    assert got.dtype == want.dtype == torch.int32 and got.shape == want.shape == (t, slots)
    assert torch.equal(got.cpu(), want.cpu()) and torch.equal(got_length.cpu(), want_length.cpu())


def test_int64_indices_and_no_rows():
    idx, _ = _case(5, 4, 50, False)
    got, count = compact_slots_triton(idx.to(torch.int64), None, 64)
    want, want_count = compact_slots_torch(idx, None, 64)
    assert torch.equal(got.cpu(), want.cpu()) and torch.equal(count.cpu(), want_count.cpu())
    empty, empty_count = compact_slots_triton(idx[:0], None, 64)
    assert empty.shape == (0, 64) and empty_count.shape == (0,)


def test_fewer_output_slots_than_slots_is_refused():
    idx, _ = _case(6, 2, 10, False)
    with pytest.raises(ValueError, match="slots: must be at least idx's 10 slots, got 8"):
        compact_slots_triton(idx, None, 8)
