"""Ranks stop together: an error that one rank alone meets, a SIGTERM to ranks blocked in a
collective or waiting for slow storage, torchrun's SIGTERM to a rank still ending, a SIGTERM during
start-up, a folder only one rank sees, a rank-0-only phase longer than the collective timeout, a
run whose folder's lock another run took over.

The faults are injected inside one rank's process (``rank_faults``). Errors are run as Slurm's
``srun`` starts ranks, one process each without torchrun, so that nothing but the ranks themselves
ends them and each rank's exit code and lines can be read; the stall is run under torchrun, whose
teardown SIGTERM it is about.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from processes import IDLE_LIMIT_S, Watched
from rank_faults import patched_in_rank
from small_runs import DEMO_CONFIG, DIGITS_VOCAB, free_port, run_overrides, slow_zeroshot

from clip_train.checkpoint import checkpoint_problem, checkpoint_step, complete_checkpoints
from clip_train.model.tokenizer import HFTokenizer
from clip_train.preemption import EXIT_PREEMPTED, Preempted, preemption_signals
from clip_train.run_lock import LOCK_FILE, STALE_S, Holder

EXIT_AFTER_CAUSE_S = 60  # the issue asks for 30 s; a hang is forever, an exit takes seconds
STEPS = 4


def overrides(digits: Path, out: Path, *extra: str) -> list[str]:
    return run_overrides(
        digits, out, STEPS, "checkpoint.every_steps=2", "log.every_steps=1", "data.workers=0", *extra
    )


def zeroshot(digits: Path) -> list[str]:
    return [f"eval.zeroshot={digits}/zeroshot.json", f"eval.zeroshot_data={digits}/val"]


def plain_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def start_ranks(args: list[str], env: dict[str, str], ranks: int = 2) -> list[Watched]:
    """One ``clip-train train`` process per rank, joined through rank 0's store, as ``srun`` starts them."""
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks)}
    command = [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *args]
    return [
        Watched.start(
            command,
            merge_stderr=True,
            env={
                **env,
                **rendezvous,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(ranks),
            },
        )
        for rank in range(ranks)
    ]


def torchrun(args: list[str], env: dict[str, str]) -> Watched:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return Watched.start(
        [*command, "-m", "clip_train", "train", str(DEMO_CONFIG), *args], env=env, merge_stderr=True
    )


def wait_for_text(runs: list[Watched], needle: str) -> float:
    """When ``needle`` first appeared in any run's output; fails once every run ended without it, or
    all went silent for ``IDLE_LIMIT_S``."""
    while True:
        seen = [at for run in runs if (at := run.stdout.first_seen(needle)) is not None]
        if seen:
            return min(seen)
        if all(run.process.poll() is not None for run in runs):
            raise AssertionError(
                f"ended without {needle!r}:\n" + "\n".join(r.stdout.text[-3000:] for r in runs)
            )
        assert time.monotonic() - max(r.last_output for r in runs) < IDLE_LIMIT_S, f"silent before {needle!r}"
        time.sleep(0.05)


