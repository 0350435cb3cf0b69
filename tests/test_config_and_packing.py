"""Presets (parameter shapes of the public checkpoints), PackedSeqs and config validation, and the
layer's input checks: every invalid input raises ValueError naming the offending field (DESIGN 1.1, 2)."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, expected_shapes, make_layer, packed, randn
from dsv4cp import DSv4Attention
from dsv4cp.config import DSv4Config
from dsv4cp.packing import PackedSeqs


def _meta_layer(cfg, r):
    from dsv4cp import DSv4Attention

    with torch.device("meta"):
        return DSv4Attention(cfg, r)


def _shapes(layer):
    return {n: tuple(p.shape) for n, p in layer.named_parameters()}


# ---------------------------------------------------------------------------------------- presets
FLASH_COMMON = {
    "wq_a.weight": (1024, 4096), "q_norm.weight": (1024,), "wq_b.weight": (32768, 1024),
    "wkv.weight": (512, 4096), "kv_norm.weight": (512,), "wo_a.weight": (8192, 4096),
    "wo_b.weight": (4096, 8192), "attn_sink": (64,),
}
FLASH_CSA = {
    "compressor.wkv.weight": (1024, 4096), "compressor.wgate.weight": (1024, 4096),
    "compressor.ape": (4, 1024), "compressor.norm.weight": (512,),
    "indexer.wq_b.weight": (8192, 1024), "indexer.weights_proj.weight": (64, 4096),
    "indexer.compressor.wkv.weight": (256, 4096), "indexer.compressor.wgate.weight": (256, 4096),
    "indexer.compressor.ape": (4, 256), "indexer.compressor.norm.weight": (128,),
}
FLASH_HCA = {
    "compressor.wkv.weight": (512, 4096), "compressor.wgate.weight": (512, 4096),
    "compressor.ape": (128, 512), "compressor.norm.weight": (512,),
}
PRO_COMMON = {
    "wq_a.weight": (1536, 7168), "q_norm.weight": (1536,), "wq_b.weight": (65536, 1536),
    "wkv.weight": (512, 7168), "kv_norm.weight": (512,), "wo_a.weight": (16384, 4096),
    "wo_b.weight": (7168, 16384), "attn_sink": (128,),
}
PRO_CSA = {
    "compressor.wkv.weight": (1024, 7168), "compressor.wgate.weight": (1024, 7168),
    "compressor.ape": (4, 1024), "compressor.norm.weight": (512,),
    "indexer.wq_b.weight": (8192, 1536), "indexer.weights_proj.weight": (64, 7168),
    "indexer.compressor.wkv.weight": (256, 7168), "indexer.compressor.wgate.weight": (256, 7168),
    "indexer.compressor.ape": (4, 256), "indexer.compressor.norm.weight": (128,),
}
PRO_HCA = {
    "compressor.wkv.weight": (512, 7168), "compressor.wgate.weight": (512, 7168),
    "compressor.ape": (128, 512), "compressor.norm.weight": (512,),
}


@pytest.mark.parametrize(
    "preset,r,expected",
    [
        ("flash", 0, FLASH_COMMON),
        ("flash", 4, {**FLASH_COMMON, **FLASH_CSA}),
        ("flash", 128, {**FLASH_COMMON, **FLASH_HCA}),
        ("pro", 0, PRO_COMMON),
        ("pro", 4, {**PRO_COMMON, **PRO_CSA}),
        ("pro", 128, {**PRO_COMMON, **PRO_HCA}),
    ],
)
def test_preset_parameter_shapes_match_public_checkpoints(preset, r, expected):
    cfg = DSv4Config.preset(preset)
    layer = _meta_layer(cfg, r)
    assert _shapes(layer) == expected
    assert expected_shapes(cfg, r) == expected
    assert all(p.device.type == "meta" for p in layer.parameters())


def test_preset_fields():
    flash, pro = DSv4Config.preset("flash"), DSv4Config.preset("pro")
    assert (flash.hidden, flash.n_heads, flash.head_dim, flash.rope_dim) == (4096, 64, 512, 64)
    assert (flash.q_lora_rank, flash.o_groups, flash.o_lora_rank, flash.window) == (1024, 8, 1024, 128)
    assert (flash.index_n_heads, flash.index_head_dim, flash.index_topk) == (64, 128, 512)
    assert (pro.hidden, pro.n_heads, pro.q_lora_rank, pro.o_groups, pro.index_topk) == (7168, 128, 1536, 16, 1024)
    assert flash.compress_ratios == (0, 0) + (4, 128) * 20 + (4, 0) and len(flash.compress_ratios) == 44
    assert pro.compress_ratios == (128, 128) + (4, 128) * 29 + (4, 0) and len(pro.compress_ratios) == 62
    for cfg in (flash, pro):
        assert cfg.rope_base == 10000 and cfg.compressed_rope_base == 160000
        assert (cfg.yarn_factor, cfg.yarn_original_len, cfg.yarn_beta_fast, cfg.yarn_beta_slow) == (16, 65536, 32, 1)
        assert cfg.rms_eps == 1e-6
    tiny = DSv4Config.preset("tiny")
    assert (tiny.hidden, tiny.n_heads, tiny.head_dim, tiny.rope_dim, tiny.window) == (64, 4, 32, 8, 8)
    assert (tiny.index_topk, tiny.index_n_heads, tiny.index_head_dim) == (8, 2, 16)
    assert (tiny.q_lora_rank, tiny.o_groups, tiny.o_lora_rank) == (32, 2, 16)
    assert DSv4Config.preset("tiny", window=16).window == 16
    assert TINY.replace(indexer_loss="dense").indexer_loss == "dense"


@pytest.mark.parametrize("r", [0, 4, 8, 16])
def test_tiny_layer_parameter_names_and_shapes(r):
    cfg = TINY.replace(window=max(TINY.window, r))
    layer = make_layer(cfg, r, seed=1, dtype=torch.float32)
    assert _shapes(layer) == expected_shapes(cfg, r)
    assert layer.attn_sink.dtype == torch.float32
    assert dict(layer.named_parameters())["attn_sink"].abs().max() > 0  # the helper randomised it
    if r:
        assert dict(layer.named_parameters())["compressor.ape"].abs().max() > 0


def test_layer_default_initialisation_is_finite():
    from dsv4cp import DSv4Attention

    layer = DSv4Attention(TINY, 4)
    for name, p in layer.named_parameters():
        assert torch.isfinite(p).all(), name
    assert torch.all(layer.attn_sink == 0), "DESIGN 1.2: the sink initialises to 0"


# ---------------------------------------------------------------------------------------- packing
def test_packing_from_lengths():
    pk = PackedSeqs.from_lengths([5, 0, 7], pad_to_multiple=4, total=20)
    assert pk.cu_seqlens.tolist() == [0, 5, 5, 12]
    assert pk.cu_seqlens_padded.tolist() == [0, 8, 8, 16]
    assert pk.cu_seqlens.dtype == torch.int64 and pk.cu_seqlens_padded.dtype == torch.int64
    assert pk.total == 20 and pk.max_seqlen_padded == 8 and pk.padded_end == 16 and pk.real_tokens == 12
    assert packed([3, 4], 1, 2).total == 9


@pytest.mark.parametrize(
    "build,field",
    [
        (lambda: PackedSeqs.from_tensors(torch.tensor([-1, 4])), "cu_seqlens"),
        (lambda: PackedSeqs.from_tensors(torch.tensor([0, 5, 3])), "cu_seqlens"),
        (lambda: PackedSeqs.from_tensors(torch.tensor([0, 5, 9]), torch.tensor([0, -2, 9])), "cu_seqlens_padded"),
        (lambda: PackedSeqs.from_tensors(torch.tensor([0, 5, 9]), torch.tensor([0, 6, 4])), "cu_seqlens_padded"),
        (lambda: PackedSeqs.from_tensors(torch.tensor([0, 5, 9]), torch.tensor([0, 4, 9])), "cu_seqlens_padded"),
        (lambda: PackedSeqs.from_tensors(torch.tensor([0, 5, 9]), torch.tensor([0, 9])), "cu_seqlens_padded"),
        (lambda: PackedSeqs.from_tensors(torch.tensor([0, 5, 9]), total=8), "total"),
        (lambda: PackedSeqs.from_lengths([3, 4], total=5), "total"),
        (lambda: PackedSeqs.from_tensors(torch.tensor([0.0, 3.0])), "cu_seqlens"),
        (lambda: PackedSeqs.from_tensors(torch.tensor([0, 3]), torch.tensor([0.0, 3.0])), "cu_seqlens_padded"),
        (lambda: PackedSeqs.from_tensors(torch.tensor([[0, 3]])), "cu_seqlens"),
        (lambda: PackedSeqs.from_lengths([3, -1]), "lengths"),
        (lambda: PackedSeqs.from_lengths([3, 2.5]), "lengths"),
        (lambda: PackedSeqs.from_lengths([3], pad_to_multiple=0), "pad_to_multiple"),
    ],
    ids=["negative", "non_monotonic", "padded_negative", "padded_non_monotonic", "padded_shorter_than_real",
         "offset_count_mismatch", "total_below_padded_end", "total_below_padded_end_lengths", "float_dtype",
         "padded_float_dtype", "not_1d", "negative_length", "fractional_length", "zero_pad_multiple"],
)
def test_invalid_packing_is_rejected(build, field):
    with pytest.raises(ValueError, match=field):
        build()


# ---------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(rope_dim=32), "rope_dim"),
        (dict(rope_dim=40), "rope_dim"),
        (dict(rope_dim=7), "rope_dim"),
        (dict(window=4), "window"),  # the tiny preset has H layers of ratio 8
        (dict(index_head_dim=24), "index_head_dim"),
        (dict(o_groups=3), "o_groups"),
        (dict(n_heads=0), "n_heads"),
        (dict(indexer_loss="kl"), "indexer_loss"),
    ],
    ids=["rope_eq_head", "rope_gt_head", "rope_odd", "window_below_ratio", "index_dim_not_pow2",
         "groups_not_dividing", "zero_heads", "unknown_loss"],
)
def test_invalid_config_is_rejected(overrides, field):
    with pytest.raises(ValueError, match=field):
        DSv4Config.preset("tiny", **overrides)


def test_non_power_of_two_indexer_dim_is_fine_without_hadamard():
    cfg = DSv4Config.preset("tiny", index_head_dim=24, hadamard=False)
    assert cfg.index_head_dim == 24


def test_unknown_preset_is_rejected():
    with pytest.raises(ValueError, match="preset"):
        DSv4Config.preset("huge")


@pytest.mark.parametrize("r,field", [(16, "window"), (-4, "compress_ratio")])
def test_layer_rejects_bad_ratio(r, field):
    from dsv4cp import DSv4Attention

    with pytest.raises(ValueError, match=field):
        DSv4Attention(TINY, r)  # window 8 < 16: an H layer of ratio 16 needs window >= 16


# ---------------------------------------------------------------------------------------- layer input
X_FIELD = r"(?<![A-Za-z_])x(?![A-Za-z_])"


@pytest.fixture(scope="module")
def tiny_layer():
    return make_layer(TINY, 4, seed=3, dtype=torch.float32)


def test_layer_accepts_good_input(tiny_layer):
    pk = packed([5, 7])
    res = tiny_layer(randn(12, TINY.hidden, seed=1, dtype=torch.float32), pk)
    assert res.out.shape == (12, TINY.hidden)


@pytest.mark.parametrize(
    "make_x,field",
    [
        (lambda: randn(12, seed=1, dtype=torch.float32), X_FIELD),
        (lambda: randn(12, TINY.hidden + 1, seed=1, dtype=torch.float32), X_FIELD),
        (lambda: randn(1, 12, TINY.hidden, seed=1, dtype=torch.float32), X_FIELD),
        (lambda: torch.ones(12, TINY.hidden, dtype=torch.int64), X_FIELD),
        (lambda: randn(12, TINY.hidden, seed=1, dtype=torch.float64), X_FIELD),
        (lambda: randn(13, TINY.hidden, seed=1, dtype=torch.float32), X_FIELD + "|total"),
        (lambda: randn(11, TINY.hidden, seed=1, dtype=torch.float32), X_FIELD + "|total"),
    ],
    ids=["1d", "wrong_hidden", "3d", "int_dtype", "dtype_differs_from_layer", "too_many_rows", "too_few_rows"],
)
def test_layer_rejects_bad_input(tiny_layer, make_x, field):
    pk = packed([5, 7])
    with pytest.raises(ValueError, match=field):
        tiny_layer(make_x(), pk)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"compress_ratios": (4.7,)}, "compress_ratio"),
        ({"compress_ratios": (True,)}, "compress_ratio"),
        ({"compress_ratios": "48"}, "compress_ratios"),
        ({"hadamard": "no"}, "hadamard"),
        ({"rope_base": "x"}, "rope_base"),
        ({"rms_eps": "1"}, "rms_eps"),
        ({"index_topk": 2**40}, "index_topk"),
        ({"yarn_beta_fast": float("inf")}, "yarn_beta_fast"),
    ],
)
def test_config_rejects_wrongly_typed_values(overrides, field):
    with pytest.raises(ValueError, match=field):
        DSv4Config.preset("tiny", **overrides)


@pytest.mark.parametrize("ratio,loss", [(0, "sparse"), (4, "sparse"), (4, "dense"), (8, "sparse")])
def test_a_batch_of_no_documents_outputs_zeros(ratio, loss):
    layer = DSv4Attention(DSv4Config.preset("tiny", indexer_loss=loss), ratio)
    res = layer(torch.randn(16, 64), PackedSeqs.from_lengths([], total=16))
    assert torch.equal(res.out, torch.zeros(16, 64))
    assert (res.indexer_loss is None) == (ratio != 4)
