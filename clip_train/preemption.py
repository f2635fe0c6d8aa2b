"""Preemption: SIGTERM (SLURM preempting or cancelling) or SIGUSR1 (``--signal=USR1@N``) makes the
trainer checkpoint at the next step boundary and exit 75. The handler only records the signal:
saving inside it could interrupt a collective halfway.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL from sysexits.h: a temporary failure, run it again


class Preempted(Exception):
    """The run saved a checkpoint and stopped on a signal; ``checkpoint.resume=auto`` continues it."""


@dataclass
class SignalFlag:
    """The first preemption signal this process received, or None."""

    received: signal.Signals | None = None

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)


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
