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

from clip_train.loss import tiled

SHAPES = [(13, 11, 5), (1, 4, 3), (9, 9, 9), (6, 17, 4)]  # (n, m, tile)
STRIPS = [1, 7, 1 << 20]  # elements per strip: one row, ragged rows, the whole tile


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.mm:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _block(n: int, m: int, dim: int = 6, scale: float = 30.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n * 100 + m)
    images = F.normalize(torch.randn(n, dim, generator=gen, dtype=torch.float64), dim=1) * scale
    texts = F.normalize(torch.randn(m, dim, generator=gen, dtype=torch.float64), dim=1)
    return images, texts


@pytest.mark.parametrize("strip_elements", STRIPS)
@pytest.mark.parametrize(("n", "m", "tile"), SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_forward_merges_exact_log_sum_exps(n, m, tile, strip_elements, symmetric) -> None:
    images, texts = _block(n, m)
    logits = images @ texts.t()
    # Start from earlier partial sums, as the ring does for every block after the first.
    row_lse = torch.linspace(-3, 40, n, dtype=torch.float64)
    col_lse = torch.linspace(50, -2, m, dtype=torch.float64)
    expected_rows = torch.logaddexp(row_lse, logits.logsumexp(1))
    expected_cols = torch.logaddexp(col_lse, logits.logsumexp(0))
    last = tiled.block_forward(
        images, texts, row_lse, col_lse if symmetric else None, tile, strip_elements=strip_elements
    )
    torch.testing.assert_close(row_lse, expected_rows, rtol=1e-13, atol=0)
    if symmetric:
        torch.testing.assert_close(col_lse, expected_cols, rtol=1e-13, atol=0)
    assert (last.rows.stop, last.cols.stop) == (n, m)
    torch.testing.assert_close(last.logits, logits[last.rows, last.cols], rtol=1e-14, atol=1e-14)


def _expected_grads(images, texts, row_shift, col_shift, row_sign=-1.0, col_sign=1.0):
    logits = images @ texts.t()
    grads = row_sign * (logits - row_shift[:, None]).exp()
    if col_shift is not None:
        grads = grads + col_sign * (logits - col_shift[None, :]).exp()
    return grads @ texts, grads.t() @ images


@pytest.mark.parametrize("strip_elements", STRIPS)
@pytest.mark.parametrize(("n", "m", "tile"), SHAPES)
@pytest.mark.parametrize("path", ["rank_one", "wide_gap", "rows_only"])
@pytest.mark.parametrize("hand_over", [False, True])
def test_backward_matches_formula(n, m, tile, strip_elements, path, hand_over) -> None:
    images, texts = _block(n, m)
    logits = images @ texts.t()
    row_shift = logits.logsumexp(1) + 2.0
    # Beyond a gap of -log(tiny)/3 ≈ 236 between the shifts the kernel takes the two-exp path.
    col_shift = {"rank_one": logits.logsumexp(0) - 1.0, "wide_gap": logits.logsumexp(0) - 300.0}.get(path)
    last = tiled.block_forward(images, texts, torch.full((n,), -torch.inf, dtype=torch.float64), None, tile)
    grad_images, grad_texts = torch.zeros_like(images), torch.zeros_like(texts)
    with _CountMatmuls() as matmuls:
        tiled.block_backward(
            images, texts, row_shift, -1.0, col_shift, 1.0, grad_images, grad_texts, tile,
            last if hand_over else None, strip_elements=strip_elements,
        )  # fmt: skip
    expected_images, expected_texts = _expected_grads(images, texts, row_shift, col_shift)
    for actual, expected in [(grad_images, expected_images), (grad_texts, expected_texts)]:
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12 * expected.abs().max())
    tiles = -(-n // tile) * -(-m // tile)
    assert matmuls.count == tiles - hand_over  # the hand-over's tile is not recomputed
