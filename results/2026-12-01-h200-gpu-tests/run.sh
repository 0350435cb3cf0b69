#!/usr/bin/env bash
# Every GPU test (`-m gpu`) on one H200, after the integrity fixes (backward reduce-scatter ordering,
# precision-pinned tables, no host syncs, chunked dense loss, one-way layering). From the repository
# root, with nvtx and sgl-flash-mla installed:
#   bash results/2026-12-01-h200-gpu-tests/run.sh $OUT
set -uo pipefail
out=${1:-.}
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia_smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/nvidia_smi.txt"
timeout ${GPU_TEST_TIMEOUT:-480} python3 -m pytest -m gpu tests -q -p no:cacheprovider -rfE 2>&1 | tail -60 | tee "$out/gpu_tests.txt"
