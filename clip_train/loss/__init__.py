"""Contrastive (CLIP / InfoNCE) loss for batches far larger than the b×b similarity matrix allows.

``contrastive_loss`` is the one entry point. ``impl="inf"`` (the default through ``"auto"``)
never materialises the similarity matrix: it tiles it on each rank and passes text blocks
around a ring of ranks (see DESIGN.md §2–3). ``"vanilla"`` and ``"local"`` are the
materialising baselines it is tested against.

Gradient convention (Inf-CL's, with an exact scale gradient): each rank returns the mean loss
over its own rows, so the average over ranks is the global loss. Backward gives each rank's
features W × ∂L_global/∂(its features), and the per-rank logit-scale gradients average to
∂L_global/∂s. Averaging parameter gradients across ranks, as DDP does, therefore yields exactly
the gradient of the single-process global loss.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from clip_train.loss._common import check_inputs
from clip_train.loss.reference import local_loss, vanilla_loss

Impl = Literal["auto", "inf", "vanilla", "local"]
IMPLS: tuple[str, ...] = ("auto", "inf", "vanilla", "local")
Kernel = Literal["auto", "torch", "triton"]

__all__ = ["IMPLS", "Impl", "Kernel", "contrastive_loss"]


def contrastive_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor | float,
    *,
    labels: torch.Tensor | None = None,
    impl: Impl = "auto",
    group: dist.ProcessGroup | None = None,
    tile_size: int | None = None,
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """CLIP loss of this rank's rows against the whole (all-rank) batch.

    Args:
        image_features: (n, d) this rank's image embeddings, L2-normalised.
        text_features: (m, d) this rank's text embeddings, L2-normalised; every rank has the
            same n and m.
        logit_scale: the multiplier s (``exp`` of the learnable parameter), a 0-dim tensor.
        labels: ``None`` for the symmetric CLIP loss (row i of rank r pairs with global column
            r·n+i). Otherwise (n,) global column indices into the rank-major concatenation of
            all ranks' text rows: one-directional InfoNCE with hard negatives (m >= n).
        impl: ``"inf"`` (tiled ring), ``"vanilla"``, ``"local"`` or ``"auto"`` (= ``"inf"``).
        group: process group; ``None`` means the default group if torch.distributed is
            initialised, else a single process.
        tile_size: rows/columns per tile of the tiled loss; ``None`` or 0 picks one per device.
        kernel: the tiled loss's in-device kernels: ``"torch"`` (PyTorch tiles), ``"triton"``
            (fused kernels on CUDA) or ``"auto"``; see ``ring.select_kernels`` for what auto picks.

    Returns:
        The mean loss over this rank's rows (a 0-dim tensor).
    """
    if impl not in IMPLS:
        raise ValueError(f"contrastive_loss: unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")
    if tile_size is not None and tile_size < 0:
        raise ValueError(
            f"contrastive_loss: tile_size must be positive (or None/0 for a default), got {tile_size}"
        )
    if not isinstance(logit_scale, torch.Tensor):
        logit_scale = torch.tensor(
            float(logit_scale), dtype=image_features.dtype, device=image_features.device
        )
    batch = check_inputs(image_features, text_features, logit_scale, labels, group)
    if impl == "vanilla":
        return vanilla_loss(image_features, text_features, logit_scale, batch)
    if impl == "local":
        return local_loss(image_features, text_features, logit_scale, batch)
    from clip_train.loss.ring import ring_loss

    return ring_loss(image_features, text_features, logit_scale, batch, tile_size or None, kernel)
