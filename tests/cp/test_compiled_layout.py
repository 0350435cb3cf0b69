"""The packed boundary lookup under ``torch.compile`` (default Inductor backend) equals eager: the document
of every row, the entries' owners and the gathered-row maps of :func:`dsv4cp.cp.layout.build_layout`.

The offsets are views at a storage offset into a larger tensor (some PyTorch builds lost a slice's
offset in a compiled ``bucketize(rows, cu_seqlens[1:])``, moving rows one document to the right), with
empty documents, per-document padding and a tail of padding rows past the last document.
"""

from __future__ import annotations

import dataclasses

import torch

from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import build_layout
from dsv4cp.packing import PackedSeqs

CFG = DSv4Config.preset("tiny")


def _offset_view(offsets: torch.Tensor) -> torch.Tensor:
    """The same values, as a view 3 elements into a tensor whose other elements are wrong offsets."""
    big = torch.cat([torch.full((3,), 999, dtype=offsets.dtype), offsets, torch.full((2,), -7, dtype=offsets.dtype)])
    return big[3 : 3 + offsets.numel()]


def test_compiled_boundary_lookup_matches_eager():
    packed = PackedSeqs.from_lengths([5, 0, 37, 0, 21], pad_to_multiple=4, total=96)
    sliced = dataclasses.replace(packed, cu_seqlens=_offset_view(packed.cu_seqlens),
                                 cu_seqlens_padded=_offset_view(packed.cu_seqlens_padded))
    assert sliced.cu_seqlens_padded.storage_offset() == 3
    torch._dynamo.reset()
    compiled = torch.compile(build_layout, dynamic=False)  # the default backend: Inductor
    got = compiled(sliced, CFG, 4, 1, 2)
    want = build_layout(packed, CFG, 4, 1, 2)
    assert int((want.ext_doc == -1).sum()) > 0 and int((want.gathered_doc == -1).sum()) > 0  # padding seen
    for field in dataclasses.fields(want):
        value = getattr(want, field.name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(got, field.name), value), field.name
        else:
            assert getattr(got, field.name) == value, field.name
