"""Shared helpers for the layer/op tests: seeded generators, random layers, packings, comparisons."""

from __future__ import annotations

import math
import os
import random
import sys
import zlib

import hypothesis
import numpy
import pytest
import torch

# Without CUDA, Triton kernels run on its CPU interpreter, which must be chosen before triton is
# first imported (by any test module): set it here, the first conftest pytest loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import reference`

# Hypothesis: no example database (it would replay examples from earlier runs, whatever the seed) and
# derandomized, for any Hypothesis test the collection hook below does not seed (e.g. a state machine's
# TestCase); the others are seeded from the base seed.
hypothesis.settings.register_profile("dsv4cp", database=None, derandomize=True, print_blob=True)
hypothesis.settings.load_profile("dsv4cp")

from dsv4cp.config import DSv4Config  # noqa: E402
from dsv4cp.packing import PackedSeqs  # noqa: E402

# ------------------------------------------------------------------------------------------ configs
TINY = DSv4Config.preset("tiny")
TINY_C = TINY.replace(index_n_heads=8)
"""Tiny config used for C-layer comparisons: with only 2 indexer heads many scores are exactly 0
(every ReLU off), so the top-k becomes a tie and the selection is arbitrary; 8 heads make ties rare.
Every comparison also checks the top-k margin reported by the reference."""

MICRO = DSv4Config.preset(
    "tiny", hidden=16, n_heads=2, head_dim=8, rope_dim=4, q_lora_rank=8, o_groups=1, o_lora_rank=8,
    window=4, index_n_heads=4, index_head_dim=8, index_topk=2, compress_ratios=(0, 4),
)
"""Very small dims for full-Jacobian gradcheck."""


def cfg_for(ratio: int, base: DSv4Config | None = None, **overrides) -> DSv4Config:
    """A config able to build a layer of ``ratio`` (window raised to the ratio for H layers)."""
    cfg = base if base is not None else (TINY_C if ratio == 4 else TINY)
    if ratio not in (0, 4) and cfg.window < ratio:
        overrides.setdefault("window", ratio)
    return cfg.replace(**overrides) if overrides else cfg


# ------------------------------------------------------------------------------------------ seeds
SEED_ENV = "DSV4CP_TEST_SEED"
DEFAULT_BASE_SEED = 0
"""Base seed when ``DSV4CP_TEST_SEED`` is unset: 0 keeps :func:`seed_of` equal to plain ``crc32``, the
seeds every test had before the base seed existed."""


def _read_base_seed() -> int:
    raw = os.environ.get(SEED_ENV, "").strip()
    if not raw:
        return DEFAULT_BASE_SEED
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{SEED_ENV}: expected an integer in [0, 2**32), got {raw!r}") from None
    if not 0 <= value < 2**32:  # crc32's start value is an unsigned 32-bit integer
        raise ValueError(f"{SEED_ENV}: expected an integer in [0, 2**32), got {value}")
    return value


BASE_SEED = _read_base_seed()
"""The run's base seed: every test seed derives from it, so one integer reproduces a whole run."""

_SEED_KEY = pytest.StashKey[int]()


def seed_of(*parts) -> int:
    """A 31-bit seed determined by the base seed and ``parts`` (stable across runs, machines and Python
    versions: crc32 of ``repr(parts)`` started from :data:`BASE_SEED`, not Python's salted ``hash``)."""
    return zlib.crc32(repr(parts).encode(), BASE_SEED) & 0x7FFFFFFF


@pytest.fixture
def seed(request) -> int:
    """A per-test seed (stable across runs, different between tests), derived from the test's node id;
    printed with the base seed when the test fails."""
    value = seed_of(request.node.nodeid)
    request.node.stash[_SEED_KEY] = value
    return value


@pytest.fixture(autouse=True)
def _seed_global_generators(request) -> None:
    """Seed torch's, Python's and numpy's global generators from the test's node id, so a test that
    draws from them (``torch.randn`` without a generator) sees the same values alone as in the suite."""
    value = seed_of("global generators", request.node.nodeid)
    torch.manual_seed(value)
    random.seed(value)
    numpy.random.seed(value)


def pytest_report_header(config) -> str:
    return f"{SEED_ENV}={BASE_SEED} (every test seed derives from it; set it to vary them)"


