"""``checkpoint.remote``: the run's checkpoints mirrored to any fsspec URL (``s3://``, ``gs://``,
``hf://``, a mounted path), so a run on a machine that loses its disk (a spot instance, a node
swap) resumes elsewhere: ``checkpoint.resume=auto`` pulls the newest remote checkpoint when it is
newer than the disk's newest sound one (the disk lacks it, or holds it damaged).

A checkpoint goes up in the background after it is saved, its manifest last (a step uploaded again
loses its old manifest first): as on the local disk, a remote checkpoint without a manifest is
incomplete and is never pulled, and a pulled one is verified against its manifest like any other.
The run's config (with the weights it pinned), its metrics and its wandb run id go up with each
checkpoint (the metrics again after each evaluation), and a fresh disk's resume pulls them first.
After each upload the remote is pruned by the run's own rule (``checkpoint.keep`` and
``keep_every``) over what it holds up to that step, so milestones a fresh disk never pulled stay; a
save never prunes the checkpoint whose upload is in flight. A failed upload is a warning and is
retried with the next checkpoint (a resumed run's checkpoint the remote lacks goes up at start-up):
a week-long run does not stop for a storage hiccup.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import fsspec

from clip_train.checkpoint import (
    MANIFEST_FILE,
    RUN_CONFIG_FILE,
    beyond_keep,
    checkpoint_problem,
    checkpoint_root,
    checkpoint_step,
    is_step_name,
    replace_checkpoint,
    temp_checkpoint_dir,
)
from clip_train.config import CheckpointConfig
from clip_train.errors import UserError
from clip_train.logs import get_logger
from clip_train.monitor import METRICS_FILE, WANDB_ID_FILE
from clip_train.stopping import waiting_for_own_work

RUN_FILES = (RUN_CONFIG_FILE, METRICS_FILE, WANDB_ID_FILE)  # mirrored beside the checkpoints


class RemoteMirror:
    """Uploads of ``run_dir``'s checkpoints to ``url``, one at a time, and the pull back. The remote
    keeps what ``keep`` and ``keep_every`` keep (``checkpoint.*``)."""

    def __init__(
        self,
        url: str,
        run_dir: str | os.PathLike,
        keep: int = CheckpointConfig.keep,
        keep_every: int = CheckpointConfig.keep_every,
    ) -> None:
        self.url, self.run_dir = url, Path(run_dir)
        self.keep, self.keep_every = keep, keep_every
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as err:  # an unknown protocol, or its package missing
            raise UserError(f"checkpoint.remote={url}: {err}") from None
        self._upload: threading.Thread | None = None

    def push(self, checkpoint: Path) -> None:
        """Start uploading ``checkpoint`` (waiting for the previous upload first), then the run's
        files, then delete the remote checkpoints the run's keep rule does not keep."""
        self.wait()
        self._upload = threading.Thread(target=self._push, args=(checkpoint,), daemon=True)
        self._upload.start()

    def before_save(self, keep: int) -> None:
        """Call before each save, which prunes all but the newest ``keep`` checkpoints. The upload in
        flight is of the newest one: with ``keep=1`` the save would delete it mid-upload, so that upload
        ends first; with more the save keeps it, and the upload goes on beside the save."""
        if keep < 2:
            self.wait()

    def wait(self) -> None:
        """Block until the upload in flight (if any) is done: before the next one, and at the end.
        Neither a signal nor another rank's ending cuts the wait short: the checkpoint going up is
        often the one a preemption saved."""
        if self._upload is not None:
            with waiting_for_own_work():
                self._upload.join()
            self._upload = None

    def push_metrics(self) -> None:
        """Upload ``metrics.jsonl`` again once the upload in flight (if any) is done: an evaluation
        logged after its checkpoint went up, whose record a fresh disk's resume would otherwise lack
        and run again. (The run's other files do not change after start-up.)"""
        upload = threading.Thread(target=self._push_metrics, args=(self._upload,), daemon=True)
        upload.start()
        self._upload = upload  # once started: ``wait`` cannot join a thread that never started

    def _push_metrics(self, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()
        try:
            self._put_run_files([METRICS_FILE])
        except Exception as err:  # any storage error: warn, and retry with the next save
            get_logger().warning(
                f"warning: checkpoint.remote={self.url}: uploading {METRICS_FILE} failed "
                f"({type(err).__name__}: {err}); the next checkpoint tries again"
            )

    def _push(self, checkpoint: Path) -> None:
        try:
            self._upload_checkpoint(checkpoint)
            self._put_run_files()
            self._prune(checkpoint_step(checkpoint))
            get_logger().info(f"checkpoint {checkpoint.name} mirrored to {self.url}")
        except Exception as err:  # any storage error: warn, and retry with the next save
            get_logger().warning(
                f"warning: checkpoint.remote={self.url}: uploading {checkpoint.name} failed "
                f"({type(err).__name__}: {err}); the next checkpoint tries again"
            )

    def _put_run_files(self, names: Sequence[str] = RUN_FILES) -> None:
        for name in names:
            if (self.run_dir / name).is_file():
                self._put(self.run_dir / name, f"{self.root}/{name}")

    def _upload_checkpoint(self, checkpoint: Path) -> None:
        target = f"{self._checkpoints()}/{checkpoint.name}"
        if self.fs.isfile(f"{target}/{MANIFEST_FILE}"):  # a step saved again: incomplete until it is up
            self.fs.rm(f"{target}/{MANIFEST_FILE}")
        files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
        for file in files:
            self._put(file, f"{target}/{file.relative_to(checkpoint).as_posix()}")
        self._put(checkpoint / MANIFEST_FILE, f"{target}/{MANIFEST_FILE}")  # complete from now on

    def _prune(self, uploaded: int) -> None:
        """Delete what the run's keep rule drops from the remote's complete checkpoints up to the
        ``uploaded`` step, the run's newest; those after it (a history the run went back from) and
        the uploads cut short (no manifest) of other steps go too."""
        steps = self._remote_steps()
        ours = (Path(name) for name in steps if checkpoint_step(Path(name)) <= uploaded and self.holds(name))
        complete = sorted(ours, key=checkpoint_step)
        dropped = beyond_keep(complete, self.keep, self.keep_every)
        kept = {path.name for path in complete if path not in dropped}
        for stale in set(steps) - kept:
            self.fs.rm(f"{self._checkpoints()}/{stale}", recursive=True)

    def _put(self, file: Path, target: str) -> None:
        self.fs.makedirs(posixpath.dirname(target), exist_ok=True)  # object stores ignore it
        self.fs.put_file(str(file), target)

    def newest_complete(self) -> str | None:
        """The name of the newest remote checkpoint with its manifest (an upload cut short has none)."""
        complete = (name for name in self._remote_steps() if self.holds(name))
        return max(complete, key=lambda name: checkpoint_step(Path(name)), default=None)

    def pull_run_files(self) -> None:
        """The run's files the disk lacks (a fresh one): its config, whose pins keep the teacher it
        started with, its metrics and its wandb run id, before the resume reads them. A file that
        does not come is a warning: the checkpoint alone resumes the training."""
        for name in RUN_FILES:
            local, remote = self.run_dir / name, f"{self.root}/{name}"
            pulled = local.with_name(f".{name}.pulled")
            try:
                if local.exists() or not self.fs.isfile(remote):
                    continue
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(remote, str(pulled))
                os.replace(pulled, local)
                get_logger().info(f"checkpoint.remote={self.url}: pulled {name}")
            except Exception as err:  # any storage error
                pulled.unlink(missing_ok=True)
                get_logger().warning(
                    f"warning: checkpoint.remote={self.url}: pulling {name} failed ({type(err).__name__}: "
                    f"{err}); the run resumes without it"
                )

    def pull_newer_than(self, held: Path | None) -> Path | None:
        """Download the newest complete remote checkpoint into the run's checkpoint folder and return
        it, verified; ``None`` when it is not newer than ``held``, the disk's newest sound checkpoint.
        It goes to a temporary folder, renamed into place once it verifies; a damaged local copy of
        its step is replaced then (resuming would pass over it and lose what the remote kept), and
        left as it was if the pulled copy does not verify either."""
        name = self.newest_complete()
        if name is None or (held is not None and checkpoint_step(held) >= checkpoint_step(Path(name))):
            return None
        local = checkpoint_root(self.run_dir) / name
        partial = temp_checkpoint_dir(self.run_dir, checkpoint_step(local))  # cleaned up if we die
        get_logger().info(f"checkpoint.remote={self.url}: pulling {name}")
        partial.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.fs.get(f"{self._checkpoints()}/{name}", str(partial), recursive=True)
        except Exception as err:  # any storage error ends the resume, with its cause
            shutil.rmtree(partial, ignore_errors=True)
            raise UserError(
                f"checkpoint.remote={self.url}: pulling {name} failed ({type(err).__name__}: {err})"
            ) from None
        if problem := checkpoint_problem(partial, checksums=True):
            shutil.rmtree(partial, ignore_errors=True)
            kept = f"; the local {local} is left as it was" if local.exists() else ""
            raise UserError(
                f"checkpoint.remote={self.url}: the pulled {name} does not verify: {problem}{kept}; "
                f"delete it from the remote to resume from an older one"
            )
        replace_checkpoint(partial, local)
        return local

    def drop_newer_than(self, step: int) -> None:
        """Delete the remote checkpoints newer than the resumed ``step``, which the checkpointer set
        aside on the disk: pulled, they would resume the history the run went back from."""
        try:
            for stale in (name for name in self._remote_steps() if checkpoint_step(Path(name)) > step):
                self.fs.rm(f"{self._checkpoints()}/{stale}", recursive=True)
                get_logger().info(f"checkpoint.remote={self.url}: deleted {stale}, newer than step {step}")
        except Exception as err:  # any storage error: warn; the next upload prunes them too
            get_logger().warning(
                f"warning: checkpoint.remote={self.url}: deleting the checkpoints newer than step {step} "
                f"failed ({type(err).__name__}: {err}); the next upload tries again"
            )

    def _checkpoints(self) -> str:
        return f"{self.root}/checkpoints"

    def _remote_steps(self) -> list[str]:
        if not self.fs.isdir(self._checkpoints()):
            return []
        names = (Path(entry).name for entry in self.fs.ls(self._checkpoints(), detail=False))
        return [name for name in names if is_step_name(name)]

    def holds(self, name: str) -> bool:
        """Whether the remote holds the checkpoint ``name`` whole (its manifest is up)."""
        return self.fs.isfile(f"{self._checkpoints()}/{name}/{MANIFEST_FILE}")
