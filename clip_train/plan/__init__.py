"""Memory planning (``clip-train plan``): ``profile`` measures a model's chunk memory on the device at
hand, ``estimate`` turns a profile into per-GPU bytes and the largest batch that fits."""

from clip_train.plan.estimate import (
    GIB,
    Breakdown,
    ModelProfile,
    Setting,
    breakdown,
    loss_workspace,
    max_batch,
    usable_bytes,
)
from clip_train.plan.profile import measure_cpu_step, profile_model

__all__ = [
    "GIB",
    "Breakdown",
    "ModelProfile",
    "Setting",
    "breakdown",
    "loss_workspace",
    "max_batch",
    "measure_cpu_step",
    "profile_model",
    "usable_bytes",
]
