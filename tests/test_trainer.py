"""The trainer, end to end, in real torchrun processes on CPU (gloo).

One uninterrupted 2-rank fp64 run is the reference. A fresh run resumed from its mid-run
checkpoint, a run whose worker is killed with SIGKILL under ``--max-restarts=1``, and a run
stopped by SIGTERM and started again must all end with bit-identical weights.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import forked_cli
import psutil
import pytest
import torch
from processes import Watched, run_to_end
from safetensors.torch import load_file
from small_runs import DEMO_CONFIG, DIGITS_VOCAB, run_overrides
from test_loss_tiles import _CountOps, _host_read, numbers_assigned_into_tensors

import clip_train.eval
import clip_train.loss
import clip_train.trainer
from clip_train import load_config
from clip_train.checkpoint import MODEL_FILE, STATE_FILE, checkpoint_step, complete_checkpoints
from clip_train.cli import main as cli_main
from clip_train.data import SKIP_REASONS
from clip_train.distributed import DistEnv
from clip_train.ema import WeightsEMA
from clip_train.errors import UserError
from clip_train.logs import get_logger
from clip_train.optim import Update
from clip_train.preemption import EXIT_PREEMPTED
from clip_train.skipped_steps import TrainingAborted
from clip_train.trainer import Trainer

STEPS, EVERY = 24, 6
LOSS_CODE = str(Path(clip_train.loss.__file__).parent)


def overrides(digits: Path, out_dir: Path, *extra: str) -> list[str]:
    return run_overrides(
        digits,
        out_dir,
        STEPS,
        "train.precision=fp64",
        f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep=5",
        "log.every_steps=1",
        *extra,
    )


def torchrun(
    *args: str,
    nproc: int = 2,
    restarts: int = 0,
    fresh_ranks: bool = False,
    env: dict[str, str] | None = None,
) -> Watched:
    """A real torchrun run of the demo recipe. Its ranks are forked from a server that imported the
    library (tests/forked_rank.py) unless ``fresh_ranks``: a test that places a signal to the step
    wants it sent to the rank itself, not forwarded by the rank's stand-in."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if fresh_ranks:
        env[forked_cli.ALWAYS_FRESH] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += [
        f"--max-restarts={restarts}",
        "-m",
        "clip_train",
        "train",
        str(DEMO_CONFIG),
    ]
    return Watched.start([*command, *args], env=env, merge_stderr=True)


