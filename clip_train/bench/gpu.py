"""`clip-train bench gpu` (``make gpu-bench``): what one GPU session should measure, in one command
of at most ten minutes on an H100, into one folder: ``gpu-bench.json`` (everything),
``gpu-bench.md`` (the summary tables, printed last), ``gpu-bench.log`` (every step's output) and
``gpu-bench.trace.json.gz`` (the profiled steps' Chrome trace).

1. matmul: the rate of an 8192³ bf16 product, the practical ceiling "of matmul rate" is against;
2. trainer: ``clip-train train`` on synthetic 224 px shards, ViT-B/16 + BERT-base, per-GPU batch
   256 in one chunk and 1024 with Gradient Cache, eager and ``train.compile`` (batch 256 also with
   ``train.compile_mode=reduce-overhead``, CUDA graphs, last: its first-ever run is the likeliest to
   hang): samples/s, model TFLOP/s, MFU, the share of the measured matmul rate, peak memory and the
   step split. The CUDA-graph run is also profiled (``log.profile_steps``, ``clip_train.profiling``)
   before its measured steps: the shares of matmul, attention, elementwise, optimizer, copies and
   idle, the idle time by what the host was doing, and the top 15 kernels;
3. step: ``bench step``, the bare Gradient Cache step (forward and backward, no loop, no optimizer)
   at the trainer's eager batches and chunks, and the trainer's samples/s as a share of its;
4. open_clip: OpenCLIP's own trainer on the same exported architecture and shards at batch 256,
   at the trainer's log cadence, beside the eager trainer;
5. loss: forward + backward in bf16, d = 512, at 16k to 262k rows: clip_train's tiles, open_clip's
   ``ClipLoss`` (until it runs out of memory) and Inf-CL's ``cal_inf_loss`` when ``inf_cl`` is
   installed; time, peak memory, error against fp64 at 8k rows, and the time over the floor of the
   loss's 4 matmuls at the rate of its b × d × b product measured in the same run (``bench loss``).

Each section runs in its own processes and fails soft: its error goes into the JSON and the summary
beside what it measured before it, and the next section runs. ``--budget-s`` bounds the whole,
counted from ``launch/gpu-bench.sh``'s start (``CLIP_TRAIN_BENCH_STARTED``) when that ran it, so the
kit's install counts as it does against the session's outer timeout: a run still going when it is
spent is stopped, and what has not started is recorded as not run, so the summary is written in
time. Each trainer run and ``bench step`` process also stops at a cap of its own, so a hung one costs
that cap, not every run after it. SIGTERM (the outer timeout's) stops the running process with its
group and writes the files once more, the stopped section saying so.

Without a CUDA GPU the same sections run on the CPU at toy sizes (the tiny model, small batches,
small losses): a dry run that keeps the command working between GPU sessions, said so on its first
line; its figures mean nothing. There ``train.compile`` runs with
``TORCHDYNAMO_DISABLE=1`` (inductor's C++ builds take minutes on a small CPU): the runs and their
reports are the same, the towers run eager.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch

from clip_train.bench import step as bench_step
from clip_train.bench.matmul import square_matmul_tflops
from clip_train.bench.runner import Terminated, in_fresh_process, run_logged, sigterm_raises
from clip_train.bench.train import OUTPUT, export_initial_model, run_clip_train, run_open_clip
from clip_train.config import load_config
from clip_train.files import replace_text
from clip_train.profiling import SHARES, describe

# The trainer's figures first: a session whose time runs out loses the loss, measured three times before.
SECTIONS = ("matmul", "trainer", "step", "open_clip", "loss")
# From launch/gpu-bench.sh's start, the kit's install included: done by ~555 s, inside the GPU
# session's `timeout 590 make gpu-bench`, with the stopped run killed and the summary written.
BUDGET_S = 545.0
STARTED_VARIABLE = "CLIP_TRAIN_BENCH_STARTED"  # launch/gpu-bench.sh's start, in epoch seconds
LEFT_TO_START_S = 20.0  # a section starts only with this much of the budget left
RUN_LEFT_TO_START_S = 60.0  # a trainer run too: a GPU trainer process takes ~40 s to its first step
STOPPED = "Terminated: stopped by SIGTERM (the session's outer timeout, most likely)"
# Beside torch, what the figures depend on: a GPU box's own copies may run instead of the kit's.
PACKAGES = ("transformers", "timm", "open_clip_torch", "triton", "huggingface_hub", "numpy")
FIGURES = ("tflops", "runs", "points", "samples_per_s")  # where the sections keep what they measured
Compiling = Literal["off", "default", "reduce-overhead"]  # eager, or train.compile in that mode
FILES = ("gpu-bench.json", "gpu-bench.md", "gpu-bench.log", "gpu-bench.trace.json.gz")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each section runs: the GPU session's sizes, or the dry run's toy ones."""

    loss_batches: tuple[int, ...]
    loss_dim: int
    loss_repeats: int
    accuracy_rows: int
    model: str
    synthetic_images: int
    workers: int
    # (per-GPU batch, image chunk, text chunk, compiling: off or a train.compile_mode); chunk 0 = one
    trainer: tuple[tuple[int, int, int, Compiling], ...]
    profiled: tuple[int, Compiling]  # the trainer run (batch, compiling) also profiled
    steps: int
    warmup: int
    log_every: int  # the trainer's samples/s: over each window of this many steps (one waits to log)
    step_repeats: int
    open_clip_batch: int
    matmul_size: int  # the square product whose rate "of matmul rate" is against
    profile_after: int  # the profiled run's steps before its trace
    profile_steps: int
    run_cap_s: float  # a trainer run's timeout at most (clip_train's or OpenCLIP's)
    step_cap_s: float  # a bench-step process's


