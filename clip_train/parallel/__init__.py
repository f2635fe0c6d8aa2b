"""Sharding the towers across ranks (FSDP2) and what it changes around the step: gradient sync,
the time spent gathering weights, evaluation on gathered weights, and sharded checkpoints."""

from clip_train.parallel.fsdp import (
    GatherWaits,
    builds_on_meta,
    gathered_for_eval,
    gradient_sync,
    is_sharded,
    shard_towers,
)

__all__ = [
    "GatherWaits",
    "builds_on_meta",
    "gathered_for_eval",
    "gradient_sync",
    "is_sharded",
    "shard_towers",
]
