"""The sigmoid (SigLIP) loss, tiled on each rank and ringed across ranks (``impl="inf"``).

``X = s·I Tᵀ + b``, positive on the diagonal, negative elsewhere; rank r's loss is
``(1/n) [Σ_{i∈r, all j} softplus(X_ij) - Σ_{i∈r} X_ii]``, as open_clip's ``SigLipLoss``. With no
normaliser, ``G = (w_r / n)·(sigmoid(X) - I)`` depends on each element alone, so the forward
computes loss and unit-coefficient gradients in one ring pass and the backward only scales them;
it repeats the pass only when ranks backpropagate different coefficients. A caller whose ranks
all backpropagate the same gradient says so (``same_upstream``: the trainer's engine); otherwise
the ranks compare theirs, a host read that waits for the whole forward ring. Gradients follow the
softmax loss's convention (see ``clip_train.loss``).
"""

from __future__ import annotations

from typing import Any

import torch

from clip_train.loss.checks import Batch, grads_like, row_dots
from clip_train.loss.ring import accumulating_pass, rank_coefficients, without_autocast
from clip_train.loss.tiles_torch import device_scalar, sigmoid_forward_backward, tile_operands


def _ring_pass(
    images: torch.Tensor, texts: torch.Tensor, ctx: Any, coef: float | torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """One pass of every rank's text block, each rank weighting its rows' ``G`` by its ``coef``:
    ``Σ softplus(X)``, ``Σ X_ii``, ``Σ G`` and this rank's gradients without the factor s."""
    batch: Batch = ctx.batch
    acc_dtype = torch.promote_types(images.dtype, torch.float32)
    n = images.shape[0]
    grad_images = images.new_zeros(images.shape, dtype=acc_dtype)
    coef = device_scalar(coef, grad_images)
    softplus_sum, g_sum, positives = (images.new_zeros((), dtype=acc_dtype) for _ in range(3))

    def visit(owner: int, travelling: list[torch.Tensor]) -> torch.Tensor:
        nonlocal softplus_sum, g_sum, positives
        (block,) = travelling
        grad_block = images.new_zeros(block.shape, dtype=acc_dtype)
        home = owner == batch.rank  # the positives, the diagonal: -coef on it in G, the tiles' own
        args = (ctx.scale, ctx.bias, coef, grad_images, grad_block, ctx.tile)
        diagonal = torch.arange(n, device=images.device) if home else None
        softplus, g = sigmoid_forward_backward(images, block, *args, positives=diagonal)
        softplus_sum, g_sum = softplus_sum + softplus, g_sum + g
        if home:  # and -X_ii in the loss, -coef·n in Σ G
            positives = (row_dots(images, block, acc_dtype) * ctx.scale + ctx.bias).sum()
            g_sum = g_sum - coef * n
        return grad_block

    grad_texts = accumulating_pass(batch, texts, visit)
    return softplus_sum, positives, g_sum, grad_images, grad_texts


class SigmoidLoss(torch.autograd.Function):
    @staticmethod
    @without_autocast
    def forward(  # type: ignore[override]
        ctx: Any,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor,
        batch: Batch,
        tile: int,
        same_upstream: bool,
    ) -> torch.Tensor:
        images, texts = tile_operands(image_features, text_features)
        ctx.batch, ctx.tile, ctx.same_upstream = batch, tile, same_upstream
        acc_dtype = torch.promote_types(images.dtype, torch.float32)
        # Tensors: the tiles apply them on the device and never read them on the host.
        ctx.scale, ctx.bias = (value.detach().to(acc_dtype) for value in (logit_scale, logit_bias))
        # Gradients for a unit coefficient and without the factor s: G0 = sigmoid(X) - I.
        softplus_sum, positives, g_sum, grad_images, grad_texts = _ring_pass(images, texts, ctx, 1.0)
        ctx.save_for_backward(images, texts, grad_images, grad_texts, g_sum)
        ctx.input_meta = [
            (t.dtype, t.shape) for t in (image_features, text_features, logit_scale, logit_bias)
        ]
        return (softplus_sum - positives) / images.shape[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        images, texts, grad_images, grad_texts, g_sum = ctx.saved_tensors
        coef = grad_loss.to(grad_images.dtype) / images.shape[0]
        # One process, or ranks whose caller knows they agree, scale the forward's gradients without
        # asking; other ranks read whether they agree.
        agree = ctx.batch.world == 1 or ctx.same_upstream
        if agree or bool((rank_coefficients(coef, ctx.batch) == coef).all()):
            grad_images, grad_texts, grad_bias = grad_images * coef, grad_texts * coef, g_sum * coef
        else:
            *_, grad_bias, grad_images, grad_texts = _ring_pass(images, texts, ctx, coef)
        grad_scale = row_dots(images, grad_images, grad_images.dtype).sum()
        grads = (grad_images * ctx.scale, grad_texts * ctx.scale, grad_scale, grad_bias)
        return (*grads_like(grads, ctx.input_meta), None, None, None)
