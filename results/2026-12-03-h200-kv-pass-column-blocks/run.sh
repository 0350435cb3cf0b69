#!/usr/bin/env bash
# One H200: every kv-pass tile of the Triton sparse backward with and without its atomics, the kv pass's atomics
# alone, the dq-pass tiles and whole backwards (sweep.json), then the whole backward with the default kv pass
# beside the 2-block one in one pytest-benchmark run (bench_bwd.json; the 2-block case has since been renamed to
# the 4-block one, triton-kv-pass-4-blocks). The commands as they ran, written here after the run.
# Run from the repository root: bash results/2026-12-03-h200-kv-pass-column-blocks/run.sh OUT
set -uo pipefail
out=${1:?output folder}
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
python3 -m bench.sweep_sparse_attention_dq_pass --shapes flash,pro --reps 10 --json "$out/sweep.json" 2>&1 | quiet
python3 -m pytest -m gpu -q -p no:cacheprovider \
  "bench/test_bench_sparse_attention.py::test_sparse_attention_backward[flash-triton]" \
  "bench/test_bench_sparse_attention.py::test_sparse_attention_backward[flash-triton-kv-pass-4-blocks]" \
  --benchmark-json "$out/bench_bwd.json" 2>&1 | quiet | tail -8
