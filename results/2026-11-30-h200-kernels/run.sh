#!/usr/bin/env bash
# Kernel correctness (gpu-marked tests) and benchmarks on one H200, with the cuDNN frontend 1.32 installed:
# Triton vs torch vs cuDNN DSA backward side by side in one run. From the repository root:
#   bash results/2026-11-30-h200-kernels/run.sh $OUT
set -uo pipefail
out=${1:-.}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import cudnn; print('cudnn frontend', cudnn.__version__)" || true
python3 -m pytest -m gpu tests/kernels -q -p no:cacheprovider -rs 2>&1 | tee "$out/gpu_tests.txt" | tail -25
python3 -m pytest bench -m gpu -q -p no:cacheprovider --benchmark-json "$out/bench.json" \
    --benchmark-columns=median,min,max --benchmark-sort=name 2>&1 | tee "$out/bench.txt" | tail -60
python3 -m dsv4cp.kernels.report_run 2>&1 | tee "$out/resources.txt"
