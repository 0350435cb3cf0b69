#!/usr/bin/env bash
# After the fused Triton per-head RMSNorm + RoPE kernels (query path) and RoPE-tail kernel (output path),
# and the consolidation of the Triton launch code: every gpu-marked kernel test, the norm/RoPE benchmark,
# then the 64K flash C layer at CP = 1 and CP = 2 (async) as in ../2026-11-30-h200x2-loss-target-kernels.
# From the repository root on a 2 x H200 machine:  bash results/2026-11-30-h200x2-norm-rope/run.sh $OUT
set -uo pipefail
out=${1:-.}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
quiet() { grep -v -e "^W1130" -e "OMP_NUM_THREADS" -e "^\*\*\*" -e "USDT" -e "STAGE:"; }
python3 -m pytest -m gpu tests/kernels -q -p no:cacheprovider -x --tb=short 2>&1 | tail -8 | tee "$out/gpu_tests.txt"
python3 -m pytest -m gpu bench/test_bench_norm_rope.py -q -p no:cacheprovider --benchmark-json "$out/bench_norm_rope.json" \
    --benchmark-columns=median,min,max 2>&1 | tail -14 | tee "$out/bench_norm_rope.txt"
common="--preset flash --ratio 4 --tokens 65536 --backward --warmup 2 --reps 8"
{
echo "\$ python3 -m dsv4cp.cli.main profile $common --out records.jsonl"
python3 -m dsv4cp.cli.main profile $common --out "$out/records.jsonl" 2>&1 | quiet
echo "\$ torchrun --nproc-per-node 2 -m dsv4cp.cli.main profile $common --overlap async --trace-dir trace --trace-steps 1 --out records.jsonl"
torchrun --nproc-per-node 2 -m dsv4cp.cli.main profile $common --overlap async --trace-dir "$out/trace" --trace-steps 1 \
    --out "$out/records.jsonl" 2>&1 | quiet
cp "$out/trace/overlap.csv" "$out/overlap_async.csv"; rm -rf "$out/trace"
echo "\$ torchrun --nproc-per-node 2 -m dsv4cp.cli.main profile $common --overlap async --recompute --out records.jsonl"
torchrun --nproc-per-node 2 -m dsv4cp.cli.main profile $common --overlap async --recompute --out "$out/records.jsonl" 2>&1 | quiet
} 2>&1 | tee "$out/profile.txt"
