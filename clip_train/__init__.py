"""clip_train: CLIP-style training with contrastive batches of 100k to 1M+ pairs."""

from clip_train.config import Config, ConfigError, load_config
from clip_train.loss import contrastive_loss
from clip_train.model import build_model

__all__ = ["Config", "ConfigError", "build_model", "contrastive_loss", "load_config"]
