"""Single-process contrastive loss: every implementation against the formula, in fp64 and beyond.

The reference below is the CLIP loss's definition written with ``torch.logsumexp`` on the full
matrix and autograd for the gradients; it shares no code with ``clip_train.loss``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clip_train.loss import contrastive_loss

IMPLS = ["inf", "local", "vanilla"]


def _features(rows: int, dim: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=gen, dtype=torch.float64), dim=1).to(dtype)


def clip_loss_formula(images, texts, scale, labels=None) -> torch.Tensor:
    """The CLIP loss on the full matrix (hard negatives with ``labels``): the tests' reference."""
    logits = scale * images @ texts.t()
    if labels is None:
        diagonal = logits.diagonal()
        return ((logits.logsumexp(1) - diagonal).mean() + (logits.logsumexp(0) - diagonal).mean()) / 2
    return (logits.logsumexp(1) - logits.gather(1, labels[:, None]).squeeze(1)).mean()


def _run(fn, images, texts, scale, dtype=None) -> tuple[torch.Tensor, ...]:
    """Loss and gradients w.r.t. both feature sets and the scale (inputs cast to ``dtype``)."""
    dtype = dtype or images.dtype
    images = images.detach().to(dtype).requires_grad_()
    texts = texts.detach().to(dtype).requires_grad_()
    scale = torch.tensor(
        float(scale), dtype=dtype if dtype == torch.float64 else torch.float32, requires_grad=True
    )
    loss = fn(images, texts, scale)
    loss.backward()
    return loss.detach(), images.grad, texts.grad, scale.grad


def _assert_all_close(actual, expected, rtol, atol) -> None:
    for name, a, e in zip(("loss", "d_images", "d_texts", "d_scale"), actual, expected, strict=True):
        assert torch.isfinite(a).all(), f"{name} is not finite"
        torch.testing.assert_close(a.to(e.dtype), e, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("n", "dim", "tile", "scale"),
    [(1, 3, None, 10.0), (7, 5, 3, 10.0), (33, 17, 8, 30.0), (64, 19, 16, 100.0), (40, 64, 40, 1.0)],
)
def test_symmetric_matches_formula_fp64(impl, n, dim, tile, scale) -> None:
    images, texts = _features(n, dim, 0), _features(n, dim, 1)
    expected = _run(clip_loss_formula, images, texts, scale)
    actual = _run(lambda i, t, s: contrastive_loss(i, t, s, impl=impl, tile_size=tile), images, texts, scale)
    _assert_all_close(actual, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("n", "m", "tile"), [(1, 4, None), (6, 11, 4), (13, 40, 5)])
def test_hard_negatives_match_formula_fp64(impl, n, m, tile) -> None:
    images, texts = _features(n, 9, 2), _features(m, 9, 3)
    labels = torch.randint(0, m, (n,), generator=torch.Generator().manual_seed(4))
    labels[0] = labels[-1]  # two rows sharing a positive
    expected = _run(lambda i, t, s: clip_loss_formula(i, t, s, labels), images, texts, 20.0)
    actual = _run(
        lambda i, t, s: contrastive_loss(i, t, s, labels=labels, impl=impl, tile_size=tile),
        images,
        texts,
        20.0,
    )
    _assert_all_close(actual, expected, rtol=1e-10, atol=1e-12)


