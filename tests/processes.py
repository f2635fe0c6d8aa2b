"""Subprocesses that tests wait on by progress, not by the clock: a run that still writes output
(a progress-bar redraw, a log line) is never killed, so a busy machine makes tests slow, not
failing; one that stays silent for ``IDLE_LIMIT_S`` is taken for hung."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import forked_cli
import psutil

IDLE_LIMIT_S = 600.0


@dataclass
class Stream:
    """One pipe's text so far, and when each piece of it arrived."""

    pieces: list[tuple[float, str]] = field(default_factory=list)  # (time.monotonic(), text)

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.pieces)

    def first_seen(self, needle: str) -> float | None:
        """When ``needle`` was complete in the output, or None if it never was."""
        so_far = ""
        for at, text in self.pieces:
            so_far += text
            if needle in so_far:
                return at
        return None


@dataclass
class Watched:
    """A running command whose stdout and stderr are read as they come (stderr into stdout when
    merged). ``last_output`` is when either last grew: the progress a wait is bounded by."""

    process: subprocess.Popen | forked_cli.ForkedProcess
    stdout: Stream = field(default_factory=Stream)
    stderr: Stream = field(default_factory=Stream)
    last_output: float = field(default_factory=time.monotonic)
    _readers: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        command: Sequence[str],
        *,
        merge_stderr: bool = False,
        env: Mapping[str, str] | None = None,
        **popen_kwargs,
    ) -> Watched:
        """Start ``command``; ``python -m clip_train ...`` and torchrun are forked from the worker's
        server (``forked_cli``) where they can be, and so are the ranks of ``torchrun ... -m MODULE``."""
        out_read, out_write = os.pipe()
        err_read, err_write = (out_read, out_write) if merge_stderr else os.pipe()
        env = os.environ if env is None else env
        command, env = forked_cli.with_forked_ranks(command, env, popen_kwargs)
        if forked_cli.can_fork(command, env, popen_kwargs):
            process = forked_cli.start(command, env, popen_kwargs.get("cwd"), out_write, err_write)
        else:
            process = subprocess.Popen(command, stdout=out_write, stderr=err_write, env=env, **popen_kwargs)
        for fd in {out_write, err_write}:
            os.close(fd)
        watched = cls(process)
        pipes = [(out_read, watched.stdout)] + ([] if merge_stderr else [(err_read, watched.stderr)])
        for fd, stream in pipes:
            reader = threading.Thread(target=watched._read, args=(fd, stream), daemon=True)
            reader.start()
            watched._readers.append(reader)
        return watched

    def _read(self, fd: int, stream: Stream) -> None:
        with open(fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                self.last_output = time.monotonic()
                stream.pieces.append((self.last_output, chunk.decode(errors="replace")))

    def wait_for(self, condition: Callable[[], bool], what: str, idle_limit_s: float = IDLE_LIMIT_S) -> None:
        """Poll ``condition()`` while the process runs and keeps writing output."""
        while not condition():
            assert self.process.poll() is None, f"it ended before {what}:\n{self.output[-3000:]}"
            assert time.monotonic() - self.last_output < idle_limit_s, f"it went silent before {what}"
            time.sleep(0.02)

    def wait(self, idle_limit_s: float = IDLE_LIMIT_S) -> subprocess.CompletedProcess:
        """Wait for the end; kill the process (and fail) only after ``idle_limit_s`` without output."""
        while self.process.poll() is None:
            if time.monotonic() - self.last_output > idle_limit_s:
                self.process.kill()
                self.process.wait()
                raise AssertionError(
                    f"no output for {idle_limit_s:.0f} s, taken for hung:\n{self.output[-3000:]}"
                )
            time.sleep(0.05)
        for reader in self._readers:
            reader.join()
        return subprocess.CompletedProcess(
            self.process.args, self.process.returncode, self.stdout.text, self.stderr.text
        )

    @property
    def output(self) -> str:
        return self.stdout.text + self.stderr.text


def both_ends(text: str, size: int = 3000) -> str:
    """A long output's start (where a failing multi-node run said why) and its end (how it ended)."""
    return text if len(text) <= 2 * size else f"{text[:size]}\n[...]\n{text[-size:]}"


def run_to_end(
    command: Sequence[str], *, idle_limit_s: float = IDLE_LIMIT_S, **popen_kwargs
) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(command, capture_output=True, text=True)``, bounded by silence, not by
    duration."""
    return Watched.start(command, **popen_kwargs).wait(idle_limit_s)


@dataclass
class FilesGrowing:
    """Progress of work that runs elsewhere (a Slurm job): the files it writes keep changing."""

    paths: Sequence[Path]
    idle_limit_s: float = IDLE_LIMIT_S
    _seen: tuple = ()
    _changed: float = field(default_factory=time.monotonic)

    def stalled(self) -> bool:
        """True once none of the files changed for ``idle_limit_s``."""
        now = tuple(_stamp(path) for path in self.paths)
        if now != self._seen:
            self._seen, self._changed = now, time.monotonic()
        return time.monotonic() - self._changed > self.idle_limit_s


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns


def process_status(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"


def ended(pids: list[int], within_s: float = 60.0) -> bool:
    """Whether every process ends (gone, or a zombie left to whoever adopted it); a hang guard."""
    deadline = time.monotonic() + within_s
    while any(process_status(pid) not in ("gone", psutil.STATUS_ZOMBIE) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
