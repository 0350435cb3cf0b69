#!/usr/bin/env bash
# One H200, Triton only (no FlashMLA / cuDNN needed):
#  tests  the indexer kernels' GPU tests, the head-pair score loop's among them;
#  bench  one pytest-benchmark run: the score kernel alone under every tile, one head at a time and with the
#         head-pair loop (T = 32K); the whole chunked top-k at 64K, default against head pairs; the bounded
#         radix select alone at 64K under each launch of its sweep;
#  select (after the bounded select's new default launch) the radix selects' GPU tests, and one pytest-benchmark
#         run: the bounded select alone at 64K under each launch of its sweep, and the whole top-k at 64K with
#         the new default against the select pinned to the old one (2048,8,4,2);
#  layer  (triton backend) the flash C layer at 64K, one document and histogram, with the bounded select's
#         new default launch and its old one (select_layer.yaml, 12 timed steps each), profiled, and each
#         point's phases against their bounds;
#  ncu2   what bounds the top-k's two kernels at 64K (one_topk.py: _score_kernel's first chunk, the bounded
#         select under its new default launch) and the tensor pipe of the sparse backward's scores kernel;
#  parts  the top-k's score kernel at 64K with parts of its head loop left out (score_parts.py), and the tensor
#         pipe's activity (ncu) of the kernel as is and of its products alone;
#  layertests  (after the select's new default) the GPU tests of the layer that run its top-k: the bf16 flash
#         layer with every default kernel against fp64 at full size, the triton layer against the torch one,
#         the radix top-k's scores, the indexer loss on the selection's scores;
#  ncu    what bounds the sparse backward's scores kernel (_bwd_dq_kernel: p and ds of each (query, slot,
#         head)): stall reasons per issued instruction, issue activity, tensor pipe, L2 / DRAM throughput and
#         ncu's sections, one launch at flash and at pro (T = 16K).
# Run from the repository root: bash results/2026-12-03-h200-topk-tiles-and-backward-scores/run.sh OUT
set -uo pipefail
out=${1:?output folder}
dir=results/2026-12-03-h200-topk-tiles-and-backward-scores
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
table() {  # a pytest-benchmark JSON: name, median ms, TFLOP/s per benchmark
  python3 -c "import json,sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    e = b['extra_info']; print(f\"{b['name']:78s} {e.get('median_ms', float('nan')):9.3f} ms {e.get('tflops', float('nan')):7.1f} TFLOP/s\")" "$1"
}
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  2>&1 | tee "$out/env.txt"
for part in ${PARTS:-tests bench ncu}; do
case "$part" in
tests)
    { echo "\$ pytest -m gpu tests/kernels/test_indexer_triton.py"
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/kernels/test_indexer_triton.py 2>&1 \
        | quiet | tail -15
    } > "$out/gpu_tests.txt" 2>&1; tail -5 "$out/gpu_tests.txt"
    ;;
bench)
    sel="test_indexer_score_config or (test_indexer_topk and 64k and (triton] or triton-head-pairs])) or test_indexer_select_bounded_config"
    { echo "\$ pytest bench/test_bench_indexer.py -m gpu -k '$sel'"
      timeout 300 python3 -m pytest bench/test_bench_indexer.py -m gpu -q -p no:cacheprovider -rfE -k "$sel" \
        --benchmark-json="$out/bench.json" 2>&1 | quiet | tail -8
      table "$out/bench.json"
    } 2>&1 | tee "$out/bench.txt"
    ;;
select)
    { echo "\$ pytest -m gpu tests/kernels/test_select_top_triton.py"
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/kernels/test_select_top_triton.py 2>&1 \
        | quiet | tail -15
    } > "$out/gpu_tests_select.txt" 2>&1; tail -5 "$out/gpu_tests_select.txt"
    sel="test_indexer_select_bounded_config or (test_indexer_topk and 64k and (triton] or triton-bounded-2048x8x4x2]))"
    { echo "\$ pytest bench/test_bench_indexer.py -m gpu -k '$sel'"
      timeout 240 python3 -m pytest bench/test_bench_indexer.py -m gpu -q -p no:cacheprovider -rfE -k "$sel" \
        --benchmark-json="$out/bench_select.json" 2>&1 | quiet | tail -8
      table "$out/bench_select.json"
    } 2>&1 | tee "$out/bench_select.txt"
    ;;
