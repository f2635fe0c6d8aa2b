"""The softmax (CLIP / InfoNCE) loss, tiled on each rank and ringed across ranks (``impl="inf"``).

The forward merges tile LSEs into this rank's row LSE and into the column LSE of the text block
in hand, which travels with the block (hard negatives need rows only). A column's softmax term
belongs to its owner's loss, so the backward weights it by the owner's upstream gradient. The
scale gradient ⟨I_r, dI_r⟩ / s covers every tile exactly once over the ranks, so the per-rank
values average to ∂L_global/∂s (Inf-CL returns the full sum on every rank, W× too large).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from clip_train.loss.checks import Batch, grads_like, row_dots
from clip_train.loss.ring import backward_pass, forward_pass, rank_coefficients, without_autocast
from clip_train.loss.tiles_torch import softmax_backward, softmax_forward, tile_operands


def _positives(batch: Batch, owner: int, m: int, images: torch.Tensor) -> torch.Tensor | None:
    """Per row of this rank, its positive's row in rank ``owner``'s text block of ``m``, or -1 where
    it lies in another block; None for a block with none (symmetric mode: all but the home block,
    whose positives are its diagonal). Found on the device: a host read would wait for every hop."""
    if batch.symmetric:
        return torch.arange(m, device=images.device) if owner == batch.rank else None
    in_block = batch.labels - owner * m
    return torch.where((in_block >= 0) & (in_block < m), in_block, -1)


class SoftmaxLoss(torch.autograd.Function):
    @staticmethod
    @without_autocast
    def forward(  # type: ignore[override]
        ctx: Any,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        batch: Batch,
        tile: int,
    ) -> torch.Tensor:
        images, texts = tile_operands(image_features, text_features)
        acc_dtype = torch.promote_types(images.dtype, torch.float32)  # LSEs and gradient sums
        scale = logit_scale.detach().to(acc_dtype)  # a tensor: the tiles never read it on the host
        (n, _), m = images.shape, texts.shape[0]
        row_lse = images.new_full((n,), -math.inf, dtype=acc_dtype)
        positive_logits = images.new_zeros(n, dtype=acc_dtype)
        last_tile = None

        def visit(owner: int, block: torch.Tensor, col_lse: torch.Tensor | None) -> None:
            nonlocal last_tile
            last_tile = softmax_forward(images, block, scale, row_lse, col_lse, tile)
            positives = _positives(batch, owner, m, images)
            if positives is not None:
                partners = block if batch.symmetric else block[positives.clamp(min=0)]
                logits = row_dots(images, partners, acc_dtype) * scale
                positive_logits.copy_(torch.where(positives >= 0, logits, positive_logits))

        col_lse = images.new_full((m,), -math.inf, dtype=acc_dtype) if batch.symmetric else None
        block, held_col_lse, col_lse = forward_pass(batch, texts, col_lse, visit)
        lse_sum = row_lse.sum() + (col_lse.sum() if col_lse is not None else 0.0)
        loss = lse_sum / (2 * n if batch.symmetric else n) - positive_logits.sum() / n
        # The backward starts from the block in hand, the one the forward ended on.
        ctx.save_for_backward(images, block, row_lse, held_col_lse)
        ctx.batch, ctx.tile, ctx.scale, ctx.last_tile = batch, tile, scale, last_tile
        ctx.input_meta = [(t.dtype, t.shape) for t in (image_features, text_features, logit_scale)]
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        images, block, row_lse, col_lse = ctx.saved_tensors
        # The hand-over's buffer is overwritten here; a second backward (retain_graph) recomputes.
        last_tile, ctx.last_tile = ctx.last_tile, None
        batch: Batch = ctx.batch
        n, m = images.shape[0], block.shape[0]
        acc_dtype = row_lse.dtype
        upstream = grad_loss.to(acc_dtype)  # stays on the device, as the coefficients made of it
        # Each direction's mean over this rank's rows is scaled by this rank's upstream gradient.
        row_coef = upstream / (2 * n if batch.symmetric else n)
        col_coefs = rank_coefficients(row_coef, batch) if batch.symmetric else None
        # Gradients without the factor s (dI / s, dT / s): their dot with I and T gives ∂L/∂s.
        grad_images = images.new_zeros(images.shape, dtype=acc_dtype)

        def visit(owner: int, travelling: list[torch.Tensor]) -> torch.Tensor:
            nonlocal last_tile
            block, *carried = travelling
            grad_block = images.new_zeros(block.shape, dtype=acc_dtype)
            softmax_backward(
                images,
                block,
                ctx.scale,
                row_lse,
                row_coef,
                carried[0] if carried else None,
                col_coefs[owner] if col_coefs is not None else 0.0,
                grad_images,
                grad_block,
                ctx.tile,
                last_tile,
                positives=_positives(batch, owner, m, images),
                positive_coef=-upstream / n,
            )
            last_tile = None  # only the first block visited is the forward's last
            return grad_block

        grad_texts = backward_pass(batch, [block] + ([col_lse] if col_lse is not None else []), visit)
        grad_scale = row_dots(images, grad_images, acc_dtype).sum()
        grads = (grad_images.mul_(ctx.scale), grad_texts.mul_(ctx.scale), grad_scale)
        return (*grads_like(grads, ctx.input_meta), None, None)
