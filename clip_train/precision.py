"""What a ``train.precision`` string means for autocast, kept in one place."""

from __future__ import annotations

import contextlib

import torch

from clip_train.config import PRECISIONS

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for bf16/fp16; fp32 and fp64 run in the parameters' own dtype."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: must be one of {', '.join(PRECISIONS)}")
    dtype = AUTOCAST_DTYPES.get(precision)
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def use_tf32(device: torch.device, precision: str) -> None:
    """TF32 matmuls on CUDA (Ampere and newer) unless fp64 is asked for: training, its evaluations and
    ``clip-train eval`` compute alike, so a checkpoint scores what it scored in its run."""
    if device.type == "cuda" and precision != "fp64":
        torch.set_float32_matmul_precision("high")
