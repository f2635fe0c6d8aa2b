"""The Inf-CL loss: tiled on each rank, with text blocks passed around a ring of ranks.

Forward, one ring pass: text block T_k starts at rank k and visits every rank. Each rank merges
its tile LSEs into its own row LSE and into the block's column LSE, which travels with the
block and is complete when it gets home (symmetric mode only; hard negatives need rows only).
Backward, one more pass the other way round: each rank starts with the block the forward ended
on (its last tile's logits still in hand, so that tile is not recomputed) and T_k travels with
its column LSE and a dT_k accumulator, arriving home complete after the last hop, while dI
accumulates locally. A column's softmax term is part of its owner's loss, so it is weighted by
the owner's upstream gradient (one all-gather of W scalars), which may differ from this rank's.
The next block's transfer is posted before computing on the block in hand and waited for after,
so communication overlaps the matmuls. With one rank there is no communication and this is the
plain tiled loss.

Scale gradient: rank r returns ⟨I_r, dI_r⟩ / s, i.e. Σ G∘X/s over its own rows' tiles. Summed
over ranks that is every tile exactly once, so the per-rank values average to ∂L_global/∂s
(Inf-CL instead returns the full sum on every rank, W× too large).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
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


KERNELS: tuple[str, ...] = ("auto", "torch", "triton")


@dataclass(frozen=True)
class _Kernels:
    """One implementation of the block functions, and the dtype it wants the features in."""

    block_forward: Callable[..., Any]
    block_backward: Callable[..., Any]
    feature_dtype: torch.dtype


def select_kernels(kernel: str, device: torch.device, dtype: torch.dtype, dim: int) -> _Kernels:
    """``torch`` (PyTorch tiles in fp32/fp64, any device) or ``triton`` (fused kernels on CUDA, or on
    CPU tensors under ``TRITON_INTERPRET=1``; fp32 features with d ≤ 512, bf16/fp16 with d ≤ 1024).

    ``auto`` is ``torch`` on every device. On CUDA the PyTorch tiles are 8192² cuBLAS matmuls with
    bandwidth-bound elementwise passes between them, and they are the path every CPU test and
    benchmark exercises; the Triton kernels keep the tile on chip but have not yet been timed on
    a GPU (``make gpu-check`` measures both). ``auto`` moves to Triton once that shows it faster.
    """
    if kernel not in KERNELS:
        raise ValueError(f"contrastive_loss: unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if kernel != "triton":
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        return _Kernels(tiled.block_forward, tiled.block_backward, wide)
    from clip_train.loss import triton_kernels

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"contrastive_loss: kernel='triton' needs a CUDA device, got {device}")
    if dtype not in triton_kernels.DTYPES or dim > triton_kernels.max_dim(dtype):
        raise ValueError(
            "contrastive_loss: kernel='triton' takes fp32 features with d <= 512 or bf16/fp16 ones with "
            f"d <= 1024, got {dtype} with d = {dim}; use kernel='torch'"
        )
    return _Kernels(triton_kernels.block_forward, triton_kernels.block_backward, dtype)


def _without_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The kernels pick their own precision; autocast must not lower it under them."""

    @functools.wraps(fn)
    def run(ctx: Any, tensor: torch.Tensor, *args: Any) -> Any:
        with torch.autocast(tensor.device.type, enabled=False):
            return fn(ctx, tensor, *args)

    return run


