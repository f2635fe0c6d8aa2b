"""Memory planning (``clip-train plan``): ``profile`` measures a model's chunk memory on the device at
hand, ``estimate`` turns a profile into per-GPU bytes and the largest batch that fits, and
``auto_chunks`` picks a run's ``auto`` chunk sizes from both."""

from clip_train.plan.auto_chunks import choose_chunks, largest_fitting_chunks
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
    "choose_chunks",
    "largest_fitting_chunks",
    "loss_workspace",
    "max_batch",
    "measure_cpu_step",
    "profile_model",
    "usable_bytes",
]