def finish(run: Watched) -> str:
    result = run.wait()
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def weights(out_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(out_dir / "checkpoints" / f"step_{step:08d}" / MODEL_FILE)


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


# A made-up wandb key in the reference run's environment: no file the run writes may hold it.
WANDB_KEY = "clip-train-test-key-" + "5e" * 10


@pytest.fixture(scope="module")
def reference(digits, tmp_path_factory) -> Path:
    """The uninterrupted run, with wandb on (offline) to check what a run leaves behind, and steps
    9-11 profiled: the runs compared with it bit for bit profile nothing."""
    out = tmp_path_factory.mktemp("reference")
    profiled = ("log.profile_after=8", "log.profile_steps=3")
    options = ("log.wandb.mode=offline", *profiled)
    finish(torchrun(*overrides(digits, out, *options), env={"WANDB_API_KEY": WANDB_KEY}))
    return out


def test_two_rank_run_writes_checkpoints_metrics_and_wandb(reference):
    steps = [int(p.name.split("_")[1]) for p in complete_checkpoints(reference)]
    assert steps == list(range(EVERY, STEPS + 1, EVERY))
    state = torch.load(reference / "checkpoints" / f"step_{STEPS:08d}" / STATE_FILE, weights_only=True)
    assert state["trainer"]["step"] == STEPS and state["world_size"] == 2 and len(state["rng"]) == 2
    assert len(state["data"]) == 2
    lines = (reference / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == STEPS
    records = [json.loads(line) for line in lines]
    assert all(math.isfinite(record["train/loss"]) for record in records)
    # skipped samples are summed over both ranks and logged for every reason, zeros included
    assert all(record[f"data/skipped_{reason}"] == 0 for record in records for reason in SKIP_REASONS)
    startup = {key: value for key, value in records[0].items() if key.startswith("startup/")}
    assert startup["startup/first_step_s"] > 0 and startup["startup/model_s"] > 0
    assert not any(key.startswith("startup/") for record in records[1:] for key in record)
    assert (reference / "config.yaml").is_file()
    assert load_config(reference / "config.yaml").batch.global_size == 16
    assert list((reference / "wandb").glob("offline-run-*")), "no offline wandb run directory"
    run_id = (reference / "wandb_run_id.txt").read_text()
    assert any(run_id in p.name for p in (reference / "wandb").glob("offline-run-*"))
    files = [p for p in reference.rglob("*") if p.is_file()]
    assert not [p for p in files if WANDB_KEY in p.read_text(errors="ignore")]
    profiles = sorted(p.name for p in (reference / "profile").iterdir())  # every rank traces its own steps
    assert profiles == [
        "summary-rank0.json",
        "summary-rank1.json",
        "trace-rank0.json.gz",
        "trace-rank1.json.gz",
    ]
    for rank in (0, 1):
        summary = json.loads((reference / "profile" / f"summary-rank{rank}.json").read_text())
        assert summary["steps_traced"] == [9, 11] and summary["host_s"]["loss"] > 0


def test_resume_from_mid_run_checkpoint_is_bit_identical(digits, reference, tmp_path):
    halfway = reference / "checkpoints" / f"step_{STEPS // 2 - STEPS // 2 % EVERY:08d}"
    copy = tmp_path / "from" / halfway.name
    shutil.copytree(halfway, copy)
    output = finish(torchrun(*overrides(digits, tmp_path / "resumed", f"checkpoint.resume={copy}")))
    assert f"resumed from {copy}" in output
    first = checkpoint_step(copy) + 1  # the start-up ends with the first step this process runs
    assert re.search(rf"start-up: step {first} ended [\d.]+ s after the process started \(", output), output
    first_record = logged(tmp_path / "resumed")[0]
    assert first_record["step"] == first and "startup/total_s" in first_record
    assert_bit_identical(weights(tmp_path / "resumed"), weights(reference))


def _kill_one_worker_after_first_checkpoint(run: Watched, out_dir: Path, killed: list[int]) -> None:
    run.wait_for(lambda: bool(complete_checkpoints(out_dir)), "the first checkpoint")
    ranks = psutil.Process(
        run.process.pid
    ).children()  # torchrun's workers; their own children are DataLoader workers
    victim = max(ranks, key=lambda p: p.create_time())
    victim.send_signal(signal.SIGKILL)
    killed.append(victim.pid)


def finish_with_a_worker_killed(run: Watched, out_dir: Path) -> str:
    """``run``'s output, one of its workers SIGKILLed once its first checkpoint exists (asserted)."""
    killed: list[int] = []
    killer = threading.Thread(target=_kill_one_worker_after_first_checkpoint, args=(run, out_dir, killed))
    killer.start()
    output = finish(run)
    killer.join()
    assert killed, "no worker was killed"
    return output


def logged(out_dir: Path) -> list[dict]:
    metrics = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []


def logged_steps(out_dir: Path) -> list[int]:
    return [record["step"] for record in logged(out_dir)]


def wait_for_logged_steps(run: Watched, out_dir: Path, steps: int) -> None:
    run.wait_for(lambda: len(logged(out_dir)) >= steps, f"{steps} logged steps")


def signal_rank_group(run: Watched, rank: int, sig: signal.Signals) -> float:
    """``sig`` to one worker's process group (the worker and its DataLoader workers), as torchrun
    delivers it, but to that rank alone; returns when it was sent (``time.time()``)."""
    workers = psutil.Process(run.process.pid).children()
    (worker,) = [p for p in workers if p.environ().get("RANK") == str(rank)]
    sent = time.time()
    os.killpg(worker.pid, sig)
    return sent


def step_in_progress(out_dir: Path, at: float) -> int:
    """The step rank 0 was in at time ``at``: the first it logged after ``at`` (a step is logged when
    its compute ends), or the last logged one when ``at`` fell in its bookkeeping after the log."""
    records = logged(out_dir)
    return next((r["step"] for r in records if r["time"] >= at), records[-1]["step"])


def stopped_at(out_dir: Path) -> tuple[Path, int]:
    saved = complete_checkpoints(out_dir)[-1]
    return saved, checkpoint_step(saved)


def test_signals_save_the_step_in_progress_and_the_rerun_redoes_none(digits, reference, tmp_path):
    """SIGTERM to rank 0 alone, then SIGUSR1 to rank 1 alone: each time all ranks stop after the step
    in progress with a checkpoint of it (the interval is too long for any other), and the run
    started again picks up at the next step, ending bit-identical."""
    out = tmp_path / "preempted"
    args = overrides(digits, out, "checkpoint.every_steps=1000", "checkpoint.resume=auto")
    run = torchrun(*args, fresh_ranks=True)
    wait_for_logged_steps(run, out, 3)
    sent = signal_rank_group(run, 0, signal.SIGTERM)  # rank 0 logs: its log times place the signal
    output = run.wait().stdout
    saved, stopped = stopped_at(out)
    assert stopped == step_in_progress(out, sent) and stopped < STEPS, output[-3000:]
    assert f"clip-train: preempted: SIGTERM received: stopped after step {stopped};" in output, output[-3000:]
    assert logged_steps(out) == list(range(1, stopped + 1))

    run = torchrun(*args, fresh_ranks=True)
    wait_for_logged_steps(run, out, stopped + 3)
    sent = signal_rank_group(run, 1, signal.SIGUSR1)  # rank 0 learns of it at the step's end
    output = run.wait().stdout
    assert f"resumed from {saved} at step {stopped}" in output
    assert (
        f"world size 2, device cpu, per-rank batch 8 in image/text chunks of 4/8, steps {stopped} to"
        in output
    )
    saved, stopped = stopped_at(out)
    # rank 1 may cast its vote for the next step just before rank 0 logs this one: at most one later
    assert step_in_progress(out, sent) <= stopped <= step_in_progress(out, sent) + 1, output[-3000:]
    assert len(complete_checkpoints(out)) == 2 and stopped < STEPS, output[-3000:]
    assert logged_steps(out) == list(range(1, stopped + 1))

    output = finish(torchrun(*args))
    assert f"resumed from {saved} at step {stopped}" in output
    assert logged_steps(out) == list(range(1, STEPS + 1))  # every step once: none lost, none redone
    assert_bit_identical(weights(out), weights(reference))


def cli_in_thread_signalled(args: list[str], when: Callable[[], bool], sig: signal.Signals) -> int:
    """``clip-train ARGS`` in this process, sent ``sig`` once ``when()`` holds: the exit code. The
    signal is not sent if the run ends first."""
    running = threading.Event()
    running.set()

    def send() -> None:
        while not when():
            if not running.is_set():
                return
            time.sleep(0.01)
        if running.is_set():
            os.kill(os.getpid(), sig)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        return cli_main(args)
    finally:
        running.clear()
        sender.join()


@pytest.mark.parametrize("every", [1000, 0], ids=["saves", "checkpoint.every_steps=0"])
def test_sigusr1_saves_the_step_and_exits_75(digits, tmp_path, capsys, every):
    """One process without torchrun: the signal's exit code reaches the caller (SLURM, a script).
    Without checkpoints (``checkpoint.every_steps=0``, as benchmarks run) it saves nothing."""
    out = tmp_path / "run"
    args = [
        "train",
        str(DEMO_CONFIG),
        *overrides(digits, out, "data.workers=0", f"checkpoint.every_steps={every}"),
    ]
    code = cli_in_thread_signalled(args, lambda: len(logged(out)) >= 2, signal.SIGUSR1)
    assert code == EXIT_PREEMPTED
    stopped = logged_steps(out)[-1]
    assert 2 <= stopped < STEPS and logged_steps(out) == list(range(1, stopped + 1))
    assert [checkpoint_step(c) for c in complete_checkpoints(out)] == ([stopped] if every else [])
    assert f"SIGUSR1 received: stopped after step {stopped}" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the trainer's handler is gone again


def cli_signalled_in_evaluation(
    args: list[str], step: int, sig: signal.Signals, monkeypatch: pytest.MonkeyPatch
) -> int:
    """``clip-train ARGS`` in this process, sent ``sig`` from inside step ``step``'s evaluation, as
    its first split is encoded: the exit code. (Sent by a thread once the evaluation had said it
    started, it could come after a short evaluation ended, on a busy machine.)"""
    evaluation_started = threading.Event()

    def watch(record: logging.LogRecord) -> bool:  # a filter: train's logging setup keeps it
        if record.getMessage() == f"step {step}: evaluating ...":
            evaluation_started.set()
        return True

    encode_split = clip_train.eval.encode_split

    def signalled_once_started(*args: Any, **kwargs: Any) -> Any:
        if evaluation_started.is_set():
            evaluation_started.clear()
            os.kill(os.getpid(), sig)
        return encode_split(*args, **kwargs)

    monkeypatch.setattr(clip_train.eval, "encode_split", signalled_once_started)
    get_logger().addFilter(watch)
    try:
        return cli_main(args)
    finally:
        get_logger().removeFilter(watch)


def zeroshot_on(digits: Path) -> list[str]:
    return [f"eval.zeroshot={digits}/zeroshot.json", f"eval.zeroshot_data={digits}/val"]


def evaluated_steps(out_dir: Path) -> list[int]:
    """The steps of the evaluation records: those without a training loss, as the trainer tells them."""
    return [record["step"] for record in logged(out_dir) if "train/loss" not in record]


def test_sigterm_during_the_final_evaluation_exits_75_and_saves_nothing_new(
    digits, tmp_path, capsys, monkeypatch
):
    """The last step is saved before the evaluation: the signal, sent once the evaluation has said
    it started, stops it at once, with a line."""
    out = tmp_path / "run"
    args = [
        "train",
        str(DEMO_CONFIG),
        *overrides(digits, out, "data.workers=0", "train.precision=fp32", "train.max_steps=4"),
        *zeroshot_on(digits),
    ]
    assert cli_signalled_in_evaluation(args, 4, signal.SIGTERM, monkeypatch) == EXIT_PREEMPTED
    assert [checkpoint_step(c) for c in complete_checkpoints(out)] == [4]
    assert evaluated_steps(out) == []  # the evaluation did not finish
    errors = capsys.readouterr().err.splitlines()
    assert (
        "clip-train: preempted: SIGTERM received during the final evaluation: nothing new saved; the last "
        f"step's checkpoint {complete_checkpoints(out)[0]} is complete (clip-train eval evaluates it)"
    ) in errors


def test_a_periodic_evaluation_stopped_by_a_signal_runs_first_when_the_run_resumes(
    digits, tmp_path, capsys, monkeypatch
):
    """SIGUSR1 in step 2's evaluation: step 2 is saved, with no evaluation on record. The resumed run
    evaluates step 2 before step 3; resumed from step 2 once more, it finds that record and goes on;
    started again when finished, it evaluates its last step once, as the end of a run does."""
    out = tmp_path / "run"
    schedule = ["data.workers=0", "train.precision=fp32", "train.max_steps=4", "eval.every_steps=2"]
    args = ["train", str(DEMO_CONFIG), *overrides(digits, out, *schedule), *zeroshot_on(digits)]
    assert cli_signalled_in_evaluation(args, 2, signal.SIGUSR1, monkeypatch) == EXIT_PREEMPTED
    (step_2,) = complete_checkpoints(out)
    assert checkpoint_step(step_2) == 2 and evaluated_steps(out) == []
    zeroshot = zeroshot_on(digits)
    in_process_trainer(digits, out, *schedule, *zeroshot, "checkpoint.resume=auto").run()
    assert logged_steps(out) == [1, 2, 2, 3, 4, 4] and evaluated_steps(out) == [2, 4]
    assert "step 2: metrics.jsonl holds no evaluation of it; evaluating it now" in capsys.readouterr().err
    for resume in (step_2, "auto"):  # then step 4, the run's end
        in_process_trainer(digits, out, *schedule, *zeroshot, f"checkpoint.resume={resume}").run()
        assert logged_steps(out) == [1, 2, 2, 3, 4, 4] and evaluated_steps(out) == [2, 4]
        assert "holds no evaluation" not in capsys.readouterr().err


def test_sigkill_worker_restarts_and_matches_uninterrupted_run(digits, reference, tmp_path):
    """The run is started without checkpoint.resume=auto: the restart goes on from its checkpoint all
    the same, where it refused the folder's checkpoints as another run's."""
    out = tmp_path / "killed"
    output = finish_with_a_worker_killed(torchrun(*overrides(digits, out), restarts=1), out)
    restarted = "TORCHELASTIC_RESTART_COUNT=1, a restart: it goes on from the newest checkpoint in "
    assert f"{restarted}{out / 'checkpoints'}" in output and "resumed from" in output, output[-3000:]
    assert logged_steps(out) == list(range(1, STEPS + 1))  # the steps after the checkpoint logged once
    assert_bit_identical(weights(out), weights(reference))


def test_a_requeue_of_a_run_started_from_a_path_goes_on_from_its_own_newest_checkpoint(
    digits, demo_run, tmp_path, monkeypatch, capsys
):
    """A Slurm requeue (SLURM_RESTART_COUNT, the same SLURM_JOB_ID) passes the user's
    checkpoint.resume=PATH again: going back to it moved the run's newer checkpoints aside and redid
    their steps, and once PATH was gone (pruned, or another run's since deleted) the start failed."""
    step_20 = demo_run / "checkpoints" / "step_00000020"
    started_from = shutil.copytree(step_20, tmp_path / "from" / step_20.name)
    out = tmp_path / "run"

    def train(steps: int) -> int:
        resume = f"checkpoint.resume={started_from}"
        args = run_overrides(digits, out, steps, "checkpoint.every_steps=1", "data.workers=0", resume)
        return cli_main(["train", str(DEMO_CONFIG), *args])

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert train(21) == 0  # the first start, from PATH
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert train(22) == 0
    said = f"SLURM_RESTART_COUNT=1, a restart: it goes on from the newest checkpoint in {out / 'checkpoints'}"
    assert said in capsys.readouterr().err
    shutil.rmtree(started_from)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert train(23) == 0
    assert logged_steps(out) == [21, 22, 23] and not (out / "checkpoints" / "superseded").exists()
    assert [checkpoint_step(c) for c in complete_checkpoints(out)] == [22, 23]  # checkpoint.keep=2


# -- in-process: the NaN guard --------------------------------------------------------------------


def in_process_trainer(digits: Path, out_dir: Path, *extra: str) -> Trainer:
    cfg = load_config(DEMO_CONFIG, overrides(digits, out_dir, "data.workers=0", *extra))
    return Trainer(
        cfg.validate(world_size=1), DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    )


def test_checkpoint_every_steps_0_trains_to_the_end_and_saves_nothing(digits, tmp_path):
    in_process_trainer(digits, tmp_path, "train.max_steps=3", "checkpoint.every_steps=0").run()
    assert logged_steps(tmp_path) == [1, 2, 3] and complete_checkpoints(tmp_path) == []
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def poison_loss_at(trainer: Trainer, bad_step: int) -> list[dict[str, torch.Tensor]]:
    """Make step ``bad_step``'s loss NaN; the list fills with the weights each step started from."""
    real_step, seen = trainer.engine.step, []

    def step(*args, **kwargs):
        stats = real_step(*args, **kwargs)
        seen.append(snapshot(trainer))
        if len(seen) == bad_step:
            stats.loss = torch.full_like(stats.loss, float("nan"))
        return stats

    trainer.engine.step = step
    return seen


# The guard skips on the device (fused AdamW's found_inf) or reads its flag on the host every step.
GUARDS = pytest.mark.parametrize("fused", ["optim.fused=true", "optim.fused=false"])


@GUARDS
def test_non_finite_step_is_skipped_and_leaves_weights_unchanged(digits, tmp_path, fused):
    trainer = in_process_trainer(digits, tmp_path, "train.max_steps=3", "checkpoint.every_steps=100", fused)
    assert trainer.update.skips_on_device == fused.endswith("true")
    seen = poison_loss_at(trainer, 1)
    trainer.run()
    # seen[i] holds the weights step i+1 started from
    assert_bit_identical(seen[1], seen[0])
    assert any(not torch.equal(seen[2][k], seen[1][k]) for k in seen[1]), "the good step changed nothing"
    assert trainer.update.skipped_steps.total == 1 and trainer.update.skipped_steps.in_a_row == 0
    state = trainer.update.optimizer.state[trainer.model.visual.proj.weight]
    assert int(state["step"]) == 2  # the skipped step is not counted in AdamW's bias correction


def test_a_skipped_step_leaves_batch_norms_running_statistics_as_they_were(digits, tmp_path):
    """A ResNet image tower whose second step's forward overflows: the skip keeps its batch norms'
    running statistics too (that forward folded inf into them, which every evaluation, checkpoint
    and export would carry), and a good step moves them. Both guards set ``Update.stepped``, which
    decides the restore: the fused one (no host read) is the one run here."""
    resnet = ("model.image.timm=resnet10t", "model.image.timm_kwargs={}", "optim.fused=true")
    trainer = in_process_trainer(digits, tmp_path, "train.max_steps=3", "checkpoint.every_steps=3", *resnet)
    first_conv = next(m for m in trainer.model.visual.modules() if isinstance(m, torch.nn.Conv2d))
    real_step, seen = trainer.engine.step, []  # seen[i]: the model's state as step i + 1 starts

    def step(*args, **kwargs):
        seen.append(snapshot(trainer))
        return real_step(*args, **kwargs)

    trainer.engine.step = step
    first_conv.register_forward_hook(
        lambda module, inputs, output: output * math.inf if len(seen) == 2 else None
    )
    trainer.run()
    assert trainer.update.skipped_steps.total == 1
    stats = [name for name in seen[0] if ".running_" in name or name.endswith("num_batches_tracked")]
    assert stats and all(seen[1][name].isfinite().all() for name in stats)
    assert any(not torch.equal(seen[1][name], seen[0][name]) for name in stats), "the good step moved none"
    assert_bit_identical(seen[2], seen[1])  # weights and statistics
    saved = load_file(tmp_path / "checkpoints" / "step_00000003" / "model.safetensors")
    assert all(saved[name].isfinite().all() for name in stats)


@pytest.mark.parametrize(
    ("fused", "steps", "in_a_row"),
    [
        # read at the checkpoint steps: at step 4 (2 in a row, no checkpoint), then step 6 (4)
        ("optim.fused=true", 6, 4),
        ("optim.fused=false", 5, 3),  # read every step: the third in a row stops the run
    ],
)
def test_consecutive_bad_steps_abort_and_keep_last_good_checkpoint(digits, tmp_path, fused, steps, in_a_row):
    trainer = in_process_trainer(
        digits,
        tmp_path,
        "train.max_steps=8",
        "checkpoint.every_steps=2",
        "log.every_steps=100",
        "train.max_bad_steps=3",
        fused,
    )
    real_step = trainer.engine.step
    calls = []

    def poison_from_third_step(*args, **kwargs):
        stats = real_step(*args, **kwargs)
        calls.append(1)
        if len(calls) >= 3:
            for p in trainer.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("inf"))
        return stats

    trainer.engine.step = poison_from_third_step
    stopped = rf"{in_a_row} consecutive steps .*stopped at step {steps}\..*step_00000002"
    with pytest.raises(TrainingAborted, match=stopped):
        trainer.run()
    assert len(calls) == steps
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000002"]
    assert_bit_identical(snapshot(trainer), weights(tmp_path, 2))
    # the step that stopped it is logged (no log step came before), for wandb as for metrics.jsonl
    assert [(r["step"], r["train/skipped_steps"]) for r in logged(tmp_path)] == [(steps, in_a_row)]


@GUARDS
def test_a_non_finite_last_step_still_saves_the_last_good_weights_as_the_final_step(digits, tmp_path, fused):
    """A periodic checkpoint waits for a good step; the last step has no later one to wait for."""
    trainer = in_process_trainer(digits, tmp_path, "train.max_steps=3", "checkpoint.every_steps=2", fused)
    seen = poison_loss_at(trainer, 3)
    trainer.run()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert_bit_identical(weights(tmp_path, 3), seen[2])  # the weights step 3 started from
    resumed = in_process_trainer(digits, tmp_path, "train.max_steps=3", "checkpoint.resume=auto", fused)
    assert resumed.step == 3
    assert (resumed.update.skipped_steps.total, resumed.update.skipped_steps.in_a_row) == (1, 1)
    resumed.loader.close()


def test_an_fp16_overflow_moves_neither_the_weights_nor_the_ema_and_is_not_a_bad_step(digits, tmp_path):
    """GradScaler's overflow skips the step and halves the scale; the EMA skips it too (it would be
    pulled toward the unchanged weights), and the guard does not count it: above a scale of 1 the
    scaler is still searching (test_optim has the overflows at 1 and below, which are bad steps)."""
    trainer = in_process_trainer(
        digits, tmp_path, "train.precision=fp16", "train.ema_decay=0.5", "checkpoint.every_steps=100"
    )
    assert not trainer.update.skips_on_device  # the scaler's own skip is read on the host
    trainer.update.scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # no overflow: the EMA moves
    trainer.train_step(next(trainer.loader))
    assert trainer.update.scaler.get_scale() == 1.0
    weights_before = snapshot(trainer)
    averages_before = {name: average.clone() for name, average in trainer.ema.averages.items()}
    trainer.update.scaler.update(2.0**60)  # the next backward overflows fp16
    trainer.train_step(next(trainer.loader))
    assert_bit_identical(snapshot(trainer), weights_before)
    assert all(torch.equal(trainer.ema.averages[name], avg) for name, avg in averages_before.items())
    assert any(not torch.equal(avg, weights_before[name]) for name, avg in averages_before.items())
    assert trainer.update.scaler.get_scale() == 2.0**59
    assert (trainer.update.skipped_steps.total, trainer.update.skipped_steps.in_a_row) == (0, 0)
    trainer.loader.close()


def test_an_unlogged_step_reads_nothing_from_the_device_and_a_logged_step_three_values(
    digits, tmp_path, monkeypatch
):
    """Outside the loss (whose reads per call test_loss_tiles counts), a step hands no device value to
    the host, so the host never waits for the GPU's kernels: the NaN guard skips on the device (fused
    AdamW) and reads its ledger on logged steps. A logged step also reads its metrics and its skip
    counts, summed over the ranks as a host tensor (no wait on CUDA: test_distributed), counted here
    with the rest because on the CPU the two kinds of read look the same. (The unfused optimizer's
    reads of its step counts, host tensors, would look the same too: the guard's per-step read there
    shows in the abort test above.)"""
    trainer = in_process_trainer(
        digits, tmp_path, "train.max_steps=5", "log.every_steps=2", "checkpoint.every_steps=100"
    )
    assert trainer.update.skips_on_device
    reads, tolist_reads = {}, [0]  # host reads by step; .tolist() calls (they bypass the dispatcher)
    assigned = []  # numbers put into tensors, which on CUDA are copies that wait for the device

    def outside_the_loss() -> bool:
        return not any(frame.filename.startswith(LOSS_CODE) for frame in traceback.extract_stack())

    def counted(real):
        def run(*args, **kwargs):
            before = tolist_reads[0]
            with (
                _CountOps(lambda op, kwargs: _host_read(op, kwargs) and outside_the_loss()) as ops,
                numbers_assigned_into_tensors() as numbers,
            ):
                out = real(*args, **kwargs)
            reads[trainer.step] = reads.get(trainer.step, 0) + ops.count + tolist_reads[0] - before
            assigned.extend(numbers)
            return out

        return run

    tolist = torch.Tensor.tolist

    def counted_tolist(tensor: torch.Tensor) -> list:
        tolist_reads[0] += outside_the_loss()
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    trainer.train_step, trainer._after_step = counted(trainer.train_step), counted(trainer._after_step)
    trainer.run()
    assert {step: reads[step] for step in (1, 2, 3, 4)} == {1: 0, 2: 3, 3: 0, 4: 3}
    assert assigned == []


def test_a_logged_step_waits_for_the_device_before_and_after_it_and_no_other_step_does(
    digits, tmp_path, monkeypatch
):
    """On a GPU the kernels are queued: a logged step's time split must neither take in the queued
    work of the unlogged steps before it nor leave out its own optimizer and EMA work, which ran on
    the device after the last stage's wait (the "opt" share was another step's). The waits are
    recorded here (on the CPU they return at once), between the updates: the start-up's last stage
    waits once before the first step (its laps settle), then only the logged steps wait, and an
    unlogged step before its save (step 3): the save would wait for the step's kernels, and the
    window, which leaves the save's time out, would leave them out too."""
    trainer = in_process_trainer(
        digits,
        tmp_path,
        "train.max_steps=4",
        "log.every_steps=2",
        "checkpoint.every_steps=3",
        "train.ema_decay=0.9",
    )
    events: list[str] = []

    def recorded(name: str, real: Callable) -> Callable:
        def call(*args, **kwargs):
            events.append(name)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(clip_train.trainer, "wait_for_device", lambda device: events.append(f"wait {device}"))
    monkeypatch.setattr(Update, "__call__", recorded("update", Update.__call__))
    monkeypatch.setattr(WeightsEMA, "update", recorded("ema", WeightsEMA.update))
    trainer.run()
    step = ["update", "ema"]
    logged = ["wait cpu", *step, "wait cpu"]
    assert events == ["wait cpu", *step, *logged, *step, "wait cpu", *logged]


# -- clear failures --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.train=/no/such/shards", "/no/such/shards"),
        ("model.image.pretrained=/no/such/vit.safetensors", "/no/such/vit.safetensors"),
        ("batch.image_chunk=5", "batch.image_chunk=5 must divide"),
    ],
)
def test_bad_input_fails_in_one_line(digits, tmp_path, override, message):
    command = [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG)]
    result = run_to_end([*command, *overrides(digits, tmp_path), override])
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_max_steps_below_the_checkpoints_step_is_an_error(digits, demo_run, tmp_path):
    """A resumed run that would train nothing says so instead of exiting 0."""
    out = tmp_path / "run"
    shutil.copytree(demo_run, out)
    args = run_overrides(digits, out, 30, "checkpoint.every_steps=20", "checkpoint.resume=auto")
    result = run_to_end([sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *args])
    assert result.returncode == 2
    assert "train.max_steps=30 is below step 40 of the checkpoint" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_resume_with_other_model_settings_is_refused_naming_each_and_changes_nothing(digits, tmp_path):
    """Weights of fitting shapes would otherwise train on as another model (CLS pooling over 8 tokens
    where they learnt mean pooling over 12), config.yaml recording only the new settings."""
    in_process_trainer(digits, tmp_path, "train.max_steps=2", "checkpoint.every_steps=2").run()
    config, [checkpoint] = (tmp_path / "config.yaml").read_text(), complete_checkpoints(tmp_path)
    changed = [
        "model.text.pooling=cls",
        "model.text.context_length=8",
        "model.image.timm_kwargs.drop_path_rate=0.5",
    ]
    with pytest.raises(UserError) as refused:
        in_process_trainer(digits, tmp_path, "train.max_steps=3", "checkpoint.resume=auto", *changed)
    assert str(refused.value) == (
        f"checkpoint {checkpoint} was saved with other model settings: "
        "model.image.timm_kwargs.drop_path_rate=0.5 (saved: 0.1); model.text.pooling=cls (saved: mean); "
        "model.text.context_length=8 (saved: 12); resume it with its settings, or start a new run from its "
        f"weights with model.init_from={checkpoint} (fine-tuning: a new train.out_dir, a fresh optimizer)"
    )
    assert (tmp_path / "config.yaml").read_text() == config and complete_checkpoints(tmp_path) == [checkpoint]


