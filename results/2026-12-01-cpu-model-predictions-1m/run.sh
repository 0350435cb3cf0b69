#!/usr/bin/env bash
# Cost-model predictions (no measurement) for the flash C layer at 1M tokens on cp 16 and 64, one document and
# histogram packing: equal against balanced splits, on the model's bounds and on the committed H200 calibration
# (fitted on h200x2 ceilings, so it applies at NVLink bandwidth only), and on the bounds at inter-node (40 GB/s)
# bandwidth. CPU only, seconds. From the repository root:
#   bash results/2026-12-01-cpu-model-predictions-1m/run.sh > results/2026-12-01-cpu-model-predictions-1m/model.txt
set -euo pipefail
cal=results/baselines/h200/calibration.json
for packing in one histogram; do
  for cp in 16 64; do
    for machine in h200x2 internode; do
      calibrations=("")
      [ $machine = h200x2 ] && calibrations+=("--calibration $cal")
      for calibration in "${calibrations[@]}"; do
        echo "\$ dsv4cp model --preset flash --ratio 4 --tokens 1048576 --cp $cp --packing $packing --partition balanced --align 8 --machine $machine $calibration"
        python -m dsv4cp.cli.main model --preset flash --ratio 4 --tokens 1048576 --cp $cp --packing $packing \
            --partition balanced --align 8 --machine $machine $calibration | grep -A5 -E "^ *partition|^fwd\+bwd"
        echo
      done
    done
  done
done
