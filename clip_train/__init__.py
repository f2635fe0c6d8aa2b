"""clip_train: CLIP-style training with contrastive batches of 100k to 1M+ pairs."""

from clip_train.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
