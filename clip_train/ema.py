"""An exponential moving average of the trainable weights (``train.ema_decay``): after each optimizer
step ``ema = d * ema + (1 - d) * w``, which fine-tuned models are often evaluated and shipped with.

The averages are kept in fp32 (fp64 in an fp64 run), whatever the weights are cast to in the forward
pass. Frozen (LiT-locked) parameters are not kept: their average is themselves, which the model
holds. Under FSDP each average is a DTensor with its parameter's placements, so a rank keeps only
its shard and updating it needs no communication. Checkpoints hold the averages in
``ema.safetensors`` (those parameters only; the model's file supplies the rest), and sharded ones in
their shards too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor

from clip_train.checkpoint import EMA_FILE
from clip_train.config import TrainConfig
from clip_train.errors import UserError
from clip_train.model.state_dicts import misfit


def ema_decay_at(step: int, decay: float, warmup_power: float = 0.0) -> float:
    """The decay of the update after optimizer step ``step`` (1 for the first): ``decay``, or with a
    warmup ``min(decay, 1 - (1 + step) ** -warmup_power)`` (timm's a step on), so that the first
    steps' weights, far from where training goes, fade out of the average quickly."""
    if not warmup_power:
        return decay
    return min(decay, 1.0 - (1.0 + step) ** -warmup_power)


class WeightsEMA:
    """The moving averages of a model's trainable parameters, by parameter name; a checkpoint
    component (``state_dict`` holds the averages, DTensors under FSDP)."""

    def __init__(self, model: nn.Module, decay: float, warmup_power: float = 0.0) -> None:
        self.decay, self.warmup_power = decay, warmup_power
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.averages: dict[str, torch.Tensor] = {}
        self.restart()

    @classmethod
    def from_config(cls, model: nn.Module, cfg: TrainConfig) -> WeightsEMA | None:
        """``train.ema_decay``'s average, from ``model`` as it is now (loaded and sharded); None if off."""
        return cls(model, cfg.ema_decay, cfg.ema_warmup_power) if cfg.ema_decay else None

    @torch.no_grad()
    def restart(self) -> None:
        """Averages equal to the weights: where a run starts, or resumes a checkpoint without an EMA."""
        self.averages = {
            name: p.detach().to(torch.promote_types(p.dtype, torch.float32), copy=True)
            for name, p in self.params.items()
        }
        # Each rank's shards, taken once: loading a checkpoint copies into the averages in place, so
        # these views hold until the next restart, and the step need not unwrap every DTensor anew.
        self._local_averages = [_local(average) for average in self.averages.values()]

    @torch.no_grad()
    def update(self, step: int, stepped: torch.Tensor) -> None:
        """Fold in the weights after optimizer step ``step``: ``lerp`` computes ``d*ema + (1-d)*w``,
        with ``1 - d`` times ``stepped`` (a bool on the device), so a skipped step leaves the averages
        as they were without the host reading it. Each rank updates its own shards."""
        averages = self._local_averages
        dtype = averages[0].dtype  # every average's: float32 or float64
        targets = [_local(p.to(dtype)) for p in self.params.values()]  # in the averages' order
        weight = stepped.to(dtype) * (1.0 - ema_decay_at(step, self.decay, self.warmup_power))
        torch._foreach_lerp_(averages, targets, [weight] * len(averages))

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averages in place of the weights while inside (an evaluation), the weights back, bit
        for bit, on the way out. Each rank swaps its own shards: no communication."""
        with torch.no_grad():
            kept = {name: p.detach().clone() for name, p in self.params.items()}
            for name, p in self.params.items():
                p.copy_(self.averages[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(kept[name])

    def full_weights(self, keep: bool) -> dict[str, torch.Tensor]:
        """The whole averages on the host, for ``ema.safetensors``; sharded ones are gathered one
        tensor at a time (a collective: call on every rank), and only kept where ``keep``."""
        weights = {}
        for name, average in self.averages.items():
            whole = average.full_tensor() if isinstance(average, DTensor) else average
            if keep:
                weights[name] = whole.detach().cpu().contiguous()
        return weights

    @torch.no_grad()
    def load_full_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Set the averages from whole tensors (``ema.safetensors`` of an unsharded run)."""
        if problem := misfit(weights, self.averages):
            raise UserError(f"{EMA_FILE} does not fit the EMA of the trainable parameters: {problem}")
        for name, average in self.averages.items():
            average.copy_(weights[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages themselves (DTensors under FSDP), which the sharded checkpoint saves and loads
        in place."""
        return self.averages


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a view: updating it updates the DTensor), or the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def load_ema_weights(checkpoint: Path, model: nn.Module) -> None:
    """Put a checkpoint's EMA (``ema.safetensors``) into ``model``, whose other parameters (frozen
    during training, so never averaged) keep the checkpoint's weights, loaded first."""
    file = checkpoint / EMA_FILE
    if not file.is_file():
        raise UserError(
            f"{checkpoint} has no {EMA_FILE}: only runs with train.ema_decay > 0 save an EMA of the weights"
        )
    weights = load_file(file)
    own = dict(model.named_parameters())
    if problem := misfit(weights, own, kept_if_absent=own.keys()):  # frozen parameters have no average
        raise UserError(f"{file} does not fit the model: {problem}")
    for name, average in weights.items():
        own[name].copy_(average)
