#!/usr/bin/env python3
"""Build the GPU check kit's wheelhouse (`make gpu-wheels`): the wheels that a GPU box with torch
and torchvision already installed lacks for `launch/gpu-check.sh`, so the check installs there with
`pip install --no-index` and needs no network.

What the box has is torch's and torchvision's dependency closure; what the check needs is the
package's dependencies without wandb (imported only by runs that log to it) plus pytest, and pandas
for OpenCLIP's trainer in `make gpu-bench`. One pip dry run resolves both at the image's pins
(docker/constraints.txt); the difference is downloaded.

usage: launch/gpu_wheels.py OUT [--python-version 3.12]   (the box's Python; default: this one's)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "docker/constraints.txt"
PREINSTALLED = ("torch", "torchvision")
NOT_NEEDED = {"wandb"}
TEST_TOOLS = {"pytest", "pytest-timeout"}
BENCH_TOOLS = {"pandas"}  # open_clip_train imports it: OpenCLIP's trainer beside ours in `make gpu-bench`
MANYLINUX_GLIBC_MINORS = range(17, 40)  # glibc 2.17 (manylinux2014) to 2.39 (Ubuntu 24.04)


def foreign_python_args(python_version: str) -> list[str]:
    """pip's options for wheels for another Python on an x86-64 Linux box. pip takes a ``--platform``
    literally (no older glibc implied), and wheels name the oldest glibc they need, anywhere from
    2.17 (nvidia-nccl-cu13: manylinux_2_18 only) to current: every manylinux tag is passed."""
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in MANYLINUX_GLIBC_MINORS] + ["manylinux2014_x86_64"]
    args = ["--only-binary=:all:", "--python-version", python_version]
    for platform in platforms:
        args += ["--platform", platform]
    return args


def check_requirements() -> list[str]:
    """pyproject's dependencies, less the preinstalled and the unneeded, plus the test runner and
    what `make gpu-bench` runs OpenCLIP's trainer with."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    skip = NOT_NEEDED | set(PREINSTALLED)
    runtime = [d for d in project["dependencies"] if Requirement(d).name not in skip]
    extras = project["optional-dependencies"]
    tools = [d for d in extras["dev"] if Requirement(d).name in TEST_TOOLS]
    tools += [d for d in extras["bench"] if Requirement(d).name in BENCH_TOOLS]
    return runtime + tools


def resolve(requirements: list[str], platform_args: list[str]) -> dict[str, dict]:
    """{name: pip's report entry} for everything ``requirements`` needs, as on an empty box."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed"]
        command += ["--target", f"{tmp}/target", "--report", str(report), "--constraint", str(CONSTRAINTS)]
        subprocess.run([*command, *platform_args, *requirements], check=True)
        entries = json.loads(report.read_text())["install"]
    return {canonicalize_name(e["metadata"]["name"]): e for e in entries}


def closure(roots: tuple[str, ...], resolved: dict[str, dict], python_version: str) -> set[str]:
    """The names ``roots`` pull in, following each resolved package's requirements whose markers
    hold on the box for the extras asked of it (torch asks ``cuda-toolkit[cublas,...]``)."""
    environment = default_environment() | {"python_version": python_version}
    seen: set[tuple[str, str]] = set()
    todo = [(canonicalize_name(root), "") for root in roots]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen or name not in resolved:
            continue
        seen.add((name, extra))
        for line in resolved[name]["metadata"].get("requires_dist", []):
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(environment | {"extra": extra}):
                wanted = canonicalize_name(requirement.name)
                todo += [(wanted, "")] + [(wanted, e) for e in requirement.extras]
    return {name for name, _ in seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--python-version", default="{}.{}".format(*sys.version_info[:2]))
    args = parser.parse_args()
    platform_args = []
    if args.python_version != "{}.{}".format(*sys.version_info[:2]):
        platform_args = foreign_python_args(args.python_version)

    needed = check_requirements()
    resolved = resolve([*PREINSTALLED, *needed], platform_args)
    on_the_box = closure(PREINSTALLED, resolved, args.python_version)
    missing = [entry["metadata"] for name, entry in resolved.items() if name not in on_the_box]
    kit = sorted(f"{package['name']}=={package['version']}" for package in missing)

    args.out.mkdir(parents=True, exist_ok=True)
    download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(args.out)]
    subprocess.run([*download, *platform_args, *kit], check=True)
    (args.out / "requirements.txt").write_text("\n".join(needed) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"gpu-wheels: {len(kit)} wheels, {size / 2**20:.1f} MiB in {args.out}")


if __name__ == "__main__":
    main()
