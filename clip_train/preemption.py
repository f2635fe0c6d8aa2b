"""Preemption: SIGTERM or SIGUSR1 makes the trainer checkpoint at the next step boundary and exit 75.

SLURM sends SIGTERM before it preempts or cancels a job, and ``--signal=USR1@N`` N seconds before
the time limit. The handler only records the signal: saving from inside it could interrupt a
collective halfway. The trainer folds "was any rank signalled?" into the all-reduce every step
already does, so all ranks stop after the same step, save, and exit with ``EXIT_PREEMPTED``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL from sysexits.h: a temporary failure, run it again


class Preempted(Exception):
    """The run saved a checkpoint and stopped on a signal; ``checkpoint.resume=auto`` continues it."""


class SignalFlag:
    """The first preemption signal this process received, or None."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)


@contextmanager
def preemption_signals() -> Iterator[SignalFlag]:
    """While the block runs, SIGTERM and SIGUSR1 set the flag instead of ending the process.

    Outside the main thread Python cannot install handlers; the flag then stays unset.
    """
    flag = SignalFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {sig: signal.signal(sig, flag._record) for sig in PREEMPTION_SIGNALS}
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ignore_preemption_signals(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: loader workers leave SIGTERM and SIGUSR1 to the trainer.

    torchrun signals each worker's whole process group and SLURM every process of a job step, so
    the loader workers get the signal too; torch's own worker handler dies of SIGTERM, which would
    fail the step before the checkpoint. A worker still exits when its trainer process is gone.
    """
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
