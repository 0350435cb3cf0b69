#!/usr/bin/env bash
# One H200: bitwise replay of the flash C layer per backend (dsv4cp check-determinism, CP = 1: one GPU), the
# time and memory cost of determinism (profile --deterministic) and the layer under torch.compile.
# With the optional backends of ../gpu_env.sh installed:
#   DSV4CP_GIT_SHA=<commit> bash results/2026-12-01-h200-determinism/run.sh $OUT
# Outputs under this folder, archived into $OUT/determinism.tar.gz.
set -uo pipefail
out=${1:-.}
day=results/2026-12-01-h200-determinism
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
mkdir -p "$day"
replay="--cp 1 --preset flash --ratio 4 --lengths 8000,4000,4384 --dtype bf16 --replays 3"
flash="--preset flash --ratio 4 --tokens 65536 --packing one --backward --dtype bf16 --warmup 2 --reps 6 --progress off"
{
  for case in "--kernel-backend triton" "--kernel-backend auto" "--kernel-backend triton-deterministic --deterministic"; do
    echo "\$ python3 -m dsv4cp.cli.main check-determinism $replay $case"
    timeout 150 python3 -m dsv4cp.cli.main check-determinism $replay $case 2>&1 | quiet; echo "(exit ${PIPESTATUS[0]})"
  done
  for case in "--kernel-backend auto" "--kernel-backend auto --deterministic" "--kernel-backend triton --deterministic"; do
    echo "\$ python3 -m dsv4cp.cli.main profile $flash $case --out $day/profile"
    timeout 120 python3 -m dsv4cp.cli.main profile $flash $case --out "$day/profile" 2>&1 | quiet
  done
  echo "\$ python3 -m dsv4cp.cli.main profile $flash --kernel-backend auto --compile --out $day/profile"
  timeout 200 python3 -m dsv4cp.cli.main profile $flash --kernel-backend auto --compile --out "$day/profile" 2>&1 | quiet | tail -30
} 2>&1 | tee "$day/run.txt"
tar czf "$out/determinism.tar.gz" "$day"
