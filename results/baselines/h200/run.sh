#!/usr/bin/env bash
# GPU regression baselines on ONE H200 (about 3-4 minutes): the kernels sweep at CP = 1 and the GPU-size
# benchmarks. From the repository root (optionally with the cuDNN frontend / FlashMLA
# installed: a backend that is missing is recorded as an error point / skipped benchmark, and compare ignores it):
#   bash results/baselines/h200/run.sh results/baselines/h200
# Gate a change against it later with results/baselines/README.md's commands.
set -euo pipefail
out=${1:-results/baselines/h200}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m dsv4cp sweep sweeps/kernels.yaml --out "$out/kernels" --progress off 2>&1 | tee "$out/kernels.txt"
python3 -m pytest bench -m gpu -q -p no:cacheprovider --benchmark-json "$out/bench.json" \
    --benchmark-columns=median,min,max --benchmark-sort=name 2>&1 | tee "$out/bench.txt" | tail -60
