#!/usr/bin/env bash
# The 2 x H200 measurements of 2026-12-01, in two parts. From the repository root, with nvtx and
# sgl-flash-mla installed:
#   bash results/2026-12-01-h200x2-cp2-after-fixes/run.sh a $OUT   # CP parity; overlap none vs async (traces); overlap sweep
#   bash results/2026-12-01-h200x2-cp2-after-fixes/run.sh b $OUT   # strong scaling, packing and partition sweeps
# Everything is written under the repository and archived into $OUT/part-<a|b>.tar.gz.
set -uo pipefail
part=$1; out=${2:-.}
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
day=results/2026-12-01-h200x2-cp2-after-fixes
tr="torchrun --nproc-per-node 2"
case $part in
  a)
    {
      for partition in equal balanced; do
        cmd="check-cp --dist-backend nccl --preset flash --ratio 4 --tokens 16384 --packing histogram --dtype bf16 --partition $partition"
        echo "\$ $tr -m dsv4cp.cli.main $cmd"; timeout 120 $tr -m dsv4cp.cli.main $cmd 2>&1 | quiet
      done
    } | tee "$day/check_cp.txt"
    common="--dist-backend nccl --preset flash --ratio 4 --tokens 65536 --packing one --backward --dtype bf16 --warmup 2 --reps 8 --progress off"
    {
      for ov in none async; do
        echo "\$ $tr -m dsv4cp.cli.main profile $common --overlap $ov --trace-dir $day/trace_$ov --trace-steps 1 --out $day/profile"
        timeout 150 $tr -m dsv4cp.cli.main profile $common --overlap $ov --trace-dir "$day/trace_$ov" --trace-steps 1 \
            --out "$day/profile" 2>&1 | quiet
        cp "$day/trace_$ov/overlap.csv" "$day/overlap_$ov.csv"
      done
    } | tee "$day/profile.txt"
    gzip -c "$day/trace_async/rank0.json" > "$day/trace_async_rank0.json.gz"
    gzip -c "$day/trace_async/rank1.json" > "$day/trace_async_rank1.json.gz"
    rm -rf "$day/trace_none" "$day/trace_async"
    timeout 240 $tr -m dsv4cp sweep sweeps/overlap.yaml --out results/runs/h200x2-overlap --profile --progress off \
        2>&1 | quiet | tee "$day/sweep_overlap.txt"
    rm -rf results/runs/h200x2-overlap/traces
    tar czf "$out/part-a.tar.gz" "$day" results/runs/h200x2-overlap ;;
  b)
    for spec in cp_scaling packing partition; do
      timeout 200 $tr -m dsv4cp sweep sweeps/$spec.yaml --out results/runs/h200x2-$spec --progress off \
          2>&1 | quiet | tee "$day/sweep_$spec.txt"
    done
    tar czf "$out/part-b.tar.gz" "$day"/sweep_*.txt results/runs/h200x2-cp_scaling results/runs/h200x2-packing \
        results/runs/h200x2-partition ;;
esac
ls -la "$out"
