"""What ``clip-train plan`` is doing, as status lines (``logs.timed``): what runs, then how long it
took, which reads the same in a terminal and in a log file."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from clip_train.logs import timed

Step = Callable[[str], AbstractContextManager[None]]


def announce(what: str) -> AbstractContextManager[None]:
    """``plan: WHAT ...`` before the step, so a slow one is never silent; its time after it."""
    return timed(f"plan: {what}")


def quiet(what: str) -> AbstractContextManager[None]:
    """No report: a run measures its own towers for auto chunks and logs only the choice."""
    return nullcontext()