def pytest_addoption(parser) -> None:
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only share K (0 <= K < N) of the selected tests, every N-th in node-id order "
                          "(CI runs one share of the slow tests per commit, all of them over N commits)")


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard: expected K/N with integers, got {text!r}") from None
    if not 0 <= k < n:
        raise pytest.UsageError(f"--shard: needs 0 <= K < N, got {text!r}")
    return k, n


@pytest.hookimpl(trylast=True)  # after -m and -k: the share is of the tests they selected
def pytest_collection_modifyitems(config, items) -> None:
    """Keep only ``--shard``'s share of the tests; seed every Hypothesis test from the base seed, so a
    failing example comes back on the next run with the same ``DSV4CP_TEST_SEED`` (and a different one
    explores other examples)."""
    if config.getoption("--shard"):
        k, n = _shard(config.getoption("--shard"))
        order = sorted(items, key=lambda item: item.nodeid)
        kept = {id(item) for index, item in enumerate(order) if index % n == k}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = [item for item in items if id(item) in kept]
    for item in items:
        test = getattr(item, "obj", None)
        if getattr(test, "is_hypothesis_test", False):
            value = seed_of(item.module.__name__, item.originalname)
            hypothesis.seed(value)(test)
            item.stash[_SEED_KEY] = value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Add the seeds and the command that reproduces the failure to every failing test's report."""
    report = yield
    if report.failed:
        derived = item.stash.get(_SEED_KEY, None)
        seeds = f"{SEED_ENV}={BASE_SEED}" + ("" if derived is None else f" seed={derived}")
        rerun = f"{SEED_ENV}={BASE_SEED} python -m pytest -p no:cacheprovider '{item.nodeid}'"
        report.sections.append(("dsv4cp test seed", f"{seeds}\nreproduce: {rerun}"))
    return report


@pytest.fixture
def single_process(monkeypatch) -> None:
    """No torchrun variables: a command run in this test process acts as one process on its own (as it
    would without torchrun), whatever launched pytest."""
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def triton_paths(monkeypatch) -> None:
    """The indexer, probabilities, norm / RoPE and pooling ops take their Triton paths for CPU tensors
    (Triton's interpreter), as for CUDA ones; skips where the interpreter cannot run them."""
    from dsv4cp.kernels import HAS_TRITON, triton_available
    from dsv4cp.ops import attention_probs, compress_pool, indexer, norm_rope

    if not (HAS_TRITON and triton_available("cpu")):
        pytest.skip("needs triton's CPU interpreter (TRITON_INTERPRET=1)")

    def serves(x: torch.Tensor, *_: object) -> bool:
        return x.dtype != torch.float64 and x.shape[-1] % 16 == 0

    monkeypatch.setattr(indexer, "triton_serves", serves)
    monkeypatch.setattr(attention_probs, "triton_serves", serves)
    monkeypatch.setattr(norm_rope, "use_fused", lambda x, freqs=None: serves(x))
    monkeypatch.setattr(compress_pool, "use_triton", lambda values, gates: serves(values))


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, dtype=torch.float64, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


# ------------------------------------------------------------------------------------------ layers
INDEXER_PREFIX = "indexer."


