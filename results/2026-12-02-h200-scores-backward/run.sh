#!/usr/bin/env bash
# One H200: the indexer scores backward with the keys on M against the heads-on-M kernel, side by side in one
# pytest-benchmark run, ncu of both (sections, the L2's load, stall reasons), the GPU tests, the kernel's
# variants (variants.py), ncu of the top-k's kernels, and the layer with either kernel (layer.yaml).
# Run from the repository root on the GPU machine: PARTS="tests bench ncu l2 stalls layer variants" bash run.sh OUT_DIR
# (ncu of the keys-on-M kernel at TILE, default 64,4,3, AHEAD=in-step: without its indices a step ahead;
# keys-on-m/ ran TILE=64,4,1 AHEAD=in-step, before the option existed; index-ahead/ TILE=64,4,1)
set -uo pipefail
out=${1:?output folder}
dir=results/2026-12-02-h200-scores-backward
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
ncu_one() {  # ncu_one KERNEL_REGEX LABEL ARGS...: one launch, the sections that say what bounds it
  local k=$1 label=$2; shift 2
  { echo "=== $label: ncu -k regex:$k -c 1 ... one_kernel.py $*"
    timeout 150 ncu --clock-control none -k "regex:$k" -c 1 --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats --section ComputeWorkloadAnalysis \
      python3 "$dir/one_kernel.py" "$@" 2>&1 | grep -v "^==PROF==" | quiet
  } >> "$out/ncu.txt" 2>&1
}
nvidia-smi -L | tee "$out/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/env.txt"
for part in ${PARTS:-bench ncu tests}; do
case "$part" in
bench)
    bench bwd_kernel bench/test_bench_indexer.py "test_indexer_scores_backward_kernel and 64k" 150
    bench fwd_bwd bench/test_bench_indexer.py "test_indexer_scores_fwd_bwd and 64k and (triton-heads-on-m or triton-keys-on-m)" 120
    ;;
ncu)
    ncu_one '^_gather_bwd_kernel$' "heads on M, 32 x 4 x 2" scores-bwd heads_on_m 32,4,2
    ncu_one '^_gather_bwd_keys_on_m_kernel$' "keys on M, ${TILE:-64,4,3}" scores-bwd keys_on_m ${TILE:-64,4,3} ${AHEAD:-ahead}
    ;;
variants)
    timeout 240 python3 "$dir/variants.py" 2>&1 | quiet | tee "$out/variants.txt"
    ;;
l2)  # the L2's throughput by unit and the sectors by operation: what the backward kernels load the L2 with
    for args in "heads_on_m 32,4,2" "keys_on_m ${TILE:-64,4,3} ${AHEAD:-ahead}"; do
      { echo "=== L2 of scores-bwd $args"
        timeout 120 ncu --clock-control none -k "regex:^_gather_bwd" -c 1 \
          --metrics breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_red.sum,lts__t_sectors_srcunit_tex_op_atom.sum,lts__t_sectors_srcunit_tex_op_write.sum,lts__t_requests_srcunit_tex_op_red.sum,lts__t_sectors_srcunit_tex_aperture_device_op_read_lookup_miss.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,gpu__time_duration.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed \
          python3 "$dir/one_kernel.py" scores-bwd $args 2>&1 | grep -v "^==PROF==" | quiet
      } >> "$out/ncu_l2.txt" 2>&1
    done
    ;;
stalls)  # why the warps wait: issue-stall reasons per issued instruction, each kernel's first launch
    m=$(for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle lg_throttle not_selected \
        selected dispatch_stall no_instruction membar drain sleeping tex_throttle branch_resolving imc_miss misc; do
        printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," $r; done)
    for spec in "^_gather_bwd_kernel$|scores-bwd heads_on_m 32,4,2" "^_gather_bwd_keys_on_m_kernel$|scores-bwd keys_on_m ${TILE:-64,4,3} ${AHEAD:-ahead}" \
                "^_score_kernel$|topk" "^_select_bounded_kernel$|topk"; do
      { echo "=== stalls of ${spec%%|*}: one_kernel.py ${spec#*|}"
        timeout 120 ncu --clock-control none -k "regex:${spec%%|*}" -c 1 --metrics "${m%,}" \
          python3 "$dir/one_kernel.py" ${spec#*|} 2>&1 | grep -v "^==PROF==" | quiet
      } >> "$out/ncu_stalls.txt" 2>&1
    done
    ;;
topk-ncu)
    ncu_one '^_score_kernel$' "top-k score kernel (first chunk)" topk
    ncu_one '^_select_bounded_kernel$' "top-k bounded select (first chunk)" topk
    ;;
layer)  # the layer at either scores backward kernel, one run directory, then each point's phases against the bound
    { echo "\$ python3 -m dsv4cp.cli.main sweep $dir/layer.yaml --profile --progress off --out $out/sweep"
      timeout 300 python3 -m dsv4cp.cli.main sweep "$dir/layer.yaml" --profile --progress off --out "$out/sweep" 2>&1 \
        | quiet | tail -8
      echo "(exit ${PIPESTATUS[0]})"; } 2>&1 | tee "$out/sweep.txt"
    python3 -m bench.phase_vs_bound "$out/sweep" > "$out/phase_vs_bound.txt" 2>&1
    tar czf "$out/sweep.tar.gz" -C "$out" sweep && rm -rf "$out/sweep"
    ;;
tests)
    { echo "\$ pytest -m gpu tests/kernels/test_indexer_scores_layouts.py tests/kernels/test_indexer_triton.py -k 'scores'"
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/kernels/test_indexer_scores_layouts.py \
        tests/kernels/test_indexer_triton.py -k "scores" 2>&1 | quiet | tail -15
    } > "$out/gpu_tests.txt" 2>&1; tail -3 "$out/gpu_tests.txt"
    ;;
esac
done
