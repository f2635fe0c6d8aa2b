"""The training step's gradient engine: Gradient Cache with chunk streaming and LiT caching."""

from clip_train.engine.gradcache import GradCache, StepStats, TrainableHead, wrap_ddp

__all__ = ["GradCache", "StepStats", "TrainableHead", "wrap_ddp"]
