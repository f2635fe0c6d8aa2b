"""clip_train: CLIP-style training with contrastive batches of 100k to 1M+ pairs."""

import importlib

from clip_train.config import Config, ConfigError, load_config

# torch, timm and transformers load on first use, so `clip-train --help` stays fast.
_LAZY = {
    "build_model": "clip_train.model",
    "contrastive_loss": "clip_train.loss",
    "load": "clip_train.loading",
}

__all__ = ["Config", "ConfigError", "build_model", "contrastive_loss", "load", "load_config"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'clip_train' has no attribute {name!r}")
