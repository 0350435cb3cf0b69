#!/usr/bin/env bash
# One H200: what the previous pass left unmeasured, then the layer at this pass's defaults.
#   kernels: the GPU-marked tests of the kernels changed since 2026-12-01 (all of them, no -x), the indexer
#            scores backward's parts alone (what bounds it), the Triton sparse backward's variants and parts
#            (the one-product dkv kernel included), and the top-k's scoring tile sweep; no optional backend.
#   layer:   the flash C layer (64K tokens, fwd+bwd, bf16) as a sweep over kernel backend x deterministic,
#            plus the Inductor-compiled point, into ONE run directory (the report pairs them), with traces
#            and phase_vs_bound tables of the eager points, then check-cp of the compiled layer against the
#            reference (part check). With the optional backends of ../gpu_env.sh installed.
#   libraries: the real FlashMLA / cuDNN adapters and the slot compaction, side by side (every optional backend).
#   prelayer: the GPU tests and benchmarks of the kernels added since (slot compaction, the fused KL pass,
#            the loss on the selection's scores), run before the layer.
# Usage: DSV4CP_GIT_SHA=<commit> bash results/2026-12-02-h200-layer-defaults/run.sh PART $OUT   (TAG names the folder)
set -uo pipefail
part=$1; out=${2:-.}; tag=${TAG:-$part}
dir=results/2026-12-02-h200-layer-defaults/$tag
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
save() { tar czf "$out/$tag.tar.gz" "$dir"; }
table() {  # a pytest-benchmark JSON: name, median ms, TFLOP/s per benchmark
  python3 -c "import json,sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    e = b['extra_info']; print(f\"{b['name']:78s} {e.get('median_ms', float('nan')):9.3f} ms {e.get('tflops', float('nan')):7.1f} TFLOP/s\")" "$1"
}
bench() {  # bench NAME FILE SELECTOR TIMEOUT: one benchmark group, its table, saved
  local name=$1 file=$2 sel=$3 limit=$4
  { echo "\$ pytest $file -m gpu -k '$sel'"
    timeout "$limit" python3 -m pytest "$file" -m gpu -q -p no:cacheprovider -k "$sel" \
      --benchmark-json="$dir/$name.json" 2>&1 | tail -3
    table "$dir/$name.json"
  } 2>&1 | quiet | tee "$dir/$name.txt"; save
}
mkdir -p "$dir"
case $part in
  kernels)
    python3 -m dsv4cp.cli.main env --device cuda > "$dir/env.txt" 2>&1
    { echo "\$ pytest -m gpu -rfE tests/kernels/test_select_top_triton.py ... (the files below)"
      timeout 190 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=15 \
        tests/kernels/test_select_top_triton.py tests/kernels/test_indexer_topk_scores.py \
        tests/kernels/test_attention_probs_triton.py tests/kernels/test_indexer_scores_reduce.py \
        tests/kernels/test_sparse_attention_triton.py 2>&1 | quiet | tail -40; } > "$dir/gpu_tests.txt"
    tail -3 "$dir/gpu_tests.txt"; save
    bench scores_parts bench/test_bench_indexer.py "test_indexer_scores_reduce_parts and 64k" 80
    bench sparse_bwd bench/test_bench_sparse_attention.py "test_sparse_attention_backward and flash and not torch and not pro and not parts and not deterministic" 130
    bench sparse_bwd_parts bench/test_bench_sparse_attention.py "flash and parts" 60
    bench score_tiles bench/test_bench_indexer.py "test_indexer_score_config" 50 ;;
  libraries)  # with every optional backend: the real FlashMLA / cuDNN adapters against the oracle (slot compaction on
    # and off), the slot compaction side by side, the last sparse-attention GPU test the first call's limit cut
    # off, and the one-product backward's new tile with the indices ahead
    { echo "\$ pytest -m gpu -rfE tests/kernels/test_optional_backends.py tests/kernels/test_sparse_attention_triton.py -k 'real or T64-H7-D512-N300-Kt200'"
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/kernels/test_optional_backends.py \
        tests/kernels/test_sparse_attention_triton.py -k "real or T64-H7-D512-N300-Kt200" 2>&1 | quiet | tail -25
    } > "$dir/gpu_tests.txt" 2>&1; tail -3 "$dir/gpu_tests.txt"; save
    bench compaction bench/test_bench_sparse_attention.py "test_library_slot_compaction" 120
    bench sparse_bwd bench/test_bench_sparse_attention.py "test_sparse_attention_backward and flash and triton and not parts and not pro and not torch and not deterministic" 90 ;;
  prelayer)  # the new kernels' GPU tests and benchmarks, before the layer sweep (the next call)
    { echo "\$ pytest -rfE tests/kernels/test_compact_slots_triton.py tests/kernels/test_optional_backends.py -k 'real or compact'"
      timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_compact_slots_triton.py \
        tests/kernels/test_optional_backends.py -k "real or compact" 2>&1 | quiet | tail -15
      echo "\$ pytest -m gpu -rfE tests/kernels/test_indexer_kl_triton.py tests/test_indexer_loss_selection_scores.py"
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/kernels/test_indexer_kl_triton.py \
        tests/test_indexer_loss_selection_scores.py 2>&1 | quiet | tail -15
    } > "$dir/gpu_tests.txt" 2>&1; cat "$dir/gpu_tests.txt" | grep -E "passed|failed|error" ; save
    bench compaction bench/test_bench_sparse_attention.py "test_library_slot_compaction" 60
    bench indexer_loss bench/test_bench_indexer_loss.py "64k" 90 ;;
  layer)
    spec=results/2026-12-02-h200-layer-defaults/layer.yaml
    { echo "\$ python3 -m dsv4cp.cli.main sweep $spec --profile --progress off --out $dir/sweep"
      timeout 330 python3 -m dsv4cp.cli.main sweep "$spec" --profile --progress off --out "$dir/sweep" 2>&1 | quiet | tail -30
      echo "(exit ${PIPESTATUS[0]})"; } 2>&1 | tee "$dir/sweep.txt"; save
    python3 -m bench.phase_vs_bound "$dir/sweep" > "$dir/phase_vs_bound.txt" 2>&1; save ;;
  verify)  # after the review, no optional backend: the GPU tests of the Triton kernels at this pass's defaults (the
    # sparse backward's one product on its new tile, indices ahead; the fused KL; the compaction kernel; the
    # scores with the selection's scores) and check-cp of the triton layer (CP = 1 against eager CP = 1)
    { echo "\$ pytest -m gpu -rfE tests/kernels/test_sparse_attention_triton.py tests/kernels/test_indexer_kl_triton.py tests/kernels/test_compact_slots_triton.py tests/test_indexer_loss_selection_scores.py"
      timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=5 \
        tests/kernels/test_sparse_attention_triton.py tests/kernels/test_indexer_kl_triton.py \
        tests/kernels/test_compact_slots_triton.py tests/test_indexer_loss_selection_scores.py 2>&1 | quiet | tail -20
      check="--cp 1 --dist-backend nccl --preset flash --ratio 4 --lengths 2500,0,1596 --dtype bf16 --kernel-backend triton"
      echo "\$ torchrun --nproc-per-node 1 -m dsv4cp.cli.main check-cp $check"
      timeout 90 torchrun --nproc-per-node 1 -m dsv4cp.cli.main check-cp $check 2>&1 | quiet | tail -10
      echo "(exit ${PIPESTATUS[0]})"; } 2>&1 | tee "$dir/verify.txt"; save ;;
  check)  # the compiled layer against the eager CP = 1 layer (run after layer, in the next call)
    check="--cp 1 --dist-backend nccl --preset flash --ratio 4 --lengths 2500,0,1596 --dtype bf16 --kernel-backend auto"
    { echo "\$ torchrun --nproc-per-node 1 -m dsv4cp.cli.main check-cp $check --compile inductor"
      timeout 150 torchrun --nproc-per-node 1 -m dsv4cp.cli.main check-cp $check --compile inductor 2>&1 | quiet | tail -25
      echo "(exit ${PIPESTATUS[0]})"; } 2>&1 | tee "$dir/check_cp_compile.txt"; save ;;
esac
ls -la "$out"
