"""The indexer scores backward's two kernels (:data:`dsv4cp.kernels.indexer_scores_triton.LAYOUTS`, the
kernel option ``triton_scores_bwd_layout``): the keys-on-M kernel and the heads-on-M one give the torch
op's gradients under every reduction, through Triton's interpreter on CPU (fp32 to 1e-5; bf16 within the
rounding of ``ds`` to bf16), the option reaches the kernel and a bad layout fails before any work.
GPU-marked tests repeat the comparison at the flash shapes (Hi = 64, Di = 128, K = 512, bf16) for every
tile of the keys-on-M ladder, against an fp64 reference, with a bound the old kernel also meets."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")  # the kernels module below imports it

import torch

from dsv4cp import kernel_options
from dsv4cp.kernel_options import KernelOptions
from dsv4cp.kernels import indexer_scores_triton as ist
from dsv4cp.kernels import triton_available
from dsv4cp.ops.indexer import indexer_scores, scores_backward_keywords
from tests.kernels.test_indexer_scores_reduce import grads, scores_case
from triton_marks import needs_cuda

pytestmark = pytest.mark.skipif(not triton_available("cpu") and not torch.cuda.is_available(),
                                reason="triton cannot run here (needs CUDA or TRITON_INTERPRET=1)")

LAYOUT_ENV = kernel_options.OPTIONS["triton_scores_bwd_layout"].env


def normwise_errors(got, ref) -> list[float]:
    """``||a - b|| / ||b||`` of each gradient (fp64)."""
    return [((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(got, ref)]


KERNELS = [("heads_on_m", False), ("keys_on_m", True), ("keys_on_m", False)]
"""(layout, index_ahead) of every backward kernel build."""


@pytest.mark.parametrize("reduce", ist.REDUCTIONS)
@pytest.mark.parametrize("layout,ahead", KERNELS)
def test_layouts_match_torch_fp32(layout, ahead, reduce, seed):
    """fp32 to 1e-5 (``sorted-bf16`` rounds each key-gradient contribution to bf16: its dkeys within 2^-6
    normwise, dq and dw still to 1e-5); K = 19 slots, so the interpreter's 16-slot steps leave a partial
    last step (the index-ahead load past the row's end is masked)."""
    q, w, keys, idx, grad = scores_case(seed)
    ref = grads(indexer_scores, q, w, keys, idx, grad)
    got = grads(ist.indexer_scores_triton, q, w, keys, idx, grad, layout=layout, reduce=reduce, index_ahead=ahead)
    exact = ("dq", "dw") if reduce == "sorted-bf16" else ("dq", "dw", "dkeys")
    for name, a, b in zip(("dq", "dw", "dkeys"), got, ref):
        if name in exact:
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), f"seed={seed} {layout} {ahead} {reduce}: {name}"
        else:
            assert normwise_errors([a], [b])[0] < 2**-6, f"seed={seed} {layout} {ahead} {reduce}: {name}"


@pytest.mark.parametrize("layout", ist.LAYOUTS)
def test_layouts_bf16_within_the_rounding_of_ds(layout, seed):
    """bf16 inputs: both kernels round ``ds`` to bf16 before its two products and return the gradients in
    bf16 (relative 2^-8 per rounding, 2^-7 under the interpreter, which truncates), so against the fp64
    gradients of the same bf16 inputs each gradient's normwise error stays below 2^-6."""
    q, w, keys, idx, grad = scores_case(seed, dtype=torch.bfloat16)
    ref = grads(indexer_scores, q.double(), w.double(), keys.double(), idx, grad.double())
    got = grads(ist.indexer_scores_triton, q, w, keys, idx, grad, layout=layout)
    errors = normwise_errors(got, ref)
    assert max(errors) < 2**-6, f"seed={seed} {layout}: dq, dw, dkeys errors {errors}"


