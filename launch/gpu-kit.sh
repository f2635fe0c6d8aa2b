# shellcheck shell=bash
# Shared by launch/gpu-check.sh and launch/gpu-bench.sh (sourced, not run): the offline kit's venv.

# kit_venv VENV: a venv at VENV over $PYTHON's torch (and torchvision), with everything else the
# wheelhouse $WHEELS (`make gpu-wheels`) holds installed from it with --no-index. The venv takes that
# torch as it is, after its own packages. No pip of its own: a venv's bundled setuptools (Python <
# 3.12) would hide the newer one that torch requires and that sits beside it; the interpreter's pip
# installs into the venv. It compiles none of the files (46 s of installing took 14 s without, on 2
# cores): Python compiles what it imports when it first does and caches that, so the scripts that
# source this file keep the caching on. Sets KIT_PYTHON to the venv's python.
unset PYTHONDONTWRITEBYTECODE
kit_venv() {
  local venv=$1 torch_site venv_site
  "$PYTHON" -m venv --without-pip "$venv"
  KIT_PYTHON=$venv/bin/python
  torch_site=$("$PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  venv_site=$("$KIT_PYTHON" -c 'import site; print(site.getsitepackages()[0])')
  echo "import site; site.addsitedir('$torch_site')" >"$venv_site/zz-torch-site.pth"
  "$PYTHON" -m pip --python "$KIT_PYTHON" install --quiet --no-compile --no-index --find-links "$WHEELS" \
    -r "$WHEELS/requirements.txt"
}
