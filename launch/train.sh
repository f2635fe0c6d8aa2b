#!/usr/bin/env bash
# Single-node training: one process per GPU, or NPROC_PER_NODE processes on CPU.
#
#   launch/train.sh CONFIG [key=value ...]
#   NPROC_PER_NODE=2 launch/train.sh configs/demo-digits.yaml train.max_steps=10
#
# PYTHON picks the interpreter (default: python3); MAX_RESTARTS lets torchrun restart a failed
# group, which goes on from the run's newest checkpoint whatever checkpoint.resume says (until the
# launch has one there, checkpoint.resume applies as at the start: docs/training.md, Restarts).
# SIGTERM or SIGUSR1 to this process makes the run save a checkpoint after its current step and stop
# (TORCH_ELASTIC_SHUTDOWN_TIMEOUT: see common.sh).
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: $0 CONFIG [key=value ...]" >&2
  exit 2
fi
config=$1
shift

# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"
nproc=$(procs_per_node)

exec "${PYTHON:-python3}" -m torch.distributed.run \
  --standalone --nproc_per_node "$nproc" --max-restarts "${MAX_RESTARTS:-0}" "${PREEMPTION_FLAGS[@]}" \
  -m clip_train train "$config" "$@"
