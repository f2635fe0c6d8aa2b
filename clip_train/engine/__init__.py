"""The training step's gradient engine: Gradient Cache with chunk streaming and LiT caching."""

from clip_train.engine.gradcache import GradCache, StepStats, TrainableHead

__all__ = ["GradCache", "StepStats", "TrainableHead"]