GPU = Sizes(
    loss_batches=(16384, 65536, 131072, 262144),
    loss_dim=512,
    loss_repeats=3,
    accuracy_rows=8192,
    model="configs/model/vit-b16-bert-base-random.yaml",
    synthetic_images=4096,
    workers=min(12, max(1, (os.cpu_count() or 2) - 2)),
    trainer=(
        (256, 0, 0, "off"),
        (256, 0, 0, "default"),
        (1024, 256, 512, "off"),
        (1024, 256, 512, "default"),
        (256, 0, 0, "reduce-overhead"),  # last: a first-ever CUDA-graph run that hangs costs only itself
    ),
    profiled=(256, "reduce-overhead"),  # the fastest: what is left of its idle time
    steps=30,
    warmup=10,
    log_every=10,
    step_repeats=10,
    open_clip_batch=256,
    matmul_size=8192,
    profile_after=3,  # steps 4-8: compiled, no log step waits, before the measured windows 11-30
    profile_steps=5,
    run_cap_s=150.0,  # 2.4x the slowest run on an H200 (1024 compiled: 62 s, 46 of them start-up)
    step_cap_s=90.0,  # 2x a process on that H200 (42 s, 22 of them to be ready)
)
DRY_RUN = Sizes(
    loss_batches=(256,),
    loss_dim=32,
    loss_repeats=1,
    accuracy_rows=128,
    model="configs/model/tiny.yaml",
    synthetic_images=48,
    workers=1,
    trainer=((16, 0, 0, "off"), (32, 8, 16, "default")),  # compiled runs are eager here: each path once
    profiled=(32, "default"),
    steps=4,
    warmup=1,
    log_every=2,
    step_repeats=1,
    open_clip_batch=16,
    matmul_size=256,
    profile_after=1,  # steps 2-3
    profile_steps=2,
    run_cap_s=120.0,  # 10x a run on 2 idle cores (12 s): a busy machine's runs are slow, not hung
    step_cap_s=60.0,  # 10x a process there (6 s)
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="the results folder (default gpu-bench/UTC-DATE)")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}"
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model config overrides")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help=f"seconds for all of it (default {BUDGET_S:.0f}), from launch/gpu-bench.sh's start when it ran "
        "this: a run still going then is stopped, and what has not started is not run; 0 for no limit",
    )


