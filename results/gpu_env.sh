# Sourced by the H200 run scripts under results/ (bash): the environment every step ran in.
# The optional backends these runs measured (sgl-flash-mla 1.0.0, nvidia-cudnn-frontend 1.32 with
# nvidia-cutlass-dsl, nvtx) are installed beforehand, as the README's "Kernel backends" section says;
# a run without them records what `auto` resolved to instead (each record's `backends`).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export DSV4CP_GIT_SHA=${DSV4CP_GIT_SHA:-}  # the commit measured, when the checkout has no .git of its own
quiet() { grep -v -e "OMP_NUM_THREADS" -e "^\*\*\*" -e "USDT" -e "STAGE:"; }
