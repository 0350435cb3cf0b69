#!/usr/bin/env bash
# Per-rank compute time and peak memory of the flash C layer (64K tokens, one document, fwd+bwd, bf16) at
# CP = 2 on ONE H200: each rank is emulated alone (`dsv4cp profile --cp 2 --emulate-rank R`, torch's
# fake process group; collectives are no-ops, so communication is NOT measured), under
# `--partition equal` and `--partition balanced` (and balanced with the measured H200 calibration when
# `profile` has `--calibration`), against a real CP = 1 profile. About 3 minutes. From the repository
# root, with nvtx and sgl-flash-mla installed:
#   bash results/2026-12-01-h200-cp2-emulated/run.sh $OUT
# Everything is written under results/2026-12-01-h200-cp2-emulated/ (or DSV4CP_EMULATE_DIR) and archived into $OUT/emulated.tar.gz.
# summary.txt holds the per-rank table.
set -uo pipefail
out=${1:-.}
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
here=results/2026-12-01-h200-cp2-emulated
day=${DSV4CP_EMULATE_DIR:-$here}  # where the outputs go (a later run writes beside its own results)
mkdir -p "$day"
# DSV4CP_EMULATE_LAYER replaces the layer flags (a CPU smoke run of this script uses a tiny layer)
layer=${DSV4CP_EMULATE_LAYER:-"--preset flash --ratio 4 --tokens 65536 --packing one --dtype bf16 --kernel-backend auto"}
common="$layer --backward --warmup 2 --reps 6 --memory-phases --progress off"
calibration=results/baselines/h200/calibration.json
# DSV4CP_CALIBRATE_FROM=TRACE_DIR: refit the calibration from a CP = 1 trace of the same layer measured just
# before (the kernels under test, e.g. a new top-k, change the per-phase factors) and balance on that
if [ -n "${DSV4CP_CALIBRATE_FROM:-}" ]; then
  calibration=$day/calibration.json
  python3 -m dsv4cp.cli.main model --cp 1 --calibrate "$DSV4CP_CALIBRATE_FROM" --indexer-scan prefix \
      --calibration-out "$calibration" 2>&1 | tee "$day/calibration.txt"
fi
profile() {  # profile OUT_DIR FLAGS...: one profile, its command echoed, appended to OUT_DIR/records.jsonl
  local dir=$1; shift
  echo "\$ python3 -m dsv4cp.cli.main profile $common $* --out $dir"
  timeout 150 python3 -m dsv4cp.cli.main profile $common "$@" --out "$dir" 2>&1 | quiet
}
{
  profile "$day/cp1"
  for partition in equal balanced; do
    for rank in 0 1; do
      profile "$day/$partition" --cp 2 --emulate-rank $rank --partition $partition
    done
  done
  if python3 -m dsv4cp.cli.main profile --help | grep -q -e "--calibration" && [ -f "$calibration" ]; then
    for rank in 0 1; do
      profile "$day/balanced-calibrated" --cp 2 --emulate-rank $rank --partition balanced --calibration "$calibration"
    done
  else
    echo "profile has no --calibration option (or $calibration is missing): balanced-calibrated skipped"
  fi
} 2>&1 | tee "$day/profile.txt"
runs=("equal=$day/equal" "balanced=$day/balanced")
[ -d "$day/balanced-calibrated" ] && runs+=("balanced-calibrated=$day/balanced-calibrated")
python3 -m bench.emulated_summary "$day/cp1" "${runs[@]}" 2>&1 | tee "$day/summary.txt"
tar czf "$out/emulated.tar.gz" "$day"
ls -la "$out"
