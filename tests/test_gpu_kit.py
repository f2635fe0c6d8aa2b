"""The GPU check kit, checked on this CPU machine as a GPU box would use it: the wheelhouse that
`make gpu-wheels` builds installs with --no-index into a venv over a Python that holds only torch
(and torchvision), and the CUDA tests collect there without the optional packages."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name, parse_wheel_filename
from processes import run_to_end

ROOT = Path(__file__).resolve().parents[1]
KIT_LIMIT_MIB = 60


def _gpu_wheels_module():
    spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "launch/gpu_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_in(python: Path, code: str) -> str:
    return subprocess.check_output([python, "-c", code], text=True).strip()


def python_with_only_torch(where: Path) -> Path:
    """A venv whose only packages are torch's and torchvision's installed closure, linked from this
    environment (the GPU box's preinstalled stack, without copying gigabytes)."""
    gpu_wheels = _gpu_wheels_module()
    installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}
    entries = {name: {"metadata": {"requires_dist": d.requires or []}} for name, d in installed.items()}
    python_version = "{}.{}".format(*sys.version_info[:2])
    stack = where / "stack"
    stack.mkdir(parents=True)
    for name in gpu_wheels.closure(gpu_wheels.PREINSTALLED, entries, python_version):
        for file in installed[name].files or []:
            top = file.parts[0]
            target = stack / top
            if not target.exists() and top != ".." and (installed[name].locate_file(top)).exists():
                target.symlink_to(installed[name].locate_file(top))
    venv = where / "box"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = _run_in(venv / "bin/python", "import site; print(site.getsitepackages()[0])")
    (Path(site) / "stack.pth").write_text(f"{stack}\n")
    return venv / "bin/python"


@pytest.mark.slow
def test_kit_installs_offline_over_a_torch_only_python_and_collects_the_cuda_tests(tmp_path):
    wheels = tmp_path / "wheels"
    built = run_to_end([sys.executable, str(ROOT / "launch/gpu_wheels.py"), str(wheels)])
    assert built.returncode == 0, built.stderr[-3000:]
    names = {canonicalize_name(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
    assert {"timm", "transformers", "webdataset", "pytest"} <= names
    assert not names & {"torch", "torchvision", "triton", "numpy", "wandb"}, "on the box already, or unneeded"
    assert not any(name.startswith("nvidia") for name in names)
    size_mib = sum(f.stat().st_size for f in wheels.iterdir()) / 2**20
    assert size_mib <= KIT_LIMIT_MIB

    box_python = python_with_only_torch(tmp_path)
    probe = "import torch, torchvision, importlib.util as u; print(u.find_spec('timm'), u.find_spec('wandb'))"
    assert _run_in(box_python, probe) == "None None"

    # pip sees no index, no config and no find-links but the kit's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    env |= {"PYTHON": str(box_python), "WHEELS": str(wheels)}
    out = tmp_path / "check"
    check = run_to_end([str(ROOT / "launch/gpu-check.sh"), str(out)], env=env)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    log = (out / "gpu-check.log").read_text()
    assert "the kit installed offline and the CUDA tests collect" in log
    collected = int(log.split(" tests collected")[0].split()[-1].split("/")[0])
    assert collected >= 10
    optional = ("wandb", "clip_benchmark", "sklearn")
    absent = f"import importlib.util as u; print([m for m in {optional} if u.find_spec(m)])"
    assert _run_in(out / "venv/bin/python", absent) == "[]"


@pytest.mark.slow
def test_kit_resolves_for_another_python_whose_wheels_name_any_glibc():
    """``make gpu-wheels GPU_PYTHON=3.12`` from this machine's Python: pip resolves the box's whole
    stack from wheels alone, nvidia-nccl-cu13 included, which is published for manylinux_2_18 only.
    (A dry run: the metadata is fetched, not the wheels.)"""
    gpu_wheels = _gpu_wheels_module()
    resolved = gpu_wheels.resolve(
        [*gpu_wheels.PREINSTALLED, *gpu_wheels.check_requirements()], gpu_wheels.foreign_python_args("3.12")
    )
    wheels = {name: entry["download_info"]["url"].rsplit("/", 1)[1] for name, entry in resolved.items()}
    assert {"torch", "nvidia-nccl-cu13", "timm", "transformers", "pytest"} <= wheels.keys()
    assert "manylinux_2_18_x86_64" in wheels["nvidia-nccl-cu13"]
    for wheel in wheels.values():  # each installs on CPython 3.12, x86-64 Linux
        tags = parse_wheel_filename(wheel)[3]
        assert any(tag.interpreter in ("cp312", "py3") or tag.abi == "abi3" for tag in tags), wheel
        assert any(tag.platform == "any" or tag.platform.endswith("x86_64") for tag in tags), wheel
