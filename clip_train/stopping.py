"""Ranks that stop together. Under NCCL a rank that fails alone leaves the others in their next
collective until the watchdog (``train.dist_timeout_s``) kills them without a word, and a SIGTERM to
a rank blocked in a collective only trips a flag that its Python code never gets back to read. So:

* a rank that fails records how the run ends (exit code and one line) in the process group's store,
  first come first served, and aborts its process group;
* every rank runs a ``StopWatch`` thread. Once another rank recorded an ending and this one has not
  followed within ``FOLLOW_S``, it aborts the collectives in flight (NCCL's then return with an
  error) and interrupts the main thread, which ends with the recorded line and code; a main thread
  still blocked ``EXIT_WAIT_S`` later (in a gloo collective whose peer is alive) is ended by the
  thread itself;
* after SIGTERM or SIGUSR1 (which the watch learns of through ``signal.set_wakeup_fd``, even while
  the main thread is blocked), a main thread that has not moved for ``STALLED_AFTER_SIGNAL_S`` ends
  the run that way with exit code 75, unless it is writing a checkpoint: it is blocked in a
  collective that a stalled or dead rank never joins. Checkpoints are published atomically, so the
  newest complete one is intact. A main thread waiting for the step's data (``waiting_for_data``:
  its own loader on slow storage, or the other ranks' in the all-reduce that follows it) has
  ``DATA_AFTER_SIGNAL_S`` to finish the step in progress;
* a main thread waiting for its own work (rank 0's checkpoint upload, ``waiting_for_own_work``) is
  left to finish it: the launcher's shutdown timeout bounds that wait.
"""

from __future__ import annotations

import _thread
import contextlib
import itertools
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Literal, TypeVar

import torch.distributed as dist

from clip_train.checkpoint import latest_checkpoint
from clip_train.distributed import (
    DistEnv,
    PeerEnded,
    abort_collectives,
    abort_distributed,
    announce_ending,
    announced_ending,
    new_group_of_all,
    raise_store_flag,
    store_flag,
    store_polls,
)
from clip_train.errors import UserError
from clip_train.logs import get_logger
from clip_train.preemption import (
    EXIT_PREEMPTED,
    PREEMPTION_SIGNALS,
    Preempted,
    SignalFlag,
    stop_worker_processes,
)

POLL_S = 1.0  # how often the watch looks at the store and the main thread
FOLLOW_S = 3.0  # how long a rank may take to reach an ending another rank recorded by itself
EXIT_WAIT_S = 5.0  # how long an interrupted main thread may take to end before the watch ends it
STALLED_AFTER_SIGNAL_S = 10.0  # a main thread this still after a signal is blocked in a collective
DATA_AFTER_SIGNAL_S = 60.0  # a main thread this long in its own loader after a signal waits on dead storage
EXIT_INTERRUPTED = 130

T = TypeVar("T")

_writing_checkpoint = [0]
_own_work = [0]
_waiting_for_data = [0]
_evaluations = itertools.count()
_evaluating: list[StoppableEvaluation | None] = [None]


@contextmanager
def _counted(counter: list[int]) -> Iterator[None]:
    """Raise ``counter`` while the block runs (nested blocks too), for the watch thread to read."""
    counter[0] += 1
    try:
        yield
    finally:
        counter[0] -= 1


def writing_checkpoint() -> contextlib.AbstractContextManager[None]:
    """A checkpoint save: a long write after a signal is the point of the signal, not a stall."""
    return _counted(_writing_checkpoint)


def waiting_for_data() -> contextlib.AbstractContextManager[None]:
    """The main thread waits for the step's data: its own loader (storage that lags), or, with its
    batch in hand, the slower ranks' in the all-reduce that follows the loaders. After a signal it has
    ``DATA_AFTER_SIGNAL_S``, not ``STALLED_AFTER_SIGNAL_S``, to reach the end of the step in
    progress, which is then saved: a rank whose storage lags is slow, not stalled."""
    return _counted(_waiting_for_data)


def waiting_for_own_work() -> contextlib.AbstractContextManager[None]:
    """The main thread waits for work of this rank alone (a checkpoint's upload), in no collective: no
    peer can be what it waits for, so neither another rank's ending nor a signal cuts it short."""
    return _counted(_own_work)


