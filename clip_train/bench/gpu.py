"""`clip-train bench gpu` (``make gpu-bench``): what one GPU session should measure, in one command
of at most ten minutes on an H100, into one folder: ``gpu-bench.json`` (everything),
``gpu-bench.md`` (the summary tables, printed last) and ``gpu-bench.log`` (every step's output).

1. loss: forward + backward in bf16, d = 512, at 16k to 262k rows: clip_train's tiles, open_clip's
   ``ClipLoss`` (until it runs out of memory) and Inf-CL's ``cal_inf_loss`` when ``inf_cl`` is
   installed; time, peak memory, error against fp64 at 8k rows, and the time over the floor of the
   loss's 4 matmuls at the bf16 matmul rate measured in the same run (``bench loss``);
2. trainer: ``clip-train train`` on synthetic 224 px shards, ViT-B/16 + BERT-base, per-GPU batch
   256 in one chunk and 1024 with Gradient Cache, eager and ``train.compile``: samples/s, model
   TFLOP/s, MFU, the share of the measured matmul rate, peak memory and the step split;
3. step: ``bench step``, the bare Gradient Cache step (forward and backward, no loop, no optimizer)
   at the trainer's eager batches and chunks, and the trainer's samples/s as a share of its;
4. open_clip: OpenCLIP's own trainer on the same exported architecture and shards at batch 256,
   beside clip_train (``bench train``);
5. profile: one training step with ``train.compile`` (the trainer's fastest setting) under
   ``torch.profiler``: the top 15 kernels by time and the shares of matmul, attention, elementwise
   (everything else), optimizer, copies and idle gaps.

Each section runs in its own processes and fails soft: its error goes into the JSON and the summary,
and the next section runs. Without a CUDA GPU the same sections run on the CPU at toy sizes (the
tiny model, small batches, small losses): a dry run that keeps the command working between GPU
sessions, said so on its first line; its figures mean nothing. There ``train.compile`` runs with
``TORCHDYNAMO_DISABLE=1`` (inductor's C++ builds take minutes on a small CPU): the runs and their
reports are the same, the towers run eager.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from clip_train.bench.runner import in_fresh_process

SECTIONS = ("loss", "trainer", "step", "open_clip", "profile")
STEP, OPTIMIZER = "clip_train.step", "clip_train.optimizer"  # the profiled step's annotations
TOP_KERNELS = 15
FILES = ("gpu-bench.json", "gpu-bench.md", "gpu-bench.log")


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
    # (per-GPU batch, image chunk, text chunk, train.compile); chunk 0 = one chunk
    trainer: tuple[tuple[int, int, int, bool], ...]
    steps: int
    warmup: int
    log_every: int  # the trainer's samples/s: over each window of this many steps (one waits to log)
    step_repeats: int
    open_clip_batch: int


GPU = Sizes(
    loss_batches=(16384, 65536, 131072, 262144),
    loss_dim=512,
    loss_repeats=3,
    accuracy_rows=8192,
    model="configs/model/vit-b16-bert-base-random.yaml",
    synthetic_images=4096,
    workers=min(12, max(1, (os.cpu_count() or 2) - 2)),
    trainer=((256, 0, 0, False), (256, 0, 0, True), (1024, 256, 512, False), (1024, 256, 512, True)),
    steps=50,
    warmup=10,
    log_every=10,
    step_repeats=10,
    open_clip_batch=256,
)
DRY_RUN = Sizes(
    loss_batches=(256,),
    loss_dim=32,
    loss_repeats=1,
    accuracy_rows=128,
    model="configs/model/tiny.yaml",
    synthetic_images=48,
    workers=1,
    trainer=((16, 0, 0, False), (32, 8, 16, True)),  # compiled runs are eager here: each path once
    steps=4,
    warmup=1,
    log_every=2,
    step_repeats=1,
    open_clip_batch=16,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="the results folder (default gpu-bench/UTC-DATE)")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}"
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model config overrides")


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
        bench = _Bench(sizes, "cuda" if cuda else "cpu", Path(tmp), log, args.set)
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
    """The sections, in order; later ones use what earlier ones measured (the matmul rate)."""

    def __init__(self, sizes: Sizes, device: str, work: Path, log, overrides: list[str]) -> None:
        self.sizes, self.device, self.work, self.log = sizes, device, work, log
        self.overrides = overrides
        self.matmul_tflops: float | None = None

    def section(self, name: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``measure()``'s results, or its error: one failing section never loses the others."""
        print(f"gpu-bench: {name} ...", flush=True)
        self._note(f"=== {name}")
        started = time.perf_counter()
        try:
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
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        self._note(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            said = [line for line in lines if "error:" in line.lower()][:5]  # a process's own message first
            shown = "\n".join([*said, "...", *lines[-10:]])
            raise RuntimeError(f"clip-train {arguments[0]} {arguments[1]} exited {proc.returncode}:\n{shown}")

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
        self.matmul_tflops = max(rates)
        points = []
        for point in measured["points"]:
            if point["impl"] == "floor":
                continue
            floor_s = 8 * point["batch"] ** 2 * point["dim"] / (self.matmul_tflops * 1e12)  # 4 matmuls
            ratio = point["time_s"] / floor_s if point["time_s"] else None
            points.append({**point, "four_matmul_floor_s": floor_s, "x_floor": ratio})
        return {
            "matmul_tflops": self.matmul_tflops,
            "matmul_tflops_by_batch": dict(zip((p["batch"] for p in floors), rates, strict=True)),
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

    def _settings(self, image_chunk: int, text_chunk: int, compiled: bool = False) -> list[str]:
        settings = [
            *self.overrides, "train.precision=bf16", f"data.workers={self.sizes.workers}",
            f"batch.image_chunk={image_chunk}", f"batch.text_chunk={text_chunk}", f"train.compile={compiled}",
        ]  # fmt: skip
        if self.device == "cpu" and self.matmul_tflops:  # no peak in the table: the measured rate stands in
            settings.append(f"log.peak_tflops={self.matmul_tflops}")
        return settings

    def trainer(self) -> dict[str, Any]:
        from clip_train.bench.train import _clip_train

        sizes, shards, runs = self.sizes, self._shards(), []
        for batch, image_chunk, text_chunk, compiled in sizes.trainer:
            run = {"batch": batch, "chunks": [image_chunk, text_chunk], "compile": compiled}
            settings = self._settings(image_chunk, text_chunk, compiled)
            options = SimpleNamespace(
                config=sizes.model, set=settings, shards=shards, steps=sizes.steps, warmup=sizes.warmup
            )
            self._note(f"clip-train train {sizes.model} {' '.join(settings)}")
            try:
                run |= _clip_train(options, batch, 1, self.work / f"run-{batch}-{compiled}", sizes.log_every)
            except Exception as err:
                run["error"] = f"{type(err).__name__}: {err}"[-3000:]
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
        }

    def step(self) -> dict[str, Any]:
        """The bare step at each eager trainer setting, which bounds what the loop around it can do."""
        points = []
        for batch, image_chunk, text_chunk, compiled in self.sizes.trainer:
            if compiled:  # bench step runs the towers eager
                continue
            out = self.work / f"step-{batch}.json"
            self._clip_train(
                "bench", "step", "--model", self.sizes.model, "--batch", str(batch),
                "--image-chunk", str(image_chunk), "--text-chunk", str(text_chunk), "--precision", "bf16",
                "--device", self.device, "--repeats", str(self.sizes.step_repeats), "--no-direct",
                "--json", str(out), "--set", *self.overrides,
            )  # fmt: skip
            (point,) = json.loads(out.read_text())["points"]
            if "error" in point:
                raise RuntimeError(f"bench step at batch {batch}: {point['error']}")
            step_s = point["median_s"]
            points.append(
                {"batch": batch, "chunks": [image_chunk, text_chunk], "step_s": step_s,
                 "samples_per_s": batch / step_s, "peak_bytes": point["peak_bytes"]}
            )  # fmt: skip
        return {"repeats": self.sizes.step_repeats, "points": points}

    def open_clip(self) -> dict[str, Any]:
        sizes, out = self.sizes, self.work / "train.json"
        self._clip_train(
            "bench", "train", "--config", sizes.model, "--shards", str(self._shards()),
            "--batch", str(sizes.open_clip_batch), "--procs", "1", "--steps", str(sizes.steps),
            "--warmup", str(sizes.warmup), "--pairs", "1", "--json", str(out), "--set", *self._settings(0, 0),
        )  # fmt: skip
        (row,) = json.loads(out.read_text())["results"]
        return row

    def profile(self) -> dict[str, Any]:
        """The step that is left to speed up: compiled, as the trainer runs fastest."""
        batch, settings = self.sizes.trainer[0][0], self._settings(0, 0, compiled=True)
        spec = {"model": self.sizes.model, "set": settings, "batch": batch, "device": self.device}
        return {"batch": batch, **in_fresh_process(profile_step, spec)}


def profile_step(spec: dict[str, Any]) -> dict[str, Any]:
    """One training step (after two warm-up steps, which compile it under ``train.compile``) under
    ``torch.profiler``, summarised."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from clip_train.bench.step import synthetic_batch
    from clip_train.config import load_config
    from clip_train.distributed import wait_for_device
    from clip_train.engine import GradCache
    from clip_train.model import build_model
    from clip_train.model.compiling import compile_towers
    from clip_train.optim import Update
    from clip_train.precision import use_tf32

    device = torch.device(spec["device"])
    cfg = load_config(spec["model"], spec["set"])
    use_tf32(device, cfg.train.precision)  # as the trainer sets it
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device).train()
    if cfg.train.compile:
        compile_towers(model)
    engine = GradCache.from_config(model, cfg, (cfg.batch.image_chunk, cfg.batch.text_chunk))
    update = Update(model, cfg, device)
    batch = synthetic_batch(model, spec["batch"])

    def step() -> None:
        update.optimizer.zero_grad(set_to_none=True)
        stats = engine.step(*batch, scale_loss=update.scaler.scale)
        # The optimizer reads nothing from the device: without this wait, the backward's kernels still
        # running would count as the optimizer's share.
        wait_for_device(device)
        with record_function(OPTIMIZER):
            update(stats.loss, 1)
        wait_for_device(device)

    for _ in range(2):
        step()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]
    with profile(activities=activities) as prof, record_function(STEP):
        step()
    events = [
        {
            "name": e.name,
            "device": "cuda" if e.device_type == torch.autograd.DeviceType.CUDA else "cpu",
            "start": e.time_range.start,
            "end": e.time_range.end,
            "self": e.self_cpu_time_total,
        }
        for e in prof.events()
    ]
    return summarise_profile(events, device.type)


CATEGORIES = (  # by kernel or op name, first match wins; the rest is elementwise (and other) work
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::baddbmm", "convolution")),
    ("copies", ("memcpy", "memset", "copy", "aten::to", "aten::clone", "aten::cat")),
)  # fmt: skip
SHARES = ("matmul", "attention", "elementwise", "optimizer", "copies", "idle")


def category(name: str, in_optimizer: bool) -> str:
    """Which share a kernel (CUDA) or op (CPU) counts toward."""
    if in_optimizer:
        return "optimizer"
    lowered = name.lower()
    for label, needles in CATEGORIES:
        if any(needle in lowered for needle in needles):
            return label
    return "elementwise"


def summarise_profile(events: list[dict[str, Any]], device: str) -> dict[str, Any]:
    """The step's time split into :data:`SHARES` and its top kernels, from profiler events (``name``,
    ``device``, ``start``/``end`` in µs, CPU ``self`` µs). On CUDA the work is the kernels' time on
    the GPU (their union: overlaps count once) and idle is the rest of the step; on the CPU it is the
    ops' self time, and idle is the step's time outside any op (Python, waits). The optimizer is
    everything that starts after its annotation does (``profile_step`` waits for the GPU before it)."""
    annotations = {e["name"]: e for e in events if e["device"] == "cpu" and e["name"] in (STEP, OPTIMIZER)}
    step, optimizer = annotations[STEP], annotations[OPTIMIZER]
    span = step["end"] - step["start"]
    work = [e for e in events if e["device"] == device and e["name"] not in (STEP, OPTIMIZER)]
    work = [e for e in work if step["start"] <= e["start"] <= step["end"]]
    totals: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in work:
        time_us = e["end"] - e["start"] if device == "cuda" else e["self"]
        totals[category(e["name"], e["start"] >= optimizer["start"])] += time_us
        kernels[e["name"]].append(time_us)
    busy = min(span, _union_us(work) if device == "cuda" else sum(totals.values()))
    worked = sum(totals.values()) or 1.0  # more than busy where kernels overlap: shared pro rata
    shares = {name: busy / span * totals[name] / worked for name in SHARES if name != "idle"}
    shares["idle"] = 1 - busy / span
    top = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    return {
        "device": device,
        "step_s": span / 1e6,
        "busy_s": busy / 1e6,
        "shares": shares,
        "top_kernels": [
            {"name": name, "calls": len(times), "total_s": sum(times) / 1e6, "share": sum(times) / span}
            for name, times in top
        ],
    }


def _union_us(events: list[dict[str, Any]]) -> float:
    """Length of the union of the events' intervals."""
    total, reach = 0.0, -float("inf")
    for e in sorted(events, key=lambda e: e["start"]):
        start = max(e["start"], reach)
        if e["end"] > start:
            total += e["end"] - start
        reach = max(reach, e["end"])
    return total


