#!/usr/bin/env bash
# One H200 without the optional backends (so `auto` resolves to the Triton kernels: the record's `backends`
# says so): the cost-growth sweep, profiled, archived. Then, on any machine, the report:
#   on the H200: DSV4CP_GIT_SHA=<commit> bash results/2026-12-01-h200-cost-growth/run.sh $OUT
#   anywhere:    dsv4cp report results/2026-12-01-h200-cost-growth/run --out results/2026-12-01-h200-cost-growth/report
set -uo pipefail
out=${1:-.}
day=results/2026-12-01-h200-cost-growth
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 DSV4CP_GIT_SHA=${DSV4CP_GIT_SHA:-}
timeout 280 python3 -m dsv4cp.cli.main sweep sweeps/cost_growth.yaml --out "$day/run" --profile --progress off 2>&1 \
  | grep -v -e UserWarning -e "return Variable" | tee "$day/sweep.txt"
gzip -f "$day"/run/traces/*/rank*.json 2>/dev/null
tar czf "$out/cost_growth.tar.gz" "$day"
