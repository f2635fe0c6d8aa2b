"""The ``train.out_dir`` lock: real runs and real processes contending, and each staleness rule."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from processes import Watched, run_to_end
from small_runs import DEMO_CONFIG, run_overrides

from clip_train.errors import UserError
from clip_train.run_lock import LOCK_FILE, Holder, RunLock, hold_out_dir

ELSEWHERE = "node-elsewhere"  # a host whose pids this machine cannot check
PATIENCE_S = 300.0  # how long a poll waits for what a real process does before the test fails


def plant(out_dir: Path, age_s: float = 0.0, **fields: object) -> Holder:
    """Write a lock file as another holder would have, its heartbeat ``age_s`` old."""
    holder = dataclasses.replace(Holder.this_process(), **fields)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    path.write_bytes(holder.to_json())
    beat = time.time() - age_s
    os.utime(path, (beat, beat))
    return holder


def holder_of(out_dir: Path) -> Holder | None:
    path = out_dir / LOCK_FILE
    return Holder.from_json(path.read_bytes()) if path.is_file() else None


def poll(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def train_command(digits: Path, out_dir: Path) -> list[str]:
    overrides = run_overrides(digits, out_dir, 4, "data.workers=0")
    return [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *overrides]


# -- real runs -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_runs_started_at_once_one_trains_and_the_other_names_it(digits, tmp_path):
    """The winner is suspended as soon as it holds the lock, so the other always finds it held."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [Watched.start(train_command(digits, out), env=env) for _ in range(2)]
    poll(lambda: holder_of(out) is not None, "either run to take the lock")
    winner_pid = holder_of(out).pid
    (winner,) = [run for run in runs if run.process.pid == winner_pid]
    (loser,) = [run for run in runs if run is not winner]
    psutil.Process(winner_pid).suspend()
    try:
        refused = loser.wait()
    finally:
        psutil.Process(winner_pid).resume()
    finished = winner.wait()
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, refused.stderr[-3000:]
    named = f"train.out_dir={out}: in use by another run (host {socket.gethostname()}, pid {winner_pid},"
    assert named in errors[0]
    assert "Traceback" not in refused.stderr
    assert not (out / LOCK_FILE).exists()  # released on the way out


@pytest.mark.slow
def test_two_rank_run_refuses_on_every_rank(digits, tmp_path):
    """Rank 0 finds the lock held; rank 1 learns it from rank 0 and stops too, instead of waiting."""
    out = tmp_path / "run"
    lock = RunLock(out)
    lock.acquire()
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        result = run_to_end([*torchrun, *train_command(digits, out)[1:]], env=env)
    finally:
        lock.release()
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"clip-train: rank {rank}: error: train.out_dir={out}: in use by another run" in result.stderr
    assert f"pid {os.getpid()}," in result.stderr
    assert not list(out.glob("checkpoints/*")), "a refused run wrote a checkpoint"


# -- which locks are stale -------------------------------------------------------------------------


def take(out_dir: Path, **timing: float) -> str | None:
    """Acquire and release at once: what ``acquire`` returned."""
    lock = RunLock(out_dir, **timing)
    try:
        return lock.acquire()
    finally:
        lock.release()


def test_a_lock_whose_process_is_gone_is_taken_over_with_one_line(tmp_path, capsys):
    gone = plant(tmp_path, pid=dead_pid())
    with hold_out_dir(tmp_path):
        assert holder_of(tmp_path).pid == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"clip-train: train.out_dir={tmp_path}: took over the lock of host {gone.host}, pid {gone.pid}, "
        f"since {gone.started}: its process is gone"
    )


def test_a_live_process_on_this_machine_keeps_it_however_old_its_heartbeat(tmp_path):
    planted = plant(tmp_path, age_s=3600, pid=os.getpid())
    with pytest.raises(
        UserError, match=re.escape(f"in use by another run (host {planted.host}, pid {planted.pid},")
    ):
        take(tmp_path)
    assert holder_of(tmp_path) == planted


def test_a_pid_reused_by_a_newer_process_does_not_hold_it(tmp_path):
    plant(tmp_path, pid=os.getpid(), started="2000-01-01T00:00:00+00:00")
    assert take(tmp_path).endswith("its process is gone")


def test_a_lock_of_this_slurm_job_step_from_another_host_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    plant(tmp_path, host=ELSEWHERE, slurm_job_id="4242", slurm_step_id="0")
    replaced = take(tmp_path)
    assert replaced.startswith(f"host {ELSEWHERE}, pid ") and "Slurm job 4242 step 0" in replaced
    assert replaced.endswith("it is from this Slurm job step, requeued or restarted")


