#!/usr/bin/env bash
# The predicted CP = 2 step (each rank's traced compute + the modelled communication, dsv4cp predict) against the
# committed real 2 x H200 measurements it is composed from (same run, same commit). The 2-GPU runs whose records
# hold per-rank traced phases: results/runs/h200x2-overlap (histogram packing, C and H layers, overlap none/async,
# with and without recompute) and results/2026-12-01-h200x2-cp2-after-fixes/profile (one 64K document, C layer). The other
# h200x2 runs were not traced, and the 2026-11-30 profiles predate the record schema. CPU only, seconds.
# From the repository root:
#   bash results/2026-12-01-cpu-step-prediction/run.sh > results/2026-12-01-cpu-step-prediction/predict.txt
set -euo pipefail
day=results/2026-12-01-cpu-step-prediction
runs="results/runs/h200x2-overlap results/2026-12-01-h200x2-cp2-after-fixes/profile"
echo "\$ dsv4cp predict $runs --machine h200x2 --csv $day/predict.csv"
python -m dsv4cp.cli.main predict $runs --machine h200x2 --csv "$day/predict.csv"
