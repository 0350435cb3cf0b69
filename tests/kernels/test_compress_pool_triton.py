"""The compressor's pooling op (:func:`dsv4cp.ops.compress_pool.compress_pool`): its torch reference and
Triton kernels against an independent loop over groups and slots (docs/design.md §1.4).

CPU (fp64 reference, Triton's interpreter in fp32, tiny dims): layouts of :func:`build_layout` for ratio 4
(overlapping halves, absent A slots of each document's first group) and ratio 8, several documents with
padding, CP = 1 and the ranks of CP = 2 / 3 (halo rows, unused capacity slots); forward and the
gradients of values, gates and ape for a random upstream gradient. Hand-made groups cover absent slots
inside a group, a valid group with no present slot and invalid groups (both give 0 and no gradient);
rows in no group get exactly zero gradient; the triton backward is bitwise repeatable; bf16 through the
interpreter; input validation; the dispatch. The torch reference is also checked by full-Jacobian
gradcheck in fp64.

GPU (marked ``gpu``): flash-size pooling (ratio 4 with overlap and ratio 128, Dc 512) in bf16 against the
torch reference in fp32, forward and all three gradients, relative error < 1e-2.

Inputs are random, from the per-test ``seed`` (DSV4CP_TEST_SEED varies it, failures print it), never zeros.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

from conftest import cfg_for, rel_err
from dsv4cp.config import DSv4Config
from dsv4cp.cp.layout import RankLayout, build_layout
from dsv4cp.kernels.compress_pool_triton import check_pool_inputs, compress_pool_triton, use_triton
from dsv4cp.ops.compress_pool import compress_pool, compress_pool_torch
from dsv4cp.packing import PackedSeqs
from triton_marks import HAS_CUDA, skip_module_without_triton

skip_module_without_triton()


def naive_pool(values, gates, ape, layout_rows, valid, ext_pos):
    """The pooling by loops over groups and slots, in fp64, the bias looked up by the row's document
    position (``ape[ext_pos % r]``, as the compressor has always added it to the gate projection).
    Differentiable: autograd of this loop is the gradient reference."""
    r, width = ape.shape
    c, slots = layout_rows.shape
    halves = slots // r
    dc = width // halves
    out = []
    for j in range(c):
        present = [s for s in range(slots) if valid[j] and layout_rows[j, s] >= 0]
        if not present:
            out.append(torch.zeros(dc, dtype=torch.float64))
            continue
        g, v = [], []
        for s in present:
            row, cols = int(layout_rows[j, s]), slice((s // r) * dc, (s // r + 1) * dc)
            g.append(gates[row, cols].double() + ape[int(ext_pos[row]) % r, cols].double())
            v.append(values[row, cols].double())
        out.append((torch.softmax(torch.stack(g), 0) * torch.stack(v)).sum(0))
    return torch.stack(out)


def grads_of(fn, inputs, upstream, *args, dtype=None, **kwargs):
    """``(out, [d input])`` of ``fn(*leaves, *args, **kwargs)`` for ``upstream``; the leaves are copies of
    ``inputs`` in ``dtype`` (their own dtypes when None)."""
    leaves = [t.detach().to(dtype or t.dtype).clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves, *args, **kwargs)
    return out.detach(), list(torch.autograd.grad(out, leaves, upstream.to(out.dtype)))


def random_inputs(seed: int, rows: int, width: int, r: int, dtype=torch.float64):
    """values, gates ``[rows, width]`` and ape ``[r, width]``: randn (gates and ape scaled up, so the
    softmax is far from uniform)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, width, generator=g, dtype=torch.float64)
    gates = 2.0 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    ape = torch.randn(r, width, generator=g, dtype=torch.float64)
    return values.to(dtype), gates.to(dtype), ape


