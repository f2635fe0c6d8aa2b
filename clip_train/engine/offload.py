"""Chunked host→device streaming: the raw batch stays on the host and moves one chunk at a time.

On CUDA the next chunk's copy (pinned memory, ``non_blocking``) runs on a side stream while the current
chunk computes, so at most two input chunks are on the device at once; elsewhere chunks are slices.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch


def chunk_bounds(total: int, chunk: int) -> list[tuple[int, int]]:
    """Row ranges of ``chunk`` rows (0 = all rows); the last one is shorter when ``chunk`` ∤ ``total``."""
    if chunk < 0:
        raise ValueError(f"chunk size must be >= 0 (0 = whole batch), got {chunk}")
    size = chunk or total
    return [(start, min(start + size, total)) for start in range(0, total, size)]


def to_host(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The batch in host memory, pinned when it feeds a CUDA device (pinning is what makes copies async)."""
    host = tuple(t.cpu() for t in tensors)
    if device.type == "cuda":
        host = tuple(t if t.is_pinned() else t.pin_memory() for t in host)
    return host


class ChunkStream:
    """The row chunks ``bounds`` of ``tensors``, each delivered on ``device``.

    ``max_live``, for tests and benchmarks: the most chunks alive at once (handed out or prefetched);
    it stays <= 2 unless ``fn`` keeps references to old chunks.
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], bounds: Sequence[tuple[int, int]], device: torch.device
    ):
        self.tensors = tuple(tensors)
        self.bounds = list(bounds)
        self.device = device
        self.max_live = 0
        self._issued: list[weakref.ref] = []

    def run(self, fn: Callable[[int, tuple[torch.Tensor, ...]], None]) -> None:
        """Call ``fn(index, chunk)`` for every chunk in order, dropping each chunk before loading the
        one after next (a plain ``for`` loop would keep the previous chunk alive in its variable)."""
        if self.device.type == "cuda" and self.tensors[0].device.type == "cpu":
            self._run_prefetching(fn)
            return
        for index in range(len(self.bounds)):
            fn(index, self._track(self._load(index)))

    def _load(self, index: int) -> tuple[torch.Tensor, ...]:
        start, end = self.bounds[index]
        return tuple(t[start:end].to(self.device, non_blocking=True) for t in self.tensors)

    def _run_prefetching(self, fn: Callable[[int, tuple[torch.Tensor, ...]], None]) -> None:
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)

        def prefetch(index: int) -> tuple[torch.Tensor, ...]:
            with torch.cuda.stream(side):
                side.wait_stream(main)  # host buffers may be filled by device→host copies queued on main
                return self._track(self._load(index))

        upcoming = prefetch(0)
        for index in range(len(self.bounds)):
            main.wait_stream(side)
            current = upcoming
            for t in current:
                t.record_stream(main)  # allocated on the side stream, last used on main
            upcoming = prefetch(index + 1) if index + 1 < len(self.bounds) else ()
            fn(index, current)
            del current

    def _track(self, chunk: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        self._issued = [ref for ref in self._issued if ref() is not None]
        self._issued.append(weakref.ref(chunk[0]))
        self.max_live = max(self.max_live, len(self._issued))
        return chunk
