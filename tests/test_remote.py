"""``checkpoint.remote``: real checkpoints of the demo run mirrored through fsspec to a local
``file://`` folder and to fsspec's in-memory filesystem, then pulled back into an empty run."""

from __future__ import annotations

import filecmp
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from dist_utils import run_distributed
from processes import run_to_end
from small_runs import DEMO_CONFIG, run_overrides
from test_checkpoint_verify import flip_a_byte, truncate
from test_trainer import evaluated_steps

from clip_train import load_config, stopping
from clip_train.checkpoint import (
    MANIFEST_FILE,
    MODEL_FILE,
    RUN_CONFIG_FILE,
    TEMP_PREFIX,
    checkpoint_problem,
    checkpoint_root,
    complete_checkpoints,
    resolve_resume,
)
from clip_train.distributed import DistEnv
from clip_train.errors import UserError
from clip_train.monitor import METRICS_FILE, WANDB_ID_FILE
from clip_train.preemption import Preempted, SignalFlag, preemption_signals
from clip_train.remote import RUN_FILES, RemoteMirror
from clip_train.trainer import Trainer


@pytest.fixture(params=["file", "memory"])
def remote_url(request, tmp_path) -> str:
    if request.param == "file":
        yield f"file://{tmp_path / 'bucket' / 'run'}"
        return
    bucket = f"bucket-{uuid.uuid4().hex}"
    yield f"memory://{bucket}/run"
    fsspec.filesystem("memory").rm(bucket, recursive=True)


@pytest.fixture
def run_copy(demo_run, tmp_path) -> Path:
    """A copy of the demo run (checkpoints at steps 20 and 40), free to change."""
    return Path(shutil.copytree(demo_run, tmp_path / "run"))


def _same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
        filecmp.cmp(a / f, b / f, shallow=False) for f in files
    )


def test_pushed_checkpoints_come_back_verified_into_an_empty_run(run_copy, remote_url, tmp_path):
    mirror = RemoteMirror(remote_url, run_copy)
    for checkpoint in complete_checkpoints(run_copy):
        mirror.push(checkpoint)
    mirror.wait()
    fresh = tmp_path / "fresh"
    pulled = RemoteMirror(remote_url, fresh).pull_newer_than(None)
    newest = complete_checkpoints(run_copy)[-1]
    assert pulled == checkpoint_root(fresh) / newest.name
    assert checkpoint_problem(pulled, checksums=True) is None
    assert _same_tree(pulled, newest)
    assert [p.name for p in checkpoint_root(fresh).iterdir()] == [newest.name]  # no temporary left
    assert RemoteMirror(remote_url, fresh).pull_newer_than(pulled) is None  # the disk holds it


def test_the_remote_keeps_what_the_run_keeps_and_never_pulls_an_incomplete_checkpoint(
    run_copy, remote_url, tmp_path
):
    mirror = RemoteMirror(remote_url, run_copy, keep=1)
    first, second = complete_checkpoints(run_copy)
    fs, root = fsspec.core.url_to_fs(remote_url)
    for pushed in (first, second):  # keep=1: each upload leaves only itself
        mirror.push(pushed)
        mirror.wait()
        assert {Path(p).name for p in fs.ls(f"{root}/checkpoints", detail=False)} == {pushed.name}
    fs.rm(f"{root}/checkpoints/{second.name}/{MANIFEST_FILE}")  # as an upload cut short leaves it
    assert RemoteMirror(remote_url, tmp_path / "fresh").pull_newer_than(None) is None


