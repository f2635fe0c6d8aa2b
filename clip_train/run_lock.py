"""The ``train.out_dir`` lock: one training run per run directory, across ranks, restarts and hosts.

Two runs writing one directory would interleave their checkpoints and metrics. Global rank 0 holds
``{out_dir}/.clip_train.lock`` for the whole run: JSON naming its host, pid, Slurm job, start time
and a random token, created with ``O_CREAT | O_EXCL`` (atomic on local disks, NFSv3+, Lustre and
GPFS, unlike ``flock`` on some of them), its mtime refreshed every ``heartbeat_s`` by a thread.
Another host's pids cannot be checked, so a lock held by someone else is stale when:

* it is from this machine (same hostname and pid namespace) and its process is gone (a run killed
  with SIGKILL, a torchrun restart; a pid reused by a newer process does not count), or
* it is from another machine and from our own Slurm job step (the same ``SLURM_JOB_ID`` and
  ``SLURM_STEP_ID``: a requeued job, or a restart that put rank 0 on another node; Slurm or torchrun
  stopped the old processes; another step of the job may be a run still going), or
* it is from another machine and its heartbeat is older than ``stale_s`` (a lost node; this assumes
  the hosts' clocks agree to well within ``stale_s``).

A live process on this machine holds the lock however old its heartbeat (it may be suspended).
Otherwise the run refuses, naming the holder. A stale lock is renamed to a name only this contender
uses, and the new one created with ``O_EXCL``: of several contenders only one rename moves the
stale lock, and one whose rename moved a lock created since it looked puts that lock back.

A run whose lock was taken over all the same (its heartbeat went unseen for ``stale_s``: a stalled
filesystem, a suspended job, clocks that disagree) must write nothing more there: its heartbeat
finds the other run's lock in place of its own, and the trainer's next step boundary stops every
rank without saving (``RunLock.kept``, ``RunLock.check_kept``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil

from clip_train.distributed import decided_by_main, failing_together
from clip_train.errors import UserError, naming_key
from clip_train.logs import get_logger

LOCK_FILE = ".clip_train.lock"
HEARTBEAT_S = 30.0
STALE_S = 90.0  # three missed heartbeats
FILL_WAIT_S = 1.0  # a lock file is filled right after it is created: how long an empty one is re-read
MAX_ATTEMPTS = 10  # takeovers lost to other contenders before giving up
SHARED_WAIT_S = 5.0  # how long a rank looks for rank 0's lock before taking out_dir for unshared


@dataclass(frozen=True)
class Holder:
    """A lock's owner, as its file records it."""

    host: str
    pid: int
    pid_namespace: str
    slurm_job_id: str | None
    started: str  # ISO 8601 with the UTC offset, to the second
    token: str  # tells this lock from any other, pid reuse and takeovers included
    slurm_step_id: str | None = None  # absent from the locks of runs from before it was recorded

    @classmethod
    def this_process(cls) -> Holder:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_namespace=_pid_namespace(),
            slurm_job_id=os.environ.get("SLURM_JOB_ID"),
            started=datetime.now().astimezone().isoformat(timespec="seconds"),
            token=secrets.token_hex(8),
            slurm_step_id=os.environ.get("SLURM_STEP_ID"),
        )

    @classmethod
    def from_json(cls, content: bytes) -> Holder | None:
        """None for anything but a complete record (a file cut short by a crash)."""
        try:
            return cls(**json.loads(content))
        except (ValueError, TypeError):
            return None

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    def same_machine(self, other: Holder) -> bool:
        """Whether pids mean the same processes for both: a container may share the hostname only."""
        return (self.host, self.pid_namespace) == (other.host, other.pid_namespace)

    def same_slurm_step(self, other: Holder) -> bool:
        """Whether both run in one step of one Slurm job: a restart or a requeue of it, never a run
        beside it (another step of the job)."""
        ours, theirs = (self.slurm_job_id, self.slurm_step_id), (other.slurm_job_id, other.slurm_step_id)
        return bool(self.slurm_job_id) and ours == theirs

    def describe(self) -> str:
        step = f" step {self.slurm_step_id}" if self.slurm_step_id else ""
        job = f", Slurm job {self.slurm_job_id}{step}" if self.slurm_job_id else ""
        return f"host {self.host}, pid {self.pid}{job}, since {self.started}"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux
        return ""


