"""`clip-train bench gpu` (`make gpu-bench`): its dry run on the CPU runs every section the GPU
session runs and writes the same files, so the command cannot rot between GPU sessions; a failing
section is recorded and the others still run; what finished is on disk before the next section
starts; the time budget counts from the script's start, and SIGTERM (the session's outer timeout)
still leaves the files. The profile's split of a CUDA window, which only a GPU produces, is checked
in ``test_profiling.py``."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import psutil
import pytest
from processes import Watched, ended, run_to_end

from clip_train.bench.gpu import DRY_RUN, FILES, GPU, PACKAGES, SECTIONS, STARTED_VARIABLE, STOPPED
from clip_train.bench.runner import RunFailed, run_logged
from clip_train.bench.train import SPLIT
from clip_train.profiling import PHASES

ROOT = Path(__file__).resolve().parents[1]


def _command(out, *options: str) -> list[str]:
    return [sys.executable, "-m", "clip_train", "bench", "gpu", "--out", str(out), *options]


def _bench(out, *options: str, env: dict[str, str] | None = None):
    result = run_to_end(_command(out, *options), env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads((out / "gpu-bench.json").read_text())


@pytest.mark.slow
def test_the_dry_run_runs_every_section_and_prints_the_summary_last(tmp_path):
    out = tmp_path / "bench"
    result, report = _bench(out)
    assert result.stdout.splitlines()[0].startswith("gpu-bench: DRY RUN on the CPU")
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)  # at most 8 files: no venv, no shards
    assert len(FILES) <= 8
    summary = (out / "gpu-bench.md").read_text()
    assert summary.startswith("# gpu-bench: DRY RUN") and result.stdout.rstrip().endswith(summary.rstrip())
    assert report["dry_run"] and all("error" not in report[name] for name in SECTIONS), summary

    matmul = report["matmul"]
    assert matmul["size"] == 256 and matmul["tflops"] > 0 and "256 x 256 x 256 bf16 product" in summary
    loss = report["loss"]
    assert {p["impl"] for p in loss["points"]} == {"inf", "open_clip"} and loss["inf_cl"] == "not installed"
    for point in loss["points"]:  # 4 matmuls at the measured rate (the best 1-matmul floor)
        assert point["x_floor"] == pytest.approx(point["time_s"] / point["four_matmul_floor_s"])
    assert loss["floor_tflops"] == max(loss["floor_tflops_by_batch"].values()) > 0
    for accuracy in loss["accuracy"]:  # bf16 against fp64: a few parts in a thousand, never exact
        assert 0 < accuracy["loss_rel_error"] < 2e-2 and 0 < accuracy["grad_rel_error"] < 5e-2

    trainer = report["trainer"]  # log windows from the first after the warm-up: steps 3-4, not 2-4
    assert (trainer["warmup"], trainer["log_every"], trainer["steps"]) == (1, 2, 4)
    assert "medians over steps 3-4:" in summary
    runs = trainer["runs"]
    assert [(r["batch"], r["compile"]) for r in runs] == [(16, "off"), (32, "default")]
    for run in runs:  # the CPU's peak is the square product's rate: MFU is the share of it
        assert run["samples_per_s"] > 0 and set(run["split_s"]) == set(SPLIT)
        assert run["mfu"] == pytest.approx(run["tflops"] / matmul["tflops"], rel=1e-9)
        assert run["of_matmul_rate"] == pytest.approx(run["mfu"], rel=1e-9)
        startup = run["startup_s"]  # the process's start to its first step's end, by stage
        assert startup["total"] == pytest.approx(sum(startup.values()) - startup["total"])
        assert 0 < startup["imports"] < startup["total"] < run["wall_s"] and startup["first_step"] > 0
        assert f"| {startup['total']:.0f} | {run['wall_s']:.0f} |" in summary
    assert "start-up, s: from the process's start to the end of its first step" in summary
    assert f"| 32 | default | {runs[1]['startup_s']['imports']:.1f} | " in summary

    (point,) = report["step"]["points"]  # the eager trainer's batch and chunks, beside its samples/s
    assert (point["batch"], point["chunks"]) == (16, [0, 0])
    assert point["samples_per_s"] == 16 / point["step_s"]
    share = runs[0]["samples_per_s"] / point["samples_per_s"]
    assert (
        f"| 16 | 0/0 | {point['step_s']:.4f} |" in summary
        and f"| {share:.1%} | {point['ready_s']:.1f} | {point['warmup_s']:.1f} | {point['wall_s']:.0f} |"
        in summary
    )
    assert 0 < point["ready_s"] < point["wall_s"] and point["warmup_s"] > 0

    open_clip = report["open_clip"]  # beside the eager one-chunk trainer
    assert open_clip["batch"] == 16 and open_clip["samples_per_s"] > 0
    ratio = runs[0]["samples_per_s"] / open_clip["samples_per_s"]
    assert (
        f"| 16 | {open_clip['samples_per_s']:.0f} | {runs[0]['samples_per_s']:.0f} | {ratio:.2f} |" in summary
    )
    profile = trainer["profile"]  # the compiled run's steps 2-3 (eager here: TORCHDYNAMO_DISABLE)
    assert "`clip-train train` at batch 32 (chunks 8/16), compile default, steps 2-3" in summary
    assert profile["steps_traced"] == [2, 3] and sum(profile["shares"].values()) == pytest.approx(1.0)
    assert profile["shares"]["matmul"] > 0 and profile["shares"]["optimizer"] > 0
    assert set(profile["idle_s"]) == {*PHASES, "other"} and all(profile["host_s"][p] > 0 for p in PHASES)
    assert 0 < len(profile["top_kernels"]) <= 15
    assert any(k["name"] in ("aten::mm", "aten::addmm") for k in profile["top_kernels"])
    log = (out / "gpu-bench.log").read_text()  # each run's own output: start-up, progress, profile
    assert log.count("clip-train: step: 4/4") == 2 and "clip-train: profile of steps 2-3" in log
    # Each trainer run (OpenCLIP's too) and the bench-step process stops at its own cap, not at the
    # budget's end: one hung run costs only that.
    assert log.count(f"(timeout {DRY_RUN.run_cap_s:.0f} s)") == 3
    assert log.count(f"(timeout {DRY_RUN.step_cap_s:.0f} s)") == 1
    assert "Train Epoch: 0" in log  # OpenCLIP's
    with gzip.open(out / "gpu-bench.trace.json.gz") as trace:
        assert json.load(trace)["traceEvents"]
    for heading in ("## matmul", "## loss", "## trainer", "## profile", "## step", "## open_clip"):
        assert heading in summary


@pytest.mark.slow
def test_a_failing_section_is_recorded_at_once_and_the_next_one_runs(tmp_path):
    """A key the config does not have: OpenCLIP's section fails with its message,
    which is on disk before the next section starts (a GPU session whose time runs out keeps what
    finished), and the matmul section (which takes no run settings) still runs."""
    out = tmp_path / "bench"
    bench = Watched.start(_command(out, "--sections", "open_clip,matmul", "--set", "train.no_such_key=1"))
    bench.wait_for(lambda: "gpu-bench: matmul ..." in bench.stdout.text, "the second section started")
    so_far = json.loads((out / "gpu-bench.json").read_text())
    assert "unknown config key train.no_such_key" in so_far["open_clip"]["error"] and "matmul" not in so_far
    assert "**failed**" in (out / "gpu-bench.md").read_text()

    result = bench.wait()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "gpu-bench.json").read_text())
    assert report["open_clip"] == so_far["open_clip"]
    assert "error" not in report["matmul"] and report["matmul"]["tflops"] > 0
    assert "gpu-bench: open_clip: FAILED" in result.stdout and "gpu-bench: matmul: done" in result.stdout
    assert "## matmul" in (out / "gpu-bench.md").read_text()


# A run that hangs, with a child in its process group, one in a group of its own (a measurement
# that runs another, as ``bench train`` runs the trainers) and one whose parent ended (torchrun's
# ranks, torchrun killed): it prints their pids.
HANGS_WITH_CHILDREN = """
import subprocess, sys, time
sleeps = [sys.executable, "-c", "import time; time.sleep(120)"]
starts_one = f"import subprocess; print(subprocess.Popen({sleeps!r}, stdout=subprocess.DEVNULL).pid)"
children = [
    subprocess.Popen(sleeps).pid,
    subprocess.Popen(sleeps, start_new_session=True).pid,
    subprocess.run([sys.executable, "-c", starts_one], stdout=subprocess.PIPE, text=True).stdout.strip(),
]
print("step: 1/30", *children, flush=True)
time.sleep(120)
"""


def test_a_logged_run_past_its_time_is_stopped_with_its_children_and_leaves_what_it_said(tmp_path):
    """A run that hangs on the GPU box: stopped at its timeout with every process it started (a
    trainer's ranks would hold the GPU through the next measurement), its output so far on disk and
    in the error, rather than the whole session's time spent waiting."""
    output = tmp_path / "run" / "output.log"
    with pytest.raises(RunFailed, match=r"^a run was stopped after 5 s:\n(.|\n)*step: 1/30"):
        run_logged([sys.executable, "-c", HANGS_WITH_CHILDREN], output, "a run", timeout_s=5)
    said = output.read_text().split()
    assert said[:2] == ["step:", "1/30"] and len(children := said[2:]) == 3
    assert ended([int(child) for child in children]), "a child of the run outlived it"
    with pytest.raises(RunFailed, match=r"^a run exited 3:\nerror: no shards\n\.\.\."):
        run_logged([sys.executable, "-c", "print('error: no shards'); exit(3)"], output, "a run")


RUNS_A_MEASUREMENT = """
import sys
from pathlib import Path
from clip_train.bench.runner import run_logged
run_logged([sys.executable, "-c", sys.argv[1]], Path(sys.argv[2]), "a run")
"""


def test_a_benchmark_stopped_by_sigterm_stops_its_measurement_with_its_children(tmp_path):
    """``timeout 300 clip-train bench ...``: the benchmark gets SIGTERM while it waits on a measurement
    in a process group of its own, which the signal's default would have left running on the GPU."""
    output = tmp_path / "output.log"
    bench = Watched.start([sys.executable, "-c", RUNS_A_MEASUREMENT, HANGS_WITH_CHILDREN, str(output)])
    bench.wait_for(lambda: output.is_file() and len(output.read_text().split()) == 5, "the run's children")
    bench.process.send_signal(signal.SIGTERM)
    assert bench.wait().returncode == 128 + signal.SIGTERM
    children = output.read_text().split()[2:]
    assert ended([int(child) for child in children]), "a child of the run outlived it"


def test_what_the_budget_leaves_no_time_for_is_recorded_as_not_run(tmp_path):
    """A section starts only with 20 s of the budget left; the summary is written."""
    out = tmp_path / "bench"
    result, report = _bench(out, "--sections", "matmul", "--budget-s", "1")
    assert re.fullmatch(
        r"TimeoutError: not run: -?\d+ s of the 1 s budget \(--budget-s\) left, 20 s needed to start",
        report["matmul"]["error"],
    )
    assert "**failed**: `TimeoutError: not run:" in (out / "gpu-bench.md").read_text()
    assert "gpu-bench: matmul: FAILED: TimeoutError: not run" in result.stdout


def test_a_trainer_run_starts_only_with_the_time_its_process_needs(tmp_path):
    """With 50 s left the trainer section starts, but no run does: a GPU trainer process takes ~40 s
    to its first step, so one started with less would only be stopped. Each is recorded as not run,
    in the JSON, the summary and on the console as it is skipped."""
    out = tmp_path / "bench"
    result, report = _bench(out, "--sections", "trainer", "--budget-s", "50")
    runs = report["trainer"]["runs"]
    assert "error" not in report["trainer"] and len(runs) == len(DRY_RUN.trainer)
    for run in runs:
        assert re.fullmatch(
            r"TimeoutError: not run: \d+ s of the 50 s budget \(--budget-s\) left, 60 s needed to start",
            run["error"],
        )
    summary = (out / "gpu-bench.md").read_text()
    assert "| 16 | 0/0 | off | failed: `TimeoutError: not run:" in summary
    assert "gpu-bench: trainer: batch 32, chunks 8/16, compile default: FAILED: TimeoutError" in result.stdout


def test_the_cuda_graph_run_is_the_gpu_sessions_last_trainer_run():
    """Its first-ever run is the likeliest to hang; last, it can cost only itself (and the profile)."""
    assert GPU.trainer[-1][3] == "reduce-overhead" == GPU.profiled[1]
    assert [compiling for *_, compiling in GPU.trainer].count("reduce-overhead") == 1


def test_the_budget_counts_from_the_scripts_start(tmp_path):
    """launch/gpu-bench.sh's start (``CLIP_TRAIN_BENCH_STARTED``) 90 s ago, the kit's install in
    between: of a 100 s budget too little is left to start a section, and the report says where the
    time went."""
    out = tmp_path / "bench"
    env = {**os.environ, STARTED_VARIABLE: str(time.time() - 90)}
    _, report = _bench(out, "--sections", "matmul", "--budget-s", "100", env=env)
    assert report["setup_s"] >= 90 and report["wall_s"] >= report["setup_s"]
    left = re.fullmatch(r"TimeoutError: not run: (-?\d+) s of the 100 s budget .*", report["matmul"]["error"])
    assert left and int(left[1]) <= 10
    summary = (out / "gpu-bench.md").read_text()
    assert f"({report['setup_s']:.0f} s of it before the benchmark started" in summary


def test_the_machine_records_the_packages_that_ran(tmp_path):
    """A GPU box's own transformers, timm or huggingface_hub may run instead of the kit's: the JSON and
    the summary name the versions this Python imports."""
    out = tmp_path / "bench"
    _, report = _bench(out, "--sections", "matmul", "--budget-s", "1")
    packages = report["machine"]["packages"]
    assert packages["transformers"] == metadata.version("transformers")
    assert set(packages) <= set(PACKAGES) and {"timm", "open_clip_torch", "numpy"} <= set(packages)
    listed = ", ".join(f"{name} {version}" for name, version in packages.items())
    assert f"\npackages: {listed}\n" in (out / "gpu-bench.md").read_text()


@pytest.mark.slow
def test_sigterm_stops_the_running_trainer_run_and_keeps_the_runs_before_it(tmp_path):
    """The session's outer timeout sends SIGTERM: the running trainer process is killed with its
    group, the run before it keeps its figures, and the files are written once more, saying the
    section was stopped; the exit status is SIGTERM's."""
    out = tmp_path / "bench"
    bench = Watched.start(_command(out, "--sections", "trainer"))
    bench.wait_for(lambda: "gpu-bench: trainer: batch 16" in bench.stdout.text, "the first run ended")
    bench.wait_for(lambda: _children(bench.process.pid), "the second run started")
    second_run = _children(bench.process.pid)
    bench.process.send_signal(signal.SIGTERM)
    result = bench.wait()
    assert result.returncode == 128 + signal.SIGTERM, result.stdout[-3000:] + result.stderr[-3000:]
    assert ended([process.pid for process in second_run]), "the stopped run outlived the benchmark"

    trainer = json.loads((out / "gpu-bench.json").read_text())["trainer"]
    first, second = trainer["runs"]
    assert first["samples_per_s"] > 0 and "error" not in first
    assert second["error"] == trainer["error"] == STOPPED
    summary = (out / "gpu-bench.md").read_text()
    assert f"**failed**: `{STOPPED}`" in summary
    assert f"| 16 | 0/0 | off | {first['samples_per_s']:.0f} |" in summary
    assert result.stdout.rstrip().endswith(summary.rstrip())


def _children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_without_a_python_or_the_kit_the_script_says_what_is_missing(tmp_path):
    """On a GPU box without the kit, `make gpu-bench` hands the script .venv's Python, which was
    not carried: one line on what is missing and how to get it, not exec's status 127."""
    env = {**os.environ, "PYTHON": str(tmp_path / ".venv/bin/python"), "WHEELS": str(tmp_path / "gpu-wheels")}
    result = subprocess.run(
        [ROOT / "launch/gpu-bench.sh", str(tmp_path / "out")], env=env, capture_output=True, text=True
    )
    assert result.returncode == 2 and not result.stdout
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"gpu-bench: no Python at PYTHON={tmp_path}/.venv/bin/python: no kit at ")
    assert "`make gpu-wheels`" in line and "set PYTHON to a Python that has the package's" in line
