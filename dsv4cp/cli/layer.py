"""Run one DSv4 attention layer on random packed input and print its time and peak memory.

One process, no CP: the quick look. ``dsv4cp profile`` is the same measurement under CP, with traces.
"""

from __future__ import annotations

import argparse

import torch

from dsv4cp.config import DTYPES, PRESET_NAMES, DSv4Config, default_dtype
from dsv4cp.layer import DSv4Attention
from dsv4cp.packing import PackedSeqs
from dsv4cp.profiling.memory import track_memory
from dsv4cp.profiling.timing import benchmark

HELP = "time one layer (forward, optionally backward) on random packed input"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    parser.add_argument("--ratio", type=int, default=4, help="compress ratio: 0 (W), 4 (C) or another (H)")
    parser.add_argument("--tokens", type=int, default=4096, help="packed tokens T")
    parser.add_argument("--lengths", type=str, default=None,
                        help="comma-separated document lengths (default: one document of --tokens)")
    parser.add_argument("--backward", action="store_true", help="also run the backward pass")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--backend", default="auto", help="sparse-attention backend")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)


def parse_lengths(text: str | None, tokens: int) -> list[int]:
    if text is None:
        return [tokens]
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--lengths: must be comma-separated ints, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    if args.tokens <= 0:
        raise ValueError(f"--tokens: must be positive, got {args.tokens}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {args.device} requested but no CUDA device is available")
    dtype = DTYPES[args.dtype] if args.dtype else default_dtype(device)
    cfg = DSv4Config.preset(args.preset)
    packed = PackedSeqs.from_lengths(parse_lengths(args.lengths, args.tokens), total=args.tokens, device=device)
    torch.manual_seed(args.seed)
    layer = DSv4Attention(cfg, args.ratio, backend=args.backend).to(device=device, dtype=dtype)
    x = torch.randn(packed.total, cfg.hidden, device=device, dtype=dtype, requires_grad=args.backward)

    def step() -> None:
        result = layer(x, packed)
        if args.backward:
            loss = result.out.float().square().mean()
            if result.indexer_loss is not None:
                loss = loss + result.indexer_loss
            loss.backward()

    timing = benchmark(step, warmup=args.warmup, reps=args.reps, device=device)
    with track_memory(device) as tracker:
        step()
    memory = tracker.result
    if device.type == "cuda":
        peak = f"{memory.peak_allocated_bytes / 2**30:.2f} GiB allocator peak"
    else:
        peak = f"{memory.host_peak_rss_bytes / 2**30:.2f} GiB process peak RSS"
    what = "fwd+bwd" if args.backward else "fwd"
    print(
        f"preset={args.preset} ratio={args.ratio} kind={layer.kind} tokens={args.tokens} docs={packed.num_docs} "
        f"dtype={str(dtype).removeprefix('torch.')} device={device} backend={args.backend}"
    )
    print(f"{what}: median {timing.median_ms:.2f} ms over {timing.reps} reps "
          f"(p20 {timing.p20_ms:.2f}, p80 {timing.p80_ms:.2f}); {peak}")
    return 0
