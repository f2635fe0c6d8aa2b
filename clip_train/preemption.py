"""Preemption: SIGTERM (SLURM preempting or cancelling) or SIGUSR1 (``--signal=USR1@N``) makes the
trainer checkpoint the step in progress and exit 75. The handler only records the signal: saving
inside it could interrupt a collective halfway. In an evaluation the handler stops it at once instead:
after the last step (nothing is left to save) the process stops; a periodic evaluation stops on
every rank, and the step it follows is saved as after any step (``stopping.StoppableEvaluation``).
"""

from __future__ import annotations

import _thread
import atexit
import functools
import multiprocessing
import multiprocessing.util  # its exit handler registered first: atexit runs ours before it
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL from sysexits.h: a temporary failure, run it again


def torchrun_grace_warning(environ: Mapping[str, str], waits_for_its_workers: bool) -> str | None:
    """The line rank 0 logs at start-up when torchrun started it (``TORCHELASTIC_RUN_ID``) and will
    kill its ranks 30 s after passing a stop signal on (``compat.torchrun_waits_for_its_workers``):
    a step and its checkpoint that take longer are lost at every preemption."""
    if "TORCHELASTIC_RUN_ID" not in environ or waits_for_its_workers:
        return None
    return (
        "warning: this torch's torchrun kills the ranks 30 s after it passes a stop signal on (newer "
        "ones wait TORCH_ELASTIC_SHUTDOWN_TIMEOUT): a step and its checkpoint must end within 30 s, or "
        "start the ranks without torchrun (srun, one task a GPU: docs/slurm-docker.md)"
    )


class Preempted(BaseException):
    """The run saved a checkpoint and stopped on a signal; ``checkpoint.resume=auto`` continues it.

    Not an ``Exception``, as ``KeyboardInterrupt`` is not: in an evaluation the handler raises it
    wherever the main thread is, and library code's ``except Exception`` would take it for its own
    failure (transformers' tokenizers turn it into a ValueError about padding, and a sample's
    decoding into a bad image), failing the run or carrying on instead of stopping it."""


@dataclass
class SignalFlag:
    """The first preemption signal this process received, or None."""

    received: signal.Signals | None = None
    interrupting: bool = False  # raise ``Preempted`` in the handler instead of waiting for the step's end
    relayed: bool = False  # the next call of the handler comes from ``relay``, not from a signal

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.relayed:
            self.relayed = False
        elif self.received is None:
            self.received = signal.Signals(signum)
        if self.interrupting:
            raise Preempted(self.cause)

    @contextmanager
    def raising(self) -> Iterator[None]:
        """While the block runs, a signal raises ``Preempted`` in it (one received before: at once)
        instead of waiting for the step's end: around an evaluation, which nothing else would stop."""
        if self.received is not None:
            raise Preempted(self.cause)
        self.interrupting = True
        try:
            yield
        finally:
            self.interrupting = False

    @property
    def cause(self) -> str:
        """Why the run stops: this rank's signal, or another rank's."""
        return f"{self.received.name} received" if self.received else "another rank was signalled"

    def relay(self) -> None:
        """From another thread: run the handler in the main thread as a signal would, recording no
        signal (another rank's), so that it raises ``Preempted`` there if ``interrupting``."""
        self.relayed = True
        _thread.interrupt_main(signal.SIGUSR1)


@contextmanager
def preemption_signals() -> Iterator[SignalFlag]:
    """While the block runs, SIGTERM and SIGUSR1 set the flag instead of ending the process (only in
    the main thread, the only one that can install handlers; elsewhere the flag stays unset)."""
    flag = SignalFlag()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, flag._record) for sig in PREEMPTION_SIGNALS}
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ignore_preemption_signals(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: workers leave SIGTERM and SIGUSR1 to the trainer. torchrun and
    SLURM signal them too, and a worker dying of SIGTERM would fail the step before the checkpoint."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def signal_free_workers() -> dict[str, Any]:
    """DataLoader options for workers that leave SIGTERM and SIGUSR1 to the trainer. Since they
    ignore the SIGTERM that the interpreter's exit sends its daemonic children before it waits for
    them, they are killed at exit first, also where no ``close`` or CLI ends them (library use)."""
    _kill_workers_at_exit()
    return {"worker_init_fn": ignore_preemption_signals}


@functools.cache
def _kill_workers_at_exit() -> None:
    atexit.register(stop_worker_processes)


def stop_worker_processes(timeout_s: float = 10.0) -> None:
    """Kill the DataLoader workers still alive (this process's daemonic children). They ignore
    SIGTERM, which is all the interpreter sends its daemonic children at exit before waiting on them:
    a worker whose loader an exception's traceback keeps alive would make the process hang there."""
    workers = [child for child in multiprocessing.active_children() if child.daemon]
    if workers:  # the DataLoader's SIGCHLD handler would report their deaths as a failure
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for worker in workers:
        worker.kill()
    for worker in workers:
        worker.join(timeout_s)
