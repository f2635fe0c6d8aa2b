"""Per-chunk RNG snapshots, so a Gradient Cache replay draws the same dropout and drop-path masks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RngState:
    """The CPU generator's state and, on CUDA, the state of the device's default generator."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Undo every RNG change made inside: replay rewinds the generators, the step must not leak that."""
    state = RngState.capture(device)
    try:
        yield
    finally:
        state.restore()
