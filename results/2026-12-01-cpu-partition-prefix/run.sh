#!/usr/bin/env bash
# CPU gloo check of the cost-balanced row split, re-run after the torch top-k learnt to score only
# each chunk's causal prefix (key_row_limit): the run of ../2026-12-01-cpu-partition (tiny C layer,
# ratio 4, 8K tokens, fwd+bwd, fp32, cp 4 and 8, one document and histogram packing, equal vs balanced
# beside the model's predicted max/mean), with the second calibration fitted on the prefix scan the
# torch top-k now does instead of the whole buffer.
#   bash results/2026-12-01-cpu-partition-prefix/run.sh [OUT_DIR]     (about 5-10 minutes on 2 cores)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
SCANS="visible prefix" bash "$here/../2026-12-01-cpu-partition/run.sh" "${1:-$here}"