def ended_within_bound(runs: list[Watched], since: float) -> list[int]:
    """Every run's exit code; fails for a run still going ``EXIT_AFTER_CAUSE_S`` after ``since``."""
    codes = []
    for run in runs:
        try:
            codes.append(run.process.wait(timeout=max(1.0, since + EXIT_AFTER_CAUSE_S - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in runs:
                other.process.kill()
            still = run.stdout.text[-3000:]
            raise AssertionError(f"a rank ran on {EXIT_AFTER_CAUSE_S} s after the cause:\n{still}") from None
        run.wait()
    return codes


def cause_lines(output: str, needle: str) -> list[str]:
    """The lines naming ``needle``, without the ``clip-train: [rank N] rank N: `` part that names the
    rank printing it."""
    lines = [line for line in output.splitlines() if needle in line and line.startswith("clip-train: ")]
    return [re.sub(r"^clip-train: (\[rank \d\] )?(rank \d: )?", "", line) for line in lines]


def assert_last_checkpoint_intact(out: Path, step: int) -> None:
    last = complete_checkpoints(out)[-1]
    assert checkpoint_step(last) == step
    assert checkpoint_problem(last, checksums=True) is None


DATA_ERROR = """
from clip_train.data import train_loader
from clip_train.data.samples import DataError

real_next = train_loader.TrainLoader.__next__

def next_or_fail(self):
    if self._step == 2:
        raise DataError("3 of 8 samples were skipped, more than data.max_skip_fraction=0.1 (injected)")
    return real_next(self)

train_loader.TrainLoader.__next__ = next_or_fail
"""

OUT_OF_MEMORY = """
import torch
from clip_train import trainer

real_step = trainer.Trainer.train_step

def step_or_fail(self, batch, logged=False):
    if self.step == 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    return real_step(self, batch, logged)

trainer.Trainer.train_step = step_or_fail
"""

LABELS_OUT_OF_RANGE = """
import clip_train.eval as evaluation

real_zeroshot = evaluation.zeroshot_from_features

def shifted(image_features, labels, classifier, **kwargs):
    return real_zeroshot(image_features, labels + 100, classifier, **kwargs)

evaluation.zeroshot_from_features = shifted
"""

NO_LABELS = """
import dataclasses
import clip_train.eval as evaluation

real_batches = evaluation.shard_batches

def unlabelled(*args, **kwargs):
    return (dataclasses.replace(batch, labels=None) for batch in real_batches(*args, **kwargs))

evaluation.shard_batches = unlabelled
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "extra", "needle", "code", "cause", "saved"),
    [
        (DATA_ERROR, False, "were skipped", 2, "error: on rank 1: 3 of 8 samples were skipped", 2),
        (
            OUT_OF_MEMORY,
            False,
            "OutOfMemoryError",
            1,
            "error: rank 1 failed: OutOfMemoryError: CUDA",
            2,
        ),
        (
            LABELS_OUT_OF_RANGE,
            True,
            "zero-shot labels span",
            2,
            "error: on rank 1: zero-shot labels span",
            4,
        ),
        (NO_LABELS, True, "samples have no label", 2, "error: on rank 1: ", 4),
    ],
    ids=["skip-rate", "out-of-memory", "label-range", "no-labels"],
)
def test_an_error_on_one_rank_ends_every_rank_with_its_line(
    digits, tmp_path, fault, extra, needle, code, cause, saved
):
    out = tmp_path / "run"
    args = overrides(digits, out, *(zeroshot(digits) if extra else []))
    runs = start_ranks(args, patched_in_rank(1, fault, tmp_path / "fault"))
    codes = ended_within_bound(runs, wait_for_text(runs, needle))
    assert codes == [code, code], [r.stdout.text[-3000:] for r in runs]
    lines = [cause_lines(run.stdout.text, needle) for run in runs]
    assert len(lines[0]) == 1 and lines[0] == lines[1], lines  # one line each, the same
    assert lines[0][0].startswith(cause), lines
    assert "Traceback" not in runs[0].stdout.text  # the rank that did not fail prints the cause only
    assert_last_checkpoint_intact(out, saved)


def test_out_dir_seen_by_one_rank_only_stops_both_naming_the_key(digits, tmp_path):
    """Rank 1 sees another folder under the same key, as on a node whose out_dir is a local disk."""
    elsewhere = f"""
from clip_train.commands import train

real_load = train.load_config

def load_elsewhere(*args, **kwargs):
    cfg = real_load(*args, **kwargs)
    cfg.train.out_dir = {str(tmp_path / "node-local")!r}
    return cfg

train.load_config = load_elsewhere
"""
    runs = start_ranks(overrides(digits, tmp_path / "run"), patched_in_rank(1, elsewhere, tmp_path / "fault"))
    needle = "must be on a filesystem all nodes share"
    codes = ended_within_bound(runs, wait_for_text(runs, needle))
    assert codes == [2, 2]
    lines = [cause_lines(run.stdout.text, needle) for run in runs]
    expected = (
        f"error: on rank 1: train.out_dir={tmp_path / 'node-local'} is not the folder rank 0 holds (its "
        "lock .clip_train.lock is missing or another run's): train.out_dir must be on a filesystem all "
        "nodes share"
    )
    assert lines[0] == lines[1] == [expected]


def test_rank_zero_alone_may_take_longer_than_the_collective_timeout(digits, tmp_path):
    """Rank 0 looks for a checkpoint on ``checkpoint.remote`` at start-up (``resume=auto``: a slow
    object store) and writes the step-2 checkpoint, each for 15 s, longer than ``train.dist_timeout_s``
    (12 s, which the run's other collectives must still fit on a busy machine): the other rank waits
    (``train.io_timeout_s``) and the run completes. Under FSDP, whose sharding's collectives come
    before the resume: the remote was listed before them, outside the wait, and they timed out."""
    slowed = tmp_path / "slowed"  # what rank 0 slowed: the fault took
    slowed.mkdir()
    slow = f"""
import pathlib
import time
from clip_train.parallel import checkpoint
from clip_train.remote import RemoteMirror

real_publish, real_remote_steps = checkpoint.publish_checkpoint, RemoteMirror._remote_steps

def slow_publish(tmp, out_dir, step, *args):
    if step == 2:
        pathlib.Path({str(slowed)!r}, "publish").touch()
        time.sleep(15)
    return real_publish(tmp, out_dir, step, *args)

def slow_first_listing(self):
    if not getattr(self, "listed", False):
        self.listed = True
        pathlib.Path({str(slowed)!r}, "listing").touch()
        time.sleep(15)
    return real_remote_steps(self)

checkpoint.publish_checkpoint = slow_publish
RemoteMirror._remote_steps = slow_first_listing
"""
    out, remote = tmp_path / "run", tmp_path / "bucket"
    args = overrides(digits, out, "train.dist_timeout_s=12", "train.parallel=fsdp", "checkpoint.resume=auto")
    run = torchrun(
        [*args, f"checkpoint.remote=file://{remote}"], patched_in_rank(0, slow, tmp_path / "fault")
    )
    result = run.wait()
    assert result.returncode == 0, result.stdout[-4000:]
    assert [checkpoint_step(c) for c in complete_checkpoints(out)] == [2, 4]
    assert [checkpoint_step(c) for c in complete_checkpoints(remote)] == [2, 4]
    assert sorted(p.name for p in slowed.iterdir()) == ["listing", "publish"]


def signal_ranks(run: Watched, sig: signal.Signals, ranks: tuple[int, ...] = (0, 1)) -> None:
    """``sig`` to torchrun's workers of ``ranks`` and their process groups, as torchrun or Slurm send it."""
    for worker in psutil.Process(run.process.pid).children():
        if int(worker.environ()["RANK"]) in ranks:
            os.killpg(worker.pid, sig)


def test_sigterm_ends_ranks_blocked_in_a_collective(digits, tmp_path):
    """Rank 1 hangs in step 3 (alive, outside any collective); rank 0 waits for it in the step's
    collectives. SIGTERM to both, as torchrun's teardown or Slurm sends it: both end with exit code
    75 and the same line, the step-2 checkpoint intact."""
    hanging = tmp_path / "hanging"
    hang = f"""
import pathlib
import time
from clip_train import trainer

real_step = trainer.Trainer.train_step

def step_or_hang(self, batch, logged=False):
    if self.step == 2:
        pathlib.Path({str(hanging)!r}).touch()
        time.sleep(3600)
    return real_step(self, batch, logged)

trainer.Trainer.train_step = step_or_hang
"""
    out = tmp_path / "run"
    env = patched_in_rank(1, hang, tmp_path / "fault")
    run = torchrun(overrides(digits, out, "checkpoint.resume=auto"), env)
    run.wait_for(hanging.exists, "rank 1 hanging in step 3")
    signal_ranks(run, signal.SIGTERM)
    needle = "waited for the other ranks"
    since = wait_for_text([run], needle)
    ended_within_bound([run], since)
    lines = cause_lines(run.stdout.text, needle)
    assert len(lines) == 2 and lines[0] == lines[1], run.stdout.text[-4000:]
    assert re.fullmatch(
        r"preempted: SIGTERM received while rank [01] waited for the other ranks for \d+ s \(a rank stalled "
        rf"or gone\): checkpoint.resume=auto continues from {re.escape(str(complete_checkpoints(out)[-1]))}",
        lines[0],
    )
    # torchrun reports each rank's exit code; a rank it stopped after it printed its line has -15
    codes = {int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", run.stdout.text)}
    assert EXIT_PREEMPTED in codes and codes <= {EXIT_PREEMPTED, -signal.SIGTERM}, run.stdout.text[-3000:]
    assert_last_checkpoint_intact(out, 2)
    # where the stalled rank was: its innermost clip_train frame, then the innermost one
    hung_in = (
        r"clip-train: rank 1 stopped in trainer\.py:\d+ \(run\) > sitecustomize\.py:\d+ \(step_or_hang\)"
    )
    assert re.search(hung_in, run.stdout.text), run.stdout.text[-4000:]


PAUSE = """
import pathlib
import time

def pause(reached, until):
    pathlib.Path(reached).touch()
    while not pathlib.Path(until).exists():
        time.sleep(0.05)
"""


STALLED_IN_RUN_S = 4.0  # STALLED_AFTER_SIGNAL_S in the slow-storage runs' ranks: the test waits past it


@pytest.mark.parametrize("slow", [(0, 1), (1,)], ids=["every-rank", "one-rank"])
def test_sigterm_while_a_ranks_loader_waits_on_slow_storage_saves_the_step_in_progress(
    digits, tmp_path, slow
):
    """The ``slow`` ranks wait for their data in step 3 (storage that lags) when SIGTERM comes to both,
    for longer than a rank blocked in a collective is given. No rank is blocked: a slow one reads,
    and one that has its batch waits for the slow one's in the all-reduce after the loaders (which it
    once took for a stall, ending both ranks unsaved). When the data comes step 3 ends and is saved,
    and both exit 75 as for any preemption."""
    waiting, sent = tmp_path / "waiting", tmp_path / "sent"
    slowed = f"""{PAUSE}
from clip_train import stopping
from clip_train.data import train_loader

stopping.STALLED_AFTER_SIGNAL_S = {STALLED_IN_RUN_S}
real_next = train_loader.TrainLoader.__next__

def slow_next(self):
    if self._step == 2 and int(os.environ["RANK"]) in {slow!r}:
        pause({str(waiting)!r} + os.environ["RANK"], {str(sent)!r})
    return real_next(self)

train_loader.TrainLoader.__next__ = slow_next
"""
    out = tmp_path / "run"
    run = torchrun(overrides(digits, out), patched_in_rank((0, 1), slowed, tmp_path / "fault"))
    reached = [Path(f"{waiting}{rank}") for rank in slow]
    run.wait_for(lambda: all(path.exists() for path in reached), "the slow ranks waiting for data in step 3")
    signal_ranks(run, signal.SIGTERM)
    time.sleep(STALLED_IN_RUN_S + 4)  # past the limit for a rank blocked in a collective
    sent.touch()
    output = run.wait().stdout
    saved = complete_checkpoints(out)[-1]
    line = f"preempted: SIGTERM received: stopped after step 3; checkpoint.resume=auto continues from {saved}"
    assert cause_lines(output, "stopped after step") == [line, line], output[-4000:]
    assert "waited for" not in output
    codes = {int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", output)}
    assert EXIT_PREEMPTED in codes and codes <= {EXIT_PREEMPTED, -signal.SIGTERM}, output[-3000:]
    assert_last_checkpoint_intact(out, 3)


@pytest.mark.parametrize("step", [3, 4], ids=["before-the-next-step", "before-the-save"])
def test_a_run_whose_out_dir_lock_another_run_took_over_stops_every_rank_without_saving(
    digits, tmp_path, step
):
    """Another run takes over rank 0's lock on ``train.out_dir`` during ``step`` (having taken this one
    for gone): both ranks stop with one line naming it, exit code 2, before the next step or before
    the save of the last step, 4: they save nothing more there."""
    stepping, planted = tmp_path / "stepping", tmp_path / "planted"
    displaced = f"""{PAUSE}
import functools
from clip_train import run_lock, trainer

run_lock.hold_out_dir = functools.partial(run_lock.hold_out_dir, heartbeat_s=0.1)
real_step = trainer.Trainer.train_step

def step_once_taken_over(self, batch, logged=False):
    if self.step == {step - 1}:
        pause({str(stepping)!r}, {str(planted)!r})
        while self.out_dir_lock.kept:  # until the heartbeat finds the other run's lock
            time.sleep(0.05)
    return real_step(self, batch, logged)

trainer.Trainer.train_step = step_once_taken_over
"""
    out = tmp_path / "run"
    runs = start_ranks(overrides(digits, out), patched_in_rank(0, displaced, tmp_path / "fault"))
    runs[0].wait_for(stepping.exists, f"rank 0 in step {step}")
    other = dataclasses.replace(Holder.this_process(), host="node-elsewhere", pid=77)
    (out / LOCK_FILE).write_bytes(other.to_json())
    planted.touch()
    needle = "another run took over"
    codes = ended_within_bound(runs, wait_for_text(runs, needle))
    assert codes == [2, 2], [r.stdout.text[-3000:] for r in runs]
    expected = (
        f"error: train.out_dir={out}: another run took over this run's lock ({other.describe()}), "
        f"taking this run for gone (no heartbeat seen for {STALE_S:.0f} s: a stalled filesystem or a "
        "suspended job, say); this run stops without saving, leaving the folder to that one"
    )
    lines = [cause_lines(run.stdout.text, needle) for run in runs]
    assert lines == [[expected], [expected]], lines
    assert [checkpoint_step(c) for c in complete_checkpoints(out)] == [2]
    assert Holder.from_json((out / LOCK_FILE).read_bytes()) == other  # left to the other run


def test_torchruns_sigterm_to_a_rank_still_ending_waits_for_its_line(digits, tmp_path):
    """SIGTERM to rank 1 alone while rank 0 is in step 3: both save step 3 and end. Rank 0 is held
    just before it prints its line until torchrun, once rank 1 has exited, has sent it SIGTERM: it
    then prints its line and exits 75."""
    stepping, sent, ending = tmp_path / "stepping", tmp_path / "sent", tmp_path / "ending"
    stopped = tmp_path / "stopped"
    slow = f"""{PAUSE}
from clip_train import stopping, trainer

real_step, real_log = trainer.Trainer.train_step, stopping.Ending.log

def slow_step(self, batch, logged=False):
    if self.step == 2:
        pause({str(stepping)!r}, {str(sent)!r})
    return real_step(self, batch, logged)

def late_log(self, rank):
    pause({str(ending)!r}, {str(stopped)!r})
    real_log(self, rank)

trainer.Trainer.train_step = slow_step
stopping.Ending.log = late_log
"""
    out = tmp_path / "run"
    run = torchrun(overrides(digits, out), patched_in_rank(0, slow, tmp_path / "fault"))
    run.wait_for(stepping.exists, "rank 0 in step 3")
    signal_ranks(run, signal.SIGTERM, ranks=(1,))
    sent.touch()
    run.wait_for(lambda: ending.exists() and "closing signal SIGTERM" in run.stdout.text, "the SIGTERM")
    stopped.touch()
    output = run.wait().stdout
    saved = complete_checkpoints(out)[-1]
    assert cause_lines(output, "stopped after step") == [
        f"preempted: {cause}: stopped after step 3; checkpoint.resume=auto continues from {saved}"
        for cause in ("SIGTERM received", "another rank was signalled")  # rank 1's, then rank 0's
    ], output[-4000:]
    codes = dict(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\n\s*exitcode\s*: (-?\d+)", output))
    assert codes == {"0": str(EXIT_PREEMPTED), "1": str(EXIT_PREEMPTED)}, output[-3000:]
    assert_last_checkpoint_intact(out, 3)


def test_sigterm_during_start_up_stops_the_run_before_its_first_step(digits, tmp_path):
    """SIGTERM while the trainer is being built: the run stops before step 1 with the preemption's
    exit code and line, and saves nothing."""
    building, sent = tmp_path / "building", tmp_path / "sent"
    slow = f"""{PAUSE}
from clip_train import trainer

real_init = trainer.Trainer.__init__

def slow_init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    pause({str(building)!r}, {str(sent)!r})

trainer.Trainer.__init__ = slow_init
"""
    out = tmp_path / "run"
    env = {**patched_in_rank(0, slow, tmp_path / "fault"), "RANK": "0"}
    command = [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *overrides(digits, out)]
    run = Watched.start(command, env=env, merge_stderr=True)
    run.wait_for(building.exists, "the trainer built")
    run.process.send_signal(signal.SIGTERM)
    sent.touch()
    result = run.wait()
    assert result.returncode == EXIT_PREEMPTED, result.stdout[-3000:]
    assert cause_lines(result.stdout, "SIGTERM") == [
        "preempted: SIGTERM received: stopped after step 0; checkpoint.resume=auto continues from the start"
    ], result.stdout[-3000:]
    assert "step: 1/" not in result.stdout
    assert complete_checkpoints(out) == []


def test_preempted_on_one_rank_in_the_final_evaluation_ends_both(digits, tmp_path):
    """SIGTERM to rank 1 alone while both evaluate after the last step: both exit 75 with rank 1's
    line, and the last step's checkpoint is intact."""
    out = tmp_path / "run"
    args = [*overrides(digits, out, "log.all_ranks=true"), *slow_zeroshot(digits, tmp_path)]
    runs = start_ranks(args, plain_env())
    wait_for_text([runs[1]], f"[rank 1] step {STEPS}: evaluating ...")
    runs[1].process.send_signal(signal.SIGTERM)
    needle = "during the final evaluation"
    codes = ended_within_bound(runs, wait_for_text(runs, needle))
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED]
    lines = [cause_lines(run.stdout.text, needle) for run in runs]
    assert len(lines[0]) == 1 and lines[0] == lines[1], lines
    assert lines[0][0].startswith("preempted: SIGTERM received during the final evaluation: nothing new")
    assert_last_checkpoint_intact(out, STEPS)


def test_a_signal_during_a_periodic_evaluation_saves_its_step_and_stops_every_rank(digits, tmp_path):
    """SIGUSR1 to rank 1 alone in the step-2 evaluation (no checkpoint due before step 1000): both
    ranks leave the evaluation, save step 2 and exit 75. (Its tagged lines also show that rank 0
    alone warns about the config at start-up.)"""
    out = tmp_path / "run"
    extra = ("log.all_ranks=true", "eval.every_steps=2", "checkpoint.every_steps=1000")
    runs = start_ranks([*overrides(digits, out, *extra), *slow_zeroshot(digits, tmp_path)], plain_env())
    wait_for_text([runs[1]], "[rank 1] step 2: evaluating ...")
    runs[1].process.send_signal(signal.SIGUSR1)
    codes = ended_within_bound(runs, wait_for_text(runs, "stopped after step 2"))
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], [r.stdout.text[-3000:] for r in runs]
    (saved,) = complete_checkpoints(out)
    # start-up's config warnings are rank 0's
    warmup = "] warning: optim.warmup_steps=20 >= train.max_steps=4: the rate rises to 20% of its peak"
    assert [warmup in run.stdout.text for run in runs] == [True, False]
    for rank, cause in enumerate(("another rank was signalled", "SIGUSR1 received")):
        output = runs[rank].stdout.text
        assert f"[rank {rank}] step 2: evaluation stopped by a signal" in output, output[-3000:]
        assert (
            f"[rank {rank}] preempted: {cause}: stopped after step 2; checkpoint.resume=auto continues from "
            f"{saved}" in output
        ), output[-3000:]
    assert_last_checkpoint_intact(out, 2)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and not any("zeroshot/top1" in r for r in records)


def test_a_signal_in_library_code_that_catches_exceptions_still_stops_the_evaluation(monkeypatch):
    """In an evaluation the handler raises ``Preempted`` wherever the main thread is. Here the signal
    lands in transformers' conversion of a tokenized batch to tensors, inside its ``except
    Exception`` that re-raises any failure as a ValueError about padding: a rank whose signal came
    there failed (exit 1, no requeue) instead of stopping, as one did in the periodic-evaluation
    test above once its tiny model took a WordPiece vocabulary."""
    tokenizer = HFTokenizer(str(DIGITS_VOCAB), context_length=12)
    real_tensor = torch.tensor

    def signalled_tensor(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)  # its handler runs before the next line of Python
        return real_tensor(*args, **kwargs)

    with preemption_signals() as signals:
        monkeypatch.setattr(torch, "tensor", signalled_tensor)
        with pytest.raises(Preempted, match="SIGUSR1 received"), signals.raising():  # as in an evaluation
            tokenizer(["a handwritten seven", "the digit 7"])
    assert signals.received == signal.SIGUSR1
