"""LiT locking shared by both towers: a frozen prefix that never trains and never leaves eval().

``encode_frozen`` (input preparation plus any frozen trunk) and ``encode_trainable`` (all that gets
gradients) are the towers' contract: Gradient Cache runs the first once and replays only the second.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from timm.layers import (
    RmsNorm,
    RmsNorm2d,
    RmsNorm2dFp32,
    RmsNormFp32,
    SimpleNorm,
    SimpleNorm2d,
    SimpleNorm2dFp32,
    SimpleNormFp32,
)
from torch import nn

from clip_train.config import TowerConfig, check_lock

# What freeze_norms keeps frozen in the unlocked blocks (locked ones are frozen whole, norms included):
# torch's norms and timm's RMS and simple norms (norm_layer=rmsnorm), which subclass none of them.
_NORMS = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.SyncBatchNorm,
    nn.RMSNorm,
    RmsNorm,
    RmsNorm2d,
    RmsNormFp32,
    RmsNorm2dFp32,
    SimpleNorm,
    SimpleNorm2d,
    SimpleNormFp32,
    SimpleNorm2dFp32,
)


class LockableTower(nn.Module):
    """Base class: ``forward = encode_trainable(*encode_frozen(*inputs))``; frozen parts stay in eval()."""

    proj: nn.Linear  # the projection into the shared embedding space, trainable unless lock_head

    def __init__(self) -> None:
        super().__init__()
        self.locked = False
        self.unlocked_layers = 0  # > 0 only when locked: the frozen and trainable halves split the blocks
        # The dtype prepared float inputs are handed on in: the weights' master dtype (None), or the
        # dtype FSDP gathers them in (fsdp.param_dtype), which ``shard_towers`` sets.
        self.input_dtype: torch.dtype | None = None
        self._frozen_module_names: list[str] = []

    def encode_frozen(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def encode_trainable(self, *hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _unlocked_modules(self) -> list[nn.Module]:
        """The last ``unlocked_layers`` blocks and what follows them; a ConfigError if impossible."""
        raise NotImplementedError

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.encode_trainable(*self.encode_frozen(*inputs))

    @property
    def has_frozen_trunk(self) -> bool:
        """True when locked, i.e. caching ``encode_frozen``'s output saves recomputing a trunk."""
        return self.locked

    @property
    def is_frozen(self) -> bool:
        """True when no parameter trains, so a Gradient Cache replay of this tower would be wasted."""
        return not any(p.requires_grad for p in self.parameters())

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        return (p for p in self.parameters() if p.requires_grad)

    def train(self, mode: bool = True) -> LockableTower:
        """Frozen submodules stay in eval(): no dropout, drop-path or norm-statistic updates there."""
        super().train(mode)
        for name in self._frozen_module_names:
            self.get_submodule(name).eval()
        return self

    def lock(self, cfg: TowerConfig, key: str) -> None:
        """LiT as ``cfg`` says: freeze all but the last ``unlocked_layers`` blocks and (unless
        ``lock_head``) the projection, with ``freeze_norms`` their norm layers too, and pin the frozen
        submodules to eval(). ``key``: model.image/text.
        """
        check_lock(cfg, key)  # validate() checked it, unless the config came from elsewhere (eval)
        if not cfg.lock:
            return
        self.unlocked_layers = cfg.unlocked_layers
        trainable = self._unlocked_modules() if cfg.unlocked_layers else []
        if not cfg.lock_head:
            trainable.append(self.proj)
        norms = [m for module in trainable for m in module.modules() if isinstance(m, _NORMS)]
        frozen_norms = {id(p) for m in norms for p in m.parameters()} if cfg.freeze_norms else set()
        keep = {id(p) for module in trainable for p in module.parameters()} - frozen_norms
        for p in self.parameters():
            if id(p) not in keep:
                p.requires_grad_(False)
        self.locked = True
        # every submodule with no trainable module in or above it; not the tower, whose eval() calls train()
        inside = {id(m) for module in trainable for m in module.modules()}
        frozen = {
            name
            for name, module in self.named_modules()
            if name and not any(id(m) in inside for m in module.modules())
        }
        # only the largest frozen subtrees: their eval() reaches the rest; frozen norms inside trained
        # blocks too, so that batch-norm statistics stay as loaded
        norm_ids = {id(m) for m in norms} if cfg.freeze_norms else set()
        frozen_norm_names = [name for name, m in self.named_modules() if id(m) in norm_ids]
        largest = [name for name in frozen if name.rpartition(".")[0] not in frozen]
        self._frozen_module_names = sorted(largest + frozen_norm_names)
        self.train(self.training)


def init_projection(width: int, embed_dim: int) -> nn.Linear:
    """CLIP's bias-free projection into the shared embedding space, std width^-0.5 as in CLIP."""
    proj = nn.Linear(width, embed_dim, bias=False)
    nn.init.normal_(proj.weight, std=width**-0.5)
    return proj


def tower_blocks(tower: LockableTower) -> list[nn.Module]:
    """The repeated blocks of a tower: timm's ``blocks`` (ViTs) or ``stages`` (hierarchical nets),
    transformers' ``encoder.layer`` (BERT family) or ``layers``; empty when there are none."""
    holder = getattr(tower, "trunk", None) or getattr(tower, "encoder", None)
    for path in ("blocks", "stages", "encoder.layer", "layers", "encoder.layers"):
        try:
            blocks = holder.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, nn.Sequential | nn.ModuleList):
            return list(blocks)
    return []
