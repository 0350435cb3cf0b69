"""The peak-memory estimate against the committed GPU measurements and a CPU run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4cp.config import DSv4Config
from dsv4cp.model.memory import parameter_count, peak_bytes_estimate
from dsv4cp.packing import PackedSeqs

CALIBRATION = Path(__file__).resolve().parents[1] / "data" / "h200x2-flash-c-64k-records.jsonl"
"""Profile records measured on 2 x H200 (flash C layer, 64K tokens, fwd+bwd bf16, CP = 1 and 2; a copy of
results/2026-11-30-h200x2-norm-rope/records.jsonl)."""


def _records() -> list[dict]:
    return [json.loads(line) for line in CALIBRATION.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("record", _records(), ids=lambda r: f"cp{r['cp']}-recompute{r['recompute']}")
def test_estimate_within_ten_percent_of_the_measured_gpu_peak(record):
    cfg = DSv4Config.preset(record["preset"])
    packed = PackedSeqs.from_lengths([record["tokens"]])
    estimate = peak_bytes_estimate(cfg, record["ratio"], packed, record["cp"], record["direction"], torch.bfloat16,
                                   record["recompute"])
    measured = max(m["peak_allocated_bytes"] for m in record["memory_per_rank"])
    assert 0.9 <= estimate / measured <= 1.1, (estimate / 2**30, measured / 2**30)


def test_estimate_moves_the_right_way():
    cfg = DSv4Config.preset("flash")
    one = PackedSeqs.from_lengths([65536])
    est = lambda packed=one, cp=1, d="fwd+bwd", dtype=torch.bfloat16: peak_bytes_estimate(  # noqa: E731
        cfg, 4, packed, cp, d, dtype)
    assert est(d="fwd") < est()
    assert est(cp=2) < est() and est(cp=4) < est(cp=2)
    assert est(PackedSeqs.from_lengths([32768])) < est()
    assert est(dtype=torch.float32) > est()
    for ratio in (0, 4, 128):
        assert parameter_count(cfg, ratio) * 2 < peak_bytes_estimate(cfg, ratio, one, 1, "fwd", torch.bfloat16)


_MEASURE = """
import resource, sys, torch
from dsv4cp.config import DSv4Config
from dsv4cp.layer import DSv4Attention
from dsv4cp.packing import PackedSeqs
torch.manual_seed(0)
torch.zeros(8, 8) @ torch.zeros(8, 8)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = DSv4Config.preset("flash")
layer = DSv4Attention(cfg, 4, backend="torch")
x = torch.randn(1024, cfg.hidden, requires_grad=True)
result = layer(x, PackedSeqs.from_lengths([1024]))
(result.out.square().mean() + result.indexer_loss).backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


@pytest.mark.slow
def test_estimate_within_a_third_of_a_cpu_run():
    """Process peak RSS of a flash C layer fwd+bwd at 1024 tokens in fp32 (measured 0.88 to 1.33 x the
    estimate across presets and sizes: the torch path keeps fp32 norm copies the GPU path does not).
    Minutes on 2 busy cores."""
    done = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, timeout=600, check=True)
    measured = int(done.stdout.split()[-1])
    estimate = peak_bytes_estimate(DSv4Config.preset("flash"), 4, [1024], 1, "fwd+bwd", torch.float32)
    assert 0.8 <= measured / estimate <= 1.35, (measured / 2**20, estimate / 2**20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("ratio", "tokens"), [(4, 16384), (4, 65536), (0, 65536), (128, 65536)])
def test_estimate_within_fifteen_percent_of_the_gpu_allocator_peak(ratio, tokens):
    """Calibration beyond the committed C-layer records: W and H layers and a smaller batch, bf16, CP = 1."""
    from dsv4cp.layer import DSv4Attention

    cfg = DSv4Config.preset("flash")
    device = torch.device("cuda")
    packed = PackedSeqs.from_lengths([tokens], device=device)
    torch.manual_seed(0)
    layer = DSv4Attention(cfg, ratio).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(tokens, cfg.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    result = layer(x, packed)
    loss = result.out.float().square().mean() + (result.indexer_loss if result.indexer_loss is not None else 0)
    loss.backward()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    estimate = peak_bytes_estimate(cfg, ratio, packed, 1, "fwd+bwd", torch.bfloat16)
    print(f"ratio {ratio} tokens {tokens}: measured {measured / 2**30:.2f} GiB, estimate {estimate / 2**30:.2f} GiB")
    assert 0.85 <= measured / estimate <= 1.15
