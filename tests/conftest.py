import gc
import os
import sys
from pathlib import Path

import pytest

# Tests never touch a model hub or wandb's servers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# The tests' CPU, set before anything here starts torch (every process they start inherits it).
# Two test workers share two cores, so OpenMP threads that spin while they wait for work burn what
# the other worker needs: with idle threads asleep, three in-process test files took 107 s of CPU
# instead of 192 (71 s of wall instead of 113, `-n 2`).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Where cores are that few, inductor compiles in the compiling process (no pool of fresh
# interpreters that each import torch) and without vector instructions, whose headers make each
# C++ kernel slower to build: the compiled-replay test took 87 s of CPU instead of 113. What the
# tests check of compiling (graphs, recompiles, RNG replay, results) is the same. A GPU box's
# `make gpu-check` keeps the pool for its Triton kernels.
if (os.cpu_count() or 1) <= 4:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

# The longest files, longest first (wall seconds of their tests, fixtures included, in a 2-core
# `make test` on 2026-11-30; test_launch's with the real-Slurm jobs that .ci/run's local cluster
# runs). `make test` hands whole files to its two workers in this order (--no-loadscope-reorder:
# xdist's own order puts the files with the most tests first, and those are quick), so the long
# ones start early and the workers end together instead of one finishing the last long file alone
# (test_remote, unlisted, once ran last and left one core idle for 30 s). A stale list costs
# balance only; files not named keep their order.
LONGEST_FIRST = (
    "test_launch.py",  # 177, 55 of it without Slurm
    "test_compile.py",  # 137
    "test_trainer.py",  # 101
    "test_bench.py",  # 97
    "test_stopping.py",  # 87
    "test_fsdp_gradcache.py",  # 82
    "test_gpu_bench.py",  # 75
    "test_fsdp_trainer.py",  # 74
    "test_forked_cli.py",  # 72
    "test_gpu_kit.py",  # 63, much of it pip reading the package index: it overlaps the CPU's work
    "test_fsdp_bench.py",  # 46
    "test_remote.py",  # 36
    "test_fsdp_memory.py",  # 34
    "test_fine_tune_runs.py",  # 33
    "test_data.py",  # 32
    "test_export.py",  # 27
    "test_open_clip_text.py",  # 24
    "test_loss_tiles.py",  # 24
    "test_plan.py",  # 22
)


def pytest_configure(config: pytest.Config) -> None:
    """The warnings pyproject makes errors here are errors in the processes the tests start too: the
    runs they launch would print them unnoticed. Not from xdist's controller: its workers would read
    them at start-up as -W options, with which pytest drops its own filters (DeprecationWarnings
    would no longer show)."""
    if config.getoption("numprocesses", default=None) and not hasattr(config, "workerinput"):
        return
    os.environ.setdefault("PYTHONWARNINGS", ",".join(config.getini("filterwarnings")))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: files stay whole


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collecting imported (torch, the library, the test modules) lives as long as the worker:
    frozen, the collections that the tests' own garbage sets off no longer scan it."""
    gc.freeze()


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    """The embedded digits set at 16 px, written once per test session by the real CLI."""
    from processes import run_to_end

    out = tmp_path_factory.mktemp("digits")
    command = [sys.executable, "-m", "clip_train", "make-shards", "digits", str(out), "--size", "16"]
    result = run_to_end(command)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="session")
def demo_run(digits, tmp_path_factory) -> Path:
    """A short real run of the demo recipe (tiny model, mean pooling) by the real CLI: checkpoints at
    steps 20 and 40, and a run config whose eval section is digits zero-shot on the val shards."""
    from processes import run_to_end
    from small_runs import DEMO_CONFIG, run_overrides

    out = tmp_path_factory.mktemp("demo_run")
    overrides = run_overrides(
        digits,
        out,
        40,
        "checkpoint.every_steps=20",
        f"eval.zeroshot={digits}/zeroshot.json",
        f"eval.zeroshot_data={digits}/val",
    )
    command = [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *overrides]
    result = run_to_end(command)
    assert result.returncode == 0, result.stderr[-3000:]
    return out
