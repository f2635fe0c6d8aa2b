# shellcheck shell=bash
# Shared by launch/train.sh and launch/multinode.sh (sourced, not run).

# GPUs this process may use: nvidia-smi's, narrowed to CUDA_VISIBLE_DEVICES when it is set (each
# rank takes cuda:LOCAL_RANK among those). CUDA stops reading the list at an empty or negative entry.
visible_gpus() {
  local gpus=0 listed=0 entry entries
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU ' || true)  # not its MIG devices' lines
  fi
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    IFS=, read -ra entries <<<"$CUDA_VISIBLE_DEVICES"
    for entry in "${entries[@]}"; do
      if [ -z "$entry" ] || [[ $entry == -* ]]; then break; fi
      listed=$((listed + 1))
    done
    gpus=$((listed < gpus ? listed : gpus))
  fi
  echo "$gpus"
}

# Processes per node: $NPROC_PER_NODE, else one per visible GPU, else 1 (CPU).
procs_per_node() {
  local gpus
  gpus=$(visible_gpus)
  echo "${NPROC_PER_NODE:-$((gpus > 0 ? gpus : 1))}"
}

# Preemption: torchrun (torch >= 2.9) forwards SIGUSR1 (SLURM's --signal) as well as SIGTERM to the
# workers, which finish their step, save a checkpoint and exit. TORCH_ELASTIC_SHUTDOWN_TIMEOUT is
# how long torchrun waits for that before it kills them: 600 s here, where torch reads it (releases
# from 2026 on; older ones wait 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}
# shellcheck disable=SC2034  # used by the scripts that source this file
PREEMPTION_FLAGS=(--signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
