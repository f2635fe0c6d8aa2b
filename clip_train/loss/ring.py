"""The Inf-CL loss: tiled on each rank, with text blocks passed around a ring of ranks.

Forward, one ring pass: text block T_k starts at rank k and visits every rank. Each rank merges
its tile LSEs into its own row LSE and into the block's column LSE, which travels with the
block and is complete when it gets home (symmetric mode only; hard negatives need rows only).
Backward, one more pass the other way round: each rank starts with the block the forward ended
on (its last tile's logits still in hand, so that tile is not recomputed) and T_k travels with
its column shift (column LSE and upstream coefficient) and a dT_k accumulator, arriving home
complete after the last hop, while dI accumulates locally. The next block's transfer is posted
before computing on the block in hand and waited for after, so communication overlaps the
matmuls. With one rank there is no communication and this is the plain tiled loss.

Scale gradient: rank r returns ⟨I_r, dI_r⟩ / s, i.e. Σ G∘X/s over its own rows' tiles. Summed
over ranks that is every tile exactly once, so the per-rank values average to ∂L_global/∂s
(Inf-CL instead returns the full sum on every rank, W× too large).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from clip_train.loss import tiled
from clip_train.loss._common import Batch


class _Ring:
    """Point-to-point exchange with this rank's ring neighbours (send to next, receive from previous)."""

    def __init__(self, batch: Batch) -> None:
        self.group, self.world = batch.group, batch.world
        if self.world > 1:
            self.next = dist.get_global_rank(self.group, (batch.rank + 1) % self.world)
            self.prev = dist.get_global_rank(self.group, (batch.rank - 1) % self.world)

    def start(self, send: list[torch.Tensor], recv: list[torch.Tensor], reverse: bool = False) -> list[Any]:
        """Post the transfers; ``reverse`` sends to the previous rank and receives from the next."""
        if self.world == 1 or not (send or recv):
            return []
        to, source = (self.prev, self.next) if reverse else (self.next, self.prev)
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, source, self.group) for t in recv]
        return dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _kernels(device: torch.device, dtype: torch.dtype) -> tuple[Callable[..., None], Callable[..., None]]:
    """Triton kernels for fp32 compute on CUDA when Triton is importable, the PyTorch tiles elsewhere."""
    if device.type == "cuda" and dtype == torch.float32:
        try:
            from clip_train.loss import triton_kernels
        except ImportError:
            pass
        else:
            return triton_kernels.block_forward, triton_kernels.block_backward
    return tiled.block_forward, tiled.block_backward