def _process_alive(holder: Holder) -> bool:
    """Whether the holder's process still runs on this machine (not a newer one that reused its pid)."""
    try:
        process = psutil.Process(holder.pid)
        started = datetime.fromisoformat(holder.started).timestamp()
        # 2 s: ``started`` is cut to the second, and psutil's start time can be off by one
        return process.status() != psutil.STATUS_ZOMBIE and process.create_time() <= started + 2
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


@dataclass(frozen=True)
class LockFile:
    """One reading of a lock file."""

    content: bytes
    mtime: float
    holder: Holder | None  # None: not a complete record

    def same_lock(self, other: LockFile) -> bool:
        """The token makes every complete record unique; a file without one is told apart by its
        mtime, which no heartbeat refreshes."""
        return self.content == other.content and (self.holder is not None or self.mtime == other.mtime)

    def describe(self) -> str:
        return self.holder.describe() if self.holder else "an unreadable lock file"

    def heartbeat_age_s(self) -> float:
        return time.time() - self.mtime


def _load(path: Path) -> LockFile:
    with path.open("rb") as file:  # opening revalidates NFS's cached attributes, the mtime included
        content, mtime = file.read(), os.fstat(file.fileno()).st_mtime
    return LockFile(content, mtime, Holder.from_json(content))


def _read(path: Path, fill_wait_s: float = FILL_WAIT_S) -> LockFile | None:
    """The lock file at ``path``, or None without one; an empty one is read again for up to
    ``fill_wait_s``, since its creator writes it right after creating it."""
    deadline = time.monotonic() + fill_wait_s
    while True:
        try:
            lock = _load(path)
        except FileNotFoundError:
            return None
        if lock.content or time.monotonic() > deadline:
            return lock
        time.sleep(0.02)


