"""Distillation from a teacher CLIP (OpenCLIP's ``--distill-model``) beside the CLIP loss, tiled on
each rank and ringed across ranks as the softmax loss is, so neither the student's nor the teacher's
b×b matrix is ever built.

With student logits ``S = s·I Tᵀ`` and teacher logits ``Θ = τ·I' T'ᵀ``, the distillation term of
row i is the cross-entropy of the student's softmax against the teacher's,
``LSE_j(S_ij) − Σ_j p_ij S_ij`` with ``p = softmax_j(Θ)``, and of column j the same down the
columns (``q = softmax_i(Θ)``). Like the CLIP loss, which shares the student's LSEs, this rank's
term is the mean of its rows' and its own columns' over 2n, so the ranks' average is the global one.

One forward pass: ``Σ_j p_ij S_ij`` is kept as the teacher's LSE grows, rescaled as online softmax
rescales (``acc·exp(old − new)``), so it needs no second pass once the LSE is complete. Backward:
one pass, with ``∂/∂S_ij = c (P_ij + Q_ij − 2δ_ij) + d (P_ij − p_ij + Q_ij − q_ij)`` for the two
terms' coefficients c and d (P, Q: the student's softmaxes; column coefficients are the owner's).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from clip_train.loss.checks import Batch, check_inputs, grads_like, row_dots
from clip_train.loss.ring import backward_pass, forward_pass, rank_coefficients, without_autocast
from clip_train.loss.tiles_torch import addmm_, default_tile, tile_operands

STUDENT, TEACHER, CROSS = range(3)  # rows of the LSE states (student's, teacher's) and Σ p·S


def contrastive_and_distillation_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    teacher_image: torch.Tensor,
    teacher_text: torch.Tensor,
    teacher_scale: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    tile_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's CLIP loss and distillation term over the whole all-rank batch, two 0-dim tensors:
    the pair OpenCLIP's ``DistillClipLoss`` returns. Gradients reach the student's features and
    scale only; the teacher's (n, d') features and scale are constants. Features are L2-normalised,
    and gradients follow :func:`clip_train.loss.contrastive_loss`'s convention."""
    batch = check_inputs(image_features, text_features, logit_scale, None, group)
    n = image_features.shape[0]
    if teacher_image.shape != (n, teacher_text.shape[-1]) or teacher_text.shape[0] != n:
        raise ValueError(
            f"contrastive_and_distillation_loss: the teacher's features must be ({n}, d') for images and "
            f"texts, got {tuple(teacher_image.shape)} and {tuple(teacher_text.shape)}"
        )
    tile = tile_size or default_tile(image_features.device)
    teacher = (teacher_image, teacher_text, teacher_scale)
    return _Loss.apply(image_features, text_features, logit_scale, *teacher, batch, tile)


def _tiles(rows: int, cols: int, tile: int) -> Iterator[tuple[slice, slice]]:
    for row in range(0, rows, tile):
        for col in range(0, cols, tile):
            yield slice(row, min(row + tile, rows)), slice(col, min(col + tile, cols))


class _Operands:
    """This rank's rows or a text block: the student's and the teacher's features side by side in one
    tensor (one ring transfer), split into the student's ``d`` columns and the teacher's."""

    def __init__(self, joined: torch.Tensor, d: int, acc_dtype: torch.dtype):
        self.joined, self.acc_dtype = joined, acc_dtype
        self.student, self.teacher = joined[:, :d], joined[:, d:]

    def logits(self, other: _Operands, rows: slice, cols: slice, scales: torch.Tensor) -> torch.Tensor:
        """The tile's student and teacher logits, stacked: (2, rows, cols) in the accumulation dtype."""
        out = self.joined.new_empty((2, rows.stop - rows.start, cols.stop - cols.start), dtype=self.acc_dtype)
        pairs = ((self.student, other.student), (self.teacher, other.teacher))
        for index, (mine, theirs) in enumerate(pairs):
            addmm_(out[index], mine[rows], theirs[cols].t(), beta=0.0).mul_(scales[index])
        return out


def _merge_(state: torch.Tensor, logits: torch.Tensor, dim: int) -> None:
    """Fold a tile into (3, k) ``state`` along ``dim`` of its (2, rows, cols) ``logits``: both LSEs,
    and Σ exp(Θ − LSE_Θ)·S rescaled to the teacher's new LSE."""
    lse = torch.logaddexp(state[:2], logits.logsumexp(dim=dim + 1))
    teacher = lse[TEACHER].unsqueeze(dim)
    weighted = ((logits[TEACHER] - teacher).exp_() * logits[STUDENT]).sum(dim=dim)
    state[CROSS].mul_((state[TEACHER] - lse[TEACHER]).exp_()).add_(weighted)
    state[:2] = lse


