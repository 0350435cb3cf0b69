#!/usr/bin/env bash
# One H200 with nvtx and sgl-flash-mla installed (no cuDNN frontend, so the layer is profiled with Triton
# kernels only): the indexer-scores backward with relaxed
# atomics (and its tiles) against the acq_rel kernel, the score kernel writing packed selection keys
# against the fp32 buffer, their GPU tests, and the flash C layer with `--kernel-backend triton`.
#   DSV4CP_GIT_SHA=<commit> bash results/2026-12-01-h200-packed-keys-relaxed-atomics/run.sh $OUT
set -uo pipefail
out=${1:-.}
day=results/2026-12-01-h200-packed-keys-relaxed-atomics
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
save() { tar czf "$out/speed3.tar.gz" "$day"; }
mkdir -p "$day"
table() {  # table JSON: backend, median ms, TFLOP/s per benchmark
  python3 -c "import json,sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    e = b['extra_info']; print(f\"{b['name']:52s} {e['median_ms']:9.2f} ms {e.get('tflops', float('nan')):7.1f} TFLOP/s\")" "$1"
}
{ echo "\$ pytest bench/test_bench_indexer.py -m gpu -k 'scores_fwd_bwd and 64k and not torch'"
  timeout 120 python3 -m pytest bench/test_bench_indexer.py -m gpu -q -p no:cacheprovider \
    -k "scores_fwd_bwd and 64k and not torch" --benchmark-json="$day/indexer_scores.json" 2>&1 | tail -3
  table "$day/indexer_scores.json"
} 2>&1 | quiet | tee "$day/indexer_scores.txt"; save
{ echo "\$ pytest bench/test_bench_indexer.py -m gpu -k 'test_indexer_topk and not config and 64k and (triton-chunked or triton-score)'"
  timeout 90 python3 -m pytest bench/test_bench_indexer.py -m gpu -q -p no:cacheprovider \
    -k "test_indexer_topk and not config and 64k and (triton-chunked or triton-score)" \
    --benchmark-json="$day/indexer_topk.json" 2>&1 | tail -3
  table "$day/indexer_topk.json"
} 2>&1 | quiet | tee "$day/indexer_topk.txt"; save
timeout 90 python3 -m pytest tests/kernels/test_indexer_triton.py tests/kernels/test_indexer_static_plan.py \
  tests/kernels/test_select_top.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | quiet | tail -15 > "$day/gpu_tests.txt"; save
common="--preset flash --ratio 4 --tokens 65536 --packing one --backward --dtype bf16 --warmup 2 --reps 6 --progress off"
{ echo "\$ python3 -m dsv4cp.cli.main profile $common --kernel-backend triton --out $day/profile --trace-dir $day/trace --trace-steps 1"
  timeout 120 python3 -m dsv4cp.cli.main profile $common --kernel-backend triton --out "$day/profile" \
    --trace-dir "$day/trace" --trace-steps 1 2>&1 | quiet
} 2>&1 | tee "$day/profile.txt"
gzip -f "$day"/trace/*.json 2>/dev/null; save
ls -la "$out"
