"""`clip-train bench gpu` (``make gpu-bench``): what one GPU session should measure, in one command
of at most ten minutes on an H100, into one folder: ``gpu-bench.json`` (everything),
``gpu-bench.md`` (the summary tables, printed last), ``gpu-bench.log`` (every step's output) and
``gpu-bench.trace.json.gz`` (the profiled steps' Chrome trace).

1. matmul: the rate of an 8192³ bf16 product, the practical ceiling "of matmul rate" is against;
2. trainer: ``clip-train train`` on synthetic 224 px shards, ViT-B/16 + BERT-base, per-GPU batch
   256 in one chunk and 1024 with Gradient Cache, eager and ``train.compile`` (batch 256 also with
   ``train.compile_mode=reduce-overhead``, CUDA graphs): samples/s, model TFLOP/s, MFU, the share
   of the measured matmul rate, peak memory and the step split. The CUDA-graph run is also
   profiled (``log.profile_steps``, ``clip_train.profiling``) before its measured steps: the
   shares of matmul, attention, elementwise, optimizer, copies and idle, the idle time by what
   the host was doing, and the top 15 kernels;
3. step: ``bench step``, the bare Gradient Cache step (forward and backward, no loop, no optimizer)
   at the trainer's eager batches and chunks, and the trainer's samples/s as a share of its;
4. open_clip: OpenCLIP's own trainer on the same exported architecture and shards at batch 256,
   at the trainer's log cadence, beside the eager trainer;
5. loss: forward + backward in bf16, d = 512, at 16k to 262k rows: clip_train's tiles, open_clip's
   ``ClipLoss`` (until it runs out of memory) and Inf-CL's ``cal_inf_loss`` when ``inf_cl`` is
   installed; time, peak memory, error against fp64 at 8k rows, and the time over the floor of the
   loss's 4 matmuls at the rate of its b × d × b product measured in the same run (``bench loss``).

Each section runs in its own processes and fails soft: its error goes into the JSON and the summary,
and the next section runs. ``--budget-s`` bounds the whole: a run still going when it is spent is
stopped, and what has not started is recorded as not run, so the summary is written in time.

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
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch

from clip_train.bench import step as bench_step
from clip_train.bench.matmul import square_matmul_tflops
from clip_train.bench.runner import in_fresh_process, run_logged
from clip_train.bench.train import OUTPUT, export_initial_model, run_clip_train, run_open_clip
from clip_train.config import load_config
from clip_train.profiling import SHARES, describe

# The trainer's figures first: a session whose time runs out loses the loss, measured three times before.
SECTIONS = ("matmul", "trainer", "step", "open_clip", "loss")
BUDGET_S = 540.0  # of a GPU session's ten minutes: the kit's install (~30 s) and the summary need the rest
LEFT_TO_START_S = 20.0  # a run or section starts only with this much of the budget left
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
        (256, 0, 0, "reduce-overhead"),
        (1024, 256, 512, "off"),
        (1024, 256, 512, "default"),
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
        help=f"seconds for all of it (default {BUDGET_S:.0f}): a run still going then is stopped, and what "
        "has not started is not run; 0 for no limit",
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
    report: dict[str, Any] = {
        "dry_run": not cuda,
        "machine": _machine(cuda),
        "sizes": dataclasses.asdict(sizes),
        "wall_s": 0.0,
    }
    started = time.perf_counter()
    summary = _write(report, out)  # rewritten after every section: a session cut short keeps what it measured
    with tempfile.TemporaryDirectory() as tmp, (out / "gpu-bench.log").open("w") as log:
        budget_s = args.budget_s or float("inf")
        bench = _Bench(sizes, "cuda" if cuda else "cpu", out, Path(tmp), log, args.set, started, budget_s)
        for name in sections:
            report[name] = bench.section(name, getattr(bench, name))
            report["wall_s"] = time.perf_counter() - started
            summary = _write(report, out)
    print(f"gpu-bench: {', '.join(FILES)} in {out} ({report['wall_s']:.0f} s)\n")
    print(summary, flush=True)
    return 0


def _write(report: dict[str, Any], out: Path) -> str:
    """The JSON and the markdown summary of what ``report`` holds so far; returns the summary."""
    summary = summarise(report)
    (out / "gpu-bench.json").write_text(json.dumps(report, indent=2))
    (out / "gpu-bench.md").write_text(summary)
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
    return machine


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
        """``budget_s`` counts from ``started`` (``time.perf_counter``), the clock of the report's
        ``wall_s``."""
        self.sizes, self.device, self.out, self.work, self.log = sizes, device, out, work, log
        self.overrides = overrides
        self.matmul_tflops: float | None = None
        self.started, self.budget_s = started, budget_s

    def _left_s(self) -> float:
        """What is left of the budget: each process's timeout."""
        return self.budget_s - (time.perf_counter() - self.started)

    def _out_of_time(self) -> str | None:
        if self._left_s() >= LEFT_TO_START_S:
            return None
        return f"not run: {self._left_s():.0f} s of the {self.budget_s:.0f} s budget (--budget-s) left"

    def section(self, name: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``measure()``'s results, or its error: one failing section never loses the others."""
        print(f"gpu-bench: {name} ...", flush=True)
        self._note(f"=== {name}")
        started = time.perf_counter()
        try:
            if late := self._out_of_time():
                raise TimeoutError(late)
            result = measure()
        except Exception as err:
            result = {"error": f"{type(err).__name__}: {err}"[-3000:]}
        result["wall_s"] = time.perf_counter() - started
        outcome = f"FAILED: {result['error'].splitlines()[0]}" if "error" in result else "done"
        print(f"gpu-bench: {name}: {outcome} ({result['wall_s']:.0f} s)", flush=True)
        return result

    def _note(self, text: str) -> None:
        self.log.write(text + "\n")
        self.log.flush()

    def _clip_train(self, *arguments: str) -> None:
        """``python -m clip_train ARGUMENTS`` with its output in the log; its last lines on failure."""
        command = [sys.executable, "-m", "clip_train", *arguments]
        self._note("$ " + " ".join(command))
        output = self.work / f"{'-'.join(arguments[:2])}.log"
        with self._output_logged(output):
            run_logged(command, output, f"clip-train {arguments[0]} {arguments[1]}", timeout_s=self._left_s())

    @contextlib.contextmanager
    def _output_logged(self, output: Path) -> Iterator[None]:
        """A process writing ``output``: put in the log however the process ends (its start-up lines,
        progress and profile, or what it said before it failed or was stopped)."""
        try:
            yield
        finally:
            if output.is_file():
                self._note(output.read_text(errors="replace"))

    def matmul(self) -> dict[str, Any]:
        """The rate a large square bf16 product reaches here: what "of matmul rate" is against, the
        device's practical ceiling (an H100 SXM reaches about 800 of its datasheet's 989 TFLOP/s)."""
        spec = {"device": self.device, "size": self.sizes.matmul_size}
        self.matmul_tflops = in_fresh_process(square_matmul_tflops, spec, self._left_s())
        return {**spec, "dtype": "bfloat16", "tflops": self.matmul_tflops}

    def loss(self) -> dict[str, Any]:
        sizes, out = self.sizes, self.work / "loss.json"
        impls = ["inf", "open_clip", *(["inf_cl"] if importlib.util.find_spec("inf_cl") else [])]
        self._clip_train(
            "bench", "loss", "--device", self.device, "--dtype", "bfloat16", "--dim", str(sizes.loss_dim),
            "--repeats", str(sizes.loss_repeats), "--batch", ",".join(map(str, sizes.loss_batches)),
            "--impl", ",".join(impls), "--accuracy", str(sizes.accuracy_rows), "--json", str(out),
        )  # fmt: skip
        measured = json.loads(out.read_text())
        floors = [p for p in measured["points"] if p["impl"] == "floor" and p["time_s"]]
        rates = [2 * p["batch"] ** 2 * p["dim"] / p["time_s"] / 1e12 for p in floors]
        floor_tflops = max(rates)  # the loss's own shape (b × d × b), not the square product's
        points = []
        for point in measured["points"]:
            if point["impl"] == "floor":
                continue
            floor_s = 8 * point["batch"] ** 2 * point["dim"] / (floor_tflops * 1e12)  # 4 matmuls
            ratio = point["time_s"] / floor_s if point["time_s"] else None
            points.append({**point, "four_matmul_floor_s": floor_s, "x_floor": ratio})
        return {
            "floor_tflops": floor_tflops,
            "floor_tflops_by_batch": dict(zip((p["batch"] for p in floors), rates, strict=True)),
            "points": points,
            "accuracy": measured["accuracy"],
            "inf_cl": "measured" if "inf_cl" in impls else "not installed",
        }

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

    def trainer(self) -> dict[str, Any]:
        """The trainer at each setting; one run (``Sizes.profiled``) is also profiled, in steps
        before its measured windows, so the profile shows the loop as a run has it."""
        sizes, shards, runs, profile = self.sizes, self._shards(), [], None
        for batch, image_chunk, text_chunk, compiling in sizes.trainer:
            run = {"batch": batch, "chunks": [image_chunk, text_chunk], "compile": compiling}
            settings = self._settings(image_chunk, text_chunk, compiling)
            profiled = (batch, compiling) == sizes.profiled
            if profiled:
                settings += [
                    f"log.profile_after={sizes.profile_after}",
                    f"log.profile_steps={sizes.profile_steps}",
                ]
            options = SimpleNamespace(
                config=sizes.model, set=settings, shards=shards, steps=sizes.steps, warmup=sizes.warmup
            )
            self._note(f"clip-train train {sizes.model} {' '.join(settings)}")
            run_dir, started = self.work / f"run-{batch}-{compiling}", time.perf_counter()
            try:
                if late := self._out_of_time():
                    raise TimeoutError(late)
                with self._output_logged(run_dir / OUTPUT):
                    run |= run_clip_train(options, batch, 1, run_dir, sizes.log_every, self._left_s())
                if profiled:
                    profile = {
                        "batch": batch,
                        "chunks": run["chunks"],
                        "compile": compiling,
                        **self._keep_profile(run_dir / "profile"),
                    }
            except Exception as err:
                run["error"] = f"{type(err).__name__}: {err}"[-3000:]
            run["wall_s"] = time.perf_counter() - started  # start-up and compiling included
            if self.matmul_tflops and "tflops" in run:
                run["of_matmul_rate"] = run["tflops"] / self.matmul_tflops
            self._note(json.dumps(run))  # in the log at once: a session cut short keeps the runs so far
            runs.append(run)
        return {
            "model": sizes.model,
            "steps": sizes.steps,
            "warmup": sizes.warmup,
            "log_every": sizes.log_every,
            "runs": runs,
            "profile": profile,
        }

    def _keep_profile(self, folder: Path) -> dict[str, Any]:
        """The profiled run's summary; its trace goes into the results folder."""
        shutil.copy(folder / "trace-rank0.json.gz", self.out / "gpu-bench.trace.json.gz")
        return json.loads((folder / "summary-rank0.json").read_text())

    def step(self) -> dict[str, Any]:
        """The bare step at each eager trainer setting, which bounds what the loop around it can do:
        ``bench step``'s measurement, each in one fresh process (not the command's two)."""
        parser, points = argparse.ArgumentParser(), []
        bench_step.add_arguments(parser)
        for batch, image_chunk, text_chunk, compiling in self.sizes.trainer:
            if compiling != "off":  # bench step runs the towers eager
                continue
            arguments = [
                "--model", self.sizes.model, "--batch", str(batch), "--image-chunk", str(image_chunk),
                "--text-chunk", str(text_chunk), "--precision", "bf16", "--device", self.device,
                "--repeats", str(self.sizes.step_repeats), "--set", *self.overrides,
            ]  # fmt: skip
            self._note("clip-train bench step " + " ".join(arguments))
            spec = bench_step.batch_spec(parser.parse_args(arguments), batch, ["gc"])
            started = time.perf_counter()
            point = in_fresh_process(bench_step.measure, {**spec, "mode": "gc"}, self._left_s())
            self._note(json.dumps(point))
            if "error" in point:
                raise RuntimeError(f"bench step at batch {batch}: {point['error']}")
            step_s = point["median_s"]
            points.append(
                {"batch": batch, "chunks": [image_chunk, text_chunk], "step_s": step_s,
                 "samples_per_s": batch / step_s, "peak_bytes": point["peak_bytes"],
                 "ready_s": point["ready_s"], "warmup_s": point["warmup_s"],
                 "wall_s": time.perf_counter() - started}
            )  # fmt: skip
        return {"repeats": self.sizes.step_repeats, "points": points}

    def open_clip(self) -> dict[str, Any]:
        """OpenCLIP's own trainer on the same exported architecture and shards at the trainer's log
        cadence (its samples/s per log window, as clip_train's), beside the eager trainer. Its epoch
        rounds the trainer's steps up to a whole number of batches per loader worker."""
        sizes, export = self.sizes, self.work / "open_clip_model"
        cfg = load_config(sizes.model, self._settings(0, 0))
        export_initial_model(cfg, export)
        shards, batch = self._shards(), sizes.open_clip_batch
        options = SimpleNamespace(shards=shards, steps=sizes.steps, warmup=sizes.warmup)
        started = time.perf_counter()
        run_dir = self.work / "open_clip"
        with self._output_logged(run_dir / OUTPUT):
            result = run_open_clip(options, cfg, export, batch, 1, run_dir, sizes.log_every, self._left_s())
        return {"batch": batch, **result, "wall_s": time.perf_counter() - started}


def _cell(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else f"{value:{spec}}"


def summarise(report: dict[str, Any]) -> str:
    """The Markdown summary: one table per section, and each failed section's error."""
    machine = report["machine"]
    title = "DRY RUN (CPU, toy sizes: the figures mean nothing)" if report["dry_run"] else machine["device"]
    lines = [
        f"# gpu-bench: {title}",
        "",
        f"{machine['device']}, torch {machine['torch']}, CUDA {machine.get('cuda', '-')}, {machine['date']}, "
        f"{report['wall_s']:.0f} s",
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
        lines += (
            [f"**failed**: `{result['error'].splitlines()[0]}` (the JSON has the rest)"]
            if "error" in result
            else write(result)
        )
    return "\n".join(lines) + "\n"


def _loss_tables(result: dict[str, Any]) -> list[str]:
    lines = [
        f"forward + backward, bf16; the floor: 4 products at the rate of the loss's b x d x b product "
        f"measured here, {result['floor_tflops']:.3g} TFLOP/s; Inf-CL: {result['inf_cl']}",
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
