#!/usr/bin/env bash
# CPU gloo check of the cost-balanced row split: per-rank CPU time of a tiny C layer (ratio 4,
# 8K tokens, fwd+bwd, fp32) at cp 4 and 8, one document and histogram packing, equal vs balanced,
# beside the model's predicted max/mean. The balanced split uses a CPU calibration fitted from the
# per-phase CPU times of a CP = 1 run of the same layer and batch (one document).
#   bash results/2026-12-01-cpu-balanced-partition/run.sh [OUT_DIR]     (about 5-10 minutes on 2 cores)
# SCANS="visible prefix" fits the second calibration on the prefix scan (../2026-12-01-cpu-partition-prefix-topk).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."  # the repository root: python -m bench.cpu_partition
out=${1:-$here}
tokens=${TOKENS:-8192}
read -r -a scans <<< "${SCANS:-visible all}"
mkdir -p "$out"
# fixed CPU ceilings for every step (the cpu preset re-measures on each call)
python -c "import dataclasses, json; from dsv4cp.model.machine import measure_host; \
m = dataclasses.asdict(measure_host()); m.pop('name'); print(json.dumps(m))" > "$out/machine-cpu.json"
python -m bench.cpu_partition --phases-out "$out/phases-cp1.csv" --tokens "$tokens" --reps 2 > "$out/phases-cp1.txt"
# two fits of the same phases: the model's indexer count (visible) and what the torch reference
# top-k really scans on CPU (all: every entry of the gathered buffer, masked; prefix since it learnt
# key_row_limit)
for scan in "${scans[@]}"; do
  python -m dsv4cp.cli.main model --preset tiny --ratio 4 --tokens "$tokens" --cp 1 \
    --machine-file "$out/machine-cpu.json" --calibrate "$out/phases-cp1.csv" --indexer-scan $scan \
    --calibration-out "$out/calibration-cpu-$scan.json" | tee "$out/calibration-cpu-$scan.txt"
done
calibrations=()
for scan in "${scans[@]}"; do calibrations+=(--calibration "$out/calibration-cpu-$scan.json"); done
python -m bench.cpu_partition "${calibrations[@]}" \
  --machine-file "$out/machine-cpu.json" --tokens "$tokens" --cps 4,8 --reps 2 --out "$out/partition-cpu.csv" \
  | tee "$out/partition-cpu.txt"
# the H200 calibration against the committed CP = 2 per-rank phase times (reads committed files; seconds)
python -m bench.calibration_check --calibration results/baselines/h200/calibration.json \
  --one-document-phases results/2026-12-01-h200x2-cp2-after-fixes/overlap_async.csv \
  --histogram-records results/runs/h200x2-overlap/records.jsonl > "$out/h200_check.txt"
