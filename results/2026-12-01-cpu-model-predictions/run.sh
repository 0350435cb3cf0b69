#!/usr/bin/env bash
# Cost-model predictions (no measurement) for the flash C and H layers at 64K tokens, cp 2..64, one
# document and histogram packing, equal vs balanced split, on the h200x2 ceilings. CPU only, seconds.
# From the repository root:  bash results/2026-12-01-cpu-model-predictions/run.sh > results/2026-12-01-cpu-model-predictions/model.txt
set -euo pipefail
for ratio in 4 128; do
  for packing in one histogram; do
    for cp in 2 4 8 16 64; do
      echo "\$ dsv4cp model --preset flash --ratio $ratio --tokens 65536 --cp $cp --packing $packing --partition balanced --align 8"
      python -m dsv4cp.cli.main model --preset flash --ratio $ratio --tokens 65536 --cp $cp --packing $packing \
          --partition balanced --align 8
      echo
    done
  done
done
