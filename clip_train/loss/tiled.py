"""Tiled PyTorch kernels for one text block against this rank's image rows (the CPU path).

Each function walks the (n × m) similarity block ``X = (s·I) Tᵀ`` in t×t tiles and never holds
more than two tiles. The forward costs one matmul and one ``exp`` per tile and feeds both
directions from it; the backward recomputes the tile and spends two more matmuls on the
gradients of both feature sets. Shifts are folded into the matmul (``addmm``) wherever they
are known in advance. The ring in ``ring.py`` calls these once per text block in hand;
``triton_kernels.py`` provides the same two functions on CUDA.
"""

from __future__ import annotations

import math

import torch


def default_tile(device: torch.device) -> int:
    """Tile edge. On CPU large tiles keep the BLAS matmuls efficient (4096² fp32 is 64 MiB per
    buffer, still O(1) in the batch); on CUDA it is the Triton forward's column chunk."""
    return 4096 if device.type == "cpu" else 8192


def _tiles(size: int, tile: int) -> list[slice]:
    return [slice(start, min(start + tile, size)) for start in range(0, size, tile)]


def _view(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return buffer[: rows * cols].view(rows, cols)


def _exp_shifted_by_row_max(images: torch.Tensor, texts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``exp(X - rowmax)`` in ``out``; returns the row maxima."""
    torch.mm(images, texts.t(), out=out)
    row_max = out.amax(dim=1)
    out.sub_(row_max[:, None]).exp_()
    return row_max


def block_forward(
    scaled_images: torch.Tensor,
    texts: torch.Tensor,
    row_lse: torch.Tensor,
    col_lse: torch.Tensor | None,
    tile: int,
) -> None:
    """Merge the log-sum-exps of ``X = scaled_images @ textsᵀ`` into ``row_lse`` and ``col_lse``.

    Rows are shifted by their running LSE (folded into the matmul), or by the tile maximum on
    their first tile or when a row would overflow. Columns reuse the same exponentials, rescaled
    per row by ``exp(shift - max shift)`` in one matrix-vector product; this is exact unless a
    column lies so far below the others that its terms underflow, or so far above that they
    overflow. Such columns (rare, only at large scales in fp32) are recomputed on their own.
    """
    finfo = torch.finfo(scaled_images.dtype)
    buffer = scaled_images.new_empty(min(tile, scaled_images.shape[0]) * min(tile, texts.shape[0]))
    ones = scaled_images.new_ones(min(tile, texts.shape[0]))
    for rows in _tiles(scaled_images.shape[0], tile):
        for cols in _tiles(texts.shape[0], tile):
            images_tile, texts_tile = scaled_images[rows], texts[cols]
            exps = _view(buffer, len(images_tile), len(texts_tile))
            shift = row_lse[rows].clone()
            if torch.isinf(shift).any():  # first tile of these rows: no running LSE yet
                shift = _exp_shifted_by_row_max(images_tile, texts_tile, exps)
                row_sums = torch.mv(exps, ones[: len(texts_tile)])
            else:
                torch.addmm(shift[:, None], images_tile, texts_tile.t(), beta=-1, out=exps).exp_()
                row_sums = torch.mv(exps, ones[: len(texts_tile)])
                if not torch.isfinite(row_sums).all():  # a row jumped far above its running LSE
                    shift = _exp_shifted_by_row_max(images_tile, texts_tile, exps)
                    row_sums = torch.mv(exps, ones[: len(texts_tile)])
            torch.logaddexp(row_lse[rows], row_sums.log_().add_(shift), out=row_lse[rows])
            if col_lse is None:
                continue
            top = shift.max()
            col_sums = torch.mv(exps.t(), (shift - top).exp_())
            # Below this bound a sum may have lost more than a rounding error to underflow.
            unsafe = ~((col_sums >= len(images_tile) * finfo.tiny / finfo.eps) & (col_sums <= finfo.max))
            col_tile_lse = col_sums.log_().add_(top)
            if unsafe.any():
                idx = unsafe.nonzero().squeeze(1)
                col_tile_lse[idx] = torch.logsumexp(images_tile @ texts_tile[idx].t(), dim=0)
            torch.logaddexp(col_lse[cols], col_tile_lse, out=col_lse[cols])


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
) -> None:
    """Accumulate ``G @ texts`` into ``grad_images`` and ``Gᵀ @ scaled_images`` into ``grad_texts``.

    ``G = row_sign·exp(X - row_shift[:, None]) + col_sign·exp(X - col_shift[None, :])``: the
    softmax gradients of both directions, with each direction's upstream coefficient α folded
    into its shift as ``lse - log|α|`` (so neither exponential can overflow). When the shifts
    of a tile are within a safe range of each other, the column term is the row term times the
    rank-one factor ``exp(row_shift_i - col_shift_j)`` and costs no second ``exp``.
    """
    n, m = scaled_images.shape[0], texts.shape[0]
    size = min(tile, n) * min(tile, m)
    logits_buffer = scaled_images.new_empty(size)
    other_buffer = scaled_images.new_empty(size) if col_shift is not None else None
    one = scaled_images.new_ones(())
    # Past this gap a row term could underflow where the column term still matters.
    max_gap = -math.log(torch.finfo(scaled_images.dtype).tiny) / 3
    for rows in _tiles(n, tile):
        for cols in _tiles(m, tile):
            images_tile, texts_tile = scaled_images[rows], texts[cols]
            logits = _view(logits_buffer, len(images_tile), len(texts_tile))
            row_shift_tile = row_shift[rows]
            top = row_shift_tile.max()
            if col_shift is None or (top - col_shift[cols].min()).item() <= max_gap:
                grad = torch.addmm(
                    row_shift_tile[:, None], images_tile, texts_tile.t(), beta=-1, out=logits
                ).exp_()
                if col_shift is not None:
                    factor = _view(other_buffer, len(images_tile), len(texts_tile))
                    u, v = (row_shift_tile - top).exp_(), (top - col_shift[cols]).exp_()
                    grad.mul_(torch.addr(one, u, v, alpha=row_sign * col_sign, out=factor))
            else:
                torch.mm(images_tile, texts_tile.t(), out=logits)
                grad = torch.sub(
                    logits, row_shift_tile[:, None], out=_view(other_buffer, *logits.shape)
                ).exp_()
                grad.add_(logits.sub_(col_shift[None, cols]).exp_(), alpha=row_sign * col_sign)
            grad_images[rows].addmm_(grad, texts_tile, alpha=row_sign)
            grad_texts[cols].addmm_(grad.t(), images_tile, alpha=row_sign)
