"""One logging setup for every command: status lines on stderr as ``clip-train: ...``, from rank 0
by default (``log.all_ranks`` tags every rank's lines), at ``log.level``; and progress that is a
live bar in a terminal but plain periodic lines in a file, so a Slurm ``.out`` reads step by step
instead of holding one carriage-returned line.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from tqdm import tqdm

LOGGER = "clip_train"
PLAIN_EVERY_S = 30.0  # how often progress prints a plain line when stderr is not a terminal

T = TypeVar("T")


def get_logger(name: str = "") -> logging.Logger:
    """The package logger, or ``clip_train.NAME`` below it."""
    return logging.getLogger(f"{LOGGER}.{name}" if name else LOGGER)


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged (a redirection, pytest's capture),
    not the stream that was current when logging was set up."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def setup_logging(
    level: str = "INFO", *, rank: int = 0, world_size: int = 1, all_ranks: bool = False
) -> None:
    """(Re)configure the package logger: one stderr handler. Ranks other than 0 log only warnings
    and errors unless ``all_ranks``; with several ranks, ``all_ranks`` tags each line."""
    logger = get_logger()
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = _CurrentStderr()
    tag = f"[rank {rank}] " if all_ranks and world_size > 1 else ""
    handler.setFormatter(logging.Formatter(f"clip-train: {tag}%(message)s"))
    logger.addHandler(handler)
    quiet = rank != 0 and not all_ranks
    logger.setLevel(max(logging.WARNING, logging.getLevelName(level)) if quiet else level)
    logger.propagate = False


def interactive() -> bool:
    """Whether this process draws bars: stderr is a terminal, where a redrawn bar reads well, and
    it logs status lines (rank 0, or every rank with ``log.all_ranks``)."""
    return sys.stderr.isatty() and get_logger().isEnabledFor(logging.INFO)


class Progress:
    """A tqdm bar in a terminal. Elsewhere plain ``DESC: n/total, key value ...`` lines through the
    logger: at most every ``every_s`` seconds (``None``: only when :meth:`plain_line` is called, as
    training does on its log steps), and at the end."""

    def __init__(
        self,
        desc: str,
        total: int | None = None,
        *,
        initial: int = 0,
        unit: str = "it",
        every_s: float | None = PLAIN_EVERY_S,
    ) -> None:
        self.desc, self.total, self.n, self.every_s = desc, total, initial, every_s
        self.bar = None
        if interactive():
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)
        self.started = self.last_line = time.monotonic()
        self.postfix: dict[str, str] = {}
        self.postfix_at = initial  # the count the postfix's values are of
        self.shown = initial  # the count the last plain line showed

    def update(self, n: int = 1) -> None:
        self.move_to(self.n + n)

    def move_to(self, n: int, postfix: dict[str, str] | None = None) -> None:
        self.n = n
        if postfix:
            self.postfix, self.postfix_at = postfix, n
        if self.bar is not None:
            self.bar.n = n
            self.bar.set_postfix(self.postfix, refresh=True)
        elif self.every_s is not None and time.monotonic() - self.last_line >= self.every_s:
            self.plain_line()

    def plain_line(self) -> None:
        """One line with the count and the postfix (not in a terminal, where the bar shows them); a
        postfix of an earlier count is left out, not shown as this one's (a run's last line after a
        stop between its log steps)."""
        if self.bar is not None or self.n == self.shown:
            return
        self.last_line, self.shown = time.monotonic(), self.n
        of = f"/{self.total}" if self.total is not None else ""
        current = self.postfix if self.postfix_at == self.n else {}
        extra = "".join(f", {key} {value}" for key, value in current.items())
        get_logger().info(f"{self.desc}: {self.n}{of}{extra} ({self.last_line - self.started:.0f} s)")

    def write(self, text: str) -> None:
        """A status line that does not break the bar."""
        if self.bar is not None:
            self.bar.write(f"clip-train: {text}", file=sys.stderr)
        else:
            get_logger().info(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self.plain_line()


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """``items`` with progress reported (see :class:`Progress`)."""
    shown = Progress(desc, total, unit=unit)
    try:
        for item in items:
            yield item
            shown.update()
    finally:
        shown.close()


@contextmanager
def timed(what: str) -> Iterator[None]:
    """``WHAT ...`` before a step that may take a while, so it is never silent, and ``WHAT: 3.1 s``
    (or ``WHAT: failed``) after it."""
    log = get_logger()
    log.info(f"{what} ...")
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        log.info(f"{what}: failed")
        raise
    log.info(f"{what}: {time.perf_counter() - start:.1f} s")


@contextmanager
def without_warning(starting: str) -> Iterator[None]:
    """Silences a library's warning that starts with ``starting`` (its text as printed), for one
    call whose case the warning misreads. Around that call only: meanwhile the process's filters
    are swapped for a copy (another thread's change to them is lost), and Python forgets which
    warnings it has shown once, so those may show once more."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", re.escape(starting), UserWarning)
        yield


setup_logging(rank=int(os.environ.get("RANK", "0")))  # what every command starts with; train refines it
