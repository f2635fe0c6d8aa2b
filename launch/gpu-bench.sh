#!/usr/bin/env bash
# `make gpu-bench`: `clip-train bench gpu` on a GPU box without network, results in one folder (OUT).
#
# With the wheelhouse that `make gpu-wheels` built (WHEELS), a venv beside the checkout
# (GPU_BENCH_VENV) takes PYTHON's torch and torchvision and installs what it lacks from the
# wheelhouse with --no-index, as `make gpu-check` does; it is kept for the next run. Without a
# wheelhouse PYTHON must have the package's dependencies (.venv does). Without a CUDA GPU the
# benchmark is a dry run at toy sizes, and says so on its first line. The benchmark's time budget
# counts from this script's start (CLIP_TRAIN_BENCH_STARTED), the kit's install included.
#
# usage: [PYTHON=python3] [WHEELS=dist/gpu-wheels] [GPU_BENCH_VENV=.venv-gpu-bench] launch/gpu-bench.sh [OUT]
set -euo pipefail
CLIP_TRAIN_BENCH_STARTED=$(date +%s)
export CLIP_TRAIN_BENCH_STARTED
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-dist/gpu-wheels}
OUT=${1:-gpu-bench/$(date -u +%Y%m%dT%H%M%SZ)}

# need_python PY HOW: stop with one line saying what is missing, where running PY would end in exit 127.
need_python() {
  command -v "$1" >/dev/null || { echo "gpu-bench: no Python at PYTHON=$1: $2" >&2; exit 2; }
}

py=$PYTHON
if [ -f "$WHEELS/requirements.txt" ]; then
  venv=${GPU_BENCH_VENV:-.venv-gpu-bench}
  if [ ! -x "$venv/bin/python" ]; then
    need_python "$PYTHON" "set PYTHON to the Python whose torch sees the GPU, which the kit's venv is built over"
    # shellcheck source=launch/gpu-kit.sh
    source launch/gpu-kit.sh
    kit_venv "$venv"
  fi
  py=$venv/bin/python
else
  need_python "$py" "no kit at $WHEELS either: build it with \`make gpu-wheels\` where there is network and \
carry $WHEELS along, or set PYTHON to a Python that has the package's dependencies"
fi
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 WANDB_MODE=disabled
exec "$py" -m clip_train bench gpu --out "$OUT"
