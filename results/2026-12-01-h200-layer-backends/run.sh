#!/usr/bin/env bash
# The layer on ONE H200 after the first speed run (../2026-12-01-h200-kernel-configs-stream-topk) set the
# defaults it measured faster: chunked top-k with the packed-key selection, sparse backward "dq in dkv"
# (64,64,8,1 + dkv 64,256,8,2). Parts, run in this order (the optional backends of ../gpu_env.sh installed):
#   bash results/2026-12-01-h200-layer-backends/run.sh main $OUT    (about 9 minutes)
#   bash results/2026-12-01-h200-layer-backends/run.sh tests $OUT   (GPU tests)
# Outputs under this folder and ../2026-12-01-h200-cp2-emulated, archived into $OUT/<part>.tar.gz.
# Afterwards, the sparse-attention backends side by side in one run (FlashMLA, cuDNN, Triton with both dq
# placements, torch; flash and pro):
#   bash results/2026-12-01-h200-layer-backends/run.sh sparse $OUT
# DSV4CP_GIT_SHA=<commit> names the commit measured.
set -uo pipefail
part=$1; out=${2:-.}
day=results/2026-12-01-h200-layer-backends
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
save() { tar czf "$out/$part.tar.gz" "$day" "$@"; }  # after every step: a part cut at its time limit keeps what ran
mkdir -p "$day"
case $part in
  main)
    python3 -m dsv4cp.cli.main env --device cuda > "$day/env.txt" 2>&1
    { echo "\$ pytest bench/test_bench_indexer.py -m gpu -k 'test_indexer_topk and not config and (32k or 64k) and (chunked or score)'"
      timeout 90 python3 -m pytest bench/test_bench_indexer.py -m gpu -q -p no:cacheprovider \
        -k "test_indexer_topk and not config and (32k or 64k) and (chunked or score)" \
        --benchmark-columns=median,min,max --benchmark-json="$day/indexer_topk.json"
    } 2>&1 | quiet | tail -30 > "$day/bench_indexer.txt"; save
    common="--preset flash --ratio 4 --tokens 65536 --packing one --backward --dtype bf16 --warmup 2 --reps 6 --progress off"
    {
      for kb in auto triton; do
        echo "\$ python3 -m dsv4cp.cli.main profile $common --kernel-backend $kb --out $day/profile"
        timeout 100 python3 -m dsv4cp.cli.main profile $common --kernel-backend $kb --out "$day/profile" 2>&1 | quiet
        save
      done
      echo "\$ python3 -m dsv4cp.cli.main profile $common --kernel-backend auto --trace-dir $day/trace --trace-steps 1"
      timeout 100 python3 -m dsv4cp.cli.main profile $common --kernel-backend auto --trace-dir "$day/trace" --trace-steps 1 2>&1 | quiet
    } 2>&1 | tee "$day/profile.txt"
    gzip -f "$day"/trace/*.json 2>/dev/null; save
    DSV4CP_CALIBRATE_FROM=$day/trace timeout 300 bash results/2026-12-01-h200-cp2-emulated/run.sh "$out" > "$day/emulated.log" 2>&1
    save results/2026-12-01-h200-cp2-emulated ;;
  sparse)
    timeout 400 python3 -m pytest bench/test_bench_sparse_attention.py -m gpu -q -p no:cacheprovider \
      --benchmark-columns=median,min,max --benchmark-group-by=group --benchmark-json="$day/bench_sparse_attention.json" \
      2>&1 | quiet > "$day/bench_sparse_attention.txt"; tail -3 "$day/bench_sparse_attention.txt"; save ;;
  tests)
    timeout ${GPU_TEST_TIMEOUT:-420} python3 -m pytest -m gpu tests -q -p no:cacheprovider -rfE > "$day/gpu_tests.txt" 2>&1
    tail -5 "$day/gpu_tests.txt"; save ;;
esac
ls -la "$out"