def test_a_step_uploaded_again_is_incomplete_until_its_new_files_are_up(run_copy, remote_url, monkeypatch):
    """A restarted run saves a step again and uploads it over the remote copy: while its files go
    up, the old manifest must not vouch for a mix of old and new files."""
    newest = complete_checkpoints(run_copy)[-1]
    mirror = RemoteMirror(remote_url, run_copy)
    mirror.push(newest)
    mirror.wait()
    assert _complete_remote_checkpoints(remote_url) == [newest.name]
    seen_while_uploading = []
    put = RemoteMirror._put

    def watched_put(self: RemoteMirror, file: Path, target: str) -> None:
        seen_while_uploading.append(_complete_remote_checkpoints(remote_url))
        put(self, file, target)

    monkeypatch.setattr(RemoteMirror, "_put", watched_put)
    mirror.push(newest)
    mirror.wait()
    files = [p for p in newest.rglob("*") if p.is_file() and p.name != MANIFEST_FILE]
    assert seen_while_uploading[: len(files)] == [[]] * len(files)  # no manifest before the last file
    assert _complete_remote_checkpoints(remote_url) == [newest.name]


def test_a_failed_upload_warns_and_the_run_goes_on(run_copy, tmp_path, capsys):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the remote folder should be")
    mirror = RemoteMirror(f"file://{blocked}", run_copy)
    mirror.push(complete_checkpoints(run_copy)[-1])
    mirror.push_metrics()  # after an evaluation
    mirror.wait()
    checkpoint, metrics = capsys.readouterr().err.splitlines()
    warning = f"clip-train: warning: checkpoint.remote=file://{blocked}: uploading"
    assert checkpoint.startswith(f"{warning} step_") and metrics.startswith(f"{warning} {METRICS_FILE} ")
    assert checkpoint.endswith("the next checkpoint tries again") and metrics.endswith("tries again")


def test_an_unknown_protocol_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(UserError, match=r"checkpoint.remote=nosuch://bucket/run: "):
        RemoteMirror("nosuch://bucket/run", tmp_path)


@pytest.mark.slow
def test_a_run_on_a_fresh_disk_resumes_from_the_remote(digits, tmp_path):
    """The spot-instance case: a run mirrors its checkpoints, its disk is lost, and the same command
    with resume=auto on an empty disk continues from the newest remote checkpoint. Each evaluation's
    record goes up after it, although its checkpoint went up first: the resumed run, whose step 4
    has a periodic evaluation, finds it done."""
    remote = f"file://{tmp_path / 'bucket' / 'run'}"
    fs, root = fsspec.core.url_to_fs(remote)

    def train(out: Path, steps: int) -> str:
        overrides = run_overrides(
            digits, out, steps, "checkpoint.every_steps=2", "checkpoint.resume=auto", "eval.every_steps=2"
        )
        command = [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *overrides]
        result = run_to_end([*command, f"data.val={digits}/val", f"checkpoint.remote={remote}"])
        assert result.returncode == 0, result.stderr[-3000:]
        assert fs.cat_file(f"{root}/{METRICS_FILE}") == (out / METRICS_FILE).read_bytes()
        return result.stderr

    first = train(tmp_path / "disk1", 4)
    assert "clip-train: checkpoint step_00000004 mirrored to" in first
    assert evaluated_steps(tmp_path / "disk1") == [2, 4]
    resumed = train(tmp_path / "disk2", 6)
    assert f"resumed from {tmp_path / 'disk2' / 'checkpoints' / 'step_00000004'} at step 4" in resumed
    assert "holds no evaluation" not in resumed
    assert evaluated_steps(tmp_path / "disk2") == [2, 4, 6]
    # the remote keeps what the run keeps: the new disk holds the pulled step 4 and its own step 6
    assert {Path(p).name for p in fs.ls(f"{root}/checkpoints", detail=False)} == {
        "step_00000004",
        "step_00000006",
    }


