"""Where a run's time goes before its first step ends.

A GPU rented by the hour bills the start-up like the steps: the interpreter and its imports, building
the model, counting its FLOPs, fitting auto chunks, the loader's first batch and the first step
(which compiles under ``train.compile``). The trainer laps a :class:`StartupClock` after each stage
and, once its first step ends, logs one line and adds ``startup/*`` to its first metrics record.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Mapping

import psutil


def process_started() -> float:
    """When this process was created, in ``time.time()``'s seconds: the interpreter's start and
    the imports count toward what follows it. On Linux psutil adds the process's start (clock ticks
    since boot) to a boot time in whole seconds, up to a second early; the process's age on the
    boot-time clock is exact to a tick."""
    created = psutil.Process().create_time()
    if not hasattr(time, "CLOCK_BOOTTIME"):  # macOS: create_time is exact
        return created
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - (created - psutil.boot_time())
    return time.time() - age


@contextlib.contextmanager
def collector_paused_then_frozen() -> Iterator[None]:
    """For the library's imports: torch, timm and transformers make about half a million objects
    that live as long as the process, and the cyclic collector, run every few hundred allocations,
    scans them again and again (0.4-1.1 s of the 5-6 s of CPU that importing the trainer takes on
    a 2-core CPU). Frozen afterwards, they stay out of the training loop's full collections, and
    out of copy-on-write in processes forked from this one."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


class StartupClock:
    """Seconds per stage since the process started, in the order they were lapped. ``settle`` runs
    before each lap: waiting for the device there charges a stage's queued kernels (the FLOP count's
    forward, say) to that stage instead of the next."""

    def __init__(
        self, settle: Callable[[], None] = lambda: None, ended: Mapping[str, float] | None = None
    ) -> None:
        self.started = process_started()
        self._settle = settle
        self._last = self.started
        self.laps: dict[str, float] = {}
        for stage, when in (ended or {}).items():  # stages that ended before the clock, in order
            self.laps[stage], self._last = when - self._last, when

    def lap(self, stage: str) -> None:
        """``stage`` took the time since the previous lap (or since the process started)."""
        self._settle()
        now = time.time()
        self.laps[stage] = self.laps.get(stage, 0.0) + now - self._last
        self._last = now

    def finish(self, first_batch_s: float, first_step_s: float) -> None:
        """The first step just ended: its data wait and its step (both timed by the loop); what the
        last lap and the step's start left between them (other ranks, the wait for the device) is
        ``other``, so the laps add up to :attr:`total_s`."""
        self.laps["first_batch"] = first_batch_s
        self.laps["first_step"] = first_step_s
        self.laps["other"] = max(0.0, time.time() - self._last - first_batch_s - first_step_s)
        self._last = self.started + sum(self.laps.values())

    @property
    def total_s(self) -> float:
        return self._last - self.started

    def describe(self, step: int) -> str:
        shown = ", ".join(f"{stage.replace('_', ' ')} {s:.1f}" for stage, s in self.laps.items() if s >= 0.05)
        return f"start-up: step {step} ended {self.total_s:.1f} s after the process started ({shown} s)"

    def metrics(self) -> dict[str, float]:
        laps = {f"startup/{stage}_s": seconds for stage, seconds in self.laps.items()}
        return {"startup/total_s": self.total_s, **laps}
