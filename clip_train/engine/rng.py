"""RNG state: per-chunk snapshots, so a Gradient Cache replay draws the same dropout and drop-path
masks, and the process's streams as a checkpoint component, so a resumed run draws them on."""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from typing import Any

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


def preserved_rng(device: torch.device) -> contextlib.AbstractContextManager:
    """Undo every RNG change made inside: replay rewinds the generators, the step must not leak that."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type="cuda")


class ProcessRng:
    """Every RNG stream of this process (Python, torch CPU, the current CUDA device) as a checkpoint
    component: ``state_dict`` / ``load_state_dict``.

    Only the current device's CUDA generator is kept: a rank draws on its own device alone, and a
    resumed process may see fewer GPUs than the one that saved (one GPU per task under SLURM).
    """

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved_cuda_state(state["cuda"]))


def saved_cuda_state(saved: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """The generator state to restore onto the current device.

    Older checkpoints hold a list, one state per device the saving process saw. That process drew on
    ``cuda:LOCAL_RANK`` (``clip_train.distributed.init_distributed``), and a resume with as many
    processes per node gives the rank the same ``LOCAL_RANK``, so that entry is the stream it used;
    entry 0 where the list is shorter or ``LOCAL_RANK`` is unset (a single process).
    """
    if isinstance(saved, torch.Tensor):
        return saved
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return saved[local_rank if local_rank < len(saved) else 0]