def _positives(batch: Batch, owner: int, m: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows whose positive lies in the text block of rank ``owner``, and the block rows they pair with.

    ``None`` stands for the whole diagonal of the home block in symmetric mode (no indexing).
    """
    if batch.symmetric:
        return None
    rows = ((batch.labels // m) == owner).nonzero().squeeze(1)
    return rows, batch.labels[rows] - owner * m


def _owner_coefficients(coef: float, batch: Batch, device: torch.device) -> list[float]:
    """Every rank's loss coefficient, indexed by rank: a column's softmax term belongs to the loss
    of the rank that owns the column, so it takes that rank's upstream gradient, not the holder's."""
    if batch.world == 1:
        return [coef]
    mine = torch.tensor([coef], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(batch.world)]
    dist.all_gather(every, mine, group=batch.group)
    return [float(c) for c in every]


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
        kernels: _Kernels,
    ) -> torch.Tensor:
        # Contiguous copies (or the inputs themselves): the kernels and the ring's buffers need them.
        images = image_features.detach().to(kernels.feature_dtype).contiguous()
        texts = text_features.detach().to(kernels.feature_dtype).contiguous()
        acc_dtype = torch.promote_types(images.dtype, torch.float32)  # LSEs and gradient sums
        scale = float(logit_scale)
        (n, _), m = images.shape, texts.shape[0]
        ring = _Ring(batch)

        row_lse = images.new_full((n,), -math.inf, dtype=acc_dtype)
        positive_logits = images.new_zeros(n, dtype=acc_dtype)
        block = texts
        col_lse = images.new_full((m,), -math.inf, dtype=acc_dtype) if batch.symmetric else None
        held_col_lse = col_lse  # complete column LSE of the block in hand after the last step
        for step in range(batch.world):
            owner = (batch.rank - step) % batch.world
            last = step == batch.world - 1
            next_block = None if last else torch.empty_like(block)
            transfer = ring.start([] if last else [block], [] if last else [next_block])
            last_tile = kernels.block_forward(images, block, scale, row_lse, col_lse, tile)
            pairs = _positives(batch, owner, m)
            if pairs is not None:
                positive_logits[pairs[0]] = _dots(images[pairs[0]], block[pairs[1]], acc_dtype) * scale
            elif owner == batch.rank:
                positive_logits = _dots(images, block, acc_dtype) * scale
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
        ctx.save_for_backward(images, block, row_lse, held_col_lse)
        ctx.batch, ctx.tile, ctx.kernels, ctx.scale, ctx.last_tile = batch, tile, kernels, scale, last_tile
        ctx.input_dtypes = (image_features.dtype, text_features.dtype, logit_scale.dtype, logit_scale.shape)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    @_without_autocast
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        images, block, row_lse, col_lse = ctx.saved_tensors
        # The hand-over's buffer is overwritten here; a second backward (retain_graph) recomputes.
        last_tile, ctx.last_tile = ctx.last_tile, None
        batch: Batch = ctx.batch
        kernels: _Kernels = ctx.kernels
        (n, _), m = images.shape, block.shape[0]
        ring = _Ring(batch)
        acc_dtype = row_lse.dtype
        upstream = float(grad_loss)
        # Each direction's mean over this rank's rows is scaled by this rank's upstream gradient;
        # a column's term takes the coefficient of the rank that owns the column.
        row_coef = upstream / (2 * n if batch.symmetric else n)
        col_coefs = _owner_coefficients(row_coef, batch, images.device) if batch.symmetric else None

        # Gradients without the factor s (dI / s, dT / s): their dot with I and T gives ∂L/∂s.
        grad_images = images.new_zeros(images.shape, dtype=acc_dtype)
        done = None  # the accumulator of the block processed in the previous step
        for step in range(batch.world):
            owner = (batch.rank + 1 + step) % batch.world
            last = step == batch.world - 1
            travelling = [block] + ([col_lse] if col_lse is not None else [])
            send, recv = [], []
            if not last:
                send, recv = travelling, [torch.empty_like(t) for t in travelling]
            if done is not None:
                incoming = torch.empty_like(done)
                send, recv = [*send, done], [*recv, incoming]
            transfer = ring.start(send, recv, reverse=True)

            grad_block = images.new_zeros(block.shape, dtype=acc_dtype)
            kernels.block_backward(
                images,
                block,
                ctx.scale,
                row_lse,
                row_coef,
                col_lse,
                col_coefs[owner] if col_coefs is not None else 0.0,
                grad_images,
                grad_block,
                ctx.tile,
                last_tile if step == 0 else None,
            )
            pairs, positive_coef = _positives(batch, owner, m), upstream / n
            if pairs is not None:
                grad_images.index_add_(0, pairs[0], block[pairs[1]].to(acc_dtype), alpha=-positive_coef)
                grad_block.index_add_(0, pairs[1], images[pairs[0]].to(acc_dtype), alpha=-positive_coef)
            elif owner == batch.rank:
                grad_images.sub_(block.to(acc_dtype), alpha=positive_coef)
                grad_block.sub_(images.to(acc_dtype), alpha=positive_coef)
            _wait(transfer)
            if done is not None:
                grad_block += incoming
            done = grad_block
            if not last:
                block, col_lse = recv[0], (recv[1] if col_lse is not None else None)
        grad_texts = done  # the last block processed is this rank's own

        image_dtype, text_dtype, scale_dtype, scale_shape = ctx.input_dtypes
        grad_scale = _dots(images, grad_images, acc_dtype).sum()
        return (
            grad_images.mul_(ctx.scale).to(image_dtype),
            grad_texts.mul_(ctx.scale).to(text_dtype),
            grad_scale.to(scale_dtype).reshape(scale_shape),
            None,
            None,
            None,
        )


def _dots(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Row-wise dot products, accumulated in ``dtype``."""
    return (a.to(dtype) * b.to(dtype)).sum(dim=1)


def ring_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    batch: Batch,
    tile_size: int | None,
    kernel: str = "auto",
) -> torch.Tensor:
    kernels = select_kernels(kernel, image_features.device, image_features.dtype, image_features.shape[1])
    tile = tile_size or tiled.default_tile(image_features.device)
    return _InfLoss.apply(image_features, text_features, logit_scale, batch, tile, kernels)