def test_a_pull_replaces_a_damaged_local_copy_of_its_step(run_copy, remote_url, tmp_path):
    """A disk that kept a damaged copy of the newest step (resume=auto passes over it) is the case
    the remote copy is for: the pulled copy takes its place, verified, and the run resumes from it."""
    newest = complete_checkpoints(run_copy)[-1]
    mirror = RemoteMirror(remote_url, run_copy)
    mirror.push(newest)
    mirror.wait()
    disk = Path(shutil.copytree(run_copy, tmp_path / "disk"))
    truncate(disk / "checkpoints" / newest.name / MODEL_FILE)
    held = resolve_resume("auto", disk, verify=True)
    assert held == complete_checkpoints(disk)[0]
    pulled = RemoteMirror(remote_url, disk).pull_newer_than(held)
    assert pulled == checkpoint_root(disk) / newest.name
    assert _same_tree(pulled, newest)
    assert resolve_resume("auto", disk, verify=True) == pulled
    assert not list(checkpoint_root(disk).glob(f"{TEMP_PREFIX}*"))  # nothing left aside


@pytest.mark.parametrize("local_copy", ["damaged", "none"])
def test_a_pulled_copy_that_fails_verification_leaves_the_disk_as_it_was(run_copy, tmp_path, local_copy):
    newest = complete_checkpoints(run_copy)[-1]
    bucket = tmp_path / "bucket" / "run"
    mirror = RemoteMirror(f"file://{bucket}", run_copy)
    mirror.push(newest)
    mirror.wait()
    remote_weights = bucket / "checkpoints" / newest.name / MODEL_FILE
    remote_weights.write_bytes(bytes(remote_weights.stat().st_size))  # its size, not its content
    disk = Path(shutil.copytree(run_copy, tmp_path / "disk"))
    if local_copy == "damaged":
        truncate(disk / "checkpoints" / newest.name / MODEL_FILE)
    else:
        shutil.rmtree(disk / "checkpoints" / newest.name)
    before = Path(shutil.copytree(checkpoint_root(disk), tmp_path / "before"))
    refused = rf"pulled {newest.name} does not verify: {MODEL_FILE} does not match"
    with pytest.raises(UserError, match=refused):
        RemoteMirror(f"file://{bucket}", disk).pull_newer_than(complete_checkpoints(disk)[0])
    assert _same_tree(checkpoint_root(disk), before)  # no temporary folder left either


def _train_in_process(digits: Path, run: Path, steps: int, resume: str, remote: str, *extra: str) -> None:
    overrides = [f"checkpoint.resume={resume}", f"checkpoint.remote={remote}", "checkpoint.every_steps=100"]
    cfg = load_config(DEMO_CONFIG, run_overrides(digits, run, steps, *overrides, *extra)).validate()
    with preemption_signals() as signals:  # held to the exit, as `clip-train train` holds them
        Trainer(cfg, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))).run(signals)


def test_resume_auto_pulls_the_remote_copy_of_a_newest_checkpoint_damaged_on_the_disk(
    run_copy, digits, tmp_path, capsys
):
    """Same size, changed bytes: the disk's step 40 passed the size check, so no pull was tried and
    the run went back to step 20 (and the next upload deleted the remote's sound step 40). Going back
    on purpose (resume=PATH) then deletes the remote's newer checkpoints even before any upload:
    resume=auto would pull them otherwise."""
    remote = f"file://{tmp_path / 'bucket' / 'run'}"
    mirror = RemoteMirror(remote, run_copy)
    for checkpoint in complete_checkpoints(run_copy):
        mirror.push(checkpoint)
        mirror.wait()
    flip_a_byte(run_copy / "checkpoints" / "step_00000040" / MODEL_FILE)
    _train_in_process(digits, run_copy, 41, "auto", remote)
    err = capsys.readouterr().err
    assert f"resumed from {run_copy / 'checkpoints' / 'step_00000040'} at step 40" in err
    assert checkpoint_problem(run_copy / "checkpoints" / "step_00000040", checksums=True) is None
    assert _complete_remote_checkpoints(remote) == ["step_00000040", "step_00000041"]  # keep=2
    _train_in_process(digits, run_copy, 40, str(run_copy / "checkpoints" / "step_00000040"), remote)
    assert _complete_remote_checkpoints(remote) == ["step_00000040"]  # nothing saved, step 41 gone


