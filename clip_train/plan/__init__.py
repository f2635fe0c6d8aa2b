"""Memory planning (``clip-train plan``): ``profile`` measures a model's chunk memory on the device at
hand, ``estimate`` turns a profile into per-GPU bytes and the largest batch that fits,
``auto_chunks`` picks a run's ``auto`` chunk sizes from both, and ``table`` lays out the plan that
``clip-train plan`` prints.

Each name below imports its module on first use, so ``clip_train.plan.architecture`` and
``clip_train.plan.progress`` load without torch: ``clip-train plan`` checks its inputs before the
seconds that torch, transformers and timm take to import."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_HOMES = {
    "choose_chunks": "auto_chunks",
    "largest_fitting_chunks": "auto_chunks",
    "GIB": "estimate",
    "Breakdown": "estimate",
    "ModelProfile": "estimate",
    "Setting": "estimate",
    "breakdown": "estimate",
    "loss_workspace": "estimate",
    "max_batch": "estimate",
    "usable_bytes": "estimate",
    "measure_cpu_step": "profile",
    "profile_model": "profile",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
