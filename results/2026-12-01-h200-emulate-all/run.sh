#!/usr/bin/env bash
# One H200, after the kernel-options registry / one-step / cost-model refactor: the GPU test suite and the
# flash C layer at 64K (figures to set beside results/2026-12-01-h200-radix-topk-glue), then every rank of CP 4 and CP 8
# emulated in turn on the one GPU (`profile --emulate-rank all`: compute and memory only, no communication) with
# equal, balanced and measured splits, and a sample of CP 64 ranks at 1M tokens.
# Parts, run in this order (the optional backends of ../gpu_env.sh installed):
#   DSV4CP_GIT_SHA=<commit> bash results/2026-12-01-h200-emulate-all/run.sh tests $OUT
#   DSV4CP_GIT_SHA=<commit> bash results/2026-12-01-h200-emulate-all/run.sh one-document $OUT
#   DSV4CP_GIT_SHA=<commit> bash results/2026-12-01-h200-emulate-all/run.sh more $OUT
# tests: `dsv4cp env`, the whole GPU test suite, and the flash C layer (64K tokens, one document, fwd+bwd, bf16)
#   with `auto` and with Triton only. one-document: one 256K document on cp 8 (equal, balanced, measured) and one
#   128K document on cp 4 (measured). more: histogram packing at 256K on cp 8 (equal, measured) and ranks 0, 31, 63
#   of cp 64 at 1M tokens (equal, balanced). The balanced and measured splits start from the committed H200
#   calibration (results/baselines/h200/calibration.json).
# Outputs under this folder, archived into $OUT/<part>.tar.gz after every step.
set -uo pipefail
part=$1; out=${2:-.}
day=results/2026-12-01-h200-emulate-all
source results/gpu_env.sh  # PYTHONPATH, NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
save() { tar czf "$out/$part.tar.gz" "$day"; }
mkdir -p "$day"
cal=results/baselines/h200/calibration.json
flash="--preset flash --ratio 4 --backward --dtype bf16 --progress off"
emulate() {  # emulate CP TOKENS PACKING PARTITION [more flags]: every rank in turn, into $day/<packing's run>
  local cp=$1 tokens=$2 packing=$3 partition=$4; shift 4
  local run=$day/$([ "$packing" = one ] && echo one-document || echo "$packing")
  local extra=(); [ "$partition" != equal ] && extra=(--calibration "$cal")
  [ "$partition" = measured ] && extra+=(--save-split "$day/split-cp$cp-$tokens-$packing.json"
                                         --save-calibration "$day/calibration-cp$cp-$tokens-$packing.json")
  echo "\$ python3 -m dsv4cp.cli.main profile $flash --tokens $tokens --packing $packing --warmup 1 --reps 4 --kernel-backend auto --cp $cp --emulate-rank all --partition $partition ${extra[*]} $* --out $run"
  local start=$(date +%s)
  timeout 400 python3 -m dsv4cp.cli.main profile $flash --tokens "$tokens" --packing "$packing" --warmup 1 --reps 4 \
    --kernel-backend auto --cp "$cp" --emulate-rank all --partition "$partition" "${extra[@]}" "$@" \
    --out "$run" 2>&1 | quiet
  echo "(took $(( $(date +%s) - start )) s)"
}
case $part in
  tests)
    python3 -m dsv4cp.cli.main env --device cuda > "$day/env.txt" 2>&1
    timeout 330 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rfE > "$day/gpu_tests.txt" 2>&1
    tail -3 "$day/gpu_tests.txt"; save
    for kb in auto triton; do
      echo "\$ python3 -m dsv4cp.cli.main profile $flash --tokens 65536 --packing one --warmup 2 --reps 6 --kernel-backend $kb --out $day/layer"
      timeout 100 python3 -m dsv4cp.cli.main profile $flash --tokens 65536 --packing one --warmup 2 --reps 6 \
        --kernel-backend $kb --out "$day/layer" 2>&1 | quiet
    done 2>&1 | tee "$day/layer.txt"; save ;;
  one-document)
    { for partition in equal balanced measured; do emulate 8 262144 one $partition; done
      emulate 4 131072 one measured
    } 2>&1 | tee "$day/one-document.txt"; save ;;
  more)
    { for partition in equal measured; do emulate 8 262144 histogram $partition; done
      for partition in equal balanced; do
        echo "\$ python3 -m dsv4cp.cli.main profile $flash --tokens 1048576 --packing one --warmup 1 --reps 3 --kernel-backend auto --cp 64 --emulate-rank 0,31,63 --partition $partition --out $day/cp64"
        timeout 200 python3 -m dsv4cp.cli.main profile $flash --tokens 1048576 --packing one --warmup 1 --reps 3 \
          --kernel-backend auto --cp 64 --emulate-rank 0,31,63 --partition $partition \
          $([ $partition = balanced ] && echo --calibration $cal) --out "$day/cp64" 2>&1 | quiet
      done
    } 2>&1 | tee "$day/more.txt"; save ;;
esac
ls -la "$out"
