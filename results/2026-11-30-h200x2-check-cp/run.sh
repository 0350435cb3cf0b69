#!/usr/bin/env bash
# dsv4cp check-cp on 2 x H200 (NCCL), flash shapes, bf16: W, C (sparse and dense loss) and H layers,
# overlap none and async, recompute on one case. Run from the repository root on the GPU machine:
#   bash results/2026-11-30-h200x2-check-cp/run.sh $OUT
set -uo pipefail
out=${1:-.}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
run() { echo "\$ torchrun --nproc-per-node 2 -m dsv4cp.cli.main check-cp --backend nccl $*"
        torchrun --nproc-per-node 2 -m dsv4cp.cli.main check-cp --backend nccl "$@" 2>&1 | grep -v -e "^W1130" -e "OMP_NUM_THREADS" -e "^\*\*\*" ; echo "exit=${PIPESTATUS[0]}"; }
{
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
common="--preset flash --tokens 16384 --packing histogram --dtype bf16"
run $common --ratio 0 --overlap async
run $common --ratio 4 --overlap async
run $common --ratio 4 --overlap none --loss dense
run $common --ratio 4 --overlap async --recompute
run $common --ratio 128 --overlap async
run --preset flash --tokens 16384 --packing one --dtype bf16 --ratio 4 --overlap async
run --preset flash --tokens 16384 --packing one --dtype bf16 --ratio 128 --overlap none
} 2>&1 | tee "$out/check_cp.txt"