def test_a_fine_tuning_run_requeued_on_a_fresh_disk_resumes_from_the_remote_not_its_init_from(
    run_copy, digits, tmp_path, capsys
):
    """A requeued run never reads ``model.init_from`` (it may be gone) once it has a checkpoint, and
    on a fresh disk its checkpoints are on the remote."""
    remote = f"file://{tmp_path / 'bucket' / 'run'}"
    mirror = RemoteMirror(remote, run_copy)
    mirror.push(complete_checkpoints(run_copy)[-1])
    mirror.wait()
    disk = tmp_path / "fresh-disk"
    _train_in_process(digits, disk, 41, "auto", remote, f"model.init_from={tmp_path / 'gone'}")
    assert f"resumed from {disk / 'checkpoints' / 'step_00000040'} at step 40" in capsys.readouterr().err


def test_the_remote_is_pruned_by_the_runs_rule_over_what_it_holds(run_copy, remote_url, tmp_path):
    """A fresh disk holds only the checkpoint it pulled: its uploads keep the remote's milestones
    and the newest ``keep`` of the remote's own, not only what that disk holds."""
    first, second = complete_checkpoints(run_copy)  # steps 20 and 40
    mirror = RemoteMirror(remote_url, run_copy)
    for checkpoint in (first, second):
        mirror.push(checkpoint)
    mirror.wait()
    fresh = tmp_path / "fresh"
    pulled = RemoteMirror(remote_url, fresh).pull_newer_than(None)
    for keep, keep_every, kept in [(2, 0, [first, second]), (1, 20, [first, second]), (1, 0, [second])]:
        again = RemoteMirror(remote_url, fresh, keep=keep, keep_every=keep_every)
        again.push(pulled)
        again.wait()
        assert _complete_remote_checkpoints(remote_url) == [path.name for path in kept], (keep, keep_every)
    mirror.push(first)
    mirror.push(second)
    mirror.wait()
    back = RemoteMirror(remote_url, run_copy, keep=3)
    back.push(first)  # a run that went back to step 20: its newest, whatever a failed drop left after it
    back.wait()
    assert _complete_remote_checkpoints(remote_url) == [first.name]


def test_a_fresh_disk_pulls_the_run_files_it_lacks_and_keeps_those_it_has(
    run_copy, remote_url, tmp_path, monkeypatch, capsys
):
    (run_copy / WANDB_ID_FILE).write_text("abc123\n")
    mirror = RemoteMirror(remote_url, run_copy)
    mirror.push(complete_checkpoints(run_copy)[-1])
    mirror.wait()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / METRICS_FILE).write_text("{}\n")  # the disk's own: kept
    puller = RemoteMirror(remote_url, fresh)
    get_file = puller.fs.get_file

    def cut_short(remote: str, local: str) -> None:
        Path(local).write_text("half")
        raise OSError("connection reset")

    monkeypatch.setattr(puller.fs, "get_file", cut_short)
    puller.pull_run_files()
    assert sorted(path.name for path in fresh.iterdir()) == [METRICS_FILE]  # no partial file left
    assert capsys.readouterr().err.count("the run resumes without it") == 2
    monkeypatch.setattr(puller.fs, "get_file", get_file)
    puller.pull_run_files()
    assert filecmp.cmp(fresh / RUN_CONFIG_FILE, run_copy / RUN_CONFIG_FILE, shallow=False)
    assert (fresh / WANDB_ID_FILE).read_text() == "abc123\n"
    assert (fresh / METRICS_FILE).read_text() == "{}\n"
    assert sorted(path.name for path in fresh.iterdir()) == sorted(RUN_FILES)


