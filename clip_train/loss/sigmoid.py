"""The sigmoid (SigLIP) loss, tiled on each rank and ringed across ranks (``impl="inf"``).

``X = s·I Tᵀ + b``; every pair is a binary problem, positive on the diagonal and negative
elsewhere, so rank r's loss is ``(1/n) [Σ_{i∈r, all j} softplus(X_ij) - Σ_{i∈r} X_ii]`` (SigLIP
sums over pairs and divides by the images, as open_clip's ``SigLipLoss`` does per rank). There
is no normaliser across a row or column, so the forward needs one matmul per tile and no state
travels with the blocks; the gradient ``G = (w_r / n)·(sigmoid(X) - I)`` of each element depends on
that element alone. The backward recomputes each tile and spends two matmuls on dI and dT.

Same convention as the softmax loss: the average over ranks is the global loss, each rank's
features get the gradient of the sum of the rank losses, and the per-rank scale and bias
gradients average to the global ones.
"""

from __future__ import annotations

from typing import Any

import torch

from clip_train.loss.checks import Batch, row_dots
from clip_train.loss.kernels import Tiles
from clip_train.loss.ring import backward_pass, forward_pass, without_autocast


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
        tiles: Tiles,
    ) -> torch.Tensor:
        images = image_features.detach().to(tiles.feature_dtype).contiguous()
        texts = text_features.detach().to(tiles.feature_dtype).contiguous()
        acc_dtype = torch.promote_types(images.dtype, torch.float32)
        scale, bias = float(logit_scale), float(logit_bias)
        n = images.shape[0]
        total = images.new_zeros((), dtype=acc_dtype)
        positives = images.new_zeros((), dtype=acc_dtype)
        last_tile = None

        def visit(owner: int, block: torch.Tensor, _: None) -> None:
            nonlocal total, positives, last_tile
            block_total, last_tile = tiles.functions.sigmoid_forward(images, block, scale, bias, tile)
            total = total + block_total
            if owner == batch.rank:
                positives = (row_dots(images, block, acc_dtype) * scale + bias).sum()

        block, _, _ = forward_pass(batch, texts, None, visit)
        ctx.save_for_backward(images, block)
        ctx.batch, ctx.tile, ctx.tiles, ctx.last_tile = batch, tile, tiles, last_tile
        ctx.scale, ctx.bias = scale, bias
        ctx.input_dtypes = [
            (t.dtype, t.shape) for t in (image_features, text_features, logit_scale, logit_bias)
        ]
        return (total - positives) / n

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        images, block = ctx.saved_tensors
        last_tile, ctx.last_tile = ctx.last_tile, None
        batch: Batch = ctx.batch
        n = images.shape[0]
        acc_dtype = torch.promote_types(images.dtype, torch.float32)
        coef = float(grad_loss) / n
        grad_images = images.new_zeros(images.shape, dtype=acc_dtype)  # without the factor s
        grad_bias = images.new_zeros((), dtype=acc_dtype)

        def visit(owner: int, travelling: list[torch.Tensor]) -> torch.Tensor:
            nonlocal last_tile, grad_bias
            (block,) = travelling
            grad_block = images.new_zeros(block.shape, dtype=acc_dtype)
            args = (ctx.scale, ctx.bias, coef, grad_images, grad_block, ctx.tile, last_tile)
            grad_bias = grad_bias + ctx.tiles.functions.sigmoid_backward(images, block, *args)
            last_tile = None  # only the first block visited is the forward's last
            if owner == batch.rank:  # the positives' -1 on the diagonal
                grad_images.sub_(block.to(acc_dtype), alpha=coef)
                grad_block.sub_(images.to(acc_dtype), alpha=coef)
                grad_bias = grad_bias - coef * n
            return grad_block

        grad_texts = backward_pass(batch, [block], visit)
        grad_scale = row_dots(images, grad_images, acc_dtype).sum()
        grads = (grad_images.mul_(ctx.scale), grad_texts.mul_(ctx.scale), grad_scale, grad_bias)
        return (
            *(g.to(dtype).reshape(shape) for g, (dtype, shape) in zip(grads, ctx.input_dtypes, strict=True)),
            None,
            None,
            None,
        )
