"""Losses that materialise the similarity matrix: the baselines the tiled loss must match.

``vanilla_loss`` is CLIP's original (the full b×b logits), ``local_loss`` open_clip's
``local_loss=True, gather_with_grad=True`` (this rank's rows against all columns, both ways) and
``vanilla_sigmoid_loss`` SigLIP's (this rank's rows against all texts). Each returns the mean
over this rank's rows (and own columns), and the gathers' summed backward hands each rank
W × ∂L_global/∂(its features).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clip_train.loss.checks import Batch, gather_with_grad


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Low-precision logits in fp32, as autocast does for cross-entropy."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_upcast(logits), labels)


def vanilla_loss(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor, batch: Batch
) -> torch.Tensor:
    all_images = gather_with_grad(image_features, batch)
    all_texts = gather_with_grad(text_features, batch)
    logits = logit_scale * all_images @ all_texts.t()  # (W·n, W·m): the whole matrix
    n = image_features.shape[0]
    own = slice(batch.rank * n, (batch.rank + 1) * n)
    image_to_text = _cross_entropy(logits[own], batch.labels)
    if not batch.symmetric:
        return image_to_text
    text_to_image = _cross_entropy(logits[:, own].t(), batch.labels)
    return (image_to_text + text_to_image) / 2


def local_loss(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor, batch: Batch
) -> torch.Tensor:
    all_texts = gather_with_grad(text_features, batch)
    image_to_text = _cross_entropy(logit_scale * image_features @ all_texts.t(), batch.labels)
    if not batch.symmetric:
        return image_to_text
    all_images = gather_with_grad(image_features, batch)
    text_to_image = _cross_entropy(logit_scale * text_features @ all_images.t(), batch.labels)
    return (image_to_text + text_to_image) / 2


def vanilla_sigmoid_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor,
    batch: Batch,
) -> torch.Tensor:
    all_texts = gather_with_grad(text_features, batch)
    logits = _upcast(logit_scale * image_features @ all_texts.t() + logit_bias)  # (n, W·n)
    signs = -torch.ones_like(logits)
    signs[torch.arange(len(logits), device=logits.device), batch.labels] = 1.0
    return -F.logsigmoid(signs * logits).sum() / image_features.shape[0]
