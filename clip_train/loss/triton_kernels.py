"""Triton kernels for one text block against this rank's image rows (the CUDA path).

Same contract as ``tiled.block_forward`` / ``tiled.block_backward`` (except that the forward
hands no last tile to the backward); fp32 operands with fp32
accumulation (TF32 only when ``torch.backends.cuda.matmul.allow_tf32`` is set). Each program
owns one (BLOCK_M × BLOCK_N) tile of ``X = (s·I) Tᵀ``:

* forward: one pass over the tiles writes each tile's row and column log-sum-exps; the host
  merges them (a 1/BLOCK-sized reduction), column chunk by column chunk to bound that buffer.
* backward: recomputes the tile, forms the gradient of both directions and adds ``G @ T``
  and ``Gᵀ @ (s·I)`` into fp32 accumulators with atomics (so fp32 sums are not bitwise
  deterministic).

Plain ``tl`` operations only — no inline PTX — with masked loads for ragged edges and int64
offsets, so the kernels also run on CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests them).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_D = 64, 64, 32
PARTIAL_BUDGET = 1 << 24  # floats in the forward's per-tile partial LSE buffers


@triton.jit
def _program_tile(
    images, texts, n, m, dim, stride_images, stride_texts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """This program's tile of X: its rows and columns, their masks, and the fp32 logits."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < n, cols < m
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_offsets = rows.to(tl.int64)[:, None] * stride_images
    col_offsets = cols.to(tl.int64)[:, None] * stride_texts
    for start in range(0, dim, BLOCK_D):
        ks = start + tl.arange(0, BLOCK_D)
        k_mask = ks < dim
        a = tl.load(images + row_offsets + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(texts + col_offsets + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return rows, cols, row_mask, col_mask, acc


@triton.jit
def _forward_kernel(
    images, texts, row_part, col_part, n, m, dim, stride_images, stride_texts,
    HAS_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    rows, cols, row_mask, col_mask, x = _program_tile(
        images, texts, n, m, dim, stride_images, stride_texts, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION
    )
    x = tl.where(row_mask[:, None] & col_mask[None, :], x, float("-inf"))
    row_max = tl.where(row_mask, tl.max(x, axis=1), 0.0)
    row_sums = tl.where(row_mask, tl.sum(tl.exp(x - row_max[:, None]), axis=1), 1.0)
    row_lse = row_max + tl.log(row_sums)
    tl.store(row_part + tl.program_id(1).to(tl.int64) * n + rows, row_lse, mask=row_mask)
    if HAS_COLS:
        col_max = tl.where(col_mask, tl.max(x, axis=0), 0.0)
        col_sums = tl.where(col_mask, tl.sum(tl.exp(x - col_max[None, :]), axis=0), 1.0)
        col_lse = col_max + tl.log(col_sums)
        tl.store(col_part + tl.program_id(0).to(tl.int64) * m + cols, col_lse, mask=col_mask)


@triton.jit
def _backward_kernel(
    images, texts, row_shift, col_shift, grad_images, grad_texts, n, m, dim,
    stride_images, stride_texts, row_sign, col_sign,
    HAS_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    rows, cols, row_mask, col_mask, x = _program_tile(
        images, texts, n, m, dim, stride_images, stride_texts, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION
    )
    # Out-of-range rows/columns get an infinite shift, so their exponentials are exactly 0.
    shift_rows = tl.load(row_shift + rows, mask=row_mask, other=float("inf"))
    grad = row_sign * tl.exp(x - shift_rows[:, None])
    if HAS_COLS:
        shift_cols = tl.load(col_shift + cols, mask=col_mask, other=float("inf"))
        grad += col_sign * tl.exp(x - shift_cols[None, :])
    grad = tl.where(row_mask[:, None] & col_mask[None, :], grad, 0.0)
    row_offsets = rows.to(tl.int64)[:, None] * stride_images
    col_offsets = cols.to(tl.int64)[:, None] * stride_texts
    grad_row_offsets = rows.to(tl.int64)[:, None] * dim
    grad_col_offsets = cols.to(tl.int64)[:, None] * dim
    for start in range(0, dim, BLOCK_D):
        ks = start + tl.arange(0, BLOCK_D)
        k_mask = ks < dim
        row_k_mask = row_mask[:, None] & k_mask[None, :]
        col_k_mask = col_mask[:, None] & k_mask[None, :]
        t = tl.load(texts + col_offsets + ks[None, :], mask=col_k_mask, other=0.0)
        tl.atomic_add(
            grad_images + grad_row_offsets + ks[None, :],
            tl.dot(grad, t, input_precision=PRECISION),
            mask=row_k_mask,
        )
        a = tl.load(images + row_offsets + ks[None, :], mask=row_k_mask, other=0.0)
        tl.atomic_add(
            grad_texts + grad_col_offsets + ks[None, :],
            tl.dot(tl.trans(grad), a, input_precision=PRECISION),
            mask=col_k_mask,
        )


def _precision() -> str:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 and not interpreted else "ieee"


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"triton loss kernels take contiguous float32 tensors, got {t.dtype}")


def block_forward(
    scaled_images: torch.Tensor,
    texts: torch.Tensor,
    row_lse: torch.Tensor,
    col_lse: torch.Tensor | None,
    tile: int,
) -> None:
    """Merge the row (and column) log-sum-exps of ``scaled_images @ textsᵀ`` into the accumulators."""
    _check(scaled_images, texts)
    (n, dim), m = scaled_images.shape, texts.shape[0]
    row_tiles = triton.cdiv(n, BLOCK_M)
    # Partial LSEs per column of a chunk: one per row tile, plus n/BLOCK_N per row.
    floats_per_column = row_tiles + triton.cdiv(n, BLOCK_N)
    chunk = max(BLOCK_N, min(tile, PARTIAL_BUDGET // floats_per_column) // BLOCK_N * BLOCK_N)
    for start in range(0, m, chunk):
        part = texts[start : start + chunk]
        grid = (row_tiles, triton.cdiv(len(part), BLOCK_N))
        row_part = scaled_images.new_empty(grid[1], n)
        col_part = scaled_images.new_empty(grid[0], len(part)) if col_lse is not None else row_part
        _forward_kernel[grid](
            scaled_images, part, row_part, col_part, n, len(part), dim,
            scaled_images.stride(0), part.stride(0),
            HAS_COLS=col_lse is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            PRECISION=_precision(),
        )  # fmt: skip
        torch.logaddexp(row_lse, torch.logsumexp(row_part, dim=0), out=row_lse)
        if col_lse is not None:
            cols = col_lse[start : start + len(part)]
            torch.logaddexp(cols, torch.logsumexp(col_part, dim=0), out=cols)


def block_backward(
    scaled_images: torch.Tensor,
    texts: torch.Tensor,
    row_shift: torch.Tensor,
    row_sign: float,
    col_shift: torch.Tensor | None,
    col_sign: float,
    grad_images: torch.Tensor,
    grad_texts: torch.Tensor,
    tile: int,
    last_tile: None = None,
) -> None:
    """Add ``G @ texts`` to ``grad_images`` and ``Gᵀ @ scaled_images`` to ``grad_texts`` (see tiled.py).

    ``last_tile`` is always ``None``: the Triton forward keeps no logits to hand over.
    """
    del tile, last_tile  # each program owns one tile; nothing to chunk or reuse
    _check(scaled_images, texts, grad_images, grad_texts)
    (n, dim), m = scaled_images.shape, texts.shape[0]
    grid = (triton.cdiv(n, BLOCK_M), triton.cdiv(m, BLOCK_N))
    _backward_kernel[grid](
        scaled_images, texts, row_shift.contiguous(),
        col_shift.contiguous() if col_shift is not None else row_shift, grad_images, grad_texts,
        n, m, dim, scaled_images.stride(0), texts.stride(0), float(row_sign), float(col_sign),
        HAS_COLS=col_shift is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        PRECISION=_precision(),
    )  # fmt: skip