def test_a_resume_may_move_the_weights_sources_and_change_how_the_towers_train(digits, tmp_path):
    """Where the first weights and the tokenizer's files came from, and gradient checkpointing, are
    not the model's settings: the checkpoint holds every weight, and the towers compute the same."""
    in_process_trainer(digits, tmp_path, "train.max_steps=2", "checkpoint.every_steps=2").run()
    vocab = shutil.copytree(DIGITS_VOCAB, tmp_path / "vocab-moved")
    moved = [
        f"model.text.tokenizer={vocab}",
        "model.init_logit_scale=1.0",
        "model.image.grad_checkpointing=true",
    ]
    resumed = in_process_trainer(digits, tmp_path, "train.max_steps=3", "checkpoint.resume=auto", *moved)
    resumed.run()
    assert resumed.resumed_from == complete_checkpoints(tmp_path)[0] and logged_steps(tmp_path) == [1, 2, 3]


def swap_two_tokens(tokenizer: Path) -> None:
    vocab = (tokenizer / "vocab.txt").read_text().splitlines()
    vocab[5], vocab[6] = vocab[6], vocab[5]
    (tokenizer / "vocab.txt").write_text("\n".join(vocab) + "\n")


def keep_capitals(tokenizer: Path) -> None:
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": False}
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("edit", "difference"),
    [
        (swap_two_tokens, "2 of its 139 vocabulary entries differ from the 139 expected"),
        (keep_capitals, "it makes 'A Photo of the Number 7.' the ids [2, "),
    ],
)
def test_a_resume_with_another_tokenizer_of_the_same_size_is_refused(
    digits, demo_run, tmp_path, edit, difference
):
    """A tokenizer's folder may move, its tokens may not: the text embeddings are rows of the saved
    ids, and a vocabulary of the same size (or one that keeps capitals) loads without complaint."""
    checkpoint = demo_run / "checkpoints" / "step_00000040"
    other = shutil.copytree(DIGITS_VOCAB, tmp_path / "other-vocab")
    edit(other)
    with pytest.raises(UserError) as refused:
        in_process_trainer(
            digits, tmp_path / "run", f"checkpoint.resume={checkpoint}", f"model.text.tokenizer={other}"
        )
    message = str(refused.value)
    refusal = f"checkpoint {checkpoint} was trained with another tokenizer than model.text.tokenizer={other}"
    assert message.startswith(f"{refusal}: {difference}"), message
    assert message.endswith(
        f"resume it with model.text.tokenizer={checkpoint / 'text'}, or start a new run from its weights "
        f"with model.init_from={checkpoint}"
    ), message


