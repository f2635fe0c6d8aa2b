#!/usr/bin/env bash
# `make gpu-bench`: `clip-train bench gpu` on a GPU box without network, results in one folder (OUT).
#
# With the wheelhouse that `make gpu-wheels` built (WHEELS), a venv beside the checkout
# (GPU_BENCH_VENV) takes PYTHON's torch and torchvision and installs what it lacks from the
# wheelhouse with --no-index, as `make gpu-check` does; it is kept for the next run. Without a
# wheelhouse PYTHON must have the package's dependencies (.venv does). Without a CUDA GPU the
# benchmark is a dry run at toy sizes, and says so on its first line.
#
# usage: [PYTHON=python3] [WHEELS=dist/gpu-wheels] [GPU_BENCH_VENV=.venv-gpu-bench] launch/gpu-bench.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-dist/gpu-wheels}
OUT=${1:-gpu-bench/$(date -u +%Y%m%dT%H%M%SZ)}
py=$PYTHON
if [ -f "$WHEELS/requirements.txt" ]; then
  venv=${GPU_BENCH_VENV:-.venv-gpu-bench}
  if [ ! -x "$venv/bin/python" ]; then
    # shellcheck source=launch/gpu-kit.sh
    source launch/gpu-kit.sh
    kit_venv "$venv"
  fi
  py=$venv/bin/python
fi
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 WANDB_MODE=disabled
exec "$py" -m clip_train bench gpu --out "$OUT"
