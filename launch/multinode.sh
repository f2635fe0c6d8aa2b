#!/usr/bin/env bash
# Multi-node training with torchrun's c10d rendezvous. Run the same command on every node:
#
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<hostname of node 0> launch/multinode.sh CONFIG [key=value ...]
#
# Set on each node:
#   NNODES          number of nodes (required)
#   NODE_RANK       this node's index, 0 on the node at MASTER_ADDR (required)
#   MASTER_ADDR     host that serves the rendezvous, reachable from every node (required)
#   MASTER_PORT     its TCP port (default 29500): give concurrent jobs on one MASTER_ADDR their own
#                   port and RDZV_ID, or they meet at one rendezvous and one's end crashes the other
#   NPROC_PER_NODE  processes per node (default: number of GPUs, or 1 without GPUs)
#   RDZV_ID         a job id shared by all nodes (default: clip_train), its own for each launch
#                   (a date, a job id): required with MAX_RESTARTS
#   MAX_RESTARTS    group restarts torchrun may do after a failure (default 0); a restart goes on
#                   from the newest checkpoint of the run its launch took (recorded by RDZV_ID, which
#                   a default shared by every launch would not tell apart) whatever checkpoint.resume says
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds the workers get to checkpoint after SIGTERM/SIGUSR1 (600)
#   PYTHON          interpreter (default python3)
set -euo pipefail

: "${NNODES:?set NNODES to the number of nodes}"
: "${NODE_RANK:?set NODE_RANK to the index of this node, 0 on MASTER_ADDR}"
: "${MASTER_ADDR:?set MASTER_ADDR to the hostname of node 0}"
if [ $# -lt 1 ]; then
  echo "usage: $0 CONFIG [key=value ...]" >&2
  exit 2
fi
config=$1
shift
if [ "${MAX_RESTARTS:-0}" != 0 ] && [ -z "${RDZV_ID:-}" ]; then
  echo "$0: MAX_RESTARTS needs RDZV_ID, an id all nodes share and no other launch used (a date, a job id)" >&2
  exit 2
fi

# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"
nproc=$(procs_per_node)

exec "${PYTHON:-python3}" -m torch.distributed.run \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$nproc" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
  --rdzv_id "${RDZV_ID:-clip_train}" --max-restarts "${MAX_RESTARTS:-0}" "${PREEMPTION_FLAGS[@]}" \
  -m clip_train train "$config" "$@"
