"""What rank 0 reports: ``metrics.jsonl`` (a resumed run first drops the records logged after its
checkpoint, so no step appears twice), wandb when enabled (the run id is kept in the run directory,
so a resumed run continues it), and progress: a bar in a terminal, a plain line per log step in a
file (``logs.Progress``). ``clip-train report`` reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from pathlib import Path
from typing import Any

from clip_train.config import Config
from clip_train.files import replace_text
from clip_train.logs import Progress
from clip_train.preemption import EXIT_PREEMPTED

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id.txt"


class RunMonitor:
    def __init__(self, cfg: Config, run_dir: Path, start_step: int) -> None:
        metrics = run_dir / METRICS_FILE
        # A finished run started again only evaluates its last step again: that evaluation goes too.
        kept = drop_records_after(metrics, start_step, evaluations_too=start_step == cfg.train.max_steps)
        self.evaluated_steps = {record["step"] for record in kept if _is_evaluation(record)}  # at the start
        self.metrics_file = metrics.open("a")
        self.progress = Progress("step", cfg.train.max_steps, initial=start_step, every_s=None)
        self.wandb_run = _start_wandb(cfg, run_dir) if cfg.log.wandb.mode != "disabled" else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self.metrics_file.write(json.dumps(record, allow_nan=True) + "\n")
        self.metrics_file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        self.progress.plain_line()

    def advance(self, step: int, summary: dict[str, Any] | None = None) -> None:
        """Move the bar to ``step`` and show a few headline numbers (without: the last ones shown)."""
        self.progress.move_to(step, {k: _short(v) for k, v in summary.items()} if summary else None)

    def message(self, text: str) -> None:
        self.progress.write(text)

    def close(self, exit_code: int = 0) -> None:
        """``exit_code``: the run's (``stopping.exit_code``). wandb takes it, or it would show a failed
        or preempted run as finished."""
        self.progress.close()
        self.metrics_file.close()
        if self.wandb_run is not None:
            if exit_code == EXIT_PREEMPTED:
                self.wandb_run.mark_preempting()
            self.wandb_run.finish(exit_code=exit_code)


def drop_records_after(metrics: Path, step: int, *, evaluations_too: bool = False) -> list[dict[str, Any]]:
    """Remove the records logged after ``step`` from ``metrics`` (and a last line cut short by a
    crash): a run resumed at ``step`` logs those steps again. With ``evaluations_too`` the
    evaluation records of ``step`` itself go as well. Rewritten atomically, if at all. Returns the
    records kept."""
    if not metrics.is_file():
        return []
    lines = metrics.read_text().splitlines(keepends=True)
    records = zip(lines, map(_record, lines), strict=True)
    kept = [(line, record) for line, record in records if record and _kept(record, step, evaluations_too)]
    if len(kept) < len(lines):
        replace_text(metrics, "".join(line for line, _ in kept))
    return [record for _, record in kept]


def _kept(record: dict[str, Any], step: int, evaluations_too: bool) -> bool:
    """Whether a record stays: one of an earlier step, or of ``step`` unless it is an evaluation's to
    drop."""
    return record["step"] < step or (
        record["step"] == step and not (evaluations_too and _is_evaluation(record))
    )


def _record(line: str) -> dict[str, Any] | None:
    """A whole line's record, or None for a line cut short by a crash or not a record."""
    try:
        record = json.loads(line) if line.endswith("\n") else None
        return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None
    except ValueError:
        return None


def _is_evaluation(record: dict[str, Any]) -> bool:
    """An evaluation's record: its metrics, without a training loss (as is the record of a run that
    bad steps aborted, logged after its last saved step, so never one that a resume looks for)."""
    return "train/loss" not in record


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
