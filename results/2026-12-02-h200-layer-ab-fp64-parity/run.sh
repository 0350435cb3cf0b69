#!/usr/bin/env bash
# One H200: the flash C layer (64K tokens, one document, fwd+bwd, bf16) timed at the commit before the
# harness and kernel-options refactor (ef7b22e, its package in OLD) and at this commit, interleaved
# (A B A B ...) in one job, with the Triton kernels only (no library package on the machine);
# `new-prev-bwd` is this commit with the previous Triton backward
# (triton_bwd_dq_pass=0): the same kernels as `old`, so old against it isolates the refactor, and it
# against `new` the backward's dq pass. Then check-cp of the bf16 layer against the fp64 layer at full size.
# Usage: OLD=<folder holding ef7b22e's dsv4cp/> bash results/2026-12-02-h200-layer-ab-fp64-parity/run.sh OUT
set -uo pipefail
out=${1:-.}; old=${OLD:?the folder holding the older package}
dir=results/2026-12-02-h200-layer-ab-fp64-parity
mkdir -p "$dir"
export PYTHONUNBUFFERED=1
layer() {  # layer TREE BACKEND [OPTION...]: one timed layer step set (3 warm-up, 10 timed)
  local tree=$1 backend=$2; shift 2
  (cd "$tree" && timeout 200 python3 -m dsv4cp.cli.main layer --preset flash --ratio 4 --tokens 65536 --backward \
     --dtype bf16 --kernel-backend "$backend" --warmup 3 --reps 10 --device cuda --progress off "$@" 2>&1 | tail -4)
}
{ python3 -m dsv4cp.cli.main env --device cuda 2>&1 | head -30; } > "$dir/env.txt"
for round in 1 2; do
  for backend in triton; do
    echo "== round $round, $backend, old"; layer "$old" "$backend"
    echo "== round $round, $backend, new-prev-bwd"; layer "$PWD" "$backend" --kernel-option triton_bwd_dq_pass=0
    echo "== round $round, $backend, new"; layer "$PWD" "$backend"
  done
done 2>&1 | tee "$dir/layer_ab.txt"
cp "$dir"/*.txt "$out"/ 2>/dev/null
