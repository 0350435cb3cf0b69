#!/usr/bin/env bash
# One H200: the indexer's kernels and the Triton sparse attention, each new variant timed side by side with
# the kernel it may replace in ONE run (pytest-benchmark), then the flash C layer profiled (64K tokens, one
# document and histogram packing, fwd+bwd, bf16) with traces and the per-phase measured / bound tables.
# Parts, run in this order (the optional backends of ../gpu_env.sh installed):
#   DSV4CP_GIT_SHA=<commit> bash results/2026-12-02-h200-indexer-attention-variants/run.sh kernels $OUT
#   DSV4CP_GIT_SHA=<commit> bash results/2026-12-02-h200-indexer-attention-variants/run.sh layer $OUT
# Second pass, at the commit with the chosen defaults (TAG names the output folder):
#   TAG=kernels2 bash ... kernels2 $OUT; bash ... determinism $OUT
#   TAG=final KB="auto triton" PACKINGS=... bash ... layer $OUT
# Outputs under this folder (PART/ per part), archived into $OUT/<part>.tar.gz after every step.
set -uo pipefail
part=$1; out=${2:-.}; tag=${TAG:-$part}
day=results/2026-12-02-h200-indexer-attention-variants
dir=$day/$tag
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
common="--preset flash --ratio 4 --tokens 65536 --backward --dtype bf16 --warmup 2 --reps 6 --progress off"
case $part in
  kernels)
    python3 -m dsv4cp.cli.main env --device cuda > "$dir/env.txt" 2>&1
    timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE -x tests/kernels/test_indexer_triton.py \
      tests/kernels/test_attention_probs_triton.py tests/kernels/test_select_top_triton.py \
      tests/kernels/test_sparse_attention_triton.py $(ls tests/kernels/test_indexer_scores*.py 2>/dev/null) \
      2>&1 | quiet | tail -15 > "$dir/gpu_tests.txt"
    tail -3 "$dir/gpu_tests.txt"; save
    bench scores_reduce bench/test_bench_indexer.py "test_indexer_scores_reduce and 64k" 90
    bench select bench/test_bench_indexer.py "test_indexer_select and 64k and not config" 60
    bench topk bench/test_bench_indexer.py "test_indexer_topk and 64k and (triton-chunked-radix) and not config" 60
    bench probs bench/test_bench_attention_probs.py "test_head_summed_probs_kernel" 90
    bench sparse_attn bench/test_bench_sparse_attention.py "flash and not torch and not pro" 120 ;;
  kernels2)  # after the first pass: the chosen defaults against the kernels they replaced, and the breakdowns
    timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE -x tests/kernels/test_select_top_triton.py \
      tests/kernels/test_indexer_topk_scores.py tests/kernels/test_attention_probs_triton.py \
      tests/kernels/test_indexer_scores_reduce.py tests/kernels/test_sparse_attention_triton.py \
      2>&1 | quiet | tail -15 > "$dir/gpu_tests.txt"
    tail -3 "$dir/gpu_tests.txt"; save
    bench scores_parts bench/test_bench_indexer.py "test_indexer_scores_reduce and 64k" 90
    bench select bench/test_bench_indexer.py "(test_indexer_select and 64k and not config) or (test_indexer_topk and 64k and triton-chunked-radix) or test_indexer_topk_packed" 90
    bench probs bench/test_bench_attention_probs.py "test_head_summed_probs_kernel" 90
    bench sparse_attn bench/test_bench_sparse_attention.py "flash and not torch and not pro" 150 ;;
  determinism)  # the cost of determinism and the layer under Inductor (flash C, 64K, one document)
    flash="$common --packing one"
    { for case in "--kernel-backend auto --deterministic" "--kernel-backend auto --compile"; do
        echo "\$ python3 -m dsv4cp.cli.main profile $flash $case --out $dir/profile"
        timeout 200 python3 -m dsv4cp.cli.main profile $flash $case --out "$dir/profile" 2>&1 | quiet | tail -40
        echo "(exit ${PIPESTATUS[0]})"; save
      done
      for kb in triton auto; do  # the layer against the fp64 reference with every new default
        echo "\$ torchrun --nproc-per-node 1 -m dsv4cp.cli.main check-cp --cp 1 --dist-backend nccl --preset flash --ratio 4 --lengths 2500,0,1596 --dtype bf16 --kernel-backend $kb"
        timeout 90 torchrun --nproc-per-node 1 -m dsv4cp.cli.main check-cp --cp 1 --dist-backend nccl --preset flash \
          --ratio 4 --lengths 2500,0,1596 --dtype bf16 --kernel-backend $kb 2>&1 | quiet | tail -12
        echo "(exit ${PIPESTATUS[0]})"
      done
      replay="--cp 1 --preset flash --ratio 4 --lengths 8000,4000,4384 --dtype bf16 --replays 3"
      echo "\$ python3 -m dsv4cp.cli.main check-determinism $replay --kernel-backend auto --deterministic"
      timeout 120 python3 -m dsv4cp.cli.main check-determinism $replay --kernel-backend auto --deterministic 2>&1 | quiet
      echo "(exit ${PIPESTATUS[0]})"
    } 2>&1 | tee "$dir/run.txt"; save ;;
  layer)  # KB: kernel backends; LAYER_OPTS: extra profile options (e.g. --kernel-option NAME=VALUE ...)
    for kb in ${KB:-auto}; do
      for packing in ${PACKINGS:-one histogram}; do
        name=$kb-$packing
        { echo "\$ python3 -m dsv4cp.cli.main profile $common --packing $packing --kernel-backend $kb ${LAYER_OPTS:-} --out $dir/profile-$name --trace-dir $dir/trace-$name --trace-steps 1"
          timeout 120 python3 -m dsv4cp.cli.main profile $common --packing $packing --kernel-backend $kb ${LAYER_OPTS:-} \
            --out "$dir/profile-$name" --trace-dir "$dir/trace-$name" --trace-steps 1 2>&1 | quiet
          python3 -m bench.phase_vs_bound "$dir/profile-$name" 2>&1
        } 2>&1 | tee "$dir/profile-$name.txt"
        gzip -f "$dir"/trace-$name/*.json 2>/dev/null; save
      done
    done ;;
esac
ls -la "$out"
