#!/usr/bin/env bash
# The profile of ../2026-11-30-h200x2-layer-64k again after three changes: Triton kernels for the indexer
# loss target, the compressor's index_select gathers, chunked query recompute; plus the new kernels'
# GPU tests and benchmark. One flash C layer (ratio 4), 65536 tokens in one document, fwd+bwd, bf16, on 2 x H200:
# CP = 1 vs CP = 2 with overlap none / async (and async + recompute): time, peak memory, model bound,
# and a Kineto trace per rank with the per-phase overlap table. From the repository root:
#   bash results/2026-11-30-h200x2-loss-target-kernels/run.sh $OUT
set -uo pipefail
out=${1:-.}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
backend=${KERNEL_BACKEND:-auto}
common="--preset flash --ratio 4 --tokens 65536 --backward --kernel-backend $backend --warmup 2 --reps 8"
quiet() { grep -v -e "^W1130" -e "OMP_NUM_THREADS" -e "^\*\*\*" -e "USDT" -e "STAGE:"; }
python3 -m pytest -m gpu tests/kernels/test_attention_probs_triton.py -q -p no:cacheprovider 2>&1 | tail -3 | tee "$out/gpu_tests.txt"
python3 -m pytest -m gpu bench/test_bench_attention_probs.py -q -p no:cacheprovider --benchmark-json "$out/bench_probs.json" \
    --benchmark-columns=median,min,max 2>&1 | tail -25 | tee "$out/bench_probs.txt"
{
for ratio in 4; do
  echo "\$ torchrun --nproc-per-node 2 -m dsv4cp.cli.main check-cp --backend nccl --preset flash --tokens 16384 --packing histogram --dtype bf16 --ratio $ratio --overlap async --kernel-backend $backend"
  torchrun --nproc-per-node 2 -m dsv4cp.cli.main check-cp --backend nccl --preset flash --tokens 16384 --packing histogram \
      --dtype bf16 --ratio $ratio --overlap async --kernel-backend $backend 2>&1 | quiet
done
echo "\$ python3 -m dsv4cp.cli.main profile $common --out records.jsonl"
python3 -m dsv4cp.cli.main profile $common --out "$out/records.jsonl" 2>&1 | quiet
for mode in none async; do
  echo "\$ torchrun --nproc-per-node 2 -m dsv4cp.cli.main profile $common --overlap $mode --trace-dir trace_$mode --trace-steps 1 --out records.jsonl"
  torchrun --nproc-per-node 2 -m dsv4cp.cli.main profile $common --overlap $mode --trace-dir "$out/trace_$mode" \
      --trace-steps 1 --out "$out/records.jsonl" 2>&1 | quiet
  cp "$out/trace_$mode/overlap.csv" "$out/overlap_$mode.csv"
done
echo "\$ torchrun --nproc-per-node 2 -m dsv4cp.cli.main profile $common --overlap async --recompute --out records.jsonl"
torchrun --nproc-per-node 2 -m dsv4cp.cli.main profile $common --overlap async --recompute --out "$out/records.jsonl" 2>&1 | quiet
} 2>&1 | tee "$out/profile.txt"
gzip -c "$out/trace_async/rank0.json" > "$out/trace_async_rank0.json.gz"
rm -rf "$out/trace_none" "$out/trace_async"
ls -la "$out"