class RunLock:
    """The lock on one run directory, for one process (global rank 0)."""

    def __init__(self, out_dir: Path, heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S) -> None:
        self.out_dir, self.path = out_dir, out_dir / LOCK_FILE
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.me = Holder.this_process()
        self.taken_over_by: LockFile | None = None  # another run's lock, found in ours' place
        self._released = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lock, creating the directory if needed. Returns the stale holder it replaced (None
        if there was none); raises ``UserError`` when a live run holds it or the directory is unusable."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            replaced = self._take()
        except (FileExistsError, NotADirectoryError):
            raise UserError("not a directory (a file is in the way)") from None
        except OSError as err:
            raise UserError(f"cannot create the run lock {self.path}: {err.strerror or err}") from None
        self._heartbeat = threading.Thread(target=self._beat_until_released, name="run-lock", daemon=True)
        self._heartbeat.start()
        return replaced

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still ours; nothing if never acquired."""
        if self._heartbeat is None:
            return
        self._released.set()
        self._heartbeat.join()
        self._heartbeat = None
        current = _read(self.path, fill_wait_s=0)
        if current is not None and current.holder == self.me:
            self.path.unlink(missing_ok=True)

    def _take(self) -> str | None:
        replaced = None
        for _ in range(MAX_ATTEMPTS):
            if self._create():
                return replaced
            current = _read(self.path)
            if current is None:
                continue  # released since: create it again
            reason = self._stale_reason(current)
            if reason is None:
                raise UserError(self._refusal(current))
            if self._move_aside(current):
                replaced = f"{current.describe()}: {reason}"
        raise UserError(f"gave up on the run lock {self.path}: other runs kept taking it over")

    def _create(self) -> bool:
        """Create the lock file with our record; False if there is one already."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(self.me.to_json())
        except OSError:
            self.path.unlink(missing_ok=True)  # an empty lock would block others until it went stale
            raise
        return True

    def _stale_reason(self, lock: LockFile) -> str | None:
        """Why ``lock`` belongs to a run that is gone (the module's rule), or None if it may be live."""
        holder = lock.holder
        if holder is not None and holder.same_machine(self.me):
            return None if _process_alive(holder) else "its process is gone"
        if holder is not None and holder.same_slurm_step(self.me):
            return "it is from this Slurm job step, requeued or restarted"
        age_s = lock.heartbeat_age_s()
        return f"no heartbeat for {age_s:.0f} s" if age_s > self.stale_s else None

    def _refusal(self, lock: LockFile) -> str:
        return (
            f"in use by another run ({lock.describe()}, last heartbeat {lock.heartbeat_age_s():.0f} s "
            f"ago): stop it or choose another train.out_dir; {self.path} is taken over once that run "
            f"is gone (from another host: after {self.stale_s:.0f} s without a heartbeat)"
        )

    def _move_aside(self, stale: LockFile) -> bool:
        """Rename the stale lock to a name only we use and delete it; False if another contender
        moved it first, or if what we moved is a lock created since we looked (it is put back)."""
        aside = self.path.with_name(f"{LOCK_FILE}.{self.me.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        if _load(aside).same_lock(stale):
            aside.unlink()
            return True
        os.replace(aside, self.path)
        return False

    @property
    def kept(self) -> bool:
        """False once another run took this lock over; True on the ranks that only share the folder.
        Cheap: the trainer's stop vote reads it at every step boundary."""
        return self.taken_over_by is None

    def check_kept(self) -> None:
        """Raise a one-line ``UserError`` naming the run that took this lock over, if one did."""
        if self.taken_over_by is not None:
            raise UserError(
                f"train.out_dir={self.out_dir}: another run took over this run's lock "
                f"({self.taken_over_by.describe()}), taking this run for gone (no heartbeat seen for "
                f"{self.stale_s:.0f} s: a stalled filesystem or a suspended job, say); this run stops "
                "without saving, leaving the folder to that one"
            )

    def _beat_until_released(self) -> None:
        """Refresh the heartbeat until released, or until another run's lock is found in place of
        ours (``taken_over_by``): this run must then stop."""
        while not self._released.wait(self.heartbeat_s):
            if (foreign := self._beat()) is not None:
                self.taken_over_by = foreign
                return

    def _beat(self) -> LockFile | None:
        """Refresh the mtime; returns the lock file instead once it holds another run's lock."""
        try:
            current = _read(self.path)
            if current is not None and current.holder not in (None, self.me):  # unreadable: look again
                return current
            os.utime(self.path)
        except OSError:  # gone for a moment (a contender putting it back) or a filesystem hiccup
            pass
        return None


@contextmanager
def hold_out_dir(
    out_dir: str | Path,
    heartbeat_s: float = HEARTBEAT_S,
    stale_s: float = STALE_S,
) -> Iterator[RunLock]:
    """Hold the lock on ``train.out_dir`` for the block, on global rank 0; yields it (on every rank)
    for the trainer to check it is still held. A collective: every rank learns rank 0's outcome, so a
    refusal raises the same ``UserError`` on all of them and none is left waiting for rank 0 in the
    next collective. Every rank then finds rank 0's lock in the folder (a vote on the host), or all
    stop: checkpoints are written by several ranks into folders rank 0 creates, so the folder must be
    one that all nodes share."""
    lock = RunLock(Path(out_dir), heartbeat_s, stale_s)
    try:
        token = decided_by_main(lambda: _take_announced(lock))
        with failing_together():
            _check_shared(lock, token)
        yield lock
    finally:
        lock.release()


def _take_announced(lock: RunLock) -> str:
    """Acquire, with errors naming ``train.out_dir``, and one line when a stale lock is taken over;
    returns the lock's token."""
    with naming_key("train.out_dir", str(lock.out_dir)):
        replaced = lock.acquire()
    if replaced:
        get_logger().warning(f"train.out_dir={lock.out_dir}: took over the lock of {replaced}")
    return lock.me.token


def _check_shared(lock: RunLock, token: str, wait_s: float = SHARED_WAIT_S) -> None:
    """Whether this rank sees the lock rank 0 holds, waiting ``wait_s`` for a network filesystem's
    cached view of the folder to catch up."""
    deadline = time.monotonic() + wait_s
    while (found := _read(lock.path)) is None or found.holder is None or found.holder.token != token:
        if time.monotonic() > deadline:
            raise UserError(
                f"train.out_dir={lock.out_dir} is not the folder rank 0 holds (its lock {LOCK_FILE} is "
                f"missing or another run's): train.out_dir must be on a filesystem all nodes share"
            )
        time.sleep(0.1)
