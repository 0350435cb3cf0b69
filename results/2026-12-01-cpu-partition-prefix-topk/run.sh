#!/usr/bin/env bash
# CPU gloo check of the cost-balanced row split, re-run after the torch top-k learnt to score only
# each chunk's causal prefix (key_row_limit): the run of ../2026-12-01-cpu-balanced-partition (tiny C layer,
# ratio 4, 8K tokens, fwd+bwd, fp32, cp 4 and 8, one document and histogram packing, equal vs balanced
# beside the model's predicted max/mean), with the second calibration fitted on the prefix scan the
# torch top-k now does instead of the whole buffer.
#   bash results/2026-12-01-cpu-partition-prefix-topk/run.sh [OUT_DIR]     (about 5-10 minutes on 2 cores)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
SCANS="visible prefix" bash "$here/../2026-12-01-cpu-balanced-partition/run.sh" "$out"
cd "$here/../.."  # the repository root: python -m bench.*
# every rank's share of the mean, measured beside the prefix-fit model
python -m bench.partition_shares --table "$out/partition-cpu.csv" --machine-file "$out/machine-cpu.json" \
  --calibration "$out/calibration-cpu-prefix.json" > "$out/per_rank.txt"
