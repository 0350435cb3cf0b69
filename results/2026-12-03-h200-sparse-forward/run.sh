#!/usr/bin/env bash
# One H200: the Triton sparse-attention forward (flash, T = 16K): every variant of bench/test_bench_sparse_attention.py,
# the new ones (key loop warp-specialized, four-warpgroup tiles) among them, side by side with the default in one
# pytest-benchmark run; the default's time with one
# part left out at a time (parts.py); ncu (stall reasons, issue, tensor pipe, L2 / DRAM throughput) of the
# default and of the warp-specialized kernel; the GPU tests of the warp-specialized forward; ncu's sections of the
# default (PARTS=sections); tensor-pipe activity of the default and two leave-one-outs (PARTS=gmma).
# Run from the repository root: bash results/2026-12-03-h200-sparse-forward/run.sh OUT_DIR
set -uo pipefail
out=${1:?output folder}
dir=results/2026-12-03-h200-sparse-forward
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
table() {  # a pytest-benchmark JSON: name, median ms, TFLOP/s per benchmark
  python3 -c "import json,sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    e = b['extra_info']; print(f\"{b['name']:78s} {e.get('median_ms', float('nan')):9.3f} ms {e.get('tflops', float('nan')):7.1f} TFLOP/s\")" "$1"
}
nvidia-smi -L | tee "$out/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/env.txt"
for part in ${PARTS:-bench parts ncu tests}; do
case "$part" in
bench)
    sel="test_sparse_attention_forward and (flash-triton or flash-flashmla) and not deterministic"
    { echo "\$ pytest bench/test_bench_sparse_attention.py -m gpu -k '$sel'"
      timeout 230 python3 -m pytest bench/test_bench_sparse_attention.py -m gpu -q -p no:cacheprovider -rfE -k "$sel" \
        --benchmark-json="$out/fwd.json" 2>&1 | tail -25
      table "$out/fwd.json"
    } 2>&1 | quiet | tee "$out/fwd.txt"
    ;;
parts)
    { echo "\$ python $dir/parts.py"; timeout 100 python3 "$dir/parts.py" 2>&1 | quiet; } | tee "$out/parts.txt"
    ;;
ncu)  # one launch of each kernel (parts.py --once), the default and the warp-specialized one
    m=$(for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle lg_throttle not_selected \
        selected dispatch_stall no_instruction membar drain sleeping branch_resolving tex_throttle; do
        printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," $r; done)
    for variant in library ws; do
      { echo "=== forward $variant 64,64,8,2 split ahead"
        timeout 60 ncu --clock-control none -k "regex:_fwd_kernel" -c 1 \
          --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct,lts__xbar2lts_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,${m%,} \
          python3 "$dir/parts.py" --once $variant 2>&1 | grep -v "^==PROF==" | quiet
      } >> "$out/ncu.txt" 2>&1
    done
    tail -60 "$out/ncu.txt"
    ;;
sections)  # ncu's own sections for the default kernel (pipe utilisation, throughputs), and its gmma metric names
    { echo "=== forward library 64,64,8,2 split ahead: SpeedOfLight, ComputeWorkloadAnalysis, MemoryWorkloadAnalysis"
      timeout 90 ncu --clock-control none -k "regex:_fwd_kernel" -c 1 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 "$dir/parts.py" --once library 2>&1 | grep -v "^==PROF==" | quiet
      echo "=== ncu --query-metrics | grep -i gmma"
      ncu --query-metrics 2>&1 | grep -i gmma
    } > "$out/ncu_sections.txt" 2>&1; cat "$out/ncu_sections.txt"
    ;;
gmma)  # tensor-pipe activity and the products' shared-memory bytes: the default, without its value product,
       # with its rows resident
    for v in library no-pv resident-rows; do echo "=== $v"
      timeout 60 ncu --clock-control none -k "regex:_fwd_kernel" -c 1 \
        --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_tensor_op_gmma.sum,smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio,sm__sass_data_bytes_mem_shared_op_gmma.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_gmma.sum,smsp__issue_active.avg.pct_of_peak_sustained_elapsed \
        python3 "$dir/parts.py" --once $v 2>&1 | grep -v "^==PROF==" | grep -E "===|ms|%|inst|byte|ratio|Error|error"
    done 2>&1 | tee "$out/ncu_gmma.txt"
    ;;
tests)
    { echo "\$ pytest -m gpu tests/kernels/test_sparse_attention_triton.py -k warp_specialized"
      timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/kernels/test_sparse_attention_triton.py \
        -k warp_specialized 2>&1 | quiet | tail -15
    } > "$out/gpu_tests.txt" 2>&1; tail -5 "$out/gpu_tests.txt"
    ;;
esac
done
