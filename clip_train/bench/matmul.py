"""The rate a large square bf16 product reaches: the device's practical ceiling, which ``bench gpu``
reports the trainer's model FLOP rate against ("of matmul rate").

A module of its own because the measurement runs in a fresh process, which imports the function's
module: this one needs torch alone, where ``clip_train.bench.gpu`` pulls in the trainer, timm and
OpenCLIP (about 9 s more of a small CPU's time before a product that takes milliseconds).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from clip_train.distributed import wait_for_device


def square_matmul_tflops(spec: dict[str, Any]) -> float:
    """TFLOP/s of a ``size``³ bf16 product on ``device``: the mean of 10 after 3 warm-ups."""
    device, size = torch.device(spec["device"]), spec["size"]
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    wait_for_device(device)
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    wait_for_device(device)
    return 10 * 2 * size**3 / (time.perf_counter() - started) / 1e12
