"""Distillation from a teacher CLIP (OpenCLIP's ``--distill-model``), tiled on each rank and ringed
across ranks as the softmax loss is, so neither the student's nor the teacher's b×b matrix is built.

With student logits ``S = s·I Tᵀ`` and teacher logits ``Θ = τ·I' T'ᵀ``, each direction is the
cross-entropy of the student's softmax against the teacher's: row i gives
``LSE_j(S_ij) − Σ_j p_ij S_ij`` with ``p = softmax_j(Θ)``, and column j the same down the columns
(``q = softmax_i(Θ)``). This rank's loss is the mean of its rows' and its own columns' terms over
2n, as the contrastive loss's, so the ranks' average is the global loss.

Forward: two ring passes, the four LSEs (student and teacher, rows and columns), then the teacher-
weighted sums, which need the teacher's complete column LSEs. Backward: one pass, with
``∂/∂S_ij = c_row (P_ij − p_ij) + c_col (Q_ij − q_ij)`` (P, Q: the student's softmaxes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from clip_train.loss.checks import Batch, check_inputs, grads_like, row_dots
from clip_train.loss.ring import backward_pass, forward_pass, rank_coefficients, without_autocast
from clip_train.loss.tiles_torch import addmm_, default_tile, tile_operands

STUDENT_LSE, TEACHER_LSE, CROSS = range(3)  # the rows of a text block's column state


def distillation_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    teacher_image: torch.Tensor,
    teacher_text: torch.Tensor,
    teacher_scale: torch.Tensor,
    *,
    group: Any = None,
    tile_size: int | None = None,
) -> torch.Tensor:
    """This rank's mean distillation loss (OpenCLIP's ``DistillClipLoss`` term, both directions) over
    the whole all-rank batch, a 0-dim tensor. Gradients reach the student's features and scale only;
    the teacher's (n, d') features and scale are constants. Features are L2-normalised, as for
    :func:`clip_train.loss.contrastive_loss`, whose gradient convention this follows."""
    batch = check_inputs(image_features, text_features, logit_scale, None, group)
    n = image_features.shape[0]
    if teacher_image.shape != (n, teacher_text.shape[-1]) or teacher_text.shape[0] != n:
        raise ValueError(
            f"distillation_loss: the teacher's features must be ({n}, d') for images and texts, got "
            f"{tuple(teacher_image.shape)} and {tuple(teacher_text.shape)}"
        )
    tile = tile_size or default_tile(image_features.device)
    return DistillationLoss.apply(
        image_features, text_features, logit_scale, teacher_image, teacher_text, teacher_scale, batch, tile
    )


def _tiles(rows: int, cols: int, tile: int) -> Iterator[tuple[slice, slice]]:
    for row in range(0, rows, tile):
        for col in range(0, cols, tile):
            yield slice(row, min(row + tile, rows)), slice(col, min(col + tile, cols))


class _Operands:
    """One rank's rows or one text block: the student's and the teacher's features side by side in
    one tensor (one ring transfer), split into the student's ``d`` columns and the teacher's."""

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


class DistillationLoss(torch.autograd.Function):
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
    ) -> torch.Tensor:
        images, texts = tile_operands(image_features, text_features)
        teacher_images, teacher_texts = (t.detach().to(images.dtype) for t in (teacher_image, teacher_text))
        acc_dtype = torch.promote_types(images.dtype, torch.float32)
        d, n = images.shape[1], images.shape[0]
        scales = torch.stack([s.detach().reshape(()).to(acc_dtype) for s in (logit_scale, teacher_scale)])
        mine = _Operands(torch.cat([images, teacher_images], dim=1), d, acc_dtype)
        row_lse = images.new_full((2, n), -math.inf, dtype=acc_dtype)  # student, teacher

        def merge_lses(_: int, block: torch.Tensor, col_state: torch.Tensor) -> None:
            theirs = _Operands(block, d, acc_dtype)
            for rows, cols in _tiles(n, len(block), tile):
                logits = mine.logits(theirs, rows, cols, scales)
                torch.logaddexp(row_lse[:, rows], logits.logsumexp(dim=2), out=row_lse[:, rows])
                lses = col_state[:2, cols]
                torch.logaddexp(lses, logits.logsumexp(dim=1), out=lses)

        def weigh_by_teacher(_: int, block: torch.Tensor, col_state: torch.Tensor) -> None:
            theirs = _Operands(block, d, acc_dtype)
            for rows, cols in _tiles(n, len(block), tile):
                student, teacher = mine.logits(theirs, rows, cols, scales)
                by_rows = (teacher - row_lse[TEACHER_LSE, rows, None]).exp_()
                row_cross[rows] += (by_rows * student).sum(dim=1)
                by_cols = (teacher - col_state[TEACHER_LSE, None, cols]).exp_()
                col_state[CROSS, cols] += (by_cols * student).sum(dim=0)

        joined_texts = torch.cat([texts, teacher_texts], dim=1)
        col_state = images.new_full((3, n), -math.inf, dtype=acc_dtype)
        _, _, home_state = forward_pass(batch, joined_texts, col_state, merge_lses)
        home_state[CROSS] = 0.0
        row_cross = images.new_zeros(n, dtype=acc_dtype)
        block, held_state, home_state = forward_pass(batch, joined_texts, home_state, weigh_by_teacher)
        loss = (row_lse[STUDENT_LSE] - row_cross).sum() + (home_state[STUDENT_LSE] - home_state[CROSS]).sum()
        # The backward starts from the block in hand, with its (complete) column LSEs.
        ctx.save_for_backward(mine.joined, block, row_lse, held_state[:2].clone(), scales)
        ctx.batch, ctx.tile, ctx.d = batch, tile, d
        ctx.input_meta = [(t.dtype, t.shape) for t in (image_features, text_features, logit_scale)]
        return loss / (2 * n)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        joined, block, row_lse, col_lse, scales = ctx.saved_tensors
        batch: Batch = ctx.batch
        acc_dtype, n = row_lse.dtype, joined.shape[0]
        mine = _Operands(joined, ctx.d, acc_dtype)
        row_coef = grad_loss.to(acc_dtype) / (2 * n)
        col_coefs = rank_coefficients(row_coef, batch)
        # Gradients without the factor s: their dot with the student's rows gives ∂L/∂s.
        grad_images = joined.new_zeros((n, ctx.d), dtype=acc_dtype)

        def visit(owner: int, travelling: list[torch.Tensor]) -> torch.Tensor:
            block, col_lse = travelling
            theirs = _Operands(block, ctx.d, acc_dtype)
            grad_block = joined.new_zeros((len(block), ctx.d), dtype=acc_dtype)
            for rows, cols in _tiles(n, len(block), ctx.tile):
                logits = mine.logits(theirs, rows, cols, scales)
                by_rows = (logits - row_lse[:, rows, None]).exp_()
                by_cols = (logits - col_lse[:, None, cols]).exp_()
                grads = row_coef * (by_rows[0] - by_rows[1]) + col_coefs[owner] * (by_cols[0] - by_cols[1])
                addmm_(grad_images[rows], grads, theirs.student[cols])
                addmm_(grad_block[cols], grads.t(), mine.student[rows])
            return grad_block

        grad_texts = backward_pass(batch, [block, col_lse], visit)
        grad_scale = row_dots(mine.student, grad_images, acc_dtype).sum()
        student_scale = scales[0]
        grads = (grad_images.mul_(student_scale), grad_texts.mul_(student_scale), grad_scale)
        return (*grads_like(grads, ctx.input_meta), None, None, None, None, None)