def test_saves_and_evaluations_between_logs_are_left_out_of_the_logged_rate(digits, tmp_path, monkeypatch):
    """Logs at steps 2 and 4, a checkpoint and an evaluation at step 3, which take 1000 s here (the
    trainer's clock is moved on by them): the window of steps 3-4 counted them as training time."""
    moved = [0.0]
    monkeypatch.setattr(
        clip_train.trainer, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + moved[0])
    )
    save, evaluate = Trainer._save, Trainer._evaluate

    def slow(real: Callable) -> Callable:
        def run(*args, **kwargs):
            moved[0] += 500
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(Trainer, "_save", slow(save))
    monkeypatch.setattr(Trainer, "_evaluate", slow(evaluate))
    schedule = ["train.max_steps=4", "log.every_steps=2", "checkpoint.every_steps=3", "eval.every_steps=3"]
    in_process_trainer(digits, tmp_path, *schedule, f"data.val={digits}/val").run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    windows = {r["step"]: r["time/window_s"] for r in records if "time/window_s" in r}
    assert windows.keys() == {2, 4} and max(windows.values()) < 500
    assert moved[0] == 2000  # saved at steps 3 and 4, evaluated at step 3 and at the end


def test_a_run_with_nothing_to_evaluate_logs_no_evaluation(digits, tmp_path):
    """data.val with eval.retrieval=false and no zero-shot: no evaluation at the end, and no record of
    one (periodic evaluations of nothing, eval.every_steps, are refused at start-up)."""
    evaluation = [f"data.val={digits}/val", "eval.retrieval=false"]
    assert in_process_trainer(digits, tmp_path, "train.max_steps=2", *evaluation).run() == {}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2] and all("train/loss" in r for r in records)
