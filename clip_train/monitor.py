"""What rank 0 reports: ``metrics.jsonl`` (a resumed run first drops the records logged after its
checkpoint, so no step appears twice), wandb when enabled (the run id is kept in the run directory,
so a resumed run continues it), a progress bar; and ``summarize``, which reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from clip_train.checkpoint import latest_checkpoint
from clip_train.config import Config
from clip_train.errors import UserError

WANDB_ID_FILE = "wandb_run_id.txt"


class RunMonitor:
    def __init__(self, cfg: Config, run_dir: Path, start_step: int) -> None:
        metrics = run_dir / "metrics.jsonl"
        drop_records_after(metrics, start_step)
        self.metrics_file = metrics.open("a")
        self.progress = tqdm(total=cfg.train.max_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self.wandb_run = _start_wandb(cfg, run_dir) if cfg.log.wandb.mode != "disabled" else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self.metrics_file.write(json.dumps(record, allow_nan=True) + "\n")
        self.metrics_file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def advance(self, step: int, summary: dict[str, Any]) -> None:
        """Move the bar to ``step`` and show a few headline numbers."""
        self.progress.n = step
        self.progress.set_postfix({k: _short(v) for k, v in summary.items()}, refresh=True)

    def message(self, text: str) -> None:
        self.progress.write(text)

    def close(self) -> None:
        self.progress.close()
        self.metrics_file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def drop_records_after(metrics: Path, step: int) -> None:
    """Remove the records logged after ``step`` from ``metrics`` (and a last line cut short by a
    crash): a run resumed at ``step`` logs those steps again. Rewritten atomically, if at all."""
    if not metrics.is_file():
        return
    lines = metrics.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _logged_step(line) <= step]
    if len(kept) == len(lines):
        return
    rewritten = metrics.with_name(metrics.name + ".tmp")
    rewritten.write_text("".join(kept))
    os.replace(rewritten, metrics)


def _logged_step(line: str) -> float:
    """A record's step; infinity for a line that is not a whole record (cut short by a crash)."""
    if not line.endswith("\n"):
        return math.inf
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _start_wandb(cfg: Config, run_dir: Path):
    import wandb  # only for runs that log to it: the GPU check kit installs no wandb

    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    id_file.write_text(run_id)
    return wandb.init(
        project=cfg.log.wandb.project,
        name=cfg.log.wandb.name or run_dir.name,
        tags=cfg.log.wandb.tags,
        mode=cfg.log.wandb.mode,
        dir=run_dir,
        id=run_id,
        resume="allow",
        config=dataclasses.asdict(cfg),
    )


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if math.isfinite(value) and abs(value) < 1e4 else f"{value:.2e}"
    return str(value)


def summarize(run_dir: Path, prefix: str) -> list[str]:
    """The run's headline lines from ``metrics.jsonl`` and its checkpoints; the last one is always
    the zero-shot top-1 (``demo: zero-shot top-1 = 0.953``), for scripts."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "zeroshot/top1" in r]
    if not train or not evals:
        raise UserError(f"{run_dir}: no training steps or no zero-shot eval in metrics.jsonl")
    final = evals[-1]
    wall_s = train[-1]["time"] - train[0]["time"] + train[0]["time/step_s"]  # periodic evals included
    lines = [
        f"run directory   {run_dir}",
        f"checkpoint      {latest_checkpoint(run_dir) or 'none'}",
        f"training        {train[-1]['step']} steps in {wall_s:.0f} s, "
        f"median {statistics.median(r['train/samples_per_s'] for r in train):.0f} samples/s, "
        f"final loss {train[-1]['train/loss']:.3f}",
    ]
    if "retrieval/image_to_text_R@1" in final:
        lines.append(
            f"retrieval R@1   image->text {final['retrieval/image_to_text_R@1']:.3f}, "
            f"text->image {final['retrieval/text_to_image_R@1']:.3f}"
        )
    lines.append(f"zero-shot top-1 = {final['zeroshot/top1']:.3f}")
    return [f"{prefix}: {line}" for line in lines]
