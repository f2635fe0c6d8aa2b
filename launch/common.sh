# shellcheck shell=bash
# Shared by launch/train.sh and launch/multinode.sh (sourced, not run).

# Processes per node: $NPROC_PER_NODE, else one per visible GPU, else 1 (CPU).
procs_per_node() {
  local gpus=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
  fi
  echo "${NPROC_PER_NODE:-$((gpus > 0 ? gpus : 1))}"
}
