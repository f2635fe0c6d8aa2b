"""What a rank holds for training besides activations: its parameters, gradients and optimizer
states, counted by the storage behind them (under FSDP its shards; under DDP whole replicas, with
gradients that are views of the reduction buckets)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of ``parameters``, ``gradients`` and ``optimizer`` states."""
    params = list(model.parameters())
    states = (v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))
    return {
        "parameters": _storage_bytes(params),
        "gradients": _storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _storage_bytes(states),
    }


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a sharded tensor's local shard)."""
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
