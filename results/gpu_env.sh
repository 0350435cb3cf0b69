# Sourced by the H200 run scripts under results/ (bash): installs the wheels carried to the GPU machine
# once per warm machine, then sets the environment every step runs in.
#   .whl/.whl3 are copied to $HOME/wheels by earlier device calls; .whl2 is carried by the calling one.
#   A wheel split into NAME.part.aa/.ab (the 64 MiB carry limit) is joined first.
wheels=$HOME/wheels
if [ ! -d /tmp/site/cudnn ]; then
  mkdir -p "$wheels"; [ -d .whl2 ] && cp .whl2/* "$wheels"/
  (cd "$wheels" && for first in *.part.aa; do [ -e "$first" ] || continue; base=${first%.part.aa}
     [ -e "$base.part.ab" ] && cat "$base".part.* > "$base" && rm -f "$base".part.*; done
   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ./*.whl)
fi
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export DSV4CP_GIT_SHA=${DSV4CP_GIT_SHA:-}  # pass it from the local checkout: the device's .git is stale
quiet() { grep -v -e "OMP_NUM_THREADS" -e "^\*\*\*" -e "USDT" -e "STAGE:"; }
