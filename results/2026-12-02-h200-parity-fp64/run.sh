#!/usr/bin/env bash
# One H200: the bf16 layer with every default kernel (kernel backend auto, no --kernel-option) against the
# fp64 reference layer at full size (check-cp, docs/design.md §6.3), CP = 1 on the real GPU:
#   flash (C layer, ratio 4) at 16K, 32K and 64K tokens and pro at 16K and 32K tokens, each with one
#   document, the histogram packing and the adversarial packing (15 checks), then the GPU parity test.
# Left out: pro at 64K (the fp64 reference alone needs about 195 GiB, more than the GPU holds), and CP > 1
# (the parity check needs every real rank; one GPU can only emulate the other ranks).
# About 7 minutes for the 15 checks (22-40 s each, measured on one H200), then the GPU test (three flash
# 16K checks in one process, not timed yet).
# Each check writes its output to check-cp-<preset>-<tokens>-<packing>.txt; summary.txt lists the exit codes
# (0 every quantity within its tolerance, 1 one missed it, 2 bad input, 3 would not fit).
# Usage, from the repository root on a machine with torch (CUDA) and triton:
#   bash results/2026-12-02-h200-parity-fp64/run.sh
set -uo pipefail
dir=results/2026-12-02-h200-parity-fp64
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$dir"
: > "$dir/summary.txt"
python3 -m dsv4cp.cli.main env --device cuda > "$dir/env.txt" 2>&1
for shape in flash:16384 flash:32768 flash:65536 pro:16384 pro:32768; do
  preset=${shape%%:*} tokens=${shape##*:}
  for packing in one histogram adversarial; do
    name=check-cp-$preset-$tokens-$packing
    argv=(check-cp --cp 1 --dist-backend nccl --preset "$preset" --ratio 4 --tokens "$tokens" --packing "$packing"
          --dtype bf16)
    start=$SECONDS
    { echo "\$ python3 -m dsv4cp.cli.main ${argv[*]}"; timeout 300 python3 -m dsv4cp.cli.main "${argv[@]}"; } \
      > "$dir/$name.txt" 2>&1
    rc=$?
    echo "$name rc=$rc $((SECONDS - start)) s" | tee -a "$dir/summary.txt"
  done
done
start=$SECONDS
timeout 600 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/harness/test_parity.py > "$dir/gpu-test.txt" 2>&1
echo "gpu-test rc=$? $((SECONDS - start)) s" | tee -a "$dir/summary.txt"