class StoppableEvaluation:
    """Periodic evaluations that a SIGTERM or SIGUSR1 on any rank stops on every rank, so that the
    step one follows is saved within Slurm's notice, not after minutes of evaluation. They run on a
    process group of their own: a rank that stops flags it in the store and breaks that group, which
    ends the others' collectives in it, and their watches interrupt those still computing. The
    training group stays as it was: the ranks then meet at the step's vote, which saves and stops.

    The group is made once, with the run (a collective; its collectives wait up to ``timeout_s``,
    ``train.dist_timeout_s``): under NCCL a group is a communicator with device buffers of its own,
    which made at each evaluation would come mid-run from a cache the steps have filled, and at
    scale would cost a rendezvous every time. A stop ends the evaluations, as it ends the run."""

    def __init__(self, timeout_s: float) -> None:
        self.group = new_group_of_all(timeout_s)
        self.stopped = False  # once: the ranks broke the group (or the one process was signalled)
        self.signals: SignalFlag | None = None  # the run's, while one runs
        self.key = ""  # the store flag of the evaluation running
        self.relayed = False  # the watch has interrupted the main thread for it

    def run(self, signals: SignalFlag, evaluate: Callable[[dist.ProcessGroup | None], T]) -> T | None:
        """``evaluate(group)``, or None once a signal on any rank stopped it (this one or an earlier)."""
        if self.stopped:
            return None
        self.signals, self.relayed = signals, False
        self.key = f"clip_train/evaluation_{next(_evaluations)}_stopped"
        stopped, result = signals.received is not None, None
        if not stopped:
            _evaluating[0] = self
            try:
                with signals.raising():
                    result = evaluate(self.group)
            except (Preempted, RuntimeError) as err:  # a signal here, or a peer that broke the group
                stopped = isinstance(err, Preempted) or store_flag(self.key)
                if not stopped:
                    raise
            finally:
                _evaluating[0] = None
        if stopped:
            self.stopped = True
            self._break()  # out of the except clause: nothing else holds the group now
        return None if stopped else result

    def _break(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        raise_store_flag(self.key)
        abort_collectives(group)
        dist.destroy_process_group(group)  # gloo closes its connections once the group is gone
        del group


@dataclass(frozen=True)
class Ending:
    """How a run ends: the exit code, and the line every rank prints."""

    code: int
    kind: Literal["error", "preempted", "interrupted"]
    message: str
    rank: int

    @classmethod
    def of(cls, err: BaseException, rank: int) -> Ending:
        if isinstance(err, Preempted):
            return cls(EXIT_PREEMPTED, "preempted", str(err), rank)
        if isinstance(err, UserError):
            return cls(2, "error", str(err), rank)
        if isinstance(err, KeyboardInterrupt):
            return cls(EXIT_INTERRUPTED, "interrupted", "", rank)
        first_line = next(iter(str(err).strip().splitlines()), "")
        return cls(1, "error", f"rank {rank} failed: {type(err).__name__}: {first_line}", rank)

    def log(self, rank: int) -> None:
        if self.kind == "preempted":
            get_logger().warning(f"preempted: {self.message}")
        elif self.kind == "interrupted":
            get_logger().error("interrupted")
        else:
            get_logger().error(f"rank {rank}: error: {self.message}")


def _own_ending(err: BaseException) -> bool:
    """A rank's own ``UserError`` or ``Preempted`` is how its run ends; any other exception (a
    collective broken by a peer, the watch's interrupt) follows the ending a rank recorded first."""
    return isinstance(err, UserError | Preempted)


def exit_code(err: BaseException | None, env: DistEnv) -> int:
    """The code this rank's run will exit with, by ``StopWatch.ended_by``'s rule and without
    recording anything: its own ``UserError`` or ``Preempted``, else the ending a rank recorded
    first (a peer's, which interrupted this one), else its own."""
    if err is None:
        return 0
    own = Ending.of(err, env.rank)
    if _own_ending(err) or env.world_size == 1:
        return own.code
    recorded = announced_ending()
    return own.code if recorded is None else pickle.loads(recorded).code


class StopWatch:
    """This rank's watch over the others' endings and over its own main thread after a signal;
    ``ended_by`` reports how the run ended, the same way on every rank."""

    def __init__(self, env: DistEnv, run_dir: Path) -> None:
        self.env, self.run_dir = env, run_dir
        self._main = threading.main_thread()
        self._ending_begun = threading.Event()
        self._closed = threading.Event()
        self._reader, writer = socket.socketpair()
        self._reader.setblocking(False)
        writer.setblocking(False)
        self._writer = writer
        self._previous_wakeup_fd: int | None = None
        self._thread: threading.Thread | None = None
        if env.world_size > 1 and threading.current_thread() is self._main:
            self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._thread = threading.Thread(target=self._watch, name="stop-watch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._ending_begun.set()  # ended by now: nothing left to interrupt
        self._closed.set()
        if self._previous_wakeup_fd is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
        if self._thread is not None:
            self._thread.join(timeout=5 * POLL_S)
        self._reader.close()
        self._writer.close()

    def ended_by(self, err: BaseException) -> int:
        """Log how the run ends and return the exit code. A rank's own ``UserError`` or ``Preempted``
        is its ending; any other exception (a collective broken by a peer, the watch's interrupt)
        takes the ending a rank recorded first, its own only if none did. The group is aborted."""
        self._ending_begun.set()
        own = Ending.of(err, self.env.rank)
        first = self._record(own)
        ending = own if _own_ending(err) else first
        if ending is own and not (_own_ending(err) or isinstance(err, KeyboardInterrupt | PeerEnded)):
            get_logger().error(f"rank {self.env.rank} of {self.env.world_size} failed:", exc_info=err)
        ending.log(self.env.rank)
        abort_distributed()
        return ending.code

    def _record(self, own: Ending) -> Ending:
        if self.env.world_size == 1:
            return own
        try:
            return pickle.loads(announce_ending(pickle.dumps(own)))
        except (RuntimeError, ValueError):  # the store is gone with its host (rank 0 without torchrun)
            return own

    def _watch(self) -> None:
        signalled: tuple[str, float] | None = None  # the signal's name, when it arrived
        still: tuple[object, float] | None = None  # what the main thread was doing, since when
        while not self._closed.is_set():
            try:
                readable, _, _ = select.select([self._reader], [], [], POLL_S)
            except (OSError, ValueError):  # closed: the run has ended
                return
            if readable:
                received = [n for n in self._reader.recv(64) if n in {s.value for s in PREEMPTION_SIGNALS}]
                if received and signalled is None:
                    signalled = (signal.Signals(received[0]).name, time.monotonic())
            if self._ending_begun.is_set() or self._closed.is_set():
                continue
            if _own_work[0]:
                still = None
                continue
            recorded = announced_ending()
            if recorded is not None:
                ending = pickle.loads(recorded)
                if (
                    ending.rank != self.env.rank
                    and not self._ending_begun.wait(FOLLOW_S)
                    and not _own_work[0]
                ):
                    return self._stop(ending)
                continue
            if (evaluation := _evaluating[0]) is not None:
                self._follow(evaluation, signalled is not None)
                still = None  # an evaluation stops through its flag, not as a stall
                continue
            if signalled is None or _writing_checkpoint[0]:
                still = None
                continue
            in_data = bool(_waiting_for_data[0])
            doing = (self._main_position(), store_polls(), in_data)
            if still is None or still[0] != doing:
                still = (doing, time.monotonic())
            elif time.monotonic() - still[1] >= (DATA_AFTER_SIGNAL_S if in_data else STALLED_AFTER_SIGNAL_S):
                return self._stop(self._record(self._stalled(signalled[0], in_data)))

    def _follow(self, evaluation: StoppableEvaluation, signalled: bool) -> None:
        """Flag the evaluation stopped on a signal here (the handler may wait for a collective to
        return); once any rank flagged it, end this rank's part: break off its collectives (NCCL)
        and, unless the signal came here (its own handler stops the evaluation), relay the stop to
        the main thread."""
        if signalled and not store_flag(evaluation.key):
            raise_store_flag(evaluation.key)
        if not evaluation.relayed and store_flag(evaluation.key):
            evaluation.relayed = True
            if (group := evaluation.group) is not None:
                abort_collectives(group)
            del group
            if not signalled and evaluation.signals is not None:
                evaluation.signals.relay()

    def _main_position(self) -> tuple[int, int, int] | None:
        """Where the main thread is: a frame and its instruction, which move while it computes."""
        frame = self._main_thread_frame()
        return None if frame is None else (id(frame), frame.f_lasti, frame.f_lineno or 0)

    def _main_thread_frame(self) -> FrameType | None:
        return sys._current_frames().get(self._main.ident)

    def _main_place(self) -> str:
        """The main thread's innermost clip_train frame, and the innermost frame if that is elsewhere."""
        frame = self._main_thread_frame()
        if frame is None:
            return "no frame (the main thread has ended)"
        stack = traceback.extract_stack(frame)
        own = [entry for entry in stack if f"{os.sep}clip_train{os.sep}" in entry.filename]
        shown = [*own[-1:], *(stack[-1:] if stack[-1:] != own[-1:] else [])]
        return " > ".join(f"{Path(entry.filename).name}:{entry.lineno} ({entry.name})" for entry in shown)

    def _stalled(self, signame: str, in_data: bool) -> Ending:
        resume = latest_checkpoint(self.run_dir) or "the start"
        waited = (
            f"waited for its data for {DATA_AFTER_SIGNAL_S:.0f} s (storage stalled)"
            if in_data
            else f"waited for the other ranks for {STALLED_AFTER_SIGNAL_S:.0f} s (a rank stalled or gone)"
        )
        message = (
            f"{signame} received while rank {self.env.rank} {waited}: checkpoint.resume=auto continues "
            f"from {resume}"
        )
        return Ending(EXIT_PREEMPTED, "preempted", message, self.env.rank)

    def _stop(self, ending: Ending) -> None:
        """End the main thread with ``ending``: say where it was (the other rank's line names the
        collective that timed out; this one names what kept this rank from joining it), abort the
        collectives, interrupt it, and if it is still blocked after ``EXIT_WAIT_S``, log the ending
        and end the process here."""
        get_logger().warning(f"rank {self.env.rank} stopped in {self._main_place()}")
        abort_collectives()
        if self._ending_begun.is_set():
            return
        _thread.interrupt_main()  # a KeyboardInterrupt where the main thread next runs Python
        if self._ending_begun.wait(EXIT_WAIT_S):
            return
        self._ending_begun.set()
        ending.log(self.env.rank)
        stop_worker_processes()
        sys.stderr.flush()
        os._exit(ending.code)