def _adversarial(name: str, n: int = 24, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature sets that break naive shifts: extreme, tied or one-sided similarities."""
    images, texts = _features(n, dim, 5), _features(n, dim, 6)
    if name == "all_minus_one":  # every similarity is -1
        texts = -images[:1].expand(n, dim).clone()
        images = images[:1].expand(n, dim).clone()
    elif name == "row_equals_all_columns":  # image 0 is identical to every text
        texts = images[:1].expand(n, dim).clone()
    elif name == "duplicated_rows":
        images[n // 2 :] = images[: n - n // 2]
        texts[1::2] = texts[::2][: n // 2]
    elif name == "split_columns":  # identical images; half the texts at +1, half at -1
        images = images[:1].expand(n, dim).clone()
        texts = torch.cat([images[: n // 2], -images[: n - n // 2]])
    elif name == "one_sided_rows":  # rows at +1 against some column tiles and -1 against others
        images = torch.cat([images[:1].expand(n // 2, dim), -images[:1].expand(n - n // 2, dim)])
        texts = torch.cat([-images[:1].expand(n // 2, dim), images[:1].expand(n - n // 2, dim)])
    return images, texts


CASES = [
    "all_minus_one",
    "row_equals_all_columns",
    "duplicated_rows",
    "split_columns",
    "one_sided_rows",
    "random",
]


@pytest.mark.parametrize("case", CASES)
def test_adversarial_fp32_finite_and_correct(case) -> None:
    images, texts = _adversarial(case)
    expected = _run(clip_loss_formula, images, texts, 100.0)  # fp64 truth
    actual = _run(lambda i, t, s: contrastive_loss(i, t, s, tile_size=8), images, texts, 100.0, torch.float32)
    _assert_all_close(actual, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("case", CASES)
def test_adversarial_fp64_extreme_scale(case) -> None:
    """At scale 400 even fp64 needs the underflow fallbacks; they must stay exact."""
    images, texts = _adversarial(case)
    expected = _run(clip_loss_formula, images, texts, 400.0)
    actual = _run(lambda i, t, s: contrastive_loss(i, t, s, tile_size=8), images, texts, 400.0)
    _assert_all_close(actual, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype) -> None:
    """Documented tolerance: half inputs are computed in fp32, so the loss equals the fp32 loss of
    the rounded features to 1e-5 and the gradients (returned in the input dtype) match to that
    dtype's rounding; against unrounded fp32 features the loss is within 2e-2 relative."""
    images, texts = _features(48, 24, 7, torch.float32), _features(48, 24, 8, torch.float32)
    fn = lambda i, t, s: contrastive_loss(i, t, s, tile_size=16)  # noqa: E731
    rounded = _run(fn, images.to(dtype), texts.to(dtype), 30.0, torch.float32)
    actual = _run(fn, images, texts, 30.0, dtype)
    assert actual[1].dtype == dtype and actual[2].dtype == dtype and actual[0].dtype == torch.float32
    torch.testing.assert_close(actual[0], rounded[0], rtol=1e-5, atol=1e-5)
    for a, e in zip(actual[1:3], rounded[1:3], strict=True):
        torch.testing.assert_close(a.float(), e, rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(actual[3], rounded[3], rtol=1e-4, atol=1e-5)
    unrounded = _run(fn, images, texts, 30.0, torch.float32)
    torch.testing.assert_close(actual[0], unrounded[0], rtol=2e-2, atol=0)


@pytest.mark.parametrize("upstream", [-2.5, 0.0])
def test_upstream_gradient_scales_every_gradient(upstream) -> None:
    """A negative or zero upstream gradient goes through the shift/sign folding exactly."""
    images, texts = _features(10, 6, 9), _features(10, 6, 10)
    expected = _run(lambda i, t, s: upstream * clip_loss_formula(i, t, s), images, texts, 10.0)
    actual = _run(lambda i, t, s: upstream * contrastive_loss(i, t, s, tile_size=4), images, texts, 10.0)
    _assert_all_close(actual, expected, rtol=1e-10, atol=1e-12)


def test_second_backward_with_retained_graph_is_exact() -> None:
    """The forward hands its last tile to the backward, which overwrites it; a second backward
    through a retained graph must recompute that tile rather than reuse it."""
    images, texts = _features(12, 5, 13), _features(12, 5, 14)
    expected = _run(clip_loss_formula, images, texts, 30.0)
    i, t = images.clone().requires_grad_(), texts.clone().requires_grad_()
    s = torch.tensor(30.0, dtype=torch.float64, requires_grad=True)
    loss = contrastive_loss(i, t, s, tile_size=5)
    for passes in (1, 2):
        loss.backward(retain_graph=True)
        actual = (loss.detach(), i.grad / passes, t.grad / passes, s.grad / passes)
        _assert_all_close(actual, expected, rtol=1e-10, atol=1e-12)


def test_float_scale_and_gradient_free_inputs() -> None:
    images, texts = _features(5, 4, 11), _features(5, 4, 12)
    loss = contrastive_loss(images, texts, 10.0)
    torch.testing.assert_close(loss, clip_loss_formula(images, texts, 10.0), rtol=1e-12, atol=0)
    assert not loss.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"impl": "fast"}, "unknown impl"),
        ({"texts": _features(4, 8, 0)}, "as many text rows"),
        ({"texts": _features(5, 7, 0)}, "image dim 8 != text dim 7"),
        ({"labels": torch.tensor([0, 1, 2, 3, 9])}, r"labels must lie in \[0, 5\)"),
        ({"labels": torch.zeros(5)}, "LongTensor"),
        ({"scale": torch.ones(2)}, "logit_scale must be a scalar"),
        ({"images": torch.ones(5)}, "must be 2-D"),
    ],
)
def test_bad_input_gives_clear_error(kwargs, message) -> None:
    images = kwargs.pop("images", _features(5, 8, 0))
    texts = kwargs.pop("texts", _features(5, 8, 1))
    scale = kwargs.pop("scale", torch.tensor(10.0))
    with pytest.raises(ValueError, match=message):
        contrastive_loss(images, texts, scale, **kwargs)
