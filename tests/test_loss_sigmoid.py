"""The sigmoid (SigLIP) loss in one process: every implementation against the formula, in fp64.

The reference is SigLIP's definition written here with ``softplus`` on the full matrix and
autograd for the gradients (scale and bias included); it shares no code with ``clip_train.loss``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_loss import clip_loss_formula
from test_loss_tiles import SHAPES, STRIPS, _CountOps, _logit_matmul

from clip_train.loss import contrastive_loss, tiles_torch


def _features(rows: int, dim: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=gen, dtype=torch.float64), dim=1).to(dtype)


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), exact everywhere (F.softplus returns x itself above x = 20)."""
    return x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))


def _reference(images, texts, scale, bias) -> torch.Tensor:
    logits = scale * images @ texts.t() + bias
    # +1 on the diagonal, -1 elsewhere
    signs = 2 * torch.eye(len(images), dtype=logits.dtype, device=logits.device) - 1
    return _softplus(-signs * logits).sum() / len(images)


def _run(fn, images, texts, scale, bias, dtype=torch.float64, upstream=1.0) -> list[torch.Tensor]:
    images = images.detach().to(dtype).requires_grad_()
    texts = texts.detach().to(dtype).requires_grad_()
    scalar = torch.float64 if dtype == torch.float64 else torch.float32
    scale = torch.tensor(float(scale), dtype=scalar, requires_grad=True)
    bias = torch.tensor(float(bias), dtype=scalar, requires_grad=True)
    loss = fn(images, texts, scale, bias)
    (upstream * loss).backward()
    return [loss.detach(), images.grad, texts.grad, scale.grad, bias.grad]


def _sigmoid(impl, tile=None):
    def loss(images, texts, scale, bias):
        return contrastive_loss(
            images, texts, scale, logit_bias=bias, kind="sigmoid", impl=impl, tile_size=tile
        )

    return loss


def _assert_close(actual, expected, rtol, atol) -> None:
    for name, a, e in zip(
        ("loss", "d_images", "d_texts", "d_scale", "d_bias"), actual, expected, strict=True
    ):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.to(e.dtype), e, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("impl", "tile"), [("vanilla", None), ("inf", None), ("inf", 4), ("inf", 9)])
@pytest.mark.parametrize(
    ("n", "dim", "scale", "bias"),
    [(1, 3, 10.0, -10.0), (7, 5, 10.0, -10.0), (33, 17, 30.0, -3.0), (20, 64, 1.0, 2.0)],
)
def test_matches_formula_fp64(impl, tile, n, dim, scale, bias) -> None:
    images, texts = _features(n, dim, 0), _features(n, dim, 1)
    expected = _run(_reference, images, texts, scale, bias)
    _assert_close(_run(_sigmoid(impl, tile), images, texts, scale, bias), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("upstream", [0.0, -2.5])
def test_upstream_gradient_scales_every_gradient(upstream) -> None:
    images, texts = _features(12, 6, 2), _features(12, 6, 3)
    expected = _run(_reference, images, texts, 10.0, -10.0, upstream=upstream)
    actual = _run(_sigmoid("inf", 5), images, texts, 10.0, -10.0, upstream=upstream)
    _assert_close(actual, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("scale", "bias"), [(100.0, -10.0), (100.0, 50.0), (1.0, -40.0)])
def test_extreme_logits_fp32_finite_and_correct(scale, bias) -> None:
    """Logits of ±150: softplus and sigmoid saturate without overflow."""
    images = _features(24, 8, 4)
    texts = torch.cat([images[:12], -images[12:]])  # half +1, half -1 similarities on the diagonal
    expected = _run(_reference, images, texts, scale, bias)
    actual = _run(_sigmoid("inf", 8), images, texts, scale, bias, torch.float32)
    _assert_close(actual, expected, rtol=1e-4, atol=1e-4 * expected[0].abs().item() + 1e-5)


def test_second_backward_with_retained_graph_is_exact() -> None:
    images = _features(10, 6, 5).requires_grad_()
    texts = _features(10, 6, 6).requires_grad_()
    scale, bias = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-5.0, dtype=torch.float64)
    loss = contrastive_loss(images, texts, scale, logit_bias=bias, kind="sigmoid", tile_size=3)
    first = torch.autograd.grad(loss, (images, texts), retain_graph=True)
    second = torch.autograd.grad(loss, (images, texts))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"labels": torch.zeros(4, dtype=torch.long)}, "takes no labels"),
        ({"impl": "local"}, "impl vanilla or inf"),
        ({"logit_bias": None}, "needs logit_bias"),
    ],
)
def test_bad_sigmoid_arguments_fail_clearly(kwargs, message) -> None:
    images, texts = _features(4, 3, 7), _features(4, 3, 8)
    with pytest.raises(ValueError, match=message):
        contrastive_loss(images, texts, 10.0, **{"logit_bias": -10.0, "kind": "sigmoid", **kwargs})


# -- the PyTorch tiles on their own ----------------------------------------------------------------


@pytest.mark.parametrize("strip_elements", STRIPS)
@pytest.mark.parametrize(("n", "m", "tile"), SHAPES)
def test_tiles_match_formula(n, m, tile, strip_elements) -> None:
    """One pass gives the loss's sum, the gradient's sum and both gradients, 3 matmuls a tile."""
    images, texts = _features(n, 6, n), _features(m, 6, m + 1)
    scale, bias, coef = 30.0, -4.0, -0.7
    logits = scale * images @ texts.t() + bias
    grad_images, grad_texts = torch.ones_like(images), torch.ones_like(texts)  # it accumulates
    with _CountOps(_logit_matmul) as matmuls:
        softplus, grad_sum = tiles_torch.sigmoid_forward_backward(
            images, texts, scale, bias, coef, grad_images, grad_texts, tile, strip_elements=strip_elements
        )
    grads = coef * torch.sigmoid(logits)
    torch.testing.assert_close(softplus, _softplus(logits).sum(), rtol=1e-13, atol=0)
    torch.testing.assert_close(grad_sum, grads.sum(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_images, 1 + grads @ texts, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_texts, 1 + grads.t() @ images, rtol=1e-12, atol=1e-12)
    assert matmuls.count == -(-n // tile) * -(-m // tile)  # one logits matmul a tile, nothing recomputed


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_a_float_scale_and_bias_keep_fp32_precision_beside_bf16_features(kind) -> None:
    """A Python number is not rounded to the features' dtype: 1/0.07 in bf16 would move the loss
    by 1e-3 relative. It gives what the same number as an fp32 tensor gives."""
    images, texts = (_features(32, 16, seed).bfloat16() for seed in (15, 16))
    scale, bias = 1 / 0.07, (-10.3 if kind == "sigmoid" else None)
    as_tensors = [None if v is None else torch.tensor(v, dtype=torch.float32) for v in (scale, bias)]
    expected = contrastive_loss(images, texts, as_tensors[0], logit_bias=as_tensors[1], kind=kind)
    actual = contrastive_loss(images, texts, scale, logit_bias=bias, kind=kind)
    assert torch.equal(actual, expected)
    images, texts = images.double(), texts.double()
    exact = (
        clip_loss_formula(images, texts, scale) if bias is None else _reference(images, texts, scale, bias)
    )
    torch.testing.assert_close(actual.double(), exact, rtol=1e-6, atol=0)