def layouts(ratio: int, cp: int) -> list[tuple[DSv4Config, RankLayout]]:
    """Every rank's layout of three padded documents (lengths not multiples of the ratio)."""
    cfg = cfg_for(ratio)
    doc = 6 * ratio + 3  # padded to 7 * ratio rows; the three documents fill 17 * ratio rows
    total = (-(-17 // cp) + 1) * cp * ratio  # a padding tail, every rank the same number of rows
    packed = PackedSeqs.from_lengths([doc, 2 * ratio + 1, doc], pad_to_multiple=ratio, total=total)
    return [(cfg, build_layout(packed, cfg, ratio, rank, cp)) for rank in range(cp)]


LAYOUT_CASES = [(4, 1), (4, 2), (8, 1), (8, 3)]


@pytest.mark.parametrize("ratio,cp", LAYOUT_CASES, ids=lambda v: str(v))
def test_layout_groups_are_r_aligned_and_disjoint(ratio, cp):
    """The op's contract on layouts: slot s's row sits at position s % r of its group (so the bias by slot
    is the bias by position), and no (row, half) is pooled by two slots (the triton backward's writes)."""
    for _, lay in layouts(ratio, cp):
        rows, slots = lay.group_rows, lay.group_rows.shape[1]
        present = rows >= 0
        assert bool((lay.group_valid[:, None] | ~present).all())
        slot = torch.arange(slots).expand_as(rows)
        assert torch.equal(lay.ext_pos[rows[present]] % ratio, slot[present] % ratio)
        keys = rows[present] * 2 + slot[present] // ratio
        assert keys.unique().numel() == keys.numel(), f"rank {lay.rank}: an element pooled twice"
        assert int(present.sum()) > 0


@pytest.mark.parametrize("ratio,cp", LAYOUT_CASES, ids=lambda v: str(v))
def test_op_matches_loop_reference_on_layouts(ratio, cp, seed):
    dc = 5
    for _, lay in layouts(ratio, cp):
        msg = f"seed={seed} ratio={ratio} cp={cp} rank={lay.rank}"
        halves = lay.group_rows.shape[1] // ratio
        values, gates, ape = random_inputs(seed + lay.rank, lay.ext_rows, halves * dc, ratio)
        upstream = torch.randn(lay.capacity, dc, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
        inputs, args = (values, gates, ape), (lay.group_rows, lay.group_valid)
        ref, ref_grads = grads_of(naive_pool, inputs, upstream, *args, lay.ext_pos)
        out, out_grads = grads_of(compress_pool_torch, inputs, upstream, *args)
        assert out.dtype == torch.float64 and out.shape == (lay.capacity, dc), msg
        assert rel_err(out, ref) < 1e-12, f"{msg}: torch forward"
        for name, got, want in zip(("values", "gates", "ape"), out_grads, ref_grads):
            assert rel_err(got, want) < 1e-12, f"{msg}: torch d{name}"
        out, out_grads = grads_of(compress_pool_triton, inputs, upstream, *args, dtype=torch.float32)
        assert out.dtype == torch.float32 and out.shape == (lay.capacity, dc), msg
        assert rel_err(out, ref) < 1e-5, f"{msg}: triton forward {rel_err(out, ref):.2e}"
        for name, got, want in zip(("values", "gates", "ape"), out_grads, ref_grads):
            assert got.dtype == torch.float32, msg
            assert rel_err(got, want) < 1e-5, f"{msg}: triton d{name} {rel_err(got, want):.2e}"
        # Rows pooled by no group get exactly zero gradient (and there are such rows: halo, padding tail).
        used = torch.zeros(lay.ext_rows, dtype=torch.bool)
        used[lay.group_rows[lay.group_rows >= 0]] = True
        assert bool((out_grads[0][~used] == 0).all()) and bool((out_grads[1][~used] == 0).all()), msg


def hand_case(overlap: bool):
    """Groups over 40 rows with absent slots inside group 1, a valid group 2 with no present slot and an
    invalid group 3 that still names rows (the op must ignore them); ``(rows, valid, r)``."""
    r = 4
    first = torch.tensor([0, 4, 8, 12, 16, 20])
    rows = first[:, None] + torch.arange(r)[None, :] + (r if overlap else 0)
    if overlap:
        rows = torch.cat((rows - r, rows), dim=1)
        rows[0, :r] = -1
    rows[1, 1] = rows[1, -1] = -1
    rows[2] = -1
    valid = torch.tensor([True, True, True, False, True, True])
    return rows, valid, r


@pytest.mark.parametrize("overlap", [True, False])
def test_absent_slots_empty_and_invalid_groups(overlap, seed):
    rows, valid, r = hand_case(overlap)
    halves, dc = (2 if overlap else 1), 3
    values, gates, ape = random_inputs(seed, 40, halves * dc, r)
    ext_pos = torch.arange(40)
    upstream = torch.randn(rows.shape[0], dc, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    ref, ref_grads = grads_of(naive_pool, (values, gates, ape), upstream, rows, valid, ext_pos)
    for backend, dtype, tol in (("torch", torch.float64, 1e-12), ("triton", torch.float32, 1e-5)):
        msg = f"seed={seed} overlap={overlap} backend={backend}"
        out, grads = grads_of(compress_pool, (values, gates, ape), upstream, rows, valid, dtype=dtype, backend=backend)
        assert rel_err(out, ref) < tol, msg
        assert bool((out[2:4] == 0).all()), f"{msg}: empty / invalid groups must give 0"
        for name, got, want in zip(("values", "gates", "ape"), grads, ref_grads):
            assert rel_err(got, want) < tol, f"{msg}: d{name}"
        for s in range(rows.shape[1]):  # the invalid group's elements (their other half may be pooled)
            cols = slice((s // r) * dc, (s // r + 1) * dc)
            assert bool((grads[0][rows[3, s], cols] == 0).all()), f"{msg}: an invalid group's element got gradient"


def test_strided_group_valid_is_read_by_element(seed):
    """A non-contiguous ``group_valid`` (a view of every other element) must mean what it holds."""
    rows, valid, r = hand_case(True)
    values, gates, ape = random_inputs(seed, 40, 2 * 3, r)
    strided = torch.stack((valid, ~valid), dim=1)[:, 0]  # same values, stride 2
    assert not strided.is_contiguous() and torch.equal(strided, valid)
    want = compress_pool(values.float(), gates.float(), ape.float(), rows, valid, backend="triton")
    got = compress_pool(values.float(), gates.float(), ape.float(), rows, strided, backend="triton")
    assert torch.equal(got, want), f"seed={seed}"


def test_torch_reference_gradcheck(seed):
    rows, valid, r = hand_case(True)
    values, gates, ape = random_inputs(seed, 28, 4, r)  # the hand case reads rows < 28
    leaves = [t.clone().requires_grad_(True) for t in (values, gates, ape)]
    assert torch.autograd.gradcheck(lambda v, g, a: compress_pool_torch(v, g, a, rows, valid), leaves, fast_mode=True)


def test_triton_backward_is_repeatable_and_bf16_runs(seed):
    _, lay = layouts(4, 2)[1]
    dc = 16
    values, gates, ape = random_inputs(seed, lay.ext_rows, 2 * dc, 4, dtype=torch.float32)
    upstream = torch.randn(lay.capacity, dc, generator=torch.Generator().manual_seed(seed + 3))
    inputs, args = (values, gates, ape), (lay.group_rows, lay.group_valid)
    _, first = grads_of(compress_pool_triton, inputs, upstream, *args)
    _, second = grads_of(compress_pool_triton, inputs, upstream, *args)
    assert all(torch.equal(a, b) for a, b in zip(first, second)), f"seed={seed}: backward not repeatable"

    ref, ref_grads = grads_of(compress_pool_torch, inputs, upstream.double(), *args, dtype=torch.float64)
    out, grads = grads_of(compress_pool_triton, inputs, upstream, *args, dtype=torch.bfloat16)
    assert out.dtype == torch.float32, "the pooled result is fp32 whatever the inputs"
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    assert rel_err(out, ref) < 2e-2, f"seed={seed}: bf16 forward {rel_err(out, ref):.2e}"
    for name, got, want in zip(("values", "gates", "ape"), grads, ref_grads):
        assert rel_err(got, want) < 3e-2, f"seed={seed}: bf16 d{name} {rel_err(got, want):.2e}"


def test_dispatch_and_validation(seed):
    rows, valid, r = hand_case(True)
    values, gates, ape = random_inputs(seed, 40, 6, r)
    assert not use_triton(values.float(), gates.float())  # CPU: auto takes the torch reference
    auto = compress_pool(values, gates, ape, rows, valid)
    assert auto.dtype == torch.float64 and torch.equal(auto, compress_pool_torch(values, gates, ape, rows, valid))
    assert check_pool_inputs(values, gates, ape, rows, valid) == (4, 2)
    bad = {
        "backend": dict(backend="cuda"),
        "gates": dict(gates=gates[:, :4]),
        "values": dict(values=values.long(), gates=gates.long()),
        "ape": dict(ape=ape[:, :4]),
        "group_rows": dict(group_rows=rows[:, :6]),
        "group_valid": dict(group_valid=valid.long()),
    }
    base = dict(values=values, gates=gates, ape=ape, group_rows=rows, group_valid=valid)
    for field, change in bad.items():
        with pytest.raises(ValueError, match=field):
            compress_pool(**{**base, **change})
    with pytest.raises(ValueError, match="group_rows"):
        compress_pool(**{**base, "group_rows": rows.int()})
    with pytest.raises(ValueError, match="values: width"):
        compress_pool(**{**base, "values": values[:, :5], "gates": gates[:, :5], "ape": ape[:, :5]})
    with pytest.raises(ValueError, match="values: dtype"):
        compress_pool(**base, backend="triton")  # fp64: no triton kernel


# ------------------------------------------------------------------------------------------ GPU
GPU_CASES = [pytest.param(4, 2, 16384, id="ratio4-overlap"), pytest.param(128, 1, 8192, id="ratio128")]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("ratio,halves,tokens", GPU_CASES)
def test_triton_matches_torch_bf16_gpu(ratio, halves, tokens, seed):
    dc = 512
    cfg = DSv4Config.preset("flash")
    packed = PackedSeqs.from_lengths([tokens // 2 + 3, tokens // 2 - 3], pad_to_multiple=ratio, total=tokens + ratio,
                                     device="cuda")
    lay = build_layout(packed, cfg, ratio)
    assert lay.group_rows.shape[1] == halves * ratio
    values, gates, ape = random_inputs(seed, lay.ext_rows, halves * dc, ratio, dtype=torch.bfloat16)
    values, gates, ape = values.cuda(), gates.cuda(), ape.float().cuda()
    upstream = torch.randn(lay.capacity, dc, generator=torch.Generator().manual_seed(seed + 5)).cuda()
    inputs, args = (values, gates, ape), (lay.group_rows, lay.group_valid)
    ref, ref_grads = grads_of(compress_pool_torch, inputs, upstream, *args, dtype=torch.float32)
    assert use_triton(values, gates)
    out, grads = grads_of(compress_pool, inputs, upstream, *args)
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert rel_err(out, ref) < 1e-2, f"seed={seed}: forward {rel_err(out, ref):.2e}"
    for name, got, want in zip(("values", "gates", "ape"), grads, ref_grads):
        assert rel_err(got, want) < 1e-2, f"seed={seed}: d{name} {rel_err(got, want):.2e}"