def _cell(value: Any, spec: str = ".3g", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


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
    tables = {"loss": _loss_tables, "trainer": _trainer_table,
              "step": lambda result: _step_table(result, trainer_runs),
              "open_clip": _open_clip_table, "profile": _profile_tables}  # fmt: skip
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
        f"forward + backward, bf16; bf16 matmul rate measured: {result['matmul_tflops']:.3g} TFLOP/s; "
        f"Inf-CL: {result['inf_cl']}",
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
        "the split of each logged step",
        "",
        "| batch | chunks | compile | samples/s | model TFLOP/s | MFU | of matmul rate | peak GiB | "
        "data/encode/loss/replay/optimizer s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        head = f"| {r['batch']} | {'/'.join(map(str, r['chunks']))} | {r['compile']} |"
        if "error" in r:
            lines.append(f"{head} failed: `{r['error'].splitlines()[0]}` ||||||")
            continue
        peak = r["peak_bytes"] / 2**30 if "peak_bytes" in r else None
        split = "/".join(f"{s:.3f}" for s in r["split_s"].values())
        rates = [
            _cell(r.get(key), spec)
            for key, spec in (("tflops", ".3g"), ("mfu", ".1%"), ("of_matmul_rate", ".1%"))
        ]
        lines.append(
            f"{head} {r['samples_per_s']:.0f} | {' | '.join(rates)} | {_cell(peak, '.2f')} | {split} |"
        )
    return lines


def _step_table(result: dict[str, Any], trainer_runs: list[dict[str, Any]]) -> list[str]:
    """Each bare step beside the eager trainer at its batch and chunks: the loop's share of it."""
    trainer = {
        (r["batch"], tuple(r["chunks"])): r for r in trainer_runs if not r["compile"] and "error" not in r
    }
    lines = [
        f"`clip-train bench step`, bf16, eager, median of {result['repeats']} steps after a warm-up; "
        "the loop: the eager trainer's samples/s over the step's",
        "",
        "| batch | chunks | step s | step samples/s | peak GiB | trainer samples/s | loop / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        run = trainer.get((p["batch"], tuple(p["chunks"])))
        loop = run["samples_per_s"] if run else None
        share = loop / p["samples_per_s"] if loop else None
        lines.append(
            f"| {p['batch']} | {'/'.join(map(str, p['chunks']))} | {p['step_s']:.4f} | "
            f"{p['samples_per_s']:.0f} | {p['peak_bytes'] / 2**30:.2f} | {_cell(loop, '.0f')} | "
            f"{_cell(share, '.1%')} |"
        )
    return lines


def _open_clip_table(row: dict[str, Any]) -> list[str]:
    return [
        "| batch | OpenCLIP samples/s | clip_train samples/s | clip_train / OpenCLIP |",
        "|---|---|---|---|",
        f"| {row['batch']} | {_cell(row.get('open_clip_samples_per_s'), '.0f')} | "
        f"{row['clip_train_samples_per_s']:.0f} | {_cell(row.get('ratio'), '.2f')} |",
    ]


def _profile_tables(result: dict[str, Any]) -> list[str]:
    shares = result["shares"]
    lines = [
        f"one step at batch {result['batch']} with train.compile: {result['step_s'] * 1e3:.1f} ms, of which "
        f"{result['device'].upper()} busy {result['busy_s'] * 1e3:.1f} ms",
        "",
        "| " + " | ".join(SHARES) + " |",
        "|" + "---|" * len(SHARES),
        "| " + " | ".join(f"{shares[s]:.1%}" for s in SHARES) + " |",
        "",
        "| kernel | calls | total ms | of the step |",
        "|---|---|---|---|",
    ]
    for k in result["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        lines.append(f"| `{name}` | {k['calls']} | {k['total_s'] * 1e3:.2f} | {k['share']:.1%} |")
    return lines