def randomize_parameters_(layer: torch.nn.Module, seed: int) -> None:
    """Fill every parameter with random values of a sensible scale (never zeros).

    Linear weights ~ N(0, 1/fan_in); norm weights ~ 1 + 0.2 N(0,1); attn_sink ~ N(0, 1);
    compressor ape ~ N(0, 0.5^2). Values are drawn in float64 then cast, so fp32 and fp64 layers built
    with the same seed hold the same values up to rounding.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, prm in sorted(layer.named_parameters()):
            prm.copy_(_random_value(name, tuple(prm.shape), g).to(prm.dtype))


def _random_value(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    base = torch.randn(shape, generator=g, dtype=torch.float64)
    if name.endswith("norm.weight"):
        return 1.0 + 0.2 * base
    if name == "attn_sink":
        return base
    if name.endswith("ape"):
        return 0.5 * base
    if len(shape) == 2:
        return base / math.sqrt(shape[1])
    raise AssertionError(f"unexpected parameter {name} {shape}")


def expected_shapes(cfg: DSv4Config, ratio: int) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of ``DSv4Attention(cfg, ratio)`` (DeepSeek checkpoint layout)."""
    H, D, G = cfg.n_heads, cfg.head_dim, cfg.o_groups
    shapes = {
        "wq_a.weight": (cfg.q_lora_rank, cfg.hidden),
        "q_norm.weight": (cfg.q_lora_rank,),
        "wq_b.weight": (H * D, cfg.q_lora_rank),
        "wkv.weight": (D, cfg.hidden),
        "kv_norm.weight": (D,),
        "wo_a.weight": (G * cfg.o_lora_rank, (H // G) * D),
        "wo_b.weight": (cfg.hidden, G * cfg.o_lora_rank),
        "attn_sink": (H,),
    }
    if ratio > 0:
        coff = 2 if ratio == 4 else 1
        shapes.update({
            "compressor.wkv.weight": (coff * D, cfg.hidden),
            "compressor.wgate.weight": (coff * D, cfg.hidden),
            "compressor.ape": (ratio, coff * D),
            "compressor.norm.weight": (D,),
        })
    if ratio == 4:
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        shapes.update({
            "indexer.wq_b.weight": (Hi * Di, cfg.q_lora_rank),
            "indexer.weights_proj.weight": (Hi, cfg.hidden),
            "indexer.compressor.wkv.weight": (2 * Di, cfg.hidden),
            "indexer.compressor.wgate.weight": (2 * Di, cfg.hidden),
            "indexer.compressor.ape": (4, 2 * Di),
            "indexer.compressor.norm.weight": (Di,),
        })
    return shapes


def random_state(cfg: DSv4Config, ratio: int, seed: int, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """A parameter dict with the layer's names and shapes, drawn exactly as
    :func:`randomize_parameters_` draws them (same seed, same values), usable without the layer."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: _random_value(name, shape, g).to(dtype)
        for name, shape in sorted(expected_shapes(cfg, ratio).items())
    }


def make_layer(cfg: DSv4Config, ratio: int, seed: int = 0, dtype=torch.float64):
    from dsv4cp import DSv4Attention

    layer = DSv4Attention(cfg, ratio)
    layer.to(dtype)
    randomize_parameters_(layer, seed)
    return layer


def param_state(layer: torch.nn.Module, requires_grad: bool = False) -> dict[str, torch.Tensor]:
    """Plain detached copies of the layer's parameters (the reference's input)."""
    out = {}
    for name, prm in layer.named_parameters():
        t = prm.detach().clone()
        out[name] = t.requires_grad_(True) if requires_grad else t
    return out


# ------------------------------------------------------------------------------------------ packings
def packed(lengths, pad_to_multiple: int = 1, tail: int = 0) -> PackedSeqs:
    base = PackedSeqs.from_lengths(lengths, pad_to_multiple=pad_to_multiple)
    return PackedSeqs.from_lengths(lengths, pad_to_multiple=pad_to_multiple, total=base.total + tail)


def offsets(pk: PackedSeqs) -> tuple[list[int], list[int]]:
    return pk.cu_seqlens.tolist(), pk.cu_seqlens_padded.tolist()


def run_reference(state, cfg, ratio, x, pk: PackedSeqs, info: dict | None = None):
    from reference import reference_forward

    cu, cup = offsets(pk)
    return reference_forward(state, cfg, ratio, x, cu, cup, info=info)


# ------------------------------------------------------------------------------------------ compare
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (in float64); 0 when both are empty or all zero."""
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    assert a64.shape == b64.shape, (a64.shape, b64.shape)
    if a64.numel() == 0:
        return 0.0
    num = (a64 - b64).abs().max().item()
    den = b64.abs().max().item()
    if den == 0.0:
        return num
    return num / den


def assert_close_rel(a, b, tol: float, what: str = "") -> None:
    err = rel_err(a, b)
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.1e}"


def assert_margin(info: dict, tol: float) -> None:
    """The reference's top-k had no (near-)tie, so the selection is unambiguous at this precision."""
    m = info.get("topk_margin", math.inf)
    assert m > tol, f"top-k near-tie (relative margin {m:.2e}): the test's seed makes the selection ambiguous"


def assert_parity_passes(cases, per_rank: list[list[list[dict]]]) -> None:
    """Every quantity of every ``dsv4cp.harness.parity`` case passed on all ranks (``per_rank[rank][case]``)."""
    from dsv4cp.harness.parity import merge_ranks

    failures = []
    for i, case in enumerate(cases):
        for c in merge_ranks([rank_results[i] for rank_results in per_rank]):
            if not c.passed:
                failures.append(f"{case}: {c.quantity} rel error {c.max_rel_error:.2e}")
    assert not failures, "\n".join(failures)
