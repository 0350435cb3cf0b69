#!/usr/bin/env bash
# The Triton sparse-attention backward with its own dq pass against the default one, on one H200.
# Run from the repository root on the GPU machine; $1 = the output folder.
set -uo pipefail
out=${1:?output folder}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi -L | tee "$out/env.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/env.txt"
for part in ${PARTS:-bench ncu oldtests}; do
case "$part" in
sweep)
    # every tile of both passes, part by part (kv pass with and without its atomics), and whole
    python -m bench.sweep_sparse_attention_dq_pass --json "$out/dq_pass.json" 2>&1 | tee "$out/dq_pass.txt"
    ;;
ncu)
    # what bounds each kernel: ncu stall reasons, occupancy, memory throughput (one launch each, flash)
    for k in _bwd_dkv_kernel _kv_pass_kernel _dq_pass_kernel; do
        timeout 120 ncu --clock-control none -k "regex:^${k}\$" -c 1 --section SpeedOfLight --section Occupancy \
            --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
            python results/2026-12-02-h200-sparse-backward/one_backward.py >> "$out/ncu.txt" 2>&1
    done
    ;;
bench)
    # old and new side by side in one pytest-benchmark run (flash and pro), then the GPU tests
    python -m pytest bench/test_bench_sparse_attention.py -m gpu -p no:cacheprovider -q \
        -k "test_sparse_attention_backward[ and (flash or pro) and (triton] or triton-dkv-with-dq])" \
        --benchmark-json "$out/bench_bwd.json" 2>&1 | tee "$out/bench_bwd.txt"
    timeout 60 python -m pytest tests/kernels/test_sparse_attention_bwd_dq_pass_triton.py \
        -m gpu -q -p no:cacheprovider 2>&1 | tail -30 | tee "$out/gpu_tests.txt"
    ;;
oldtests)
    timeout 120 python -m pytest tests/kernels/test_sparse_attention_triton.py -m gpu -q -p no:cacheprovider 2>&1 \
        | tail -30 | tee -a "$out/gpu_tests.txt"
    ;;
esac
done