layer)
    { echo "\$ python3 -m dsv4cp.cli.main sweep $dir/select_layer.yaml --profile --progress off --out $out/sweep"
      timeout 300 python3 -m dsv4cp.cli.main sweep "$dir/select_layer.yaml" --profile --progress off --out "$out/sweep" \
        2>&1 | quiet | tail -8
      echo "(exit ${PIPESTATUS[0]})"; } 2>&1 | tee "$out/sweep.txt"
    python3 -m bench.phase_vs_bound "$out/sweep" > "$out/phase_vs_bound.txt" 2>&1
    grep -E "point|topk|^sum" "$out/phase_vs_bound.txt"
    tar czf "$out/sweep.tar.gz" -C "$out" sweep && rm -rf "$out/sweep"
    ;;
ncu2)
    m=$(for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle lg_throttle not_selected \
        selected dispatch_stall no_instruction membar drain sleeping branch_resolving tex_throttle gmma; do
        printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," $r; done)
    base=gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_tensor_op_gmma.sum,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
    for k in _score_kernel _select_bounded_kernel; do
      { echo "=== $k (64K top-k, first launch)"
        timeout 120 ncu --clock-control none -k "regex:^${k}\$" -c 1 --metrics $base,${m%,} \
          python3 "$dir/one_topk.py" 2>&1 | grep -v "^==PROF==" | quiet
      } >> "$out/ncu_topk.txt" 2>&1
    done
    { echo "=== _bwd_dq_kernel (the sparse backward's scores kernel), flash: tensor pipe"
      timeout 90 ncu --clock-control none -k "regex:^_bwd_dq_kernel\$" -c 1 --metrics $base \
        python3 "$dir/one_scores.py" flash 2>&1 | grep -v "^==PROF==" | quiet
    } >> "$out/ncu_topk.txt" 2>&1
    grep -E "===|duration|issue_active|hmma|fma|alu|stalled_(long|barrier|wait|mio|math|short|no_inst|dispatch)|registers|warps_active" "$out/ncu_topk.txt"
    ;;
layertests)
    { echo "\$ pytest -m gpu tests/harness/test_parity.py tests/kernels/test_layer_backends.py tests/kernels/test_indexer_topk_scores.py tests/test_indexer_loss_selection_scores.py"
      timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/harness/test_parity.py \
        tests/kernels/test_layer_backends.py tests/kernels/test_indexer_topk_scores.py \
        tests/test_indexer_loss_selection_scores.py 2>&1 | quiet | tail -15
    } > "$out/gpu_tests_layer.txt" 2>&1; tail -6 "$out/gpu_tests_layer.txt"
    ;;
parts)
    { echo "\$ python3 $dir/score_parts.py"; timeout 150 python3 "$dir/score_parts.py" 2>&1 | quiet; } | tee "$out/score_parts.txt"
    for v in library products-only epilogue-only; do
      { echo "=== $v"
        timeout 90 ncu --clock-control none -k "regex:_score_kernel" -c 1 \
          --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
          python3 "$dir/score_parts.py" --once $v 2>&1 | grep -v "^==PROF==" | grep -E "===|ms|%|register|Error|error"
      } >> "$out/ncu_score_parts.txt" 2>&1
    done
    cat "$out/ncu_score_parts.txt"
    ;;
ncu)
    m=$(for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle lg_throttle not_selected \
        selected dispatch_stall no_instruction membar drain sleeping branch_resolving tex_throttle gmma; do
        printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," $r; done)
    for shape in flash pro; do
      { echo "=== _bwd_dq_kernel (the scores kernel), $shape: metrics"
        timeout 90 ncu --clock-control none -k "regex:^_bwd_dq_kernel\$" -c 1 \
          --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_tensor_op_gmma.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__xbar2lts_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,${m%,} \
          python3 "$dir/one_scores.py" $shape 2>&1 | grep -v "^==PROF==" | quiet
        echo "=== _bwd_dq_kernel (the scores kernel), $shape: sections"
        timeout 90 ncu --clock-control none -k "regex:^_bwd_dq_kernel\$" -c 1 --section SpeedOfLight \
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
          --section Occupancy --section LaunchStats \
          python3 "$dir/one_scores.py" $shape 2>&1 | grep -v "^==PROF==" | quiet
      } >> "$out/ncu.txt" 2>&1
    done
    grep -E "===|Duration|duration|issue_active|gmma|stalled_(long|barrier|wait|mio|math|short)|Throughput|Occupancy" "$out/ncu.txt" | head -80
    ;;
esac
done
