"""What a run reports: ``metrics.jsonl`` always, wandb when enabled, a progress bar on rank 0.

Only rank 0 constructs a ``RunMonitor``. The wandb run id is kept in the run directory, so a
resumed run continues the same wandb run and step axis. wandb is offline unless the user sets
``log.wandb.mode=online``; nothing here ever writes an API key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from clip_train.config import Config

WANDB_ID_FILE = "wandb_run_id.txt"


class RunMonitor:
    def __init__(self, cfg: Config, run_dir: Path, start_step: int) -> None:
        self.run_dir = run_dir
        self.metrics_file = (run_dir / "metrics.jsonl").open("a")
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


def _start_wandb(cfg: Config, run_dir: Path):
    import wandb

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
