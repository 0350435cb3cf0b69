#!/usr/bin/env bash
# One H200, one job, two parts:
#   parity: check-cp of the bf16 layer with every default kernel (kernel backend auto, no --kernel-option)
#           against the fp64 reference layer at full size, CP = 1 on the real GPU (docs/design.md §6.3);
#   ab:     the flash C layer (64K tokens, one document, fwd+bwd, bf16, Triton kernels) timed at the commit
#           before the harness and kernel-options refactor (ef7b22e, its package in $OLD) and at this commit,
#           interleaved (old, new-prev-bwd, new; twice) in one job. `new-prev-bwd` is this commit with the
#           previous Triton backward (triton_bwd_dq_pass=0), the kernels `old` runs: old against it is the
#           refactor alone, it against `new` the backward's separate dq pass.
# No library backend is installed on the machine, so `auto` runs the Triton kernels there.
# Each command's output goes to its own file beside this script; summary.txt lists exit codes and seconds.
# A part stops launching commands once the job has run $BUDGET_S seconds (default 540).
# Usage, from the repository root: OLD=<folder holding ef7b22e's dsv4cp/> bash THIS_SCRIPT OUT
set -uo pipefail
out=${1:-.}; old=${OLD:?the folder holding the older package}; budget=${BUDGET_S:-540}
dir=results/2026-12-02-h200-layer-ab-fp64-parity
mkdir -p "$dir"; : > "$dir/summary.txt"
export PYTHONUNBUFFERED=1
save() { tar czf "$out/results.tar.gz" "$dir"; }
run() {  # run NAME TREE LIMIT ARGV...: one dsv4cp command in TREE, its output in NAME.txt
  local name=$1 tree=$2 limit=$3; shift 3
  if [ "$SECONDS" -ge "$budget" ]; then echo "$name not run (job budget)" >> "$dir/summary.txt"; return; fi
  local start=$SECONDS
  { echo "\$ (cd $tree && python3 -m dsv4cp.cli.main $*)"
    (cd "$tree" && timeout "$limit" python3 -m dsv4cp.cli.main "$@"); } > "$dir/$name.txt" 2>&1
  echo "$name rc=$? $((SECONDS - start)) s" | tee -a "$dir/summary.txt"; save
}
python3 -m dsv4cp.cli.main env --device cuda > "$dir/env.txt" 2>&1
check() { run "check-cp-$1-$2-$3" . 200 check-cp --cp 1 --dist-backend nccl --preset "$1" --ratio 4 --tokens "$2" \
            --packing "$3" --dtype bf16; }
layer() { run "layer-round$1-$2" "$3" 200 layer --preset flash --ratio 4 --tokens 65536 --backward --dtype bf16 \
            --kernel-backend triton --warmup 3 --reps 10 --device cuda --progress off "${@:4}"; }
check flash 16384 one; check flash 65536 one
for round in 1 2; do
  layer "$round" old "$old"; layer "$round" new-prev-bwd . --kernel-option triton_bwd_dq_pass=0; layer "$round" new .
done
check flash 65536 histogram; check flash 65536 adversarial; check flash 16384 histogram; check flash 16384 adversarial
check pro 16384 one; check flash 32768 one; check pro 16384 histogram
