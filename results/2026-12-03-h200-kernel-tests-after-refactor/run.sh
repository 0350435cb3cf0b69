#!/usr/bin/env bash
# One H200: the GPU tests (`-m gpu`) of the sparse-attention forward/backward, the dq-pass backward, the
# indexer scoring / chunked top-k and the streaming top-k, on the kernels as they are after the CPU-side
# refactors (selected_length, the fused top-k call, the backward's launch keywords). From the repository root:
#   bash results/2026-12-03-h200-kernel-tests-after-refactor/run.sh OUT
set -uo pipefail
out=${1:?output folder}
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia_smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/nvidia_smi.txt"
timeout ${GPU_TEST_TIMEOUT:-500} python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=15 \
  tests/kernels/test_sparse_attention_triton.py tests/kernels/test_sparse_attention_bwd_dq_pass_triton.py \
  tests/kernels/test_indexer_triton.py tests/kernels/test_indexer_topk_stream.py tests/kernels/test_select_top_triton.py \
  2>&1 | tail -60 | tee "$out/gpu_tests.txt"
echo "(exit ${PIPESTATUS[0]})" | tee -a "$out/gpu_tests.txt"
