"""Run one DSv4 attention layer on random packed input and print its time and peak memory.

One process, no CP: the quick look, so fewer steps than 'dsv4cp profile' by default (1 warm-up and 3
timed steps instead of 3 and 10). 'dsv4cp profile' is the same measurement under CP, with traces: both
time the same seeded step (weights, input rows and upstream gradient from --seed; forward, then with
--backward a backward seeded with the fixed upstream gradient and the indexer loss, no loss kernels).
Before allocating, the step's peak memory is estimated and the run refused (exit 3) when it would
not fit; --force runs anyway. Examples:

  dsv4cp layer --ratio 4 --tokens 4096 --backward
  dsv4cp layer --preset flash --ratio 4 --tokens 8192 --backward --progress on

On 2 idle CPU cores the second takes about 13 minutes (5 fwd+bwd steps of about 2.5 minutes: 1 warm-up,
3 timed, 1 for the peak memory; fp32, torch backends) and about 9 GiB; the tiny preset takes seconds.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dsv4cp import kernel_options
from dsv4cp.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    LayerInputs,
    add_device_option,
    add_layer_options,
    add_memory_options,
    add_timing_options,
    case_from_args,
    check_memory,
    kernels_line,
    layer_inputs,
    parse_device,
    progress_enabled,
    resolve_dtype,
)
from dsv4cp.harness.build import LayerStep, build_step
from dsv4cp.harness.time import nonfinite_parts
from dsv4cp.profiling.memory import track_memory
from dsv4cp.profiling.progress import step_progress
from dsv4cp.profiling.timing import benchmark

HELP = "time one layer (forward, optionally backward) on random packed input"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_layer_options(parser, cp=False)
    parser.add_argument("--backward", action="store_true", help="also run the backward pass")
    add_timing_options(parser, warmup=1, reps=3)
    add_device_option(parser)
    add_memory_options(parser)


def step_from_args(args: argparse.Namespace, inputs: LayerInputs, device: torch.device,
                   dtype: torch.dtype) -> LayerStep:
    """The seeded training step the flags describe: the step ``profile`` times at CP = 1 for the same flags."""
    return build_step(case_from_args(args, inputs, device=device, dtype=dtype, backward=args.backward), device=device)


def run(args: argparse.Namespace) -> int:
    device = parse_device(args.device)
    inputs = layer_inputs(args)
    dtype = resolve_dtype(args, device)
    check_memory(inputs, args.ratio, 1, backward=args.backward, dtype=dtype, recompute=args.recompute,
                 device=device, force=args.force)
    step = step_from_args(args, inputs, device, dtype)
    layer, packed = step.layer, step.packed

    # warm-up, timed steps, then one more step for the peak memory (never measured while timing)
    kernel_options.reset_backends_ran()
    with step_progress(args.warmup, args.reps, extra=1, enabled=progress_enabled(args.progress),
                       desc="layer steps") as on_step:
        timing = benchmark(step, warmup=args.warmup, reps=args.reps, device=device, l2_flush=args.l2_flush,
                           on_step=on_step)
        with track_memory(device) as tracker:
            result = step()
        if on_step is not None:
            on_step("memory")
    nonfinite = nonfinite_parts(result, step.x, layer)
    del result
    memory = tracker.result
    if device.type == "cuda":
        peak = f"{memory.peak_allocated_bytes / 2**30:.2f} GiB allocator peak"
    else:
        peak = f"{memory.host_peak_rss_bytes / 2**30:.2f} GiB process peak RSS"
    what = "fwd+bwd" if args.backward else "fwd"
    print(
        f"preset={args.preset} ratio={args.ratio} kind={layer.kind} tokens={packed.total} docs={packed.num_docs} "
        f"dtype={str(dtype).removeprefix('torch.')} device={device} kernel_backend={args.kernel_backend} "
        f"recompute={args.recompute}"
    )
    print(f"{what}: median {timing.median_ms:.2f} ms over {timing.reps} reps "
          f"(p20 {timing.p20_ms:.2f}, p80 {timing.p80_ms:.2f}); {peak}")
    print(kernels_line(kernel_options.backends_ran()))
    if nonfinite:
        print(f"dsv4cp layer: error: non-finite {', '.join(nonfinite)}: the timed steps computed NaN or infinity",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
