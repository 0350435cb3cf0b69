#!/usr/bin/env bash
# One H200: the GPU tests and the flash C layer at 64K after the kernel-options / one-step refactor (the figures
# must match results/2026-12-01-h200-speed4), and every rank of CP 4 and CP 8 emulated in turn on the one GPU
# (`profile --emulate-rank all`: compute and memory only, no communication).
# Device calls made back to back (the machine stays warm 30 s); wheels from ../shared/gpu/fetch_wheels.sh,
# regrouped so every call stays under the 64 MiB carry limit (.whl: the cuDNN CuTe DSL's first part; .whl3:
# FlashMLA, nvtx, the small CuTe DSL wheels; .whl2: the DSL's second part and the cuDNN frontend):
#   call 1, carrying .whl  : mkdir -p $HOME/wheels && cp .whl/* $HOME/wheels/
#   call 2, carrying .whl3 : mkdir -p $HOME/wheels && cp .whl3/* $HOME/wheels/
#   call 3, carrying .whl2 : DSV4CP_GIT_SHA=<commit> bash results/2026-12-01-h200-emulate-all/run.sh tests $OUT
#   call 4                 : DSV4CP_GIT_SHA=<commit> bash results/2026-12-01-h200-emulate-all/run.sh measure $OUT
# tests: the whole GPU test suite. measure: the flash C layer, 64K tokens, one document, fwd+bwd, bf16 with `auto`
#   and with Triton only (as speed4 measured it), then CP 4 / 128K and CP 8 / 256K (one document) with every rank
#   emulated, equal and balanced splits.
# Outputs under this folder, packed into $OUT/<part>.tar.gz after every step; unpack from the repository root.
set -uo pipefail
part=$1; out=${2:-.}
day=results/2026-12-01-h200-emulate-all
source results/gpu_env.sh  # the wheels, PYTHONPATH, DSV4CP_GIT_SHA, quiet()
save() { tar czf "$out/$part.tar.gz" "$day"; }
mkdir -p "$day"
common="--preset flash --ratio 4 --packing one --backward --dtype bf16 --progress off"
case $part in
  tests)
    python3 -m dsv4cp.cli.main env --device cuda > "$day/env.txt" 2>&1
    timeout 420 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rfE > "$day/gpu_tests.txt" 2>&1
    tail -3 "$day/gpu_tests.txt"; save ;;
  measure)
    for kb in auto triton; do
      echo "\$ python3 -m dsv4cp.cli.main profile $common --tokens 65536 --warmup 2 --reps 6 --kernel-backend $kb --out $day/layer"
      timeout 100 python3 -m dsv4cp.cli.main profile $common --tokens 65536 --warmup 2 --reps 6 --kernel-backend $kb \
        --out "$day/layer" 2>&1 | quiet
    done 2>&1 | tee "$day/layer.txt"; save
    for case in "4 131072" "8 262144"; do
      set -- $case
      for partition in equal balanced; do
        echo "\$ python3 -m dsv4cp.cli.main profile $common --tokens $2 --warmup 1 --reps 4 --kernel-backend auto --cp $1 --emulate-rank all --partition $partition --out $day/emulated"
        timeout 200 python3 -m dsv4cp.cli.main profile $common --tokens "$2" --warmup 1 --reps 4 --kernel-backend auto \
          --cp "$1" --emulate-rank all --partition "$partition" --out "$day/emulated" 2>&1 | quiet
      done
    done 2>&1 | tee "$day/emulated.txt"; save ;;
esac
ls -la "$out"
