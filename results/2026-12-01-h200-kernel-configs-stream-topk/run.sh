#!/usr/bin/env bash
# The first speed pass on one H200, in two parts (the optional backends of ../gpu_env.sh installed):
#   bash results/2026-12-01-h200-kernel-configs-stream-topk/run.sh kernels $OUT
#   bash results/2026-12-01-h200-kernel-configs-stream-topk/run.sh layer $OUT
# Outputs are written under results/2026-12-01-h200-kernel-configs-stream-topk/ (and results/runs/,
# results/baselines/h200/) and archived into $OUT/<part>.tar.gz.
set -uo pipefail
part=$1; out=${2:-.}
day=results/2026-12-01-h200-kernel-configs-stream-topk
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
save() { tar czf "$out/$part.tar.gz" "$day" "$@"; }  # after every step: a part cut at its time limit keeps what ran
mkdir -p "$day"
case $part in
  kernels)
    python3 -m dsv4cp.cli.main env --device cuda 2>&1 | tee "$day/env.txt"
    { echo "\$ python3 -m bench.sweep_sparse_attention_configs --shapes flash --json $day/sweep_sparse_attention.json"
      timeout 180 python3 -m bench.sweep_sparse_attention_configs --shapes flash --json "$day/sweep_sparse_attention.json"
    } 2>&1 | quiet | tail -60 > "$day/sweep_sparse_attention.txt"
    # the fastest correct flash-shape configurations pin the layer profiles of the next call
    python3 - "$day/sweep_sparse_attention.json" > "$HOME/best_env.sh" <<'PY'
import json, math, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["shape"] == "flash" and r["ok"] and not math.isnan(r["tflops"])]
for direction in ("fwd", "bwd"):
    best = max((r for r in rows if r["direction"] == direction), key=lambda r: r["tflops"], default=None)
    for key, value in (best["env"] if best else {}).items():
        print(f"export {key}={value}")
PY
    cat "$HOME/best_env.sh" | tee "$day/best_env.sh"; save
    { echo "\$ pytest bench/test_bench_indexer.py -m gpu -k 'test_indexer_topk and not config and (32k or 64k) and (chunked or stream or score)'"
      timeout 120 python3 -m pytest bench/test_bench_indexer.py -m gpu -q -p no:cacheprovider \
        -k "test_indexer_topk and not config and (32k or 64k) and (chunked or stream or score)" \
        --benchmark-columns=median,min,max --benchmark-json="$day/indexer_topk.json"
      echo "\$ pytest bench/test_bench_compressor.py -m gpu -k 'compress_pool or flash'"
      timeout 60 python3 -m pytest bench/test_bench_compressor.py -m gpu -q -p no:cacheprovider -k "compress_pool or flash" \
        --benchmark-columns=median,min,max --benchmark-group-by=group --benchmark-json="$day/compressor.json"
    } 2>&1 | quiet | tail -80 > "$day/bench_indexer_compressor.txt"; save
    timeout 170 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rfE 2>&1 | quiet | tail -40 > "$day/gpu_tests.txt"
    save ;;
  layer)
    [ -f "$HOME/best_env.sh" ] && . "$HOME/best_env.sh" && cat "$HOME/best_env.sh"
    common="--preset flash --ratio 4 --tokens 65536 --packing one --backward --dtype bf16 --warmup 2 --reps 6 --progress off"
    {
      for kb in auto triton; do
        echo "\$ python3 -m dsv4cp.cli.main profile $common --kernel-backend $kb --out $day/profile"
        timeout 120 python3 -m dsv4cp.cli.main profile $common --kernel-backend $kb --out "$day/profile" 2>&1 | quiet
        save
      done
      echo "\$ python3 -m dsv4cp.cli.main profile $common --kernel-backend auto --trace-dir $day/trace --trace-steps 1"
      timeout 120 python3 -m dsv4cp.cli.main profile $common --kernel-backend auto --trace-dir "$day/trace" --trace-steps 1 2>&1 | quiet
    } 2>&1 | tee "$day/profile.txt"
    gzip -f "$day"/trace/*.json 2>/dev/null; save
    DSV4CP_CALIBRATE_FROM=$day/trace timeout 330 bash results/2026-12-01-h200-cp2-emulated/run.sh "$out" > "$day/emulated.log" 2>&1
    save results/2026-12-01-h200-cp2-emulated ;;
esac
ls -la "$out"
