"""Whole training steps, clip_train against OpenCLIP's own trainer: ``clip-train bench train``.

Both train the same architecture from the same initial weights (the config's model, exported for
open_clip by ``export_open_clip``), on the same shards, with AdamW and the config's learning rate,
warmup, weight decay, betas, epsilon, gradient clipping and precision, one torchrun per run of
several processes (gloo on the CPU), a plain process for one, the same processes, workers and global
batch. Each run logs every step; its samples/s is the median over the steps after the warm-up of
the rate it logs, the global batch over the step's wall time (data wait, forward, loss, backward,
optimizer, as each trainer times a step). The two alternate, run by run, so that a busy machine
slows both alike; the ratio is taken pair by pair.

OpenCLIP runs with ``--local-loss --gather-with-grad`` (its recommended distributed loss) and
``--workers`` like clip_train's ``data.workers``; its CPU quirks are handled in its worker
(``open_clip_trainer.py``). clip_train's step split (data, encode, loss, replay, optimizer) comes
from its metrics. Without ``open_clip_train`` installed only clip_train runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from clip_train.bench import positive_ints
from clip_train.bench.plotting import pyplot
from clip_train.bench.runner import run_logged
from clip_train.commands.report import read_records
from clip_train.config import Config, ConfigError, load_config
from clip_train.errors import UserError
from clip_train.export import export_open_clip
from clip_train.model import build_model

SPLIT = ("data", "encode", "loss", "replay", "optimizer")
# OpenCLIP's log line: the samples so far, then the mean step time since its previous log line.
OPEN_CLIP_STEP = re.compile(r"\[\s*(\d+)/\d+ \(\d+%\)\] Data \(t\): [0-9.]+ Batch \(t\): ([0-9.]+),")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/demo-digits.yaml", help="run config (model, optimizer)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--shards", type=Path, default=Path("runs/bench_train_digits"), help="digits shards")
    parser.add_argument("--batch", default="256,1024", help="comma-separated global batch sizes")
    parser.add_argument("--procs", default="1,2", help="comma-separated process counts (torchrun, gloo)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    parser.add_argument("--pairs", type=int, default=3, help="alternating clip_train / OpenCLIP pairs")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="save a samples/s plot here (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    batches, procs = positive_ints(args.batch, "--batch"), positive_ints(args.procs, "--procs")
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as err:
        raise UserError(str(err)) from None
    if args.steps <= args.warmup or args.pairs <= 0:
        raise UserError("--steps must be > --warmup and --pairs >= 1")
    if not (args.shards / "train").is_dir():
        subprocess.run(
            [sys.executable, "-m", "clip_train", "make-shards", "digits", str(args.shards)], check=True
        )
    has_open_clip = importlib.util.find_spec("open_clip_train") is not None
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp, "open_clip_model")
        if has_open_clip:
            export_initial_model(cfg, export)
        for batch in batches:
            for nproc in procs:
                condition = {"batch": batch, "procs": nproc, "pairs": []}
                for pair in range(args.pairs):
                    runs = {
                        "clip_train": run_clip_train(
                            args, batch, nproc, Path(tmp, f"ct-{batch}-{nproc}-{pair}")
                        )
                    }
                    if has_open_clip:
                        out = Path(tmp, f"oc-{batch}-{nproc}-{pair}")
                        runs["open_clip"] = run_open_clip(args, cfg, export, batch, nproc, out)
                    condition["pairs"].append(runs)
                    print(_pair_line(condition, runs), flush=True)
                results.append(_summarise(condition))
    print(_table(results))
    if args.json:
        args.json.write_text(
            json.dumps({"config": args.config, "set": args.set, "results": results}, indent=2)
        )
    if args.plot:
        _plot(results, args.plot)
    return 0


def export_initial_model(cfg: Config, folder: Path) -> None:
    """The config's model as clip_train initialises it (its seed), exported for open_clip: both
    trainers start from the same weights."""
    torch.manual_seed(cfg.train.seed)
    export_open_clip(build_model(cfg.model).eval(), folder)


def _launcher(nproc: int) -> list[str]:
    """torchrun for several processes; one runs on its own, as both trainers allow, which spares
    torchrun's own interpreter and start-up per run."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


OUTPUT = "output.log"  # each run's stdout and stderr, in its folder (gpu-bench copies them into its log)


