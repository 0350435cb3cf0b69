#!/usr/bin/env bash
# One H200: the flash C layer (fwd+bwd, bf16) at the step-time targets' points (layer.yaml: triton 64K one
# document; auto 64K one document and histogram, each with the bounded select's old launch beside its new one;
# auto 256K one document) in one sweep, profiled; then each point's phases against their bounds (the spec's
# targets are judged by `dsv4cp report` on the fetched run). `auto` = FlashMLA (sgl-flash-mla 1.0.0) forward + the cuDNN frontend
# (1.32, CuTe DSL 4.8.1, CUDA-12 flavour) backward, installed from wheels: they sit in $HOME/wheels (the
# folders .wa, .wb, .wc copied there by earlier calls with `mkdir -p $HOME/wheels && cp .wX/* $HOME/wheels/`),
# the CUDA-12 CuTe DSL wheel in three parts (`split -b 31M`); this script adds .wd (FlashMLA and the small
# wheels), joins the parts and installs them.
# Run from the repository root: bash results/2026-12-03-h200-layer-targets/run.sh OUT
set -uo pipefail
out=${1:?output folder}
dir=results/2026-12-03-h200-layer-targets
mkdir -p $HOME/wheels && cp .wd/* $HOME/wheels/
( cd $HOME/wheels && cat nvidia_cutlass_dsl_libs_cu12-*.part.* > nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
  && rm -f *.part.* && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site ./*.whl ) 2>&1 | tail -3
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
source results/gpu_env.sh  # PYTHONPATH (the checkout first), NCCL_NVLS_ENABLE=0, DSV4CP_GIT_SHA, quiet()
{ nvidia-smi -L
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import flash_mla, cudnn; print('flash_mla', flash_mla.__file__); print('cudnn', cudnn.__version__)"
} 2>&1 | tee "$out/env.txt"
{ echo "\$ python3 -m dsv4cp.cli.main sweep $dir/layer.yaml --profile --progress off --out $out/sweep"
  timeout 520 python3 -m dsv4cp.cli.main sweep "$dir/layer.yaml" --profile --progress off --out "$out/sweep" 2>&1 \
    | quiet | tail -12
  echo "(exit ${PIPESTATUS[0]})"; } 2>&1 | tee "$out/sweep.txt"
python3 -m bench.phase_vs_bound "$out/sweep" > "$out/phase_vs_bound.txt" 2>&1
cat "$out/phase_vs_bound.txt"

tar czf "$out/sweep.tar.gz" -C "$out" sweep && rm -rf "$out/sweep"
