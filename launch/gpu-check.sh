#!/usr/bin/env bash
# The GPU check on a GPU box without network: the CUDA tests, then one short loss benchmark, all
# written to one folder (gpu-check.log, cuda-tests.xml, bench-loss.json).
#
# Needs this checkout, the wheelhouse that `make gpu-wheels` built (WHEELS) and a Python whose torch
# and torchvision see the GPU (PYTHON). A venv in the output folder takes that torch as it is, after
# its own packages, and installs what it lacks from the wheelhouse with --no-index. Without a CUDA
# GPU it stops once the CUDA tests collect: a dry run of the kit before it travels.
#
# usage: [PYTHON=python3] [WHEELS=dist/gpu-wheels] launch/gpu-check.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-dist/gpu-wheels}
OUT=${1:-gpu-check/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1

# shellcheck source=launch/gpu-kit.sh
source launch/gpu-kit.sh
kit_venv "$OUT/venv"
py=$KIT_PYTHON
"$py" -c 'import torch; print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}")'
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 WANDB_MODE=disabled

if ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  "$py" -m pytest --collect-only -q -m cuda tests/test_cuda.py
  echo "gpu-check: no CUDA GPU here; the kit installed offline and the CUDA tests collect"
  exit 0
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true

# The benchmark runs whatever the tests found; the exit status is the tests'.
tests=0
"$py" -m pytest -m cuda tests/test_cuda.py --junitxml "$OUT/cuda-tests.xml" || tests=$?
"$py" -m clip_train bench loss --device cuda --dtype bfloat16 --dim 512 --repeats 3 \
  --batch 16384,65536 --impl vanilla,inf --json "$OUT/bench-loss.json"
echo "gpu-check: done in $OUT (CUDA tests exit $tests)"
exit "$tests"
