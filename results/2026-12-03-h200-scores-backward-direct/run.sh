#!/usr/bin/env bash
# One H200: the indexer scores backward with its key-gradient atomics issued from the accumulator's registers
# (layout keys_on_m_direct) against the keys-on-M kernel (the default), side by side in one pytest-benchmark
# run (the kernel alone at every tile; forward + backward), the GPU tests, and ncu (L2 load, stall reasons)
# of both at 64,4,3 with the indices ahead. bytes-call/ ran bytes.py alone (its command is in bytes.py).
# Run from the repository root: bash results/2026-12-03-h200-scores-backward-direct/run.sh OUT_DIR
set -uo pipefail
out=${1:?output folder}
dir=results/2026-12-03-h200-scores-backward-direct
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
table() {  # a pytest-benchmark JSON: name, median ms, TFLOP/s per benchmark
  python3 -c "import json,sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    e = b['extra_info']; print(f\"{b['name']:78s} {e.get('median_ms', float('nan')):9.3f} ms {e.get('tflops', float('nan')):7.1f} TFLOP/s\")" "$1"
}
bench() {  # bench NAME FILE SELECTOR TIMEOUT
  local name=$1 file=$2 sel=$3 limit=$4
  { echo "\$ pytest $file -m gpu -k '$sel'"
    timeout "$limit" python3 -m pytest "$file" -m gpu -q -p no:cacheprovider -k "$sel" \
      --benchmark-json="$out/$name.json" 2>&1 | tail -3
    table "$out/$name.json"
  } 2>&1 | quiet | tee "$out/$name.txt"
}
nvidia-smi -L | tee "$out/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/env.txt"
for part in ${PARTS:-bench tests ncu}; do
case "$part" in
bench)
    bench bwd_kernel bench/test_bench_indexer.py "test_indexer_scores_backward_kernel and 64k and not heads" 170
    bench fwd_bwd bench/test_bench_indexer.py "test_indexer_scores_fwd_bwd and 64k and triton-keys-on-m" 100
    ;;
tests)
    { echo "\$ pytest -m gpu tests/kernels/test_indexer_scores_layouts.py"
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/kernels/test_indexer_scores_layouts.py \
        2>&1 | quiet | tail -15
    } > "$out/gpu_tests.txt" 2>&1; tail -3 "$out/gpu_tests.txt"
    ;;
ncu)  # the L2's load and the issue-stall reasons of either kernel (one launch each)
    m=$(for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle lg_throttle not_selected \
        selected dispatch_stall no_instruction membar drain; do
        printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," $r; done)
    for layout in keys_on_m keys_on_m_direct; do
      { echo "=== scores-bwd $layout 64,4,3 ahead"
        timeout 65 ncu --clock-control none -k "regex:^_gather_bwd" -c 1 \
          --metrics gpu__time_duration.sum,lts__xbar2lts_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_red.sum,lts__t_requests_srcunit_tex_op_red.sum,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,${m%,} \
          python3 "$dir/one_kernel.py" scores-bwd $layout 64,4,3 ahead 2>&1 | grep -v "^==PROF==" | quiet
      } >> "$out/ncu.txt" 2>&1
    done
    ;;
esac
done
