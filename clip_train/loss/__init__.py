"""Contrastive losses for batches far larger than the b×b similarity matrix allows.

``contrastive_loss`` is the one entry point, for the softmax (CLIP / InfoNCE) and sigmoid (SigLIP)
losses. ``impl="inf"`` (the default) never materialises the similarity matrix: it tiles it on each
rank and passes text blocks around a ring of ranks; ``"vanilla"`` and ``"local"`` are the
materialising baselines it is tested against.

Gradient convention (Inf-CL's, with exact scale and bias gradients): each rank returns the mean
loss over its own rows, so the average over ranks is the global loss, and each rank's features
get W × ∂L_global/∂(its features). Averaging parameter gradients across ranks, as DDP does,
therefore yields exactly the gradient of the single-process global loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from clip_train.config import LOSS_IMPLS, LOSS_KINDS, LossImpl, LossKind
from clip_train.loss.checks import check_inputs
from clip_train.loss.reference import local_loss, vanilla_loss, vanilla_sigmoid_loss
from clip_train.loss.sigmoid import SigmoidLoss
from clip_train.loss.softmax import SoftmaxLoss
from clip_train.loss.tiles_torch import default_tile

__all__ = ["contrastive_loss"]


def contrastive_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor | float,
    *,
    logit_bias: torch.Tensor | float | None = None,
    kind: LossKind = "softmax",
    labels: torch.Tensor | None = None,
    impl: LossImpl = "auto",
    group: dist.ProcessGroup | None = None,
    tile_size: int | None = None,
    same_upstream: bool = False,
) -> torch.Tensor:
    """The mean loss of this rank's rows against the whole (all-rank) batch, a 0-dim tensor.

    Args:
        image_features: (n, d) this rank's L2-normalised image embeddings.
        text_features: (m, d) this rank's L2-normalised text embeddings; n and m agree across ranks.
        logit_scale: the multiplier s (``exp`` of the learnable parameter).
        logit_bias: the sigmoid loss's additive bias b (required there, unused by softmax).
        kind: ``"softmax"`` (CLIP) or ``"sigmoid"`` (SigLIP: ``X = s·I Tᵀ + b``, every pair a
            binary problem, summed and divided by n).
        labels: softmax only. ``None`` for the symmetric CLIP loss (row i of rank r pairs with
            global column r·n+i); else (n,) indices into all ranks' text rows, rank-major:
            one-directional InfoNCE with hard negatives.
        impl: ``"inf"`` (= ``"auto"``), ``"vanilla"`` or ``"local"`` (softmax only).
        group: process group; ``None`` is the default group, or a single process without one.
        tile_size: rows/columns per tile of the PyTorch tiles; ``None`` or 0 picks one per device.
        same_upstream: the caller promises that every rank backpropagates the same gradient into
            its loss (a trainer's 1, or its loss scale). The sigmoid loss's backward then scales
            its forward's gradients at once; otherwise, with several ranks, it compares the ranks'
            gradients, which waits for the device.
    """
    for name, value, choices in (("impl", impl, LOSS_IMPLS), ("kind", kind, LOSS_KINDS)):
        if value not in choices:
            raise ValueError(
                f"contrastive_loss: unknown {name} {value!r}; choose one of {', '.join(choices)}"
            )
    if kind == "sigmoid" and (labels is not None or impl == "local" or logit_bias is None):
        raise ValueError(
            "contrastive_loss: the sigmoid loss needs logit_bias and takes no labels; impl vanilla or inf"
        )
    if tile_size is not None and tile_size < 0:
        raise ValueError(
            f"contrastive_loss: tile_size must be positive (or None/0 for a default), got {tile_size}"
        )
    logit_scale, logit_bias = (
        torch.as_tensor(value, dtype=_at_least_fp32(image_features.dtype), device=image_features.device)
        if value is not None and not isinstance(value, torch.Tensor)
        else value
        for value in (logit_scale, logit_bias)
    )
    batch = check_inputs(image_features, text_features, logit_scale, labels, group)
    if impl == "vanilla":
        if kind == "sigmoid":
            return vanilla_sigmoid_loss(image_features, text_features, logit_scale, logit_bias, batch)
        return vanilla_loss(image_features, text_features, logit_scale, batch)
    if impl == "local":
        return local_loss(image_features, text_features, logit_scale, batch)
    tile = tile_size or default_tile(image_features.device)
    if kind == "sigmoid":
        return SigmoidLoss.apply(
            image_features, text_features, logit_scale, logit_bias, batch, tile, same_upstream
        )
    return SoftmaxLoss.apply(image_features, text_features, logit_scale, batch, tile)


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """A number's dtype beside ``dtype`` features: a scale of 100 rounded to bf16 would move the
    loss by 1e-3, and the tiles take it in their fp32 accumulation type anyway."""
    return torch.promote_types(dtype, torch.float32)