def run_clip_train(
    args: argparse.Namespace,
    batch: int,
    nproc: int,
    out: Path,
    log_every: int = 1,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """One clip_train run: the medians of its logged samples/s (each over the steps since the last
    log), step time and split (the logged steps') from ``metrics.jsonl``, after the warm-up steps.
    Its output is in ``out/output.log`` as it comes; past ``timeout_s`` it is stopped."""
    overrides = [
        *args.set, f"data.train={args.shards}/train", "data.val=", "eval.zeroshot=", "eval.zeroshot_data=",
        f"batch.global_size={batch}", f"train.max_steps={args.steps}", f"log.every_steps={log_every}",
        "log.wandb.mode=disabled", f"train.out_dir={out}",
        "checkpoint.every_steps=0",  # no saves, as OpenCLIP's --save-frequency 0
    ]  # fmt: skip
    command = [*_launcher(nproc), "-m", "clip_train", "train", args.config, *overrides]
    run_logged(command, out / OUTPUT, "clip_train", timeout_s=timeout_s)
    records = read_records(out)
    timed = [r for r in records if "time/step_s" in r and r["step"] - log_every >= args.warmup]
    result: dict[str, Any] = {
        "step_s": statistics.median(r["time/step_s"] for r in timed),
        "samples_per_s": statistics.median(r["train/samples_per_s"] for r in timed),
        "split_s": {part: statistics.median(r[f"time/{part}_s"] for r in timed) for part in SPLIT},
    }
    for key in ("train/tflops", "train/mfu", "memory/peak_bytes"):  # MFU where a peak is known
        if key in timed[0]:
            result[key.split("/")[1]] = statistics.median(r[key] for r in timed)
    if "compile/cudagraph_skips" in timed[-1]:  # reduce-overhead: graphs that ran without CUDA graphs
        result["cudagraph_skips"] = timed[-1]["compile/cudagraph_skips"]
    first = next(r for r in records if "startup/total_s" in r)  # the process's start to its first step
    result["startup_s"] = {
        key.removeprefix("startup/").removesuffix("_s"): value
        for key, value in first.items()
        if key.startswith("startup/")
    }
    return result


def run_open_clip(
    args: argparse.Namespace,
    cfg: Config,
    export: Path,
    batch: int,
    nproc: int,
    out: Path,
    log_every: int = 1,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """One OpenCLIP run: the median of its logged ``Batch (t)`` (the mean step time since its last
    log) over the windows after the warm-up steps, as for clip_train's."""
    shards = "::".join(str(p) for p in sorted((args.shards / "train").glob("*.tar")))
    optim, precision = cfg.optim, {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp"}[cfg.train.precision]
    options = [
        "--model", f"local-dir:{export}", "--train-data", shards, "--dataset-type", "webdataset",
        "--dataset-resampled", "--train-num-samples", str(batch * args.steps), "--epochs", "1",
        "--batch-size", str(batch // nproc), "--workers", str(cfg.data.workers), "--lr", str(optim.lr),
        "--wd", str(optim.weight_decay), "--warmup", str(optim.warmup_steps), "--beta1", str(optim.betas[0]),
        "--beta2", str(optim.betas[1]), "--eps", str(optim.eps), "--grad-clip-norm", str(optim.grad_clip),
        "--precision", precision, *_open_clip_device(), "--local-loss",
        "--gather-with-grad", "--log-every-n-steps", str(log_every), "--name", "run", "--save-frequency", "0",
        "--zeroshot-frequency", "0", "--report-to", "", "--seed", str(cfg.train.seed),
    ]  # fmt: skip
    worker = [*_launcher(nproc), "-m", "clip_train.bench.open_clip_trainer", *options]
    run_logged(worker, out / OUTPUT, "open_clip_train", {"OPEN_CLIP_LOGS": str(out)}, timeout_s)
    logged = [
        (int(samples) // batch, float(t))
        for samples, t in OPEN_CLIP_STEP.findall((out / "run" / "out.log").read_text())
    ]
    # A line at step s covers the steps since the previous line: from s - log_every + 1 (the first
    # line, at step 1, covers only that step).
    step_s = statistics.median(t for step, t in logged if step - log_every >= args.warmup)
    return {"step_s": step_s, "samples_per_s": batch / step_s}


def _open_clip_device() -> list[str]:
    """The GPUs when there are any (NCCL, one per process), as for clip_train; else the CPU (gloo)."""
    if torch.cuda.is_available():
        return ["--device", "cuda"]
    return ["--device", "cpu", "--dist-backend", "gloo"]


def _summarise(condition: dict[str, Any]) -> dict[str, Any]:
    pairs = condition["pairs"]
    summary = {**condition}
    for tool in pairs[0]:
        summary[f"{tool}_samples_per_s"] = statistics.median(p[tool]["samples_per_s"] for p in pairs)
    if "open_clip" in pairs[0]:
        summary["ratio"] = statistics.median(
            p["clip_train"]["samples_per_s"] / p["open_clip"]["samples_per_s"] for p in pairs
        )
    summary["clip_train_split_s"] = {
        part: statistics.median(p["clip_train"]["split_s"][part] for p in pairs) for part in SPLIT
    }
    return summary


def _pair_line(condition: dict[str, Any], runs: dict[str, Any]) -> str:
    rates = ", ".join(f"{tool} {r['samples_per_s']:.0f} samples/s" for tool, r in runs.items())
    where = f"batch {condition['batch']}, {condition['procs']} process(es), pair {len(condition['pairs'])}"
    return f"{where}: {rates}"


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "\n| batch | processes | OpenCLIP samples/s | clip_train samples/s | clip_train / OpenCLIP | "
        "clip_train split (data/encode/loss/replay/optimizer s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        split = "/".join(f"{r['clip_train_split_s'][part]:.3f}" for part in SPLIT)
        theirs = f"{r['open_clip_samples_per_s']:.0f}" if "ratio" in r else "-"
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
        ours = f"{r['clip_train_samples_per_s']:.0f}"
        lines.append(f"| {r['batch']} | {r['procs']} | {theirs} | {ours} | {ratio} | {split} |")
    return "\n".join(lines)


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    labels = [f"B={r['batch']}\n{r['procs']} proc" for r in results]
    positions = range(len(results))
    fig, ax = plt.subplots(figsize=(2 + 1.5 * len(results), 4))
    for offset, tool, name in ((-0.2, "open_clip", "OpenCLIP"), (0.2, "clip_train", "clip_train")):
        values = [r.get(f"{tool}_samples_per_s", 0) for r in results]
        ax.bar([p + offset for p in positions], values, width=0.4, label=name)
    ax.set_xticks(list(positions), labels)
    ax.set_ylabel("samples/s (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
