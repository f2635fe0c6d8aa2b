"""Which tile kernels compute each rank's blocks: PyTorch tiles or fused Triton kernels."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch

from clip_train.config import LOSS_KERNELS
from clip_train.loss import tiles_torch


@dataclass(frozen=True)
class Tiles:
    """A module with ``softmax_forward``, ``softmax_backward`` and ``sigmoid_forward_backward``, and
    the dtype it wants the features in."""

    functions: ModuleType
    feature_dtype: torch.dtype


def select_kernels(kernel: str, device: torch.device, dtype: torch.dtype, dim: int) -> Tiles:
    """``torch`` (PyTorch tiles in fp32/fp64 on any device, bf16 on CUDA) or ``triton`` (fused
    kernels on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``; fp32 features with d ≤ 512,
    bf16/fp16 with d ≤ 1024).

    ``auto`` is ``torch``: the Triton kernels have not yet been timed against cuBLAS tiles on a GPU
    (``make gpu-figures`` measures both); ``auto`` moves to Triton once that shows it faster.
    """
    if kernel not in LOSS_KERNELS:
        raise ValueError(
            f"contrastive_loss: unknown kernel {kernel!r}; choose one of {', '.join(LOSS_KERNELS)}"
        )
    if kernel != "triton":  # fp64 stays; bf16 only on CUDA, where it feeds cuBLAS's bf16 GEMM
        keeps = dtype == torch.float64 or (dtype == torch.bfloat16 and device.type == "cuda")
        return Tiles(tiles_torch, dtype if keeps else torch.float32)
    from clip_train.loss import tiles_triton  # Triton is optional: only this choice needs it

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"contrastive_loss: kernel='triton' needs a CUDA device, got {device}")
    if dtype not in tiles_triton.DTYPES or dim > tiles_triton.max_dim(dtype):
        raise ValueError(
            "contrastive_loss: kernel='triton' takes fp32 features with d <= 512 or bf16/fp16 ones with "
            f"d <= 1024, got {dtype} with d = {dim}; use kernel='torch'"
        )
    return Tiles(tiles_triton, dtype)
