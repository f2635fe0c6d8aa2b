"""A run's summary from its directory: ``clip-train report RUN_DIR [--prefix demo]``.

Reads ``metrics.jsonl`` and the checkpoints, so it works on any run that has logged a training step,
finished or still running: steps, time, throughput and the loss curve, then the last eval's
retrieval and zero-shot results (the main set's and those of ``eval.zeroshot_sets``) where the run
evaluated. The main zero-shot top-1, when there is one, is the last line (e.g.
``demo: zero-shot top-1 = 0.953``), for scripts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from clip_train.checkpoint import latest_checkpoint
from clip_train.errors import UserError
from clip_train.monitor import METRICS_FILE

LOSS_POINTS = 5  # logged losses shown in the curve line, first and last included
EVAL_KEYS = {"retrieval/image_to_text_R@1", "zeroshot/top1"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="the run's train.out_dir")
    parser.add_argument("--prefix", default="run", help="printed before every line (default: run)")


def run(args: argparse.Namespace) -> int:
    print("\n".join(summarize(args.run_dir, args.prefix)))
    return 0


def summarize(run_dir: Path, prefix: str) -> list[str]:
    """The run's headline lines, each after ``prefix``; a UserError if it has logged no training step."""
    records = read_records(run_dir)
    train = [r for r in records if "train/loss" in r]
    if not train:
        raise UserError(f"{run_dir}: no training step logged in metrics.jsonl yet")
    last_eval = next((r for r in reversed(records) if r.keys() & EVAL_KEYS), {})
    lines = [
        f"run directory   {run_dir}",
        f"checkpoint      {latest_checkpoint(run_dir) or 'none'}",
        _training_line(train),
        f"loss            {_loss_curve(train)}",
        *_eval_lines(last_eval),
    ]
    return [f"{prefix}: {line}" for line in lines]


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``, less a last line still being written by a running run."""
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise UserError(f"{run_dir}: no {METRICS_FILE}; give a run directory (the run's train.out_dir)")
    lines = metrics.read_text().splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n")]


def _training_line(train: list[dict[str, Any]]) -> str:
    # Each record's window is the time of the steps since the last log: their sum leaves out logging,
    # checkpoints and evaluations, and the time between a crash and its resume.
    # Each process's start to its first step's end is in the first record it logged (startup/*).
    steps_s = sum(r["time/window_s"] for r in train)
    samples_per_s = statistics.median(r["train/samples_per_s"] for r in train)
    starts = [r["startup/total_s"] for r in train if "startup/total_s" in r]
    startup = f", start-up {sum(starts):.0f} s" if starts else ""
    startup += f" over {len(starts)} starts" if len(starts) > 1 else ""
    return (
        f"training        {train[-1]['step']} steps in {steps_s:.0f} s, median {samples_per_s:.0f} "
        f"samples/s{startup}"
    )


def _loss_curve(train: list[dict[str, Any]]) -> str:
    """A few evenly spaced logged losses, ``step 10: 5.535, ..., step 300: 3.426``: the curve's shape."""
    last = len(train) - 1
    picks = sorted({round(i * last / (LOSS_POINTS - 1)) for i in range(LOSS_POINTS)})
    return ", ".join(f"step {train[i]['step']}: {train[i]['train/loss']:.3f}" for i in picks)


def _eval_lines(final: dict[str, Any]) -> list[str]:
    """Retrieval and zero-shot results of the last eval, each only where it ran."""
    lines = []
    if "retrieval/image_to_text_R@1" in final:
        lines.append(
            f"retrieval R@1   image->text {final['retrieval/image_to_text_R@1']:.3f}, "
            f"text->image {final['retrieval/text_to_image_R@1']:.3f}"
        )
    named = [
        key for key in final if key.startswith("zeroshot/") and key.count("/") == 2 and key.endswith("/top1")
    ]
    if named:  # eval.zeroshot_sets
        sets = ", ".join(f"{key.split('/')[1]} {final[key]:.3f}" for key in named)
        lines.append(f"zero-shot sets  top-1 {sets}")
    if "zeroshot/top1" in final:
        lines.append(f"zero-shot top-1 = {final['zeroshot/top1']:.3f}")
    return lines