def test_a_fresh_run_refuses_a_remote_holding_another_runs_checkpoints(run_copy, digits, tmp_path):
    """Without resume=auto, a run on a fresh disk would start over and its first upload would prune
    the remote's checkpoints."""
    remote = f"file://{tmp_path / 'bucket' / 'run'}"
    mirror = RemoteMirror(remote, run_copy)
    mirror.push(complete_checkpoints(run_copy)[-1])
    mirror.wait()
    elsewhere = str(complete_checkpoints(run_copy)[0])  # another directory's step 20, going on here
    for resume in ("", elsewhere):
        with pytest.raises(UserError) as err:
            _train_in_process(digits, tmp_path / "fresh-disk", 41, resume, remote)
        assert str(err.value) == (
            f"checkpoint.remote={remote} already holds checkpoints of another run (newest step_00000040); "
            "continue it with checkpoint.resume=auto or pick a new checkpoint.remote"
        )
        assert _complete_remote_checkpoints(remote) == ["step_00000040"]


def test_a_resumed_checkpoint_the_remote_lacks_goes_up_at_start_up(run_copy, digits, tmp_path, capsys):
    """An upload cut short (no manifest yet) is retried by the next save; a run resumed at its last
    step saves nothing more, so its resume uploads it."""
    remote = f"file://{tmp_path / 'bucket' / 'run'}"
    mirror = RemoteMirror(remote, run_copy)
    for checkpoint in complete_checkpoints(run_copy):
        mirror.push(checkpoint)
    mirror.wait()
    fs, root = fsspec.core.url_to_fs(remote)
    fs.rm(f"{root}/checkpoints/step_00000040/{MANIFEST_FILE}")
    _train_in_process(digits, run_copy, 40, "auto", remote)  # finished: evaluates, saves nothing
    assert "checkpoint step_00000040 mirrored to" in capsys.readouterr().err
    assert _complete_remote_checkpoints(remote) == ["step_00000020", "step_00000040"]


def _hold_uploads(monkeypatch) -> None:
    """Uploads slower than the training between saves, made deterministic: each upload starts only
    once the run waits for it."""
    released = threading.Event()
    push, wait = RemoteMirror._push, RemoteMirror.wait

    def held_push(self: RemoteMirror, checkpoint: Path) -> None:
        released.wait()
        released.clear()
        push(self, checkpoint)

    def releasing_wait(self: RemoteMirror) -> None:
        if self._upload is not None:
            released.set()
        wait(self)

    monkeypatch.setattr(RemoteMirror, "_push", held_push)
    monkeypatch.setattr(RemoteMirror, "wait", releasing_wait)


def _complete_remote_checkpoints(url: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url)
    return sorted(Path(p).parent.name for p in fs.glob(f"{root}/checkpoints/*/{MANIFEST_FILE}"))


def test_with_keep_1_a_save_never_prunes_the_checkpoint_still_uploading(digits, tmp_path, monkeypatch):
    """keep=1: each save would delete the previous checkpoint, whose upload may be in flight; the
    save waits for it instead, so after each upload the remote holds that complete checkpoint."""
    remote = f"file://{tmp_path / 'bucket' / 'run'}"
    _hold_uploads(monkeypatch)
    held: list[list[str]] = []
    push = RemoteMirror._push

    def recorded_push(self: RemoteMirror, checkpoint: Path) -> None:
        push(self, checkpoint)
        held.append(_complete_remote_checkpoints(remote))

    monkeypatch.setattr(RemoteMirror, "_push", recorded_push)
    overrides = run_overrides(
        digits, tmp_path / "run", 3, "data.workers=0", "checkpoint.every_steps=1", "checkpoint.keep=1"
    )
    cfg = load_config(DEMO_CONFIG, [*overrides, f"checkpoint.remote={remote}"]).validate(world_size=1)
    Trainer(cfg, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))).run()
    assert held == [[f"step_{step:08d}"] for step in (1, 2, 3)]


