"""Run one measurement in a fresh Python process, so that its memory peak is its own (the resident
set's peak is process-wide: ``memory.peak_bytes``) and nothing it loads or leaks reaches the next one.

The function is named by module and name, its spec and result travel as JSON: the child starts
from a clean interpreter, not a copy of the parent (fork) or an unpickled one (spawn).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from clip_train.errors import UserError


class ProcessFailed(RuntimeError):
    """The process ended without a result: ``killed`` by a signal (the OOM killer, typically) or an error."""

    def __init__(self, target: str, returncode: int, stderr: str) -> None:
        super().__init__(f"{target} failed in a fresh process (exit code {returncode}):\n{stderr.strip()}")
        self.killed = returncode < 0
        self.last_line = (stderr.strip().splitlines() or ["no output"])[-1]


class Terminated(SystemExit):
    """SIGTERM (``timeout``'s, a session's end), raised in the main thread while a measurement runs:
    ``finally`` blocks run and the measurement is killed with its processes (``run_as_group``), where
    the signal's default would end this process alone. Uncaught, it exits 143 as the signal would."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(128 + signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``Terminated`` (in the main thread, the one a handler
    can be set in; elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_as_group(
    command: list[str], timeout_s: float | None = None, input: str | None = None, **popen: Any
) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a process group of its own, killed whole past ``timeout_s``, on SIGTERM
    or when this process is interrupted: a measurement's own children (torchrun's ranks, a
    benchmark's trainers, data workers) would otherwise outlive it, holding the GPU the next one
    measures. Its stdin is empty unless ``input`` is given: in a group of its own, a read from the
    terminal would stop it until its timeout."""
    stdin = subprocess.PIPE if input is not None else subprocess.DEVNULL
    with sigterm_raises(), subprocess.Popen(command, stdin=stdin, process_group=0, **popen) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout_s)
        except BaseException:
            _kill_all(proc.pid)
            proc.wait()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _kill_all(pid: int) -> None:
    """``pid``, its group and its descendants: those in a group of their own (a measurement that
    started one, as this module's do) are found as descendants, listed before anything is killed;
    those whose parent had already ended, in the group."""
    descendants = []
    with contextlib.suppress(psutil.NoSuchProcess):
        descendants = psutil.Process(pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for process in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def in_fresh_process(fn: Callable[[Any], Any], spec: Any, timeout_s: float | None = None) -> Any:
    """``fn(spec)`` in a new interpreter; ``fn`` is a module-level function. Its stdout passes through;
    its stderr is replayed after it ends, or carried by :class:`ProcessFailed`. Past ``timeout_s`` it
    is killed (``subprocess.TimeoutExpired``)."""
    target = f"{fn.__module__}:{fn.__qualname__}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        command = [sys.executable, "-m", __name__, target, str(out)]
        proc = run_as_group(command, timeout_s, json.dumps(spec), stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise ProcessFailed(target, proc.returncode, proc.stderr)
        sys.stderr.write(proc.stderr)
        return json.loads(out.read_text())


class RunFailed(UserError):
    """A logged command (``run_logged``) failed or outlived its time; the message ends with its last lines."""


def run_logged(
    command: list[str],
    output: Path,
    what: str,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> None:
    """``command`` with its stdout and stderr written to ``output`` as they come, so that a run that
    hangs, or outlives ``timeout_s`` and is killed, leaves what it said. :class:`RunFailed` names
    how it ended, with its own error lines first and its last lines."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w") as sink:
        try:
            ended = run_as_group(
                command, timeout_s, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            ).returncode
        except subprocess.TimeoutExpired:
            ended = None
    if ended == 0:
        return
    lines = output.read_text(errors="replace").strip().splitlines()
    said = [line for line in lines if "error:" in line.lower()][:5]  # a process's own message first
    how = f"was stopped after {timeout_s:.0f} s" if ended is None else f"exited {ended}"
    raise RunFailed("\n".join([f"{what} {how}:", *said, "...", *lines[-10:]]))


def _main() -> None:
    target, out = sys.argv[1:]
    module, name = target.split(":")
    result = getattr(importlib.import_module(module), name)(json.load(sys.stdin))
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _main()
