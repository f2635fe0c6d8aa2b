"""The CPU tile kernels on their own, in fp64 against the formula on the whole block.

The loss-level tests run with one strip per tile (their tiles are tiny); here strips of a
single row, ragged strips, ragged tiles, all three gradient paths and the forward's hand-over of
its last tile are checked directly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from clip_train.loss import tiles_torch

SHAPES = [(13, 11, 5), (1, 4, 3), (9, 9, 9), (6, 17, 4)]  # (n, m, tile)
STRIPS = [1, 7, 1 << 20]  # elements per strip: one row, ragged rows, the whole tile


SCALE = 30.0


class _CountLogitMatmuls(TorchDispatchMode):
    """Counts the matmuls that compute a tile's logits (``addmm`` with ``beta=0``), not the
    gradient accumulations (``addmm`` into the gradients, ``beta=1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        logit_addmm = (
            func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.addmm_) and kwargs.get("beta") == 0
        )
        if func.overloadpacket is torch.ops.aten.mm or logit_addmm:
            self.count += 1
        return func(*args, **kwargs)


def _block(n: int, m: int, dim: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n * 100 + m)
    images = F.normalize(torch.randn(n, dim, generator=gen, dtype=torch.float64), dim=1)
    texts = F.normalize(torch.randn(m, dim, generator=gen, dtype=torch.float64), dim=1)
    return images, texts


@pytest.mark.parametrize("strip_elements", STRIPS)
@pytest.mark.parametrize(("n", "m", "tile"), SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_forward_merges_exact_log_sum_exps(n, m, tile, strip_elements, symmetric) -> None:
    images, texts = _block(n, m)
    logits = SCALE * images @ texts.t()
    # Start from earlier partial sums, as the ring does for every block after the first.
    row_lse = torch.linspace(-3, 40, n, dtype=torch.float64)
    col_lse = torch.linspace(50, -2, m, dtype=torch.float64)
    expected_rows = torch.logaddexp(row_lse, logits.logsumexp(1))
    expected_cols = torch.logaddexp(col_lse, logits.logsumexp(0))
    last = tiles_torch.softmax_forward(
        images, texts, SCALE, row_lse, col_lse if symmetric else None, tile, strip_elements=strip_elements
    )
    torch.testing.assert_close(row_lse, expected_rows, rtol=1e-13, atol=0)
    if symmetric:
        torch.testing.assert_close(col_lse, expected_cols, rtol=1e-13, atol=0)
    assert (last.rows.stop, last.cols.stop) == (n, m)
    torch.testing.assert_close(last.logits, logits[last.rows, last.cols], rtol=1e-14, atol=1e-14)


def _expected_grads(images, texts, row_lse, row_coef, col_lse, col_coef):
    logits = SCALE * images @ texts.t()
    grads = row_coef * (logits - row_lse[:, None]).exp()
    if col_lse is not None:
        grads = grads + col_coef * (logits - col_lse[None, :]).exp()
    return grads @ texts, grads.t() @ images


# (row coefficient, column coefficient, column LSE offset): the column LSE sits near the row LSEs
# (one exp per element, rank-one column factor), 300 below them (beyond a gap of -log(tiny)/3 ≈
# 236 the kernel takes the two-exp path), or is absent (hard negatives), or a coefficient is 0.
PATHS = {
    "rank_one": (-0.3, 0.7, -1.0),
    "wide_gap": (-0.3, 0.7, -300.0),
    "rows_only": (-0.3, 0.0, None),
    "columns_only": (0.0, 0.7, -1.0),
    "no_terms": (0.0, 0.0, -1.0),
}


@pytest.mark.parametrize("strip_elements", STRIPS)
@pytest.mark.parametrize(("n", "m", "tile"), SHAPES)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("hand_over", [False, True])
def test_backward_matches_formula(n, m, tile, strip_elements, path, hand_over) -> None:
    images, texts = _block(n, m)
    logits = SCALE * images @ texts.t()
    row_coef, col_coef, col_offset = PATHS[path]
    row_lse = logits.logsumexp(1) + 2.0
    col_lse = logits.logsumexp(0) + col_offset if col_offset is not None else None
    no_lse = torch.full((n,), -torch.inf, dtype=torch.float64)
    last = tiles_torch.softmax_forward(images, texts, SCALE, no_lse, None, tile)
    grad_images, grad_texts = torch.zeros_like(images), torch.zeros_like(texts)
    with _CountLogitMatmuls() as matmuls:
        tiles_torch.softmax_backward(
            images, texts, SCALE, row_lse, row_coef, col_lse, col_coef, grad_images, grad_texts, tile,
            last if hand_over else None, strip_elements=strip_elements,
        )  # fmt: skip
    expected_images, expected_texts = _expected_grads(images, texts, row_lse, row_coef, col_lse, col_coef)
    for actual, expected in [(grad_images, expected_images), (grad_texts, expected_texts)]:
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12 * expected.abs().max())
    tiles = -(-n // tile) * -(-m // tile)
    if path == "no_terms":
        assert matmuls.count == 0 and not grad_images.any() and not grad_texts.any()
    else:
        assert matmuls.count == tiles - hand_over  # the hand-over's tile is not recomputed