def test_a_signal_after_the_final_evaluation_leaves_the_last_upload_to_finish(digits, tmp_path, monkeypatch):
    """The run has finished (its last step saved and evaluated) when Slurm's signal arrives during
    the last checkpoint's upload: it is recorded, the upload completes and the run ends as finished.
    The signal used to raise inside the wait, abandoning the upload, and the requeued run, resumed
    at train.max_steps, never saves again: the remote kept no final checkpoint."""
    remote = f"file://{tmp_path / 'bucket' / 'run'}"
    push = RemoteMirror._push

    def signalled_push(self: RemoteMirror, checkpoint: Path) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread, which waits for this upload
        push(self, checkpoint)

    monkeypatch.setattr(RemoteMirror, "_push", signalled_push)
    _hold_uploads(monkeypatch)  # the upload starts once the run waits for it, at its very end
    _train_in_process(digits, tmp_path / "run", 3, "auto", remote)  # one save, at the last step
    assert _complete_remote_checkpoints(remote) == ["step_00000003"]


def test_a_signal_as_the_final_evaluations_record_goes_up_is_only_recorded(digits, tmp_path, monkeypatch):
    """The final evaluation has ended when the signal comes, as its record starts up to the remote:
    the run has finished, and the record and the last checkpoint go up. (The signal used to stop the
    run there as if in the evaluation, exit 75, and the process's end cut the last uploads short.)"""
    remote = f"file://{tmp_path / 'bucket' / 'run'}"
    push_metrics = RemoteMirror.push_metrics

    def signalled_push_metrics(self: RemoteMirror) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the next line of Python
        push_metrics(self)

    monkeypatch.setattr(RemoteMirror, "push_metrics", signalled_push_metrics)
    _train_in_process(digits, tmp_path / "run", 3, "auto", remote, f"data.val={digits}/val")
    assert _complete_remote_checkpoints(remote) == ["step_00000003"]
    fs, root = fsspec.core.url_to_fs(remote)
    assert fs.cat_file(f"{root}/{METRICS_FILE}") == (tmp_path / "run" / METRICS_FILE).read_bytes()
    assert evaluated_steps(tmp_path / "run") == [3]


_put = RemoteMirror._put


def _slow_put(self: RemoteMirror, file: Path, target: str) -> None:
    time.sleep(0.4)
    _put(self, file, target)


def _upload_while_the_other_rank_ends(
    rank: int, world_size: int, run_dir: Path, remote: str
) -> tuple[int, list]:
    """Rank 1 ends preempted at once; rank 0 first waits for its checkpoint's upload (about 3 s), as
    ``Trainer.run`` does on the way out. The watch follows another rank's ending within 0.4 s here
    (this rank's process alone: it is a fresh fork)."""
    stopping.POLL_S, stopping.FOLLOW_S, stopping.EXIT_WAIT_S = 0.05, 0.2, 0.2
    RemoteMirror._put = _slow_put
    watch = stopping.StopWatch(DistEnv(rank, world_size, rank, torch.device("cpu")), run_dir)
    try:
        with preemption_signals():
            try:
                if rank == 0:
                    mirror = RemoteMirror(remote, run_dir)
                    mirror.push(complete_checkpoints(run_dir)[-1])
                    mirror.wait()
                raise Preempted("SIGTERM received")
            except Preempted as err:
                return watch.ended_by(err), _complete_remote_checkpoints(remote)
    finally:
        watch.close()


def test_another_ranks_ending_leaves_rank_zeros_upload_to_finish(run_copy, tmp_path):
    """Preempted on several ranks: the others end first (they upload nothing), and rank 0's watch,
    seeing their ending, ended rank 0 mid-upload (os._exit after 3 + 5 s), so the checkpoint saved
    for the preemption never reached the remote, the case checkpoint.remote exists for."""
    remote = f"file://{tmp_path / 'bucket' / 'run'}"
    results = run_distributed(_upload_while_the_other_rank_ends, 2, run_copy, remote, timeout_s=60)
    newest = complete_checkpoints(run_copy)[-1].name
    assert results[0] == (75, [newest])
    assert results[1][0] == 75


