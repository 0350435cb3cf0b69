#!/usr/bin/env bash
# The balanced split refined on the model's own per-rank evaluation (dsv4cp.model.partition.refine_split,
# which sees the padding of the gathered slots to the largest rank) against equal slices and the per-row
# balanced split, measured in the same run as run.sh measures: tiny C layer, 8K tokens, fwd+bwd, fp32,
# cp 4 and 8, one document and histogram packing, the CPU calibration fitted on the prefix scan.
# Reuses run.sh's machine-cpu.json and calibration-cpu-prefix.json (run run.sh first).
#   bash results/2026-12-01-cpu-partition-prefix-topk/refined.sh [OUT_DIR]     (about 5 minutes on 2 cores)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."  # the repository root: python -m bench.cpu_partition
out=${1:-$here}
tokens=${TOKENS:-8192}
mkdir -p "$out"
python -m bench.cpu_partition --calibration "$here/calibration-cpu-prefix.json" --machine-file "$here/machine-cpu.json" \
  --policies equal,balanced,refined --tokens "$tokens" --cps 4,8 --reps 2 --out "$out/refined-cpu.csv" \
  | tee "$out/refined-cpu.txt"