class _Loss(torch.autograd.Function):
    @staticmethod
    @without_autocast
    def forward(  # type: ignore[override]
        ctx: Any,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        teacher_image: torch.Tensor,
        teacher_text: torch.Tensor,
        teacher_scale: torch.Tensor,
        batch: Batch,
        tile: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        images, texts = tile_operands(image_features, text_features)
        teacher_images, teacher_texts = (t.detach().to(images.dtype) for t in (teacher_image, teacher_text))
        acc_dtype = torch.promote_types(images.dtype, torch.float32)
        (n, d), scalars = images.shape, (logit_scale, teacher_scale)
        scales = torch.stack([scale.detach().reshape(()).to(acc_dtype) for scale in scalars])
        mine = _Operands(torch.cat([images, teacher_images], dim=1), d, acc_dtype)
        row_state = _empty_state(images, n, acc_dtype)

        def visit(_: int, block: torch.Tensor, col_state: torch.Tensor) -> None:
            theirs = _Operands(block, d, acc_dtype)
            for rows, cols in _tiles(n, len(block), tile):
                logits = mine.logits(theirs, rows, cols, scales)
                _merge_(row_state[:, rows], logits, dim=1)
                _merge_(col_state[:, cols], logits, dim=0)

        texts = torch.cat([texts, teacher_texts], dim=1)
        block, held_state, col_state = forward_pass(batch, texts, _empty_state(images, n, acc_dtype), visit)
        lses = row_state[STUDENT].sum() + col_state[STUDENT].sum()
        positives = row_dots(images, texts[:, :d], acc_dtype).sum() * scales[STUDENT]
        contrastive = lses / (2 * n) - positives / n
        distillation = (lses - row_state[CROSS].sum() - col_state[CROSS].sum()) / (2 * n)
        # The backward starts from the block in hand, with its (complete) column LSEs.
        ctx.save_for_backward(mine.joined, block, row_state[:2], held_state[:2], scales)
        ctx.batch, ctx.tile, ctx.d = batch, tile, d
        ctx.input_meta = [(t.dtype, t.shape) for t in (image_features, text_features, logit_scale)]
        return contrastive, distillation

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(
        ctx: Any, grad_contrastive: torch.Tensor, grad_distillation: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        joined, block, row_lse, col_lse, scales = ctx.saved_tensors
        batch: Batch = ctx.batch
        acc_dtype, n, d = row_lse.dtype, joined.shape[0], ctx.d
        mine = _Operands(joined, d, acc_dtype)
        # Per rank: the student's softmaxes' coefficient (both terms) and the teacher's (distillation).
        upstream = torch.stack([grad_contrastive, grad_distillation]).to(acc_dtype)
        coefs = torch.stack([upstream.sum(), -upstream[1]]) / (2 * n)
        col_coefs = rank_coefficients(coefs, batch).view(batch.world, 2)
        # Gradients without the factor s: their dot with the student's rows gives ∂L/∂s.
        grad_images = joined.new_zeros((n, d), dtype=acc_dtype)
        positive = -upstream[0] / n

        def visit(owner: int, travelling: list[torch.Tensor]) -> torch.Tensor:
            block, col_lse = travelling
            theirs = _Operands(block, d, acc_dtype)
            grad_block = joined.new_zeros((len(block), d), dtype=acc_dtype)
            for rows, cols in _tiles(n, len(block), ctx.tile):
                logits = mine.logits(theirs, rows, cols, scales)
                by_rows = (logits - row_lse[:, rows, None]).exp_().mul_(coefs[:, None, None]).sum(dim=0)
                by_cols = (logits - col_lse[:, None, cols]).exp_().mul_(col_coefs[owner, :, None, None])
                grads = by_rows.add_(by_cols.sum(dim=0))
                addmm_(grad_images[rows], grads, theirs.student[cols])
                addmm_(grad_block[cols], grads.t(), mine.student[rows])
            if owner == batch.rank:  # the positives: the diagonal of this rank's own block
                grad_images.add_(theirs.student.to(acc_dtype) * positive)
                grad_block.add_(mine.student.to(acc_dtype) * positive)
            return grad_block

        grad_texts = backward_pass(batch, [block, col_lse], visit)
        grad_scale = row_dots(mine.student, grad_images, acc_dtype).sum()
        student_scale = scales[STUDENT]
        grads = (grad_images.mul_(student_scale), grad_texts.mul_(student_scale), grad_scale)
        return (*grads_like(grads, ctx.input_meta), None, None, None, None, None)


def _empty_state(like: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """(3, size): both LSEs at -inf (nothing seen) and Σ p·S at 0."""
    state = like.new_zeros((3, size), dtype=dtype)
    state[:2].fill_(-math.inf)  # a number assigned into a CUDA tensor would be a synchronous copy
    return state