def _preempted_during_a_slow_upload(rank: int, world_size: int, overrides: list[str], uploaded: str) -> bool:
    """Rank 1 is signalled in step 2; rank 0's upload of the checkpoint the preemption saves takes
    5 s, then leaves ``uploaded`` behind. Returns whether it was there when this rank's run ended."""
    push = RemoteMirror._push

    def slow_push(self: RemoteMirror, checkpoint: Path) -> None:
        time.sleep(5)
        push(self, checkpoint)
        Path(uploaded).touch()

    RemoteMirror._push = slow_push
    cfg = load_config(DEMO_CONFIG, overrides).validate(world_size=world_size)
    trainer, signals = (
        Trainer(cfg, DistEnv(rank, world_size, local_rank=0, device=torch.device("cpu"))),
        SignalFlag(),
    )
    train_step = trainer.train_step

    def signalled_in_step_two(*args, **kwargs):
        if rank == 1 and trainer.step == 1:
            signals.received = signal.SIGTERM
        return train_step(*args, **kwargs)

    trainer.train_step = signalled_in_step_two
    try:
        trainer.run(signals)
    except Preempted:
        return Path(uploaded).exists()
    raise AssertionError("the run was not preempted")


def test_a_preempted_run_ends_every_rank_after_rank_zeros_upload(digits, tmp_path):
    """Under srun ``--kill-on-bad-exit`` the first rank to exit 75 has the step killed: the others
    wait for rank 0's upload of the checkpoint the preemption saved before they end."""
    remote = f"file://{tmp_path / 'bucket' / 'run'}"
    saves = ["checkpoint.every_steps=1000", f"checkpoint.remote={remote}"]
    overrides = run_overrides(digits, tmp_path / "run", 5, "data.workers=0", *saves)
    uploaded = tmp_path / "uploaded"
    assert (
        run_distributed(_preempted_during_a_slow_upload, 2, overrides, str(uploaded), timeout_s=60)
        == [True] * 2
    )
    assert _complete_remote_checkpoints(remote) == ["step_00000002"]


def _train_with_a_slow_first_upload(rank: int, world_size: int, overrides: list[str], upload_s: float) -> int:
    """Rank 0's first upload takes ``upload_s``, longer than the group's collective timeout; the
    second save waits for it (before pruning with keep=1, before the next upload with keep=2)."""
    push, slowed = RemoteMirror._push, []

    def slow_first_push(self: RemoteMirror, checkpoint: Path) -> None:
        if not slowed:
            slowed.append(checkpoint.name)
            time.sleep(upload_s)
        push(self, checkpoint)

    RemoteMirror._push = slow_first_push
    cfg = load_config(DEMO_CONFIG, overrides).validate(world_size=world_size)
    trainer = Trainer(cfg, DistEnv(rank, world_size, local_rank=0, device=torch.device("cpu")))
    trainer.run()
    return trainer.step


@pytest.mark.parametrize("keep", [1, 2])
def test_ranks_wait_for_rank_zeros_upload_past_the_collective_timeout(digits, tmp_path, keep):
    """The other ranks wait for rank 0's upload through the store, up to train.io_timeout_s: in their
    next collective they would fail after the group's timeout (4 s here)."""
    remote = f"file://{tmp_path / 'bucket' / 'run'}"
    saves = ["checkpoint.every_steps=1", f"checkpoint.keep={keep}", f"checkpoint.remote={remote}"]
    overrides = run_overrides(digits, tmp_path / "run", 3, "data.workers=0", *saves)
    assert run_distributed(_train_with_a_slow_first_upload, 2, overrides, 10.0, timeout_s=4) == [3, 3]
    assert _complete_remote_checkpoints(remote) == [f"step_{step:08d}" for step in (1, 2, 3)[-keep:]]
