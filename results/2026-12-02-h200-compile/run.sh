#!/usr/bin/env bash
# One H200: the flash C layer (64K tokens, forward + backward, bf16) eager and under torch.compile (Inductor),
# with the sparse-attention backends "auto" and "triton": step time, the compiling first step's time and the
# graph breaks (profile --compile); then the compiled layer against the eager one with the place of every
# graph break (check-cp --cp 1 --compile inductor, 4K tokens). About 4 minutes.
# Device calls (wheels as in ../2026-12-01-h200-emulate-all: .whl, .whl3, then this call carrying .whl2):
#   DSV4CP_GIT_SHA=<commit> bash results/2026-12-02-h200-compile/run.sh $OUT
# Outputs under this folder, packed into $OUT/compile.tar.gz; unpack from the repository root.
set -uo pipefail
out=${1:-.}
day=results/2026-12-02-h200-compile
source results/gpu_env.sh  # the wheels, PYTHONPATH, DSV4CP_GIT_SHA, quiet()
mkdir -p "$day"
flash="--preset flash --ratio 4 --tokens 65536 --packing one --backward --dtype bf16 --warmup 2 --reps 5 --progress off"
check="--cp 1 --dist-backend nccl --preset flash --ratio 4 --lengths 2500,0,1596 --dtype bf16 --compile inductor"
{
  for backend in auto triton; do
    for mode in "" "--compile"; do
      echo "\$ python3 -m dsv4cp.cli.main profile $flash --kernel-backend $backend $mode --out $day/profile"
      timeout 170 python3 -m dsv4cp.cli.main profile $flash --kernel-backend $backend $mode --out "$day/profile" \
        2>&1 | quiet | tail -25; echo "(exit ${PIPESTATUS[0]})"
    done
  done
  echo "\$ torchrun --nproc-per-node 1 -m dsv4cp.cli.main check-cp $check --kernel-backend auto"
  timeout 150 torchrun --nproc-per-node 1 -m dsv4cp.cli.main check-cp $check --kernel-backend auto \
    2>&1 | quiet | tail -30; echo "(exit ${PIPESTATUS[0]})"
} 2>&1 | tee "$day/run.txt"
tar czf "$out/compile.tar.gz" "$day"
