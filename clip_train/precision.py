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
