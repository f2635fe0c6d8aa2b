"""PyTorch tiles: one text block against this rank's image rows, on any device.

Each function walks the (n × m) block ``X = s·I Tᵀ`` in t×t tiles, one tile buffer at a time:
one matmul fills it (the scale rides along as ``alpha``), then the elementwise work runs over
cache-sized strips of its rows, so a tile crosses main memory about twice. The softmax backward
recomputes every tile except the forward's last (:class:`LastTile`); the sigmoid loss needs no
normaliser, so one pass gives its loss and gradients.

On CUDA each tile's elementwise work is one ``torch.compile``d function (a tile crosses memory
3 times in the forward and 3 in each backward instead of 8 and 14; docs/loss.md counts
them), and bf16 features multiply in cuBLAS's bf16 GEMM with fp32 output: logits, LSEs and
gradient sums stay fp32. The CPU keeps its cache-sized strips, whose results these functions match.

Decisions that need values on the host are taken once per call, never per tile: on CUDA a host read
waits for every kernel queued before it, and a 65k batch on one GPU is 128 tiles a step. The fused
path takes the scale and the gradient coefficients as device tensors, which its kernels apply, so
none of them reaches the host; its one read left is the forward's underflowed columns, and a block
of one tile (a small batch) takes its columns' LSEs exactly instead, without it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from clip_train.logs import get_logger

# Elements per strip of a tile's rows: 4 MiB of fp32 stays in this CPU's L2/L3 across the
# several elementwise steps applied to it.
STRIP_ELEMENTS = 1 << 20

# The scale and the gradient coefficients: a number, or a 0-dim tensor that may live on the device.
Scalar = float | torch.Tensor


@dataclass(frozen=True)
class LastTile:
    """The forward's last tile, so the backward can start there without a matmul. ``buffer`` is
    the forward's whole tile buffer, which the backward goes on using: the hand-over is free."""

    rows: slice
    cols: slice
    buffer: torch.Tensor  # in the logits' dtype
    scale: torch.Tensor | None = None  # fused: the buffer holds I·Tᵀ, which the kernels scale

    @property
    def stored(self) -> torch.Tensor:
        """The tile as the buffer holds it: the logits, or ``I·Tᵀ`` on the fused path."""
        return _view(self.buffer, self.rows.stop - self.rows.start, self.cols.stop - self.cols.start)

    @property
    def logits(self) -> torch.Tensor:
        return self.stored if self.scale is None else self.stored * self.scale


def tile_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the tiles take features of ``dtype`` in: fp64 stays, and bf16 on CUDA, where it
    feeds cuBLAS's bf16 GEMM with fp32 output (half the bytes); everything else becomes fp32."""
    keeps = dtype == torch.float64 or (dtype == torch.bfloat16 and device.type == "cuda")
    return dtype if keeps else torch.float32