def test_the_option_picks_the_kernel(seed, monkeypatch):
    """The environment's layout reaches the launch (the kernel built under its name) through the resolved
    options, as the op hands them over."""
    q, w, keys, idx, grad = scores_case(seed, t=5, kk=7)
    built: list[str] = []
    real_build = ist._build

    def recording_build(name, device):
        built.append(name)
        return real_build(name, device)

    monkeypatch.setattr(ist, "_build", recording_build)
    for layout, kernel in (("keys_on_m", "_gather_bwd_keys_on_m_kernel"), ("heads_on_m", "_gather_bwd_kernel")):
        monkeypatch.setenv(LAYOUT_ENV, layout)
        built.clear()
        settings = scores_backward_keywords(KernelOptions.resolve())
        assert settings["layout"] == layout
        grads(ist.indexer_scores_triton, q, w, keys, idx, grad, **settings)
        assert kernel in built, f"{layout}: built {built}"


def test_bad_layout_raises_before_work(seed, monkeypatch):
    q, w, keys, idx, _ = scores_case(seed, t=4, kk=5)
    leaf = q.clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"^layout: must be one of"):
        ist.indexer_scores_triton(leaf, w, keys, idx, layout="slots_on_m")
    with pytest.raises(ValueError, match=r"^index_ahead: must be a bool"):
        ist.indexer_scores_triton(leaf, w, keys, idx, index_ahead=1)
    assert leaf.grad is None
    monkeypatch.setenv(LAYOUT_ENV, "slots_on_m")
    with pytest.raises(ValueError, match=rf"^{LAYOUT_ENV}:"):
        KernelOptions.resolve()


def test_keys_on_m_ladder_is_checked():
    """bf16 tiles: a whole wgmma M of keys (multiples of 64), whole warpgroups, no tile twice."""
    tiles = ist.KEYS_ON_M_BWD_CONFIGS
    assert len(set(tiles)) == len(tiles)
    for block_k, num_warps, num_stages in tiles:
        assert block_k % 64 == 0 and num_warps % 4 == 0 and num_stages >= 1, (block_k, num_warps, num_stages)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout,tile,ahead", [("heads_on_m", ist.GATHER_BWD_CONFIGS[0], False)]
                         + [("keys_on_m", tile, True) for tile in ist.KEYS_ON_M_BWD_CONFIGS]
                         + [("keys_on_m", ist.KEYS_ON_M_BWD_CONFIGS[0], False)],
                         ids=lambda v: str(v) if isinstance(v, (str, bool)) else "x".join(map(str, v)))
def test_gpu_layouts_bf16_full_size(layout, tile, ahead, seed):
    """Hi = 64, Di = 128, K = 512 random selected rows per query (repeats across queries), bf16, each tile
    pinned, against the fp64 gradients of the same bf16 inputs: normwise error below 2^-7 per gradient
    (the rounding of ds to bf16 bounds it; measured ~2^-9 for the heads-on-M kernel)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t, hi, di, g, k = 2048, 64, 128, 512, 512
    q = torch.randn(t, hi, di, device="cuda", generator=gen).bfloat16()
    keys = torch.randn(g, di, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(t, hi, device="cuda", generator=gen) * (hi * di) ** -0.5).bfloat16()
    idx = torch.randint(0, g, (t, k), device="cuda", generator=gen)
    idx[torch.rand(t, k, device="cuda", generator=gen) < 0.2] = -1
    grad = torch.randn(t, k, device="cuda", generator=gen)
    got = grads(ist.indexer_scores_triton, q, w, keys, idx, grad, layout=layout, index_ahead=ahead,
                bwd_config=ist.GatherBwdConfig(*tile))
    ref = grads(indexer_scores, q.double(), w.double(), keys.double(), idx, grad.double())
    errors = normwise_errors(got, ref)
    assert max(errors) < 2**-7, f"seed={seed} {layout} {tile} {ahead}: dq, dw, dkeys errors {errors}"
