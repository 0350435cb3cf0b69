#!/usr/bin/env bash
# The predicted CP = 2 step (each rank's traced compute + the modelled communication, dsv4cp predict) against the
# committed real 2 x H200 measurements it is composed from (same run, same commit: results/runs/h200x2-overlap, the
# only 2-GPU run whose records hold per-rank traced phases). CPU only, seconds. From the repository root:
#   bash results/2026-12-01-step-prediction/run.sh > results/2026-12-01-step-prediction/predict.txt
set -euo pipefail
echo "\$ dsv4cp predict results/runs/h200x2-overlap --machine h200x2 --csv results/2026-12-01-step-prediction/predict.csv"
python -m dsv4cp.cli.main predict results/runs/h200x2-overlap --machine h200x2 --csv results/2026-12-01-step-prediction/predict.csv
