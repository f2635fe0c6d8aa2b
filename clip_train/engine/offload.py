"""Chunking for Gradient Cache: ``ChunkStream`` places a step's batch and delivers its row chunks on
the device. With offload the raw batch stays on the host and moves one chunk at a time.

On CUDA the next chunk's copy (pinned memory, ``non_blocking``) runs on a side stream while the current
chunk computes, so at most two input chunks are on the device at once; elsewhere chunks are slices.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

Rows = tuple[int, int]  # a chunk's [start, end) rows
Chunk = tuple[torch.Tensor, ...]  # one row range of each of a tower's inputs


def chunk_bounds(total: int, chunk: int) -> list[Rows]:
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
    """The engine's one owner of chunking: ``place`` puts each step's batch where it waits (pinned host
    memory with ``offload``, else ``device``), and ``run`` delivers row chunks of it, or of other
    row-aligned tensors (a frozen trunk's cache), on ``device``, one at a time.

    Host chunks bound for CUDA are copied on one side stream, created on first use and kept for the
    engine's life: a new stream per run would come from the 32-stream pool that ProcessGroupNCCL's
    stream comes from too, and every 32nd or so would be NCCL's, serialising prefetches with collectives.

    ``max_live``, which the tests check: the most chunks alive at once (handed out or prefetched) in
    any run since the last ``place``; it stays <= 2 unless ``fn`` keeps references to old chunks.
    """

    def __init__(self, device: torch.device, offload: bool = False):
        self.device = device
        self.offload = offload
        self.side_stream: torch.cuda.Stream | None = None
        self.max_live = 0
        self._issued: list[weakref.ref] = []

    def place(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """A step's batch, where it waits for ``run``; its step's ``max_live`` count starts here."""
        self.max_live = 0
        if self.offload:
            return to_host(tensors, self.device)
        return tuple(t.to(self.device, non_blocking=True) for t in tensors)

    def run(
        self, tensors: Sequence[torch.Tensor], bounds: Sequence[Rows], fn: Callable[[int, Chunk], None]
    ) -> None:
        """Call ``fn(index, chunk)`` for the row chunks ``bounds`` of ``tensors`` in order, dropping each
        chunk before loading the one after next (a plain ``for`` loop would keep the previous chunk
        alive in its variable)."""
        tensors = tuple(tensors)
        self._issued = []
        if self.device.type == "cuda" and tensors[0].device.type == "cpu":
            self._run_prefetching(tensors, bounds, fn)
            return
        for index, rows in enumerate(bounds):
            fn(index, self._load(tensors, rows))

    def _load(self, tensors: tuple[torch.Tensor, ...], rows: Rows) -> Chunk:
        start, end = rows
        return self._track(tuple(t[start:end].to(self.device, non_blocking=True) for t in tensors))

    def _run_prefetching(
        self, tensors: tuple[torch.Tensor, ...], bounds: Sequence[Rows], fn: Callable[[int, Chunk], None]
    ) -> None:
        main = torch.cuda.current_stream(self.device)
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(self.device)
        side = self.side_stream

        def prefetch(index: int) -> Chunk:
            with torch.cuda.stream(side):
                side.wait_stream(main)  # host buffers may be filled by device→host copies queued on main
                return self._load(tensors, bounds[index])

        upcoming = prefetch(0)
        for index in range(len(bounds)):
            main.wait_stream(side)
            current = upcoming
            for t in current:
                t.record_stream(main)  # allocated on the side stream, last used on main
            upcoming = prefetch(index + 1) if index + 1 < len(bounds) else ()
            fn(index, current)
            del current

    def _track(self, chunk: Chunk) -> Chunk:
        self._issued = [ref for ref in self._issued if ref() is not None]
        self._issued.append(weakref.ref(chunk[0]))
        self.max_live = max(self.max_live, len(self._issued))
        return chunk