def test_a_fresh_lock_of_another_step_of_this_slurm_job_refuses(tmp_path, monkeypatch):
    """Two steps of one job (two ``srun`` in one allocation) can be two live runs: only the heartbeat
    tells a gone one."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    planted = plant(tmp_path, host=ELSEWHERE, pid=77, slurm_job_id="4242", slurm_step_id="0")
    with pytest.raises(
        UserError, match=re.escape(f"in use by another run (host {ELSEWHERE}, pid 77, Slurm job 4242 step 0,")
    ):
        take(tmp_path, stale_s=60)
    assert holder_of(tmp_path) == planted


def test_a_fresh_lock_from_another_host_refuses_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    planted = plant(tmp_path, age_s=5, host=ELSEWHERE, pid=77, slurm_job_id="4242")
    with pytest.raises(UserError) as refused, hold_out_dir(tmp_path, stale_s=60):
        pass
    assert str(refused.value).startswith(
        f"train.out_dir={tmp_path}: in use by another run (host {ELSEWHERE}, pid 77, Slurm job 4242, "
        f"since {planted.started}, last heartbeat 5 s ago): stop it or choose another train.out_dir"
    )
    assert holder_of(tmp_path) == planted  # refusing leaves it alone


def test_a_lock_from_another_host_without_a_heartbeat_is_taken_over(tmp_path):
    plant(tmp_path, age_s=120, host=ELSEWHERE)
    assert take(tmp_path, stale_s=60).endswith("no heartbeat for 120 s")


def test_an_unreadable_lock_counts_by_its_heartbeat_only(tmp_path):
    (tmp_path / LOCK_FILE).write_bytes(b"")  # a holder that died between creating and filling it
    with pytest.raises(UserError, match=re.escape("in use by another run (an unreadable lock file")):
        take(tmp_path, stale_s=60)
    os.utime(tmp_path / LOCK_FILE, (0, 0))
    assert take(tmp_path, stale_s=60).startswith("an unreadable lock file: no heartbeat for")


def test_out_dir_that_is_a_file_is_one_line_naming_the_key(tmp_path):
    (tmp_path / "file").write_text("")
    for out in (tmp_path / "file", tmp_path / "file" / "run"):
        expected = f"^{re.escape(f'train.out_dir={out}: not a directory')}"
        with pytest.raises(UserError, match=expected), hold_out_dir(out):
            pass


# -- contenders ------------------------------------------------------------------------------------


def _contend(out_dir: Path, start, results, release) -> None:
    """One contender process: race for the lock, report, and hold it until told to let go."""
    lock = RunLock(out_dir)
    start.wait()
    try:
        lock.acquire()
    except UserError as err:
        results.put(str(err))
        return
    results.put(os.getpid())
    release.wait()
    lock.release()


def test_two_processes_taking_over_one_stale_lock_exactly_one_wins(tmp_path):
    """Rounds of two processes released at once on a stale lock: one takes it, the other names it."""
    context = multiprocessing.get_context("fork")  # no re-import per process: the race stays tight
    for _ in range(20):
        plant(tmp_path, age_s=3600, host=ELSEWHERE)
        start, results, release = context.Barrier(2), context.Queue(), context.Event()
        contenders = [
            context.Process(target=_contend, args=(tmp_path, start, results, release)) for _ in range(2)
        ]
        for process in contenders:
            process.start()
        outcomes = [results.get(timeout=PATIENCE_S) for _ in contenders]
        release.set()
        for process in contenders:
            process.join(PATIENCE_S)
        (winner,) = [outcome for outcome in outcomes if isinstance(outcome, int)]
        (refusal,) = [outcome for outcome in outcomes if isinstance(outcome, str)]
        assert f"(host {socket.gethostname()}, pid {winner}," in refusal
        assert sorted(p.name for p in tmp_path.iterdir()) == [], "a lock or a renamed one was left behind"


# -- the holder ------------------------------------------------------------------------------------


def test_the_heartbeat_refreshes_the_mtime(tmp_path):
    lock = RunLock(tmp_path, heartbeat_s=0.05)
    lock.acquire()
    try:
        os.utime(lock.path, (0, 0))
        poll(lambda: lock.path.stat().st_mtime > 0, "a heartbeat")
    finally:
        lock.release()
    assert not lock.path.exists()


def test_a_holder_whose_lock_was_taken_over_learns_it_names_the_other_run_and_leaves_its_lock(tmp_path):
    """Its heartbeat finds the other run's lock in place of its own: the trainer's vote then stops the
    run (``kept``), with the line ``check_kept`` raises; leaving, it keeps the other's lock."""
    with hold_out_dir(tmp_path, heartbeat_s=0.05, stale_s=60) as lock:
        assert lock.kept
        lock.check_kept()  # held: nothing to say
        other = plant(tmp_path, host=ELSEWHERE, pid=77, slurm_job_id="4242")
        poll(lambda: not lock.kept, "the heartbeat to find the other run's lock")
        with pytest.raises(UserError) as displaced:
            lock.check_kept()
    assert str(displaced.value) == (
        f"train.out_dir={tmp_path}: another run took over this run's lock (host {ELSEWHERE}, pid 77, Slurm "
        f"job 4242, since {other.started}), taking this run for gone (no heartbeat seen for 60 s: a stalled "
        "filesystem or a suspended job, say); this run stops without saving, leaving the folder to that one"
    )
    assert holder_of(tmp_path) == other
