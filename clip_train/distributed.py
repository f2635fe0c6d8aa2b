"""Process-group setup from torchrun's environment, and the few collectives the trainer needs."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", timeout_s: int = 600) -> DistEnv:
    """Join the torchrun group (``env://``) if there is one, else run as a single process.

    NCCL on CUDA and gloo on CPU, one device per ``LOCAL_RANK``. The timeout bounds every
    collective, so a rank that dies cannot leave the others waiting forever.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        torch_device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        # After a torchrun restart the store may still hold the dead group's addresses: a prefix
        # per attempt keeps the new group from connecting to them.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            store=dist.PrefixStore(f"clip_train/attempt_{attempt}", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=torch_device if use_cuda else None,
        )
    return DistEnv(rank, world_size, local_rank, torch_device)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_ranks_true(flag: bool, device: torch.device) -> bool:
    """True only if ``flag`` holds on every rank, so all ranks take the same branch."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def gather_to_main(obj: object) -> list[object] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere); just ``[obj]`` without a group."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
