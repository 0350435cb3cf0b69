#!/usr/bin/env bash
# One H200 after the glue fixes of the fourth speed pass: the indexer queries' RoPE fused
# (was torch cat/stack), the output projection's grouped map without copies (`dsv4cp.ops.grouped_linear`),
# the radix-select top-k (`dsv4cp.kernels.select_top_triton`, default `DSV4CP_TOPK_SELECT=radix`).
# Parts, run in this order (the optional backends of ../gpu_env.sh installed):
#   DSV4CP_GIT_SHA=<commit> bash results/2026-12-01-h200-radix-topk-glue/run.sh kernels $OUT
#   DSV4CP_GIT_SHA=<commit> bash results/2026-12-01-h200-radix-topk-glue/run.sh layer $OUT
#   DSV4CP_GIT_SHA=<commit> bash results/2026-12-01-h200-radix-topk-glue/run.sh emulate $OUT
# kernels: GPU tests of the changed paths, the top-k benchmark (torch selection vs radix, select tiles).
# layer: the flash C layer profiled with `auto` (FlashMLA + cuDNN) and with Triton only (traces,
#    per-phase memory, kernels per phase).
# emulate: CP = 2 rank emulation (equal / balanced / calibrated) with a calibration refit from the
#    `auto` trace of `layer`.
# final, final-layer (later, at the final commit): the whole GPU test suite;
#    the `auto` layer once more with every default, and traces of the two emulated CP = 2 ranks (equal).
# graph (after those): the probabilities kernel's two logit layouts, the GPU tests of the CUDA-graph
#    timing, and the `auto` layer eager, as CUDA-graph replays (--cuda-graph) and with the other layout.
# The kernels/layer/emulate calls above ran at commit 4fe3447 with DSV4CP_TRITON_SELECT_CONFIG=2048,8,4,2
# exported for layer and emulate (the select sweep of `kernels` had just found it fastest; the default
# since d81b296), and with dsv4cp/model/partition.py as committed.
# Outputs under this folder, archived into $OUT/<part>.tar.gz after every step.
# DSV4CP_GIT_SHA names the commit measured.
set -uo pipefail
part=$1; out=${2:-.}
day=results/2026-12-01-h200-radix-topk-glue
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
save() { tar czf "$out/$part.tar.gz" "$day"; }
table() {  # table JSON: name, median ms, TFLOP/s per benchmark
  python3 -c "import json,sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    e = b['extra_info']; print(f\"{b['name']:60s} {e['median_ms']:9.2f} ms {e.get('tflops', float('nan')):7.1f} TFLOP/s\")" "$1"
}
mkdir -p "$day" "$day/final" "$day/graph"
topk_k="test_indexer_select or (test_indexer_topk and not config and 64k and (chunked-radix or chunked-torch or score-radix))"
common="--preset flash --ratio 4 --tokens 65536 --packing one --backward --dtype bf16 --warmup 2 --reps 6 --progress off"
case $part in
  kernels)
    python3 -m dsv4cp.cli.main env --device cuda > "$day/env.txt" 2>&1
    timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/kernels/test_select_top_triton.py \
      tests/kernels/test_indexer_triton.py tests/kernels/test_indexer_static_plan.py tests/kernels/test_select_top.py \
      tests/kernels/test_norm_rope_triton.py tests/kernels/test_layer_backends.py 2>&1 | quiet | tail -15 > "$day/gpu_tests.txt"
    tail -2 "$day/gpu_tests.txt"; save
    { echo "\$ pytest bench/test_bench_indexer.py -m gpu -k '$topk_k'"
      timeout 120 python3 -m pytest bench/test_bench_indexer.py -m gpu -q -p no:cacheprovider -k "$topk_k" \
        --benchmark-json="$day/indexer_topk.json" 2>&1 | tail -3
      table "$day/indexer_topk.json"
    } 2>&1 | quiet | tee "$day/indexer_topk.txt"; save ;;
  layer)
    for kb in auto triton; do
      { echo "\$ python3 -m dsv4cp.cli.main profile $common --kernel-backend $kb --memory-phases --out $day/profile-$kb --trace-dir $day/trace-$kb --trace-steps 1"
        timeout 150 python3 -m dsv4cp.cli.main profile $common --kernel-backend $kb --memory-phases --out "$day/profile-$kb" \
          --trace-dir "$day/trace-$kb" --trace-steps 1 2>&1 | quiet
      } 2>&1 | tee "$day/profile-$kb.txt"
      gzip -f "$day"/trace-$kb/*.json 2>/dev/null; save
    done ;;
  final)
    timeout 330 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rfE > "$day/gpu_tests_final.txt" 2>&1
    tail -3 "$day/gpu_tests_final.txt"; save ;;
  final-layer)
    { echo "\$ python3 -m dsv4cp.cli.main profile $common --kernel-backend auto --out $day/final/profile"
      timeout 100 python3 -m dsv4cp.cli.main profile $common --kernel-backend auto --out "$day/final/profile" 2>&1 | quiet
      for rank in 0 1; do
        echo "\$ python3 -m dsv4cp.cli.main profile $common --kernel-backend auto --cp 2 --emulate-rank $rank --partition equal --out $day/final/emulated --trace-dir $day/final/trace-rank$rank --trace-steps 1"
        timeout 100 python3 -m dsv4cp.cli.main profile $common --kernel-backend auto --cp 2 --emulate-rank $rank \
          --partition equal --out "$day/final/emulated" --trace-dir "$day/final/trace-rank$rank" --trace-steps 1 2>&1 | quiet
      done
    } 2>&1 | tee "$day/final/profile.txt"
    gzip -f "$day"/final/trace-rank*/*.json 2>/dev/null; save ;;
  graph)
    { echo "\$ pytest bench/test_bench_attention_probs.py -m gpu -k layout"
      timeout 90 python3 -m pytest bench/test_bench_attention_probs.py -m gpu -q -p no:cacheprovider -k layout \
        --benchmark-json="$day/graph/probs_layout.json" 2>&1 | tail -2
      table "$day/graph/probs_layout.json"
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/kernels/test_attention_probs_triton.py tests/profiling/test_prof_cuda_graph.py \
        2>&1 | tail -3
      for variant in "" "--cuda-graph"; do
        echo "\$ python3 -m dsv4cp.cli.main profile $common --kernel-backend auto $variant --out $day/graph/profile"
        timeout 100 python3 -m dsv4cp.cli.main profile $common --kernel-backend auto $variant --out "$day/graph/profile" 2>&1 | quiet
      done
      echo "\$ DSV4CP_TRITON_PROBS_SLOTS_ON_M=1 python3 -m dsv4cp.cli.main profile $common --kernel-backend auto --out $day/graph/profile"
      DSV4CP_TRITON_PROBS_SLOTS_ON_M=1 timeout 100 python3 -m dsv4cp.cli.main profile $common --kernel-backend auto \
        --out "$day/graph/profile" 2>&1 | quiet
    } 2>&1 | tee "$day/graph/run.txt"; save ;;
  emulate)
    DSV4CP_EMULATE_DIR=$day/emulated DSV4CP_CALIBRATE_FROM=$day/trace-auto timeout 560 \
      bash results/2026-12-01-h200-cp2-emulated/run.sh "$out" > "$day/emulated.log" 2>&1
    tail -8 "$day/emulated.log"; save ;;
  phases)  # where the time above 2x the bound sits, per phase (reads the overlap.csv files of layer)
    python3 -m bench.phase_vs_bound "$day/trace-auto/overlap.csv" > "$day/phase_vs_bound.txt"
    python3 -m bench.phase_vs_bound "$day/trace-triton/overlap.csv" > "$day/phase_vs_bound_triton.txt" ;;
esac
ls -la "$out"
