#!/usr/bin/env bash
# All GPU measurements of 2026-12-01 on one H200, in two parts. From the repository root, with nvtx and
# sgl-flash-mla installed:
#   bash results/2026-12-01-h200-cp1-after-fixes/run.sh a $OUT    # GPU tests, profile CP = 1, strong-scaling sweep
#   bash results/2026-12-01-h200-cp1-after-fixes/run.sh b $OUT    # kernels and packing sweeps, GPU benchmarks (baselines)
# Everything is written under ./gpu-results/ and archived into $OUT/part-<a|b>.tar.gz.
set -uo pipefail
part=$1; out=${2:-.}
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
day=results/2026-12-01-h200-cp1-after-fixes
mkdir -p "$day"
case $part in
  a)
    bash results/2026-12-01-h200-gpu-tests/run.sh results/2026-12-01-h200-gpu-tests
    python3 -m dsv4cp.cli.main env --device cuda 2>&1 | tee "$day/env.txt"
    common="--preset flash --ratio 4 --tokens 65536 --packing one --backward --dtype bf16 --warmup 2 --reps 8 --progress off"
    {
      for kb in triton auto; do
        echo "\$ python3 -m dsv4cp.cli.main profile $common --kernel-backend $kb --out $day/profile"
        python3 -m dsv4cp.cli.main profile $common --kernel-backend $kb --out "$day/profile" 2>&1 | quiet
      done
      echo "\$ python3 -m dsv4cp.cli.main profile $common --kernel-backend auto --trace-dir $day/trace --trace-steps 1"
      python3 -m dsv4cp.cli.main profile $common --kernel-backend auto --trace-dir "$day/trace" --trace-steps 1 2>&1 | quiet
    } 2>&1 | tee "$day/profile.txt"
    gzip -f "$day"/trace/*.json 2>/dev/null
    timeout 300 torchrun --nproc-per-node 1 -m dsv4cp sweep sweeps/cp_scaling.yaml --out results/runs/h200-cp_scaling \
        --progress off 2>&1 | quiet | tee "$day/sweep_cp_scaling.txt"
    tar czf "$out/part-a.tar.gz" results/2026-12-01-h200-gpu-tests "$day" results/runs/h200-cp_scaling ;;
  b)
    timeout 240 torchrun --nproc-per-node 1 -m dsv4cp sweep sweeps/kernels.yaml --out results/runs/h200-kernels \
        --progress off 2>&1 | quiet | tee "$day/sweep_kernels.txt"
    timeout 180 torchrun --nproc-per-node 1 -m dsv4cp sweep sweeps/packing.yaml --out results/runs/h200-packing \
        --progress off 2>&1 | quiet | tee "$day/sweep_packing.txt"
    mkdir -p results/baselines/h200
    timeout 200 python3 -m pytest bench -m gpu -q -p no:cacheprovider --benchmark-json results/baselines/h200/bench.json \
        --benchmark-columns=median,min,max --benchmark-sort=name 2>&1 | tail -80 > results/baselines/h200/bench.txt
    cp -r results/runs/h200-kernels results/baselines/h200/kernels
    tar czf "$out/part-b.tar.gz" "$day"/sweep_*.txt results/runs/h200-kernels results/runs/h200-packing results/baselines/h200 ;;
esac
ls -la "$out"
