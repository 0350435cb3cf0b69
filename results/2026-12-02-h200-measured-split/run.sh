#!/usr/bin/env bash
# One H200: the measured split with per-rank factors in its refit (the refit fits one factor per rank on
# what no phase class expresses, and the balanced split weighs each rank by it), every rank of CP 8 emulated
# in turn on the one GPU (`profile --emulate-rank all`: compute and memory only, no communication). To set
# beside results/2026-12-01-h200-emulate-all (same points, same prior calibration, same flags but --reps 8
# instead of 4: there the rounds' max/mean moved by ~0.005 between runs of one split, which more timed steps
# per rank narrow):
#   one 256K document, cp 8, measured (at most 4 rounds): last time 1.094 -> 1.036 -> 1.034 -> 1.029, best
#     (slowest rank) 150.7 ms = 1.034; target max/mean <= 1.03.
#   histogram packing, 256K, cp 8, measured (at most 4 rounds): last time best 111.2 ms = 1.030 (equal 128.3 ms).
# Both start from the committed H200 calibration (results/baselines/h200/calibration.json), so round 0 is the
# balanced split of last time; the rounds, the best split and the refitted calibration (with its per-rank
# factors) are written beside this script.
# With the optional backends of ../gpu_env.sh installed:
#   DSV4CP_GIT_SHA=<commit> [PACKINGS=one] bash results/2026-12-02-h200-measured-split/run.sh $OUT
# (PACKINGS: the points to run, default "one histogram"; on 2026-12-02 only "one" ran)
# Under 8 minutes in all (last time each measured point took ~150 s with --reps 4; 8 reps add ~20 s);
# each point is cut at 220 s. Outputs under this folder, archived into $OUT/measured-split.tar.gz after every
# point. Afterwards, on any machine, the refit's view of the rounds:
#   python -m bench.replay_measured_split results/2026-12-02-h200-measured-split/split-cp8-262144-one.json \
#     --packing one --calibration results/baselines/h200/calibration.json
set -uo pipefail
out=${1:-.}
day=results/2026-12-02-h200-measured-split
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
save() { tar czf "$out/measured-split.tar.gz" "$day"; }
mkdir -p "$day"
cal=results/baselines/h200/calibration.json
flash="--preset flash --ratio 4 --backward --dtype bf16 --progress off"
python3 -m dsv4cp.cli.main env --device cuda > "$day/env.txt" 2>&1
measured() {  # measured PACKING: every rank of cp 8 in turn per round, at most 4 rounds, into $day/<packing's run>
  local packing=$1 run=$day/$([ "$1" = one ] && echo one-document || echo "$1")
  local files=(--save-split "$day/split-cp8-262144-$packing.json"
               --save-calibration "$day/calibration-cp8-262144-$packing.json")
  echo "\$ python3 -m dsv4cp.cli.main profile $flash --tokens 262144 --packing $packing --warmup 1 --reps 8 --kernel-backend auto --cp 8 --emulate-rank all --partition measured --max-rounds 4 --calibration $cal ${files[*]} --out $run"
  local start=$(date +%s)
  timeout 220 python3 -m dsv4cp.cli.main profile $flash --tokens 262144 --packing "$packing" --warmup 1 --reps 8 \
    --kernel-backend auto --cp 8 --emulate-rank all --partition measured --max-rounds 4 --calibration "$cal" \
    "${files[@]}" --out "$run" 2>&1 | quiet
  echo "(took $(( $(date +%s) - start )) s)"
}
{ for packing in ${PACKINGS:-one histogram}; do measured "$packing"; save; done; } 2>&1 | tee -a "$day/measured-split.txt"
save
ls -la "$out"
