"""``metrics.jsonl`` on resume: the records logged after the checkpoint go, so every step appears once;
and what wandb's own records say of a run's ending."""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from processes import run_to_end
from small_runs import DEMO_CONFIG, run_overrides

from clip_train import load_config
from clip_train.checkpoint import complete_checkpoints
from clip_train.distributed import DistEnv
from clip_train.monitor import RunMonitor, drop_records_after
from clip_train.preemption import Preempted
from clip_train.skipped_steps import TrainingAborted
from clip_train.stopping import exit_code


def record(step: int, **metrics: float) -> str:
    return json.dumps({"step": step, "time": 0.0, "train/loss": 1.0, **metrics}) + "\n"


def steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def test_records_after_the_step_and_a_line_cut_short_are_dropped(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    kept = [record(2), record(4), record(4, **{"zeroshot/top1": 0.5})]
    metrics.write_text("".join([*kept, record(6), record(8)]) + record(10)[:12])
    drop_records_after(metrics, 4)
    assert metrics.read_text() == "".join(kept)
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # the temporary file was renamed


def test_a_finished_run_started_again_drops_its_last_evaluation_which_it_repeats(tmp_path):
    """Resumed at train.max_steps the run only evaluates again: the evaluation it logged before goes,
    its training record stays, so every step's evaluation appears once."""
    metrics = tmp_path / "metrics.jsonl"
    training = [record(2), record(2, **{"zeroshot/top1": 0.4}), record(4)]  # a periodic eval at 2
    evaluation = json.dumps({"step": 4, "time": 0.0, "zeroshot/top1": 0.5}) + "\n"
    metrics.write_text("".join([*training, evaluation]))
    cfg = load_config(DEMO_CONFIG, ["log.wandb.mode=disabled", "train.max_steps=4"])
    RunMonitor(cfg, tmp_path, start_step=4).close()
    assert metrics.read_text() == "".join(training)


def test_nothing_to_drop_leaves_the_file_as_it_was(tmp_path):
    drop_records_after(tmp_path / "metrics.jsonl", 0)  # a fresh run: no file yet
    assert not list(tmp_path.iterdir())
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(record(2) + record(4))
    before = metrics.stat()
    drop_records_after(metrics, 4)
    assert (metrics.stat().st_ino, metrics.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_monitor_resumed_at_a_step_continues_after_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(record(1) + record(2) + record(3))
    cfg = load_config(DEMO_CONFIG, ["log.wandb.mode=disabled"])
    monitor = RunMonitor(cfg, tmp_path, start_step=2)
    monitor.log(3, {"train/loss": 0.5})
    monitor.close()
    assert steps(tmp_path / "metrics.jsonl") == [1, 2, 3]


@pytest.mark.slow
def test_a_run_resumed_before_its_last_logged_step_logs_every_step_once(digits, demo_run, tmp_path):
    """The newest checkpoint lost (as if the run crashed before saving it): the rerun resumes at
    step 20, and the records of steps 30 and 40 it logs replace the first run's."""
    out = tmp_path / "run"
    shutil.copytree(demo_run, out)
    shutil.rmtree(complete_checkpoints(out)[-1])
    first_run = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    args = run_overrides(digits, out, 40, "checkpoint.every_steps=20", "checkpoint.resume=auto")
    result = run_to_end([sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *args])
    assert result.returncode == 0, result.stderr[-3000:]
    up_to_checkpoint = [line for line in first_run if json.loads(line)["step"] <= 20]
    rerun = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert rerun[: len(up_to_checkpoint)] == up_to_checkpoint
    assert steps(out / "metrics.jsonl") == [10, 20, 30, 40]


def wandb_records(run_dir: Path) -> list[str]:
    """The kinds of the records in the offline run's ``.wandb`` file, and the exit code as "exit N".
    The file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) framed pieces.

    ``finish()`` returns once wandb's service has the run's last records, which the service writes
    as it closes the run: ``teardown`` waits for that, as the end of a training process does."""
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    raw, block, position, kinds, pieces = path.read_bytes(), 32768, 7, [], b""
    while position + 7 <= len(raw):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, piece_type = struct.unpack("<IHB", raw[position : position + 7])
        piece, position = raw[position + 7 : position + 7 + length], position + 7 + length
        pieces = piece if piece_type in (1, 2) else pieces + piece  # full, first; middle, last
        if piece_type in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pieces)
            kind = record.WhichOneof("record_type")
            kinds.append(f"exit {record.exit.exit_code}" if kind == "exit" else kind)
    return kinds


@pytest.mark.parametrize(
    ("ending", "code"),
    [(Preempted("SIGTERM"), 75), (TrainingAborted("5 consecutive steps", 3, 5), 2)],
)
def test_wandb_is_told_how_the_run_ended(tmp_path, ending, code):
    """wandb's default is 0 for any ending: a preempted or stopped run would show as finished."""
    cfg = load_config(DEMO_CONFIG, ["log.wandb.mode=offline"])
    monitor = RunMonitor(cfg, tmp_path, start_step=0)
    monitor.log(1, {"train/loss": 1.0})
    monitor.close(exit_code(ending, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))))
    kinds = wandb_records(tmp_path)
    assert "history" in kinds and kinds.count(f"exit {code}") == 1
    assert ("preempting" in kinds) == isinstance(ending, Preempted)
