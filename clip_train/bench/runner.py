"""Run one measurement in a process of its own, so that its memory peak is its own (the resident
set's peak is process-wide: ``memory.peak_bytes``) and nothing it loads or leaks reaches the next one.

The process is forked from multiprocessing's fork server, which has imported the measurement's module
and the libraries measured beside ours and done nothing else: not a copy of the parent (fork), which
may hold CUDA, threads and earlier results. A new interpreter spent 3-10 s of CPU on those imports
before each measurement, more than a toy one takes. The server's children have its environment, so
once this process's environment changes the measurements start new interpreters instead; so they do
on a machine with a CUDA device. The function is named by module and name, its spec and result
travel as JSON.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
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
import torch

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
    with (
        sigterm_raises(),
        subprocess.Popen(command, stdin=stdin, process_group=0, **popen) as proc,
        _killed_whole_on_error(proc.pid, proc.wait),
    ):
        stdout, stderr = proc.communicate(input, timeout=timeout_s)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@contextlib.contextmanager
def _killed_whole_on_error(pid: int, reap: Callable[[], Any]) -> Iterator[None]:
    """Waiting on process ``pid``: on any exception (a timeout, SIGTERM, an interrupt) it is killed
    with its processes (``_kill_all``) and reaped (``reap``) before the exception goes on."""
    try:
        yield
    except BaseException:
        _kill_all(pid)
        reap()
        raise


def _kill_all(pid: int) -> None:
    """``pid``, its group and its descendants: those in a group of their own (a measurement that
    started one, as this module's do) are found as descendants, listed before anything is killed;
    those whose parent had already ended, in the group."""
    descendants = []
    with contextlib.suppress(psutil.NoSuchProcess):
        descendants = psutil.Process(pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # a forked measurement killed before it made its group
    for process in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


# Imported by the fork server besides the measurement's module: what the measurements compare with
# (open_clip's losses and trainer), which brings the towers' libraries (timm, transformers).
PRELOADED = ("open_clip",)
_server_environment: dict[str, str] | None = None  # os.environ when the fork server started


def in_fresh_process(fn: Callable[[Any], Any], spec: Any, timeout_s: float | None = None) -> Any:
    """``fn(spec)`` in a process of its own; ``fn`` is a module-level function. Its stdout and stderr
    are replayed after it ends, its stderr carried by :class:`ProcessFailed` if it failed. Past
    ``timeout_s`` it is killed (``subprocess.TimeoutExpired``)."""
    target = f"{fn.__module__}:{fn.__qualname__}"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        try:
            returncode = _run_measurement(target, json.dumps(spec), folder, timeout_s)
        finally:
            sys.stdout.write(_said(folder / "stdout"))
        stderr = _said(folder / "stderr")
        if returncode != 0:
            raise ProcessFailed(target, returncode, stderr)
        sys.stderr.write(stderr)
        return json.loads((folder / "result.json").read_text())


def _said(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _run_measurement(target: str, spec: str, folder: Path, timeout_s: float | None) -> int:
    """The measurement's exit code (negative: the signal that ended it); its output in ``folder``.
    Forked from the fork server, or a new interpreter where there is none to fork from (``_fork_server``)."""
    server = _fork_server(target.split(":")[0])
    if server is None:
        command = [sys.executable, "-m", __name__, target, str(folder)]
        with (folder / "stdout").open("w") as stdout, (folder / "stderr").open("w") as stderr:
            return run_as_group(command, timeout_s, spec, stdout=stdout, stderr=stderr, text=True).returncode
    process = server.Process(target=_forked, args=(target, spec, folder), name=target)
    with sigterm_raises():
        process.start()
        with _killed_whole_on_error(process.pid, process.join):
            process.join(timeout_s)
            if process.exitcode is None:
                raise subprocess.TimeoutExpired(target, timeout_s)
    return process.exitcode


def _fork_server(module: str) -> multiprocessing.context.BaseContext | None:
    """multiprocessing's fork-server context, its server preloading ``module`` (the first
    measurement's) and :data:`PRELOADED` when it starts; None once os.environ differs from then, and
    where there is a CUDA device: CUDA does not survive a fork, and a library's import may start it."""
    global _server_environment
    if torch.cuda.is_available():
        return None
    context = multiprocessing.get_context("forkserver")
    if _server_environment is None:
        context.set_forkserver_preload([module, *PRELOADED])
        _server_environment = dict(os.environ)
    return context if _server_environment == os.environ else None


def _forked(target: str, spec: str, folder: Path) -> None:
    """A forked measurement: in a process group of its own (so that ``_kill_all`` ends what it
    starts), its output in ``folder``."""
    os.setpgid(0, 0)
    for stream, name in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):
        with (folder / name).open("w") as sink:
            os.dup2(sink.fileno(), stream.fileno())
    _measure(target, spec, folder)


def _measure(target: str, spec: str, folder: Path) -> None:
    module, name = target.split(":")
    result = getattr(importlib.import_module(module), name)(json.loads(spec))
    (folder / "result.json").write_text(json.dumps(result))


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
    target, folder = sys.argv[1:]
    _measure(target, sys.stdin.read(), Path(folder))


if __name__ == "__main__":
    _main()
