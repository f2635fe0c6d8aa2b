"""Optimizer, parameter groups and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from clip_train.config import OptimConfig

# Only the weight matrices of these layers decay. Norms, biases, embeddings, position and class
# tokens and the logit scale do not: shrinking them toward zero only hurts (as in CLIP/OpenCLIP).
_DECAYED_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split the trainable parameters into a decayed and a non-decayed group; frozen ones are left out."""
    decayed = {id(m.weight) for m in model.modules() if isinstance(m, _DECAYED_LAYERS)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if id(p) in decayed], "weight_decay": weight_decay},
        {"params": [p for p in trainable if id(p) not in decayed], "weight_decay": 0.0},
    ]


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    # torch's Adafactor has no momentum and no constant beta2: its beta2 follows 1 - t^-0.8.
    return torch.optim.Adafactor(groups, lr=cfg.lr)


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``lr`` down to ``min_lr``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr / cfg.lr
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    cfg: OptimConfig, optimizer: torch.optim.Optimizer, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, max_steps))