def _without_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The kernels pick their own precision; autocast must not lower it under them."""

    @functools.wraps(fn)
    def run(ctx: Any, tensor: torch.Tensor, *args: Any) -> Any:
        with torch.autocast(tensor.device.type, enabled=False):
            return fn(ctx, tensor, *args)

    return run


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _positives(batch: Batch, owner: int, m: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows whose positive lies in the text block of rank ``owner``, and the block rows they pair with.

    ``None`` stands for the whole diagonal of the home block in symmetric mode (no indexing).
    """
    if batch.symmetric:
        return None
    rows = ((batch.labels // m) == owner).nonzero().squeeze(1)
    return rows, batch.labels[rows] - owner * m


def _shift(lse: torch.Tensor, coef: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``lse - log|coef|`` and ``sign(coef)``: the softmax gradient's coefficient moved into its shift."""
    return lse - coef.abs().log(), -1.0 if coef.item() < 0 else 1.0


class _InfLoss(torch.autograd.Function):
    @staticmethod
    @_without_autocast
    def forward(  # type: ignore[override]
        ctx: Any,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        batch: Batch,
        tile: int,
    ) -> torch.Tensor:
        dtype = _compute_dtype(image_features.dtype)
        scale = logit_scale.detach().to(image_features.device, dtype).reshape(())
        images = image_features.detach().to(dtype)
        scaled_images = (images * scale).contiguous()
        texts = text_features.detach().to(dtype).contiguous()
        (n, _), m = images.shape, texts.shape[0]
        block_forward, _ = _kernels(images.device, dtype)
        ring = _Ring(batch)

        row_lse = images.new_full((n,), -math.inf)
        positive_logits = images.new_zeros(n)
        block, col_lse = texts, (images.new_full((m,), -math.inf) if batch.symmetric else None)
        held_col_lse = col_lse  # complete column LSE of the block in hand after the last step
        for step in range(batch.world):
            owner = (batch.rank - step) % batch.world
            last = step == batch.world - 1
            next_block = None if last else torch.empty_like(block)
            transfer = ring.start([] if last else [block], [] if last else [next_block])
            last_tile = block_forward(scaled_images, block, row_lse, col_lse, tile)
            pairs = _positives(batch, owner, m)
            if pairs is not None:
                positive_logits[pairs[0]] = (scaled_images[pairs[0]] * block[pairs[1]]).sum(dim=1)
            elif owner == batch.rank:
                positive_logits = (scaled_images * block).sum(dim=1)
            if col_lse is not None:  # the block's column LSE moves on with it (home after the last hop)
                incoming = torch.empty_like(col_lse)
                transfer += ring.start([col_lse], [incoming])
            _wait(transfer)
            if col_lse is not None and batch.world > 1:
                held_col_lse, col_lse = col_lse, incoming
            if not last:
                block = next_block

        lse_sum = row_lse.sum() + (col_lse.sum() if col_lse is not None else 0.0)
        loss = lse_sum / (2 * n if batch.symmetric else n) - positive_logits.sum() / n
        # The backward starts from the block in hand, the one the forward ended on.
        ctx.save_for_backward(images, scaled_images, block, scale, row_lse, held_col_lse)
        ctx.batch, ctx.tile, ctx.last_tile = batch, tile, last_tile
        ctx.input_dtypes = (image_features.dtype, text_features.dtype, logit_scale.dtype, logit_scale.shape)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    @_without_autocast
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        images, scaled_images, block, scale, row_lse, col_lse = ctx.saved_tensors
        # The hand-over's buffer is overwritten here; a second backward (retain_graph) recomputes.
        last_tile, ctx.last_tile = ctx.last_tile, None
        batch: Batch = ctx.batch
        (n, _), m = images.shape, block.shape[0]
        _, block_backward = _kernels(images.device, images.dtype)
        ring = _Ring(batch)
        grad_loss = grad_loss.to(images.dtype)
        direction_coef = grad_loss / (2 * n if batch.symmetric else n)
        row_shift, row_sign = _shift(row_lse, direction_coef)

        # Unscaled image gradient (dI / s): its dot with I is then exactly ∂L/∂s.
        grad_images = torch.zeros_like(images)
        # What travels with a text block: its column shift and sign (empty in hard-negative mode).
        col_meta = torch.cat(_col_meta(col_lse, direction_coef)) if batch.symmetric else images.new_empty(0)
        done = None  # the accumulator of the block processed in the previous step
        for step in range(batch.world):
            owner = (batch.rank + 1 + step) % batch.world
            last = step == batch.world - 1
            send, recv = [], []
            if not last:
                next_block, next_meta = torch.empty_like(block), torch.empty_like(col_meta)
                send, recv = [block, col_meta], [next_block, next_meta]
            if done is not None:
                incoming = torch.empty_like(done)
                send, recv = [*send, done], [*recv, incoming]
            transfer = ring.start(send, recv, reverse=True)

            grad_block = torch.zeros_like(block)
            col_shift, col_sign = (col_meta[:m], float(col_meta[m])) if batch.symmetric else (None, 1.0)
            block_backward(
                scaled_images,
                block,
                row_shift,
                row_sign,
                col_shift,
                col_sign,
                grad_images,
                grad_block,
                ctx.tile,
                last_tile if step == 0 else None,
            )
            pairs, positive_coef = _positives(batch, owner, m), grad_loss / n
            if pairs is not None:
                grad_images.index_add_(0, pairs[0], block[pairs[1]] * -positive_coef)
                grad_block.index_add_(0, pairs[1], scaled_images[pairs[0]] * -positive_coef)
            elif owner == batch.rank:
                grad_images.sub_(block * positive_coef)
                grad_block.sub_(scaled_images * positive_coef)
            _wait(transfer)
            if done is not None:
                grad_block += incoming
            done = grad_block
            if not last:
                block, col_meta = next_block, next_meta
        grad_texts = done  # the last block processed is this rank's own

        image_dtype, text_dtype, scale_dtype, scale_shape = ctx.input_dtypes
        grad_scale = torch.dot(images.flatten(), grad_images.flatten())
        return (
            grad_images.mul_(scale).to(image_dtype),
            grad_texts.to(text_dtype),
            grad_scale.to(scale_dtype).reshape(scale_shape),
            None,
            None,
        )


def _col_meta(col_lse: torch.Tensor, coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shift, sign = _shift(col_lse, coef)
    return shift, shift.new_tensor([sign])


def ring_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    batch: Batch,
    tile_size: int | None,
) -> torch.Tensor:
    tile = tile_size or tiled.default_tile(image_features.device)
    return _InfLoss.apply(image_features, text_features, logit_scale, batch, tile)