def run(args: argparse.Namespace) -> int:
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := [s for s in sections if s not in SECTIONS]:
        raise SystemExit(f"bench gpu: unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    cuda = torch.cuda.is_available()
    sizes = GPU if cuda else DRY_RUN
    out = args.out or Path("gpu-bench", datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ"))
    out.mkdir(parents=True, exist_ok=True)
    print(_first_line(cuda, out), flush=True)
    if not cuda:  # inherited by every process the sections start
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
    setup_s = _spent_before_s()
    started = time.perf_counter() - setup_s  # the clock of the budget and of wall_s
    report: dict[str, Any] = {
        "dry_run": not cuda,
        "machine": _machine(cuda),
        "sizes": dataclasses.asdict(sizes),
        "setup_s": setup_s,
        "wall_s": setup_s,
    }
    _write(report, out)  # rewritten after every section: a session cut short keeps what it measured
    with (
        sigterm_raises(),  # the session's outer timeout: the files are written once more
        _summary_at_end(report, out, started),
        tempfile.TemporaryDirectory() as tmp,
        (out / "gpu-bench.log").open("w") as log,
    ):
        budget_s = args.budget_s or float("inf")
        bench = _Bench(sizes, "cuda" if cuda else "cpu", out, Path(tmp), log, args.set, started, budget_s)
        for name in sections:
            report[name] = {}  # filled as it measures: a section that fails part-way keeps what it finished
            bench.section(name, report[name])
            report["wall_s"] = time.perf_counter() - started
            _write(report, out)
    return 0


def _spent_before_s() -> float:
    """Seconds since launch/gpu-bench.sh started (``CLIP_TRAIN_BENCH_STARTED``), 0 without it: the
    kit's install and the imports count against the budget as they do against the session's timeout."""
    started = os.environ.get(STARTED_VARIABLE)
    return max(0.0, time.time() - float(started)) if started else 0.0


@contextlib.contextmanager
def _summary_at_end(report: dict[str, Any], out: Path, started: float) -> Iterator[None]:
    """However the sections end (SIGTERM included), the files written with the whole wall time and
    the summary printed last."""
    try:
        yield
    finally:
        report["wall_s"] = time.perf_counter() - started
        summary = _write(report, out)
        print(f"gpu-bench: {', '.join(FILES)} in {out} ({report['wall_s']:.0f} s)\n")
        print(summary, flush=True)


@contextlib.contextmanager
def _error_recorded(entry: dict[str, Any]) -> Iterator[None]:
    """An error in the block recorded as ``entry["error"]`` (the end of a long one) and ended there:
    one failing part never loses the others. SIGTERM's is recorded and goes on."""
    try:
        yield
    except Exception as err:
        entry["error"] = f"{type(err).__name__}: {err}"[-3000:]
    except Terminated:
        entry["error"] = STOPPED
        raise


def _write(report: dict[str, Any], out: Path) -> str:
    """The JSON and the markdown summary of what ``report`` holds so far, each replaced whole (a
    SIGTERM or a kill while writing leaves the previous one); returns the summary."""
    summary = summarise(report)
    replace_text(out / "gpu-bench.json", json.dumps(report, indent=2))
    replace_text(out / "gpu-bench.md", summary)
    return summary


def _first_line(cuda: bool, out: Path) -> str:
    if not cuda:
        return (
            f"gpu-bench: DRY RUN on the CPU (no CUDA GPU here): every section at toy sizes, the figures "
            f"mean nothing, train.compile runs eager; results in {out}"
        )
    return f"gpu-bench: {torch.cuda.get_device_name()}, torch {torch.__version__}; results in {out}"


def _machine(cuda: bool) -> dict[str, Any]:
    machine = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if cuda:
        _, total = torch.cuda.mem_get_info()
        machine |= {"device": torch.cuda.get_device_name(), "cuda": torch.version.cuda, "memory_bytes": total}
    else:
        machine["device"] = f"CPU ({platform.processor() or platform.machine()})"
    return machine | {"packages": _package_versions()}


def _package_versions() -> dict[str, str]:
    """The installed version of each of ``PACKAGES`` (the one this Python imports; the kit's or the
    box's own), those not installed left out."""
    versions = {}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return versions


class _Bench:
    """The sections, in order; later ones use what earlier ones measured (the matmul rate, the
    trainer's runs)."""

    def __init__(
        self,
        sizes: Sizes,
        device: str,
        out: Path,
        work: Path,
        log,
        overrides: list[str],
        started: float,
        budget_s: float,
    ) -> None:
        """``budget_s`` counts from ``started`` (``time.perf_counter``, moved back to
        launch/gpu-bench.sh's start when that ran this), the clock of the report's ``wall_s``."""
        self.sizes, self.device, self.out, self.work, self.log = sizes, device, out, work, log
        self.overrides = overrides
        self.matmul_tflops: float | None = None
        self.started, self.budget_s = started, budget_s

    def _left_s(self) -> float:
        """What is left of the budget."""
        return self.budget_s - (time.perf_counter() - self.started)

    def _timeout_s(self, cap_s: float = float("inf")) -> float:
        """A process's timeout: what is left of the budget, at most ``cap_s``, so that a hung run
        costs its cap rather than every run after it."""
        return min(self._left_s(), cap_s)

    def _check_time_to_start(self, needed_s: float) -> None:
        """TimeoutError (its section or run recorded as not run) with less than ``needed_s`` left."""
        if (left_s := self._left_s()) < needed_s:
            raise TimeoutError(
                f"not run: {left_s:.0f} s of the {self.budget_s:.0f} s budget (--budget-s) left, "
                f"{needed_s:.0f} s needed to start"
            )

    def _trainer_timeout_s(self) -> float:
        """A trainer run's timeout (clip_train's or OpenCLIP's), once it is known to have the time to
        start: its process alone takes ~40 s to its first step on a GPU."""
        self._check_time_to_start(RUN_LEFT_TO_START_S)
        return self._timeout_s(self.sizes.run_cap_s)

    def section(self, name: str, result: dict[str, Any]) -> None:
        """Section ``name``'s figures into ``result`` as it measures them, and its error, if any,
        beside those it finished: one failing section never loses the others."""
        print(f"gpu-bench: {name} ...", flush=True)
        self._note(f"=== {name}")
        started = time.perf_counter()
        try:
            with _error_recorded(result):
                self._check_time_to_start(LEFT_TO_START_S)
                getattr(self, name)(result)
        finally:  # SIGTERM's path too
            result["wall_s"] = time.perf_counter() - started
            outcome = f"FAILED: {result['error'].splitlines()[0]}" if "error" in result else "done"
            print(f"gpu-bench: {name}: {outcome} ({result['wall_s']:.0f} s)", flush=True)

    def _note(self, text: str) -> None:
        self.log.write(text + "\n")
        self.log.flush()

    def _note_run(self, command: str, timeout_s: float) -> None:
        self._note(f"{command}  (timeout {timeout_s:.0f} s)")

    def _clip_train(self, *arguments: str) -> None:
        """``python -m clip_train ARGUMENTS`` with its output in the log; its last lines on failure."""
        command = [sys.executable, "-m", "clip_train", *arguments]
        timeout_s = self._timeout_s()
        self._note_run("$ " + " ".join(command), timeout_s)
        output = self.work / f"{'-'.join(arguments[:2])}.log"
        with self._output_logged(output):
            run_logged(command, output, f"clip-train {arguments[0]} {arguments[1]}", timeout_s=timeout_s)

    @contextlib.contextmanager
    def _output_logged(self, output: Path) -> Iterator[None]:
        """A process writing ``output``: put in the log however the process ends (its start-up lines,
        progress and profile, or what it said before it failed or was stopped)."""
        try:
            yield
        finally:
            if output.is_file():
                self._note(output.read_text(errors="replace"))

    def matmul(self, result: dict[str, Any]) -> None:
        """The rate a large square bf16 product reaches here: what "of matmul rate" is against, the
        device's practical ceiling (an H100 SXM reaches about 800 of its datasheet's 989 TFLOP/s)."""
        spec = {"device": self.device, "size": self.sizes.matmul_size}
        self.matmul_tflops = in_fresh_process(square_matmul_tflops, spec, self._timeout_s())
        result |= {**spec, "dtype": "bfloat16", "tflops": self.matmul_tflops}

    def loss(self, result: dict[str, Any]) -> None:
        """``bench loss``'s points against their floor; those it measured before it failed or was
        stopped too, from the JSON it rewrites after each point."""
        sizes, out = self.sizes, self.work / "loss.json"
        impls = ["inf", "open_clip", *(["inf_cl"] if importlib.util.find_spec("inf_cl") else [])]
        result["inf_cl"] = "measured" if "inf_cl" in impls else "not installed"
        try:
            self._clip_train(
                "bench", "loss", "--device", self.device, "--dtype", "bfloat16", "--dim", str(sizes.loss_dim),
                "--repeats", str(sizes.loss_repeats), "--batch", ",".join(map(str, sizes.loss_batches)),
                "--impl", ",".join(impls), "--accuracy", str(sizes.accuracy_rows), "--json", str(out),
            )  # fmt: skip
        finally:  # on a stop too: a figure missing is recorded, and the stop goes on
            if out.is_file():
                with _error_recorded(result):
                    result |= _loss_figures(json.loads(out.read_text()))

    def _shards(self) -> Path:
        """Synthetic LAION-like 256-512 px JPEGs with captions (``bench data --make-synthetic``), once."""
        shards = self.work / "shards"
        if not (shards / "train").is_dir():
            from clip_train.bench.data import write_synthetic

            write_synthetic(shards / "train", self.sizes.synthetic_images)
        return shards

    def _settings(self, image_chunk: int, text_chunk: int, compiling: Compiling = "off") -> list[str]:
        settings = [
            *self.overrides, "train.precision=bf16", f"data.workers={self.sizes.workers}",
            f"batch.image_chunk={image_chunk}", f"batch.text_chunk={text_chunk}",
            f"train.compile={compiling != 'off'}",
        ]  # fmt: skip
        if compiling != "off":
            settings.append(f"train.compile_mode={compiling}")
        if self.device == "cpu" and self.matmul_tflops:  # no peak in the table: the measured rate stands in
            settings.append(f"log.peak_tflops={self.matmul_tflops}")
        return settings

    def trainer(self, result: dict[str, Any]) -> None:
        """The trainer at each setting; one run (``Sizes.profiled``) is also profiled, in steps
        before its measured windows, so the profile shows the loop as a run has it. Each run is
        recorded as it ends, with its figures or its error: a failing or hung run costs only itself."""
        sizes, shards = self.sizes, self._shards()
        result |= {
            "model": sizes.model,
            "steps": sizes.steps,
            "warmup": sizes.warmup,
            "log_every": sizes.log_every,
            "runs": [],
            "profile": None,
        }
        for batch, image_chunk, text_chunk, compiling in sizes.trainer:
            run = {"batch": batch, "chunks": [image_chunk, text_chunk], "compile": compiling}
            result["runs"].append(run)  # before it starts: one that SIGTERM stops says so
            started = time.perf_counter()
            with _error_recorded(run):
                self._train(run, shards, result)
            run["wall_s"] = time.perf_counter() - started  # start-up and compiling included
            if self.matmul_tflops and "tflops" in run:
                run["of_matmul_rate"] = run["tflops"] / self.matmul_tflops
            self._note(json.dumps(run))  # in the log at once: a session cut short keeps the runs so far
            print(f"gpu-bench: trainer: {_run_line(run)}", flush=True)

    def _train(self, run: dict[str, Any], shards: Path, result: dict[str, Any]) -> None:
        """One trainer run's figures into ``run``; the profiled run's profile into ``result``."""
        sizes, batch, compiling = self.sizes, run["batch"], run["compile"]
        settings = self._settings(*run["chunks"], compiling)
        profiled = (batch, compiling) == sizes.profiled
        if profiled:
            settings += [
                f"log.profile_after={sizes.profile_after}",
                f"log.profile_steps={sizes.profile_steps}",
            ]
        options = SimpleNamespace(
            config=sizes.model, set=settings, shards=shards, steps=sizes.steps, warmup=sizes.warmup
        )
        timeout_s = self._trainer_timeout_s()
        self._note_run(f"clip-train train {sizes.model} {' '.join(settings)}", timeout_s)
        run_dir = self.work / f"run-{batch}-{compiling}"
        with self._output_logged(run_dir / OUTPUT):
            run |= run_clip_train(options, batch, 1, run_dir, sizes.log_every, timeout_s)
        if profiled:
            profile = self._keep_profile(run_dir / "profile")
            result["profile"] = {"batch": batch, "chunks": run["chunks"], "compile": compiling, **profile}

    def _keep_profile(self, folder: Path) -> dict[str, Any]:
        """The profiled run's summary; its trace goes into the results folder."""
        shutil.copy(folder / "trace-rank0.json.gz", self.out / "gpu-bench.trace.json.gz")
        return json.loads((folder / "summary-rank0.json").read_text())

    def step(self, result: dict[str, Any]) -> None:
        """The bare step at each eager trainer setting, which bounds what the loop around it can do:
        ``bench step``'s measurement, each in one fresh process (not the command's two). Each point
        is kept as it ends: a later one failing or stopped loses none before it."""
        parser = argparse.ArgumentParser()
        bench_step.add_arguments(parser)
        result |= {"repeats": self.sizes.step_repeats, "points": []}
        for batch, image_chunk, text_chunk, compiling in self.sizes.trainer:
            if compiling != "off":  # bench step runs the towers eager
                continue
            arguments = [
                "--model", self.sizes.model, "--batch", str(batch), "--image-chunk", str(image_chunk),
                "--text-chunk", str(text_chunk), "--precision", "bf16", "--device", self.device,
                "--repeats", str(self.sizes.step_repeats), "--set", *self.overrides,
            ]  # fmt: skip
            self._check_time_to_start(LEFT_TO_START_S)
            timeout_s = self._timeout_s(self.sizes.step_cap_s)
            self._note_run("clip-train bench step " + " ".join(arguments), timeout_s)
            spec = bench_step.batch_spec(parser.parse_args(arguments), batch, ["gc"])
            started = time.perf_counter()
            point = in_fresh_process(bench_step.measure, {**spec, "mode": "gc"}, timeout_s)
            self._note(json.dumps(point))
            if "error" in point:
                raise RuntimeError(f"bench step at batch {batch}: {point['error']}")
            step_s = point["median_s"]
            result["points"].append(
                {"batch": batch, "chunks": [image_chunk, text_chunk], "step_s": step_s,
                 "samples_per_s": batch / step_s, "peak_bytes": point["peak_bytes"],
                 "ready_s": point["ready_s"], "warmup_s": point["warmup_s"],
                 "wall_s": time.perf_counter() - started}
            )  # fmt: skip

    def open_clip(self, result: dict[str, Any]) -> None:
        """OpenCLIP's own trainer on the same exported architecture and shards at the trainer's log
        cadence (its samples/s per log window, as clip_train's), beside the eager trainer. Its epoch
        rounds the trainer's steps up to a whole number of batches per loader worker."""
        sizes, export = self.sizes, self.work / "open_clip_model"
        cfg = load_config(sizes.model, self._settings(0, 0))
        export_initial_model(cfg, export)
        shards, batch = self._shards(), sizes.open_clip_batch
        options = SimpleNamespace(shards=shards, steps=sizes.steps, warmup=sizes.warmup)
        run_dir = self.work / "open_clip"
        timeout_s = self._trainer_timeout_s()
        self._note_run(f"open_clip_train.main at batch {batch}", timeout_s)
        with self._output_logged(run_dir / OUTPUT):
            figures = run_open_clip(options, cfg, export, batch, 1, run_dir, sizes.log_every, timeout_s)
        result |= {"batch": batch, **figures}


def _loss_figures(measured: dict[str, Any]) -> dict[str, Any]:
    """``bench loss``'s points, each against the floor of 4 matmuls at the best rate of the loss's own
    b × d × b product measured (not the square product's: the inner dimension is d). A run stopped
    before any floor was timed has none."""
    floors = [p for p in measured["points"] if p["impl"] == "floor" and p["time_s"]]
    rates = [2 * p["batch"] ** 2 * p["dim"] / p["time_s"] / 1e12 for p in floors]
    floor_tflops = max(rates, default=None)
    points = []
    for point in measured["points"]:
        if point["impl"] == "floor":
            continue
        floor_s = 8 * point["batch"] ** 2 * point["dim"] / (floor_tflops * 1e12) if floor_tflops else None
        ratio = point["time_s"] / floor_s if point["time_s"] and floor_s else None
        points.append({**point, "four_matmul_floor_s": floor_s, "x_floor": ratio})
    return {
        "floor_tflops": floor_tflops,
        "floor_tflops_by_batch": dict(zip((p["batch"] for p in floors), rates, strict=True)),
        "points": points,
        "accuracy": measured["accuracy"],
    }


def _run_line(run: dict[str, Any]) -> str:
    """A trainer run in one line, printed as it ends: the console keeps it if the files are lost."""
    what = f"batch {run['batch']}, chunks {'/'.join(map(str, run['chunks']))}, compile {run['compile']}"
    if "error" in run:
        return f"{what}: FAILED: {run['error'].splitlines()[0]}"
    return f"{what}: {run['samples_per_s']:.0f} samples/s ({run['wall_s']:.0f} s)"


def _cell(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else f"{value:{spec}}"


def summarise(report: dict[str, Any]) -> str:
    """The Markdown summary: one table per section, and each failed section's error beside what it
    measured before it."""
    machine = report["machine"]
    title = "DRY RUN (CPU, toy sizes: the figures mean nothing)" if report["dry_run"] else machine["device"]
    lines = [
        f"# gpu-bench: {title}",
        "",
        f"{machine['device']}, torch {machine['torch']}, CUDA {machine.get('cuda', '-')}, {machine['date']}, "
        f"{report['wall_s']:.0f} s ({report['setup_s']:.0f} s of it before the benchmark started: the kit's "
        "install, imports)",
        "",
        "packages: " + ", ".join(f"{name} {version}" for name, version in machine["packages"].items()),
    ]
    trainer_runs = report.get("trainer", {}).get("runs", [])
    tables = {"matmul": _matmul_line, "trainer": _trainer_table,
              "step": lambda result: _step_table(result, trainer_runs),
              "open_clip": lambda result: _open_clip_table(result, trainer_runs),
              "loss": _loss_tables}  # fmt: skip
    for name, write in tables.items():
        if name not in report:
            continue
        lines += ["", f"## {name}", ""]
        result = report[name]
        if "error" in result:
            lines.append(f"**failed**: `{result['error'].splitlines()[0]}` (the JSON has the rest)")
        if any(result.get(key) for key in FIGURES):
            lines += write(result)
    return "\n".join(lines) + "\n"


def _loss_tables(result: dict[str, Any]) -> list[str]:
    lines = [
        f"forward + backward, bf16; the floor: 4 products at the rate of the loss's b x d x b product "
        f"measured here, {_cell(result['floor_tflops'])} TFLOP/s; Inf-CL: {result['inf_cl']}",
        "",
        "| rows | impl | time s | peak GiB | x 4-matmul floor | note |",
        "|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        peak = p["peak_mib"] / 1024 if p["peak_mib"] is not None else None
        lines.append(
            f"| {p['batch']} | {p['impl']} | {_cell(p['time_s'], '.4f')} | {_cell(peak, '.2f')} | "
            f"{_cell(p['x_floor'], '.2f')} | {p.get('note', '')} |"
        )
    lines += [
        "",
        "| accuracy vs fp64 | rows | loss, relative | gradients, of their largest |",
        "|---|---|---|---|",
    ]
    for a in result["accuracy"]:
        lines.append(
            f"| {a['impl']} | {a['rows']} | {_cell(a.get('loss_rel_error'), '.1e')} | "
            f"{_cell(a.get('grad_rel_error'), '.1e')} {a.get('note', '')} |"
        )
    return lines


def _trainer_table(result: dict[str, Any]) -> list[str]:
    every = result["log_every"]
    first = -(-result["warmup"] // every) * every + 1  # the first log window after the warm-up
    lines = [
        f"`clip-train train` {result['model']}, bf16, synthetic shards, logged every {every} "
        f"steps; medians over steps {first}-{result['steps']}: samples/s of each log window, "
        "the split of each logged step; peak GiB: the most allocated, or under CUDA graphs "
        "(reduce-overhead) reserved, graph pools included",
        "",
        "| batch | chunks | compile | samples/s | model TFLOP/s | MFU | of matmul rate | peak GiB | "
        "data/encode/loss/replay/optimizer s | start-up s | run's wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        head = f"| {r['batch']} | {'/'.join(map(str, r['chunks']))} | {r['compile']} |"
        if "error" in r:
            lines.append(f"{head} failed: `{r['error'].splitlines()[0]}` ||||||||")
            continue
        peak = r["peak_bytes"] / 2**30 if "peak_bytes" in r else None
        split = "/".join(f"{s:.3f}" for s in r["split_s"].values())
        rates = [
            _cell(r.get(key), spec)
            for key, spec in (("tflops", ".3g"), ("mfu", ".1%"), ("of_matmul_rate", ".1%"))
        ]
        lines.append(
            f"{head} {r['samples_per_s']:.0f} | {' | '.join(rates)} | {_cell(peak, '.2f')} | {split} | "
            f"{r['startup_s']['total']:.0f} | {r['wall_s']:.0f} |"
        )
    lines += _startup_table([r for r in result["runs"] if "error" not in r])
    if result["profile"]:
        lines += ["", "## profile", "", *_profile_tables(result["profile"])]
    return lines


def _startup_table(runs: list[dict[str, Any]]) -> list[str]:
    """Each run's start-up by stage (``startup/*`` of its metrics.jsonl), the stages that took a
    tenth of a second in some run."""
    if not runs:
        return []
    stages = [s for s in runs[0]["startup_s"] if s != "total" and max(r["startup_s"][s] for r in runs) >= 0.1]
    lines = [
        "",
        "start-up, s: from the process's start to the end of its first step",
        "",
        "| batch | compile | " + " | ".join(s.replace("_", " ") for s in stages) + " | total |",
        "|---|---|" + "---|" * (len(stages) + 1),
    ]
    for r in runs:
        times = " | ".join(f"{r['startup_s'][s]:.1f}" for s in [*stages, "total"])
        lines.append(f"| {r['batch']} | {r['compile']} | {times} |")
    return lines


def _step_table(result: dict[str, Any], trainer_runs: list[dict[str, Any]]) -> list[str]:
    """Each bare step beside the eager trainer at its batch and chunks: the loop's share of it."""
    trainer = {
        (r["batch"], tuple(r["chunks"])): r
        for r in trainer_runs
        if r["compile"] == "off" and "error" not in r
    }
    lines = [
        f"`clip-train bench step`, bf16, eager, median of {result['repeats']} steps after a warm-up; "
        "the loop: the eager trainer's samples/s over the step's; ready: its measuring process's start "
        "to its warm-up step",
        "",
        "| batch | chunks | step s | step samples/s | peak GiB | trainer samples/s | loop / step | ready s | "
        "warm-up step s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        run = trainer.get((p["batch"], tuple(p["chunks"])))
        loop = run["samples_per_s"] if run else None
        share = loop / p["samples_per_s"] if loop else None
        lines.append(
            f"| {p['batch']} | {'/'.join(map(str, p['chunks']))} | {p['step_s']:.4f} | "
            f"{p['samples_per_s']:.0f} | {p['peak_bytes'] / 2**30:.2f} | {_cell(loop, '.0f')} | "
            f"{_cell(share, '.1%')} | {p['ready_s']:.1f} | {p['warmup_s']:.1f} | {p['wall_s']:.0f} |"
        )
    return lines


def _open_clip_table(result: dict[str, Any], trainer_runs: list[dict[str, Any]]) -> list[str]:
    """OpenCLIP's trainer beside the eager one-chunk trainer at its batch."""
    ours = next(
        (r["samples_per_s"] for r in trainer_runs
         if (r["batch"], r["chunks"], r["compile"]) == (result["batch"], [0, 0], "off") and "error" not in r),
        None,
    )  # fmt: skip
    ratio = ours / result["samples_per_s"] if ours else None
    return [
        "`open_clip_train.main` on the exported architecture and the same shards, steps and log cadence, "
        "bf16 autocast; clip_train: the trainer's eager one-chunk run",
        "",
        "| batch | OpenCLIP samples/s | clip_train samples/s | clip_train / OpenCLIP | OpenCLIP's wall s |",
        "|---|---|---|---|---|",
        f"| {result['batch']} | {result['samples_per_s']:.0f} | {_cell(ours, '.0f')} | "
        f"{_cell(ratio, '.2f')} | {result['wall_s']:.0f} |",
    ]


def _matmul_line(result: dict[str, Any]) -> list[str]:
    size = result["size"]
    return [f"{size} x {size} x {size} bf16 product: {result['tflops']:.0f} TFLOP/s (mean of 10)"]


def _profile_tables(result: dict[str, Any]) -> list[str]:
    """The traced steps' shares, the idle time by what the host was doing, the top kernels."""
    shares, (first, last) = result["shares"], result["steps_traced"]
    chunks = "one chunk" if result["chunks"] == [0, 0] else "chunks " + "/".join(map(str, result["chunks"]))
    lines = [
        f"`clip-train train` at batch {result['batch']} ({chunks}), compile {result['compile']}, steps "
        f"{first}-{last} under `log.profile_steps` (the trace: gpu-bench.trace.json.gz): {describe(result)}",
        "",
        "| " + " | ".join(SHARES) + " |",
        "|" + "---|" * len(SHARES),
        "| " + " | ".join(f"{shares[s]:.1%}" for s in SHARES) + " |",
        "",
        "| ms a step | " + " | ".join(result["host_s"]) + " | other |",
        "|---|" + "---|" * (len(result["host_s"]) + 1),
        "| host in the phase | " + " | ".join(f"{t * 1e3:.1f}" for t in result["host_s"].values()) + " | - |",
        "| device idle meanwhile | " + " | ".join(f"{t * 1e3:.1f}" for t in result["idle_s"].values()) + " |",
        "",
        "| kernel | calls a step | ms a step | of the step |",
        "|---|---|---|---|",
    ]
    for k in result["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        lines.append(f"| `{name}` | {k['calls']:g} | {k['time_s'] * 1e3:.2f} | {k['share']:.1%} |")
    return lines