def tile_operands(
    image_features: torch.Tensor, text_features: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The features as the tiles take them: detached, in :func:`tile_dtype`, contiguous (copies, or
    the inputs themselves where they already are), as the tiles' matmuls and the ring's buffers need."""
    dtype = tile_dtype(image_features.dtype, image_features.device)

    def operand(features: torch.Tensor) -> torch.Tensor:
        return features.detach().to(dtype).contiguous()

    return operand(image_features), operand(text_features)


def default_tile(device: torch.device) -> int:
    """Tile edge. Large tiles keep the BLAS matmuls efficient (4096² fp32 is 64 MiB per buffer,
    still O(1) in the batch); on CUDA, 8192² keeps cuBLAS near its peak."""
    return 4096 if device.type == "cpu" else 8192


def _read(flags: torch.Tensor) -> list[Any]:
    """The tile functions' one host read per call (a device sync on CUDA)."""
    return flags.tolist()


def device_scalar(value: Scalar, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a 0-dim tensor of ``like``'s dtype and device, for the fused kernels. A number
    becomes a fill on the device: a copy from the host would wait for the stream on CUDA."""
    if isinstance(value, torch.Tensor):
        return value.to(like.device, like.dtype)
    return torch.full((), value, dtype=like.dtype, device=like.device)


def _tiles(size: int, tile: int) -> list[slice]:
    return [slice(start, min(start + tile, size)) for start in range(0, size, tile)]


def _tile_grid(images: torch.Tensor, texts: torch.Tensor, tile: int) -> list[tuple[slice, slice]]:
    return [(rows, cols) for rows in _tiles(len(images), tile) for cols in _tiles(len(texts), tile)]


def _view(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return buffer[: rows * cols].view(rows, cols)


def _logits_dtype(features: torch.Tensor) -> torch.dtype:
    """Logits and everything computed from them: fp32 for 16-bit features, else their own dtype."""
    return torch.promote_types(features.dtype, torch.float32)


def _tile_buffer(images: torch.Tensor, texts: torch.Tensor, tile: int) -> torch.Tensor:
    rows, cols = min(tile, len(images)), min(tile, len(texts))
    return images.new_empty(rows * cols, dtype=_logits_dtype(images))


def addmm_(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1.0, alpha: float = 1.0
) -> torch.Tensor:
    """``out = beta·out + alpha·a @ b`` in ``out``'s dtype. 16-bit operands go through cuBLAS's
    16-bit GEMM with an fp32 output on CUDA; elsewhere they are widened first, the same products."""
    if a.dtype == b.dtype == out.dtype:
        return out.addmm_(a, b, beta=beta, alpha=alpha)
    if out.is_cuda and a.dtype == b.dtype:
        return torch.addmm(out, a, b, out_dtype=out.dtype, beta=beta, alpha=alpha, out=out)
    return out.addmm_(a.to(out.dtype), b.to(out.dtype), beta=beta, alpha=alpha)


def _fused(device: torch.device) -> bool:
    """Whether tiles run their elementwise work as one compiled function (CUDA) or in strips."""
    return device.type == "cuda"


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled once for all tile shapes (the last row and column tiles are smaller). Where
    the compiler fails (a box without the C compiler Triton builds its launcher with, a broken
    Triton), ``fn`` itself runs, eager: the same arithmetic with more memory traffic, and one
    warning, rather than a loss that cannot run on that box."""
    compiled = torch.compile(fn, dynamic=True)

    def run(*args: Any) -> Any:
        nonlocal compiled
        try:
            return compiled(*args)
        except torch._dynamo.exc.BackendCompilerFailed as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            get_logger().warning(f"the loss runs {fn.__name__} eager: torch.compile failed on it ({reason})")
            compiled = fn
            return fn(*args)

    return run


def _softmax_tile_stats(
    products: torch.Tensor, scale: torch.Tensor, with_cols: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For ``X = scale · products`` (a tile's ``I·Tᵀ``): the row shifts (maxima), their top, row
    sums of ``exp(X - shift)`` and, ``with_cols``, the column sums of the same exponentials weighted
    by ``exp(shift - top)``: what :func:`_exp_sums` computes in strips, as two reductions that never
    store the exponentials."""
    logits = products * scale
    shift = logits.amax(dim=1)
    top = shift.max()
    exps = (logits - shift[:, None]).exp()
    col_sums = (exps * (shift - top).exp()[:, None]).sum(dim=0) if with_cols else None
    return shift, top, exps.sum(dim=1), col_sums


def _column_lse(products: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact column LSEs of ``X = scale · products``, each column shifted by its own maximum."""
    return (products * scale).logsumexp(dim=0)


def _positive_mask(positive_cols: torch.Tensor, width: int) -> torch.Tensor:
    """A tile's positive pairs as a (rows × ``width``) mask, from each row's positive column counted
    from the tile's first (outside ``[0, width)`` where it lies in another tile or block)."""
    return positive_cols[:, None] == torch.arange(width, device=positive_cols.device)[None, :]


def _softmax_tile_grads(
    products: torch.Tensor,
    scale: torch.Tensor,
    row_shift: torch.Tensor,
    col_shift: torch.Tensor,
    row_sign: torch.Tensor,
    col_sign: torch.Tensor,
    positive_cols: torch.Tensor,
    positive_coef: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``row_sign·exp(X - row_shift[:, None]) + col_sign·exp(X - col_shift[None, :])`` plus
    ``positive_coef`` on the positive pairs, for ``X = scale · products``, as ``dtype``, the GEMMs'
    operand. An absent term has infinite shifts, which make it exactly 0. The positives join before
    the narrowing: a well-matched pair's ``P + Q`` is ``2 - 2ε``, which bf16 rounds to 2 for ε < 1/256,
    so subtracting 2 after the GEMM would lose its whole pull. Two ``exp``s per element cost nothing in
    a kernel bound by memory, so no rank-one shortcut is needed here."""
    logits = products * scale
    rows, cols = (logits - row_shift[:, None]).exp(), (logits - col_shift[None, :]).exp()
    positives = _positive_mask(positive_cols, products.shape[1])
    return (row_sign * rows + col_sign * cols + positives * positive_coef).to(dtype)


def _sigmoid_tile(
    products: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    coef: torch.Tensor,
    positive_cols: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sigmoid tile's row sums of ``softplus(X)`` and ``sigmoid(X)`` and ``G = coef·(sigmoid(X) -
    positives)`` as ``dtype``, for ``X = scale · products + bias``, from one read of the tile (the
    strips' formula; row sums, as whole-tile sums would split it into kernels of other shapes). A
    positive's ``sigmoid(X) - 1`` is ``-sigmoid(-X)``, exact where bf16 would round ``sigmoid(X)``
    of a well-matched pair to 1 (as for the softmax's positives)."""
    x = products * scale + bias
    probabilities = x.sigmoid()
    softplus = x.clamp(min=0) - x.abs().sigmoid().log()
    positives = _positive_mask(positive_cols, products.shape[1])
    grads = coef * torch.where(positives, -(-x).sigmoid(), probabilities)
    return softplus.sum(dim=1), probabilities.sum(dim=1), grads.to(dtype)


def _strip_buffer(
    images: torch.Tensor, texts: torch.Tensor, tile: int, strip_elements: int | None
) -> torch.Tensor:
    """Room for as many whole rows of a tile as fit in ``strip_elements`` (by default cache-sized),
    at least one. Only the CPU's path has strips: the fused one allocates none."""
    rows, cols = min(tile, len(images)), min(tile, len(texts))
    elements = strip_elements or STRIP_ELEMENTS
    return images.new_empty(min(rows, max(1, elements // cols)) * cols, dtype=_logits_dtype(images))


def _strips(tile: torch.Tensor, strip: torch.Tensor) -> Iterator[slice]:
    yield from _tiles(tile.shape[0], strip.numel() // tile.shape[1])


def _exp_sums(
    logits: torch.Tensor, shift: torch.Tensor, col_weights: torch.Tensor | None, strip: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row sums of ``exp(X - shift[:, None])`` and, with ``col_weights``, its weighted column sums;
    the exponentials live in ``strip``, leaving ``logits`` intact for the backward."""
    rows, cols = logits.shape
    ones = logits.new_ones(cols)
    row_sums = logits.new_empty(rows)
    col_sums = logits.new_zeros(cols) if col_weights is not None else None
    for part in _strips(logits, strip):
        exps = torch.sub(logits[part], shift[part, None], out=_view(strip, part.stop - part.start, cols))
        exps.exp_()
        torch.mv(exps, ones, out=row_sums[part])
        if col_sums is not None:
            col_sums.addmv_(exps.t(), col_weights[part])
    return row_sums, col_sums


def softmax_forward(
    images: torch.Tensor,
    texts: torch.Tensor,
    scale: Scalar,
    row_lse: torch.Tensor,
    col_lse: torch.Tensor | None,
    tile: int,
    strip_elements: int | None = None,
) -> LastTile:
    """Merge the log-sum-exps of ``X = scale · images @ textsᵀ`` into ``row_lse`` and ``col_lse``.

    Rows are shifted by their maximum in the tile, so row sums lie in [1, t]. Columns reuse the
    same exponentials, weighted per row by ``exp(shift - max shift)`` ≤ 1; a rare column whose sum
    that underflows (large scales, fp32) is left out of the tile's merge and recomputed on its own
    after the last tile. A fused block of one tile takes its column LSEs exactly instead (one more
    reduction over a small tile, where the underflow's host read would cost the most). Returns the
    last tile for :func:`softmax_backward`.
    """
    finfo = torch.finfo(_logits_dtype(images))
    buffer = _tile_buffer(images, texts, tile)
    grid = _tile_grid(images, texts, tile)
    fused = _fused(images.device)
    strip = None if fused else _strip_buffer(images, texts, tile, strip_elements)
    # Fused: the buffer holds I·Tᵀ and the kernels apply the scale, which stays on the device.
    device_scale, alpha = (device_scalar(scale, buffer), 1.0) if fused else (None, float(scale))
    exact_cols = fused and col_lse is not None and len(grid) == 1
    # Columns merged from the rows' weighted sums, whose rare underflow is recovered after the grid.
    summed_cols = col_lse is not None and not exact_cols
    # Per row tile, the columns whose sum underflowed there.
    n_row_tiles = len(_tiles(len(images), tile))
    underflowed = images.new_zeros((n_row_tiles, len(texts)), dtype=torch.bool) if summed_cols else None
    for rows, cols in grid:
        logits = _logits(buffer, images[rows], texts[cols], alpha)
        if fused:
            shift, top, row_sums, col_sums = _compiled(_softmax_tile_stats)(logits, device_scale, summed_cols)
        else:
            shift = logits.amax(dim=1)
            top = shift.max()
            col_weights = (shift - top).exp_() if col_lse is not None else None
            row_sums, col_sums = _exp_sums(logits, shift, col_weights, strip)
        torch.logaddexp(row_lse[rows], row_sums.log_().add_(shift), out=row_lse[rows])
        if exact_cols:
            torch.logaddexp(col_lse[cols], _compiled(_column_lse)(logits, device_scale), out=col_lse[cols])
        if not summed_cols:
            continue
        # Below this bound a sum may have lost more than a rounding error to underflow.
        unsafe = col_sums < len(logits) * finfo.tiny / finfo.eps
        underflowed[rows.start // tile, cols] = unsafe
        col_tile_lse = col_sums.log_().add_(top).masked_fill_(unsafe, -math.inf)
        torch.logaddexp(col_lse[cols], col_tile_lse, out=col_lse[cols])
    if summed_cols:
        _merge_underflowed(images, texts, scale, col_lse, underflowed, tile)
    return LastTile(rows, cols, buffer, device_scale)


def _merge_underflowed(
    images: torch.Tensor,
    texts: torch.Tensor,
    scale: Scalar,
    col_lse: torch.Tensor,
    underflowed: torch.Tensor,
    tile: int,
) -> None:
    """Merge the exact LSE of each column that underflowed in a row tile into ``col_lse``, from
    that tile's logits recomputed for those columns alone (a tile's worth at a time)."""
    for index, flagged in enumerate(_read(underflowed.any(dim=1))):
        if not flagged:
            continue
        rows = images[index * tile : (index + 1) * tile]
        for idx in underflowed[index].nonzero().squeeze(1).split(tile):
            buffer = images.new_empty(len(rows) * len(idx), dtype=_logits_dtype(images))
            logits = _logits(buffer, rows, texts[idx], 1.0).mul_(scale)
            col_lse[idx] = torch.logaddexp(col_lse[idx], torch.logsumexp(logits, dim=0))


def _logits(buffer: torch.Tensor, images: torch.Tensor, texts: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · images @ textsᵀ`` into the front of ``buffer`` (beta=0: its old contents are ignored)."""
    return addmm_(_view(buffer, len(images), len(texts)), images, texts.t(), beta=0.0, alpha=scale)


def _fold(lse: torch.Tensor | None, coef: float) -> tuple[torch.Tensor | None, float]:
    """``lse - log|coef|`` and ``sign(coef)``: a softmax gradient's coefficient moved into its shift,
    so neither exponential can overflow. A term that is absent or has a zero coefficient is None."""
    if lse is None or coef == 0:
        return None, 1.0
    return lse - math.log(abs(coef)), -1.0 if coef < 0 else 1.0


def _rank_one_tiles(
    row_shift: torch.Tensor, col_shift: torch.Tensor, tile: int, dtype: torch.dtype
) -> list[list[bool]]:
    """Per (row tile, column tile), whether its shifts are close enough for the rank-one column
    term of :func:`_softmax_grads_`: past this gap a row term could underflow where the column
    term still matters."""
    max_gap = -math.log(torch.finfo(dtype).tiny) / 3
    row_top = torch.stack([row_shift[rows].max() for rows in _tiles(len(row_shift), tile)])
    col_bottom = torch.stack([col_shift[cols].min() for cols in _tiles(len(col_shift), tile)])
    return _read(row_top[:, None] - col_bottom[None, :] <= max_gap)


def _softmax_grads_(
    logits: torch.Tensor,
    row_shift: torch.Tensor | None,
    col_shift: torch.Tensor | None,
    col_coef: float,
    rank_one: bool,
    strip: torch.Tensor,
) -> torch.Tensor:
    """Overwrite ``logits`` with ``exp(X - row_shift[:, None]) + col_coef·exp(X - col_shift[None, :])``
    (either term may be absent). With ``rank_one`` (the shifts close enough), the column term is the
    row term times the rank-one factor ``exp(row_shift_i - col_shift_j)``: one ``exp`` per element."""
    cols = logits.shape[1]
    if rank_one:
        top = row_shift.max()
        row_factor = (row_shift - top).exp_().mul_(col_coef)
        col_factor = (top - col_shift).exp_()
    for part in _strips(logits, strip):
        grads = logits[part]
        other = _view(strip, part.stop - part.start, cols)
        if row_shift is None:
            grads.sub_(col_shift).exp_()
        elif col_shift is None:
            grads.sub_(row_shift[part, None]).exp_()
        elif rank_one:
            grads.sub_(row_shift[part, None]).exp_()
            grads.addcmul_(torch.mul(grads, col_factor, out=other), row_factor[part, None])
        else:
            torch.sub(grads, col_shift, out=other).exp_()
            grads.sub_(row_shift[part, None]).exp_().add_(other, alpha=col_coef)
    return logits


def softmax_backward(
    images: torch.Tensor,
    texts: torch.Tensor,
    scale: Scalar,
    row_lse: torch.Tensor,
    row_coef: Scalar,
    col_lse: torch.Tensor | None,
    col_coef: Scalar,
    grad_images: torch.Tensor,
    grad_texts: torch.Tensor,
    tile: int,
    last_tile: LastTile | None = None,
    strip_elements: int | None = None,
    positives: torch.Tensor | None = None,
    positive_coef: Scalar = 0.0,
) -> None:
    """Accumulate ``G @ texts`` into ``grad_images`` and ``Gᵀ @ images`` into ``grad_texts`` for
    ``G = row_coef·exp(X - row_lse[:, None]) + col_coef·exp(X - col_lse[None, :])``, both directions'
    softmax gradients, plus ``positive_coef`` at each row's positive column (``positives``: per row,
    its column in this block or -1). ``last_tile``, the forward's hand-over for this block, is not
    recomputed.
    """
    if _fused(images.device):
        positives = _no_positives(images) if positives is None else positives
        grads_of = _fused_softmax_grads(
            row_lse, row_coef, col_lse, col_coef, scale, positives, positive_coef, images.dtype
        )
        sign, alpha = 1.0, 1.0  # G carries its signs and its positives; the kernels apply the scale
    else:
        if positives is not None:
            _add_positives(images, texts, positives, float(positive_coef), grad_images, grad_texts)
        row_shift, row_sign = _fold(row_lse, float(row_coef))
        col_shift, col_sign = _fold(col_lse, float(col_coef))
        if row_shift is None and col_shift is None:
            return  # both coefficients are zero: G is zero
        sign = row_sign if row_shift is not None else col_sign  # G's overall sign; the other is relative
        grads_of = _strip_softmax_grads(
            images, texts, tile, row_shift, col_shift, row_sign * col_sign, strip_elements
        )
        alpha = float(scale)
    for rows, cols, logits in _backward_tiles(images, texts, alpha, tile, last_tile):
        grads = grads_of(rows, cols, logits)
        addmm_(grad_images[rows], grads, texts[cols], alpha=sign)
        addmm_(grad_texts[cols], grads.t(), images[rows], alpha=sign)


def _no_positives(images: torch.Tensor) -> torch.Tensor:
    """The fused functions' ``positives`` for a block that holds none of these rows' positives."""
    return torch.full((len(images),), -1, dtype=torch.long, device=images.device)


def _add_positives(
    images: torch.Tensor,
    texts: torch.Tensor,
    positives: torch.Tensor,
    coef: float,
    grad_images: torch.Tensor,
    grad_texts: torch.Tensor,
) -> None:
    """The strips' positives, ``coef`` at each row's positive column of G, added to both gradients
    in their own dtype (the strips' G is never narrower); -1 marks a row without one here."""
    found = (positives >= 0)[:, None]
    cols = positives.clamp(min=0)
    grad_images.add_(torch.where(found, texts[cols], 0).to(grad_images.dtype), alpha=coef)
    grad_texts.index_add_(0, cols, torch.where(found, images, 0).to(grad_texts.dtype), alpha=coef)


TileGrads = Callable[[slice, slice, torch.Tensor], torch.Tensor]


def _fused_softmax_grads(
    row_lse: torch.Tensor,
    row_coef: Scalar,
    col_lse: torch.Tensor | None,
    col_coef: Scalar,
    scale: Scalar,
    positives: torch.Tensor,
    positive_coef: Scalar,
    dtype: torch.dtype,
) -> TileGrads:
    """G of a tile from one compiled pass over its ``I·Tᵀ``, in the features' dtype. Each
    coefficient stays on the device: ``log|coef|`` moves into its term's shift, so no exponential
    can overflow, and its sign multiplies the term; a zero coefficient (or an absent term) shifts
    by infinity, which makes its term exactly 0."""
    scale = device_scalar(scale, row_lse)
    positive_coef = device_scalar(positive_coef, row_lse)

    def shift_and_sign(lse: torch.Tensor | None, coef: Scalar) -> tuple[torch.Tensor, torch.Tensor]:
        if lse is None:
            return device_scalar(math.inf, row_lse), device_scalar(0.0, row_lse)
        coef = device_scalar(coef, lse)
        return lse - coef.abs().log(), coef.sign()

    row_shift, row_sign = shift_and_sign(row_lse, row_coef)
    col_shift, col_sign = shift_and_sign(col_lse, col_coef)

    def grads(rows: slice, cols: slice, products: torch.Tensor) -> torch.Tensor:
        r = row_shift[rows] if row_shift.dim() else row_shift.expand(len(products))
        c = col_shift[cols] if col_shift.dim() else col_shift.expand(products.shape[1])
        in_tile = positives[rows] - cols.start
        return _compiled(_softmax_tile_grads)(
            products, scale, r, c, row_sign, col_sign, in_tile, positive_coef, dtype
        )

    return grads


def _strip_softmax_grads(
    images: torch.Tensor,
    texts: torch.Tensor,
    tile: int,
    row_shift: torch.Tensor | None,
    col_shift: torch.Tensor | None,
    col_coef: float,
    strip_elements: int | None,
) -> TileGrads:
    """G of a tile in place of its logits, strip by strip (one ``exp`` per element where the
    rank-one shortcut holds)."""
    strip = _strip_buffer(images, texts, tile, strip_elements)
    both = row_shift is not None and col_shift is not None
    rank_one_tiles = _rank_one_tiles(row_shift, col_shift, tile, _logits_dtype(images)) if both else None

    def grads(rows: slice, cols: slice, logits: torch.Tensor) -> torch.Tensor:
        row_shift_tile = row_shift[rows] if row_shift is not None else None
        col_shift_tile = col_shift[cols] if col_shift is not None else None
        rank_one = rank_one_tiles is not None and rank_one_tiles[rows.start // tile][cols.start // tile]
        return _softmax_grads_(logits, row_shift_tile, col_shift_tile, col_coef, rank_one, strip)

    return grads


def _backward_tiles(
    images: torch.Tensor, texts: torch.Tensor, alpha: float, tile: int, last_tile: LastTile | None
) -> Iterator[tuple[slice, slice, torch.Tensor]]:
    """Every tile's (rows, cols, ``alpha · I·Tᵀ``) as the forward stored it, the forward's
    hand-over first (not recomputed); the caller may overwrite each tile before asking for the next."""
    order = _tile_grid(images, texts, tile)
    if last_tile is None:
        buffer = _tile_buffer(images, texts, tile)
    else:
        buffer = last_tile.buffer
        order.remove((last_tile.rows, last_tile.cols))
        yield last_tile.rows, last_tile.cols, last_tile.stored
    for rows, cols in order:
        yield rows, cols, _logits(buffer, images[rows], texts[cols], alpha)


def sigmoid_forward_backward(
    images: torch.Tensor,
    texts: torch.Tensor,
    scale: Scalar,
    bias: Scalar,
    coef: Scalar,
    grad_images: torch.Tensor,
    grad_texts: torch.Tensor,
    tile: int,
    strip_elements: int | None = None,
    positives: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sigmoid loss's block in one pass, ``X = scale · images @ textsᵀ + bias`` (3 matmuls a tile).

    Returns ``Σ softplus(X)`` and ``coef · Σ sigmoid(X)``, every pair taken as a negative (the
    positives' terms in the loss and its sums are the caller's), and accumulates ``G @ texts`` into
    ``grad_images`` and ``Gᵀ @ images`` into ``grad_texts`` for ``G = coef · (sigmoid(X) - δ)``: it
    depends on each element alone. ``positives``: per row, its column in this block or -1.
    """
    buffer = _tile_buffer(images, texts, tile)
    softplus_total, sigmoid_total = (images.new_zeros((), dtype=buffer.dtype) for _ in range(2))
    if _fused(images.device):  # the buffer holds I·Tᵀ; the constants stay on the device
        constants = [device_scalar(value, buffer) for value in (scale, bias, coef)]
        positives = _no_positives(images) if positives is None else positives
        for rows, cols in _tile_grid(images, texts, tile):
            products = _logits(buffer, images[rows], texts[cols], 1.0)
            in_tile = positives[rows] - cols.start
            softplus, probabilities, grads = _compiled(_sigmoid_tile)(
                products, *constants, in_tile, images.dtype
            )
            softplus_total += softplus.sum()
            sigmoid_total += probabilities.sum()
            addmm_(grad_images[rows], grads, texts[cols])
            addmm_(grad_texts[cols], grads.t(), images[rows])
        return softplus_total, sigmoid_total * constants[2]
    scale, bias, coef = float(scale), float(bias), float(coef)
    if positives is not None:
        _add_positives(images, texts, positives, -coef, grad_images, grad_texts)
    strip = _strip_buffer(images, texts, tile, strip_elements)
    for rows, cols in _tile_grid(images, texts, tile):
        logits = _logits(buffer, images[rows], texts[cols], scale)
        for part in _strips(logits, strip):
            x = logits[part].add_(bias)
            other = _view(strip, part.stop - part.start, logits.shape[1])
            # softplus(x) = relu(x) - log sigmoid(|x|): vectorised ops only (logaddexp and
            # logsigmoid run 4-25x slower on CPU), and sigmoid(|x|) ∈ [0.5, 1] keeps the log exact.
            softplus_total += torch.clamp(x, min=0, out=other).sum()
            softplus_total -= torch.abs(x, out=other).sigmoid_().log_().sum()
            sigmoid_total += x.sigmoid_().sum()
        addmm_(grad_images[rows], logits, texts[cols], alpha=coef)
        addmm_(grad_texts[cols], logits.t(), images[rows], alpha=coef)
    return softplus_total, sigmoid_total * coef
