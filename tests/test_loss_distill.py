"""The CLIP loss and the distillation term, tiled and ringed, against open_clip's ``DistillClipLoss``
(which builds both b×b matrices), in fp64: one process at several tile sizes, and real gloo ranks
against the single-process full batch under clip_train's gradient convention (rank r's features get
the gradient of Σ_r upstream_r · loss_r)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import DistillClipLoss
from test_loss_tiles import numbers_assigned_into_tensors

from clip_train.loss import contrastive_loss
from clip_train.loss.distill import contrastive_and_distillation_loss
from tests.dist_utils import run_distributed

ROWS_PER_RANK, DIM, TEACHER_DIM, SCALE, TEACHER_SCALE = 6, 5, 7, 12.0, 30.0
WEIGHTS = (1.0, 0.7)  # the upstream gradients of the two terms: the trainer's 1 and distill.weight


def _batch(rows: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def features(dim: int) -> torch.Tensor:
        return F.normalize(torch.randn(rows, dim, generator=gen, dtype=torch.float64), dim=1).to(dtype)

    return {
        "images": features(DIM),
        "texts": features(DIM),
        "teacher_images": features(TEACHER_DIM),
        "teacher_texts": features(TEACHER_DIM),
    }


def _leaves(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    images, texts = (data[key].clone().requires_grad_() for key in ("images", "texts"))
    scale = torch.tensor(SCALE, dtype=images.dtype, requires_grad=True)
    teacher = (data["teacher_images"], data["teacher_texts"], torch.tensor(TEACHER_SCALE, dtype=images.dtype))
    return images, texts, scale, *teacher


def _ours(data: dict[str, torch.Tensor], weights=WEIGHTS, **kwargs) -> tuple[torch.Tensor, ...]:
    """Both terms, and the gradients of ``weights · terms`` w.r.t. the student's features and scale."""
    leaves = _leaves(data)
    terms = torch.stack(contrastive_and_distillation_loss(*leaves, **kwargs))
    (torch.tensor(weights, dtype=terms.dtype) @ terms).backward()
    return terms.detach(), *(leaf.grad for leaf in leaves[:3])


def _open_clip(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    leaves = _leaves(data)
    terms = torch.stack(DistillClipLoss()(*leaves))
    (torch.tensor(WEIGHTS, dtype=terms.dtype) @ terms).backward()
    return terms.detach(), *(leaf.grad for leaf in leaves[:3])


def _close(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], **tolerance) -> None:
    for ours, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(ours, theirs, **(tolerance or {"rtol": 1e-10, "atol": 1e-12}))


@pytest.mark.parametrize("tile", [1, 4, 5, 64])
def test_one_process_equals_open_clips_distill_clip_loss_in_fp64(tile: int) -> None:
    data = _batch(13)  # 13 rows: tiles of 4 and 5 leave a ragged last tile
    _close(_ours(data, tile_size=tile), _open_clip(data))


def test_the_contrastive_term_is_the_clip_loss_and_fp32_is_close_to_fp64() -> None:
    data = _batch(11)
    (contrastive, _), *grads = _ours(data, weights=(1.0, 0.0), tile_size=4)
    images, texts, scale, *_ = _leaves(data)
    expected = contrastive_loss(images, texts, scale, tile_size=4)
    expected.backward()
    _close((contrastive, *grads), (expected.detach(), images.grad, texts.grad, scale.grad))
    fp32 = _ours({key: value.float() for key, value in data.items()}, tile_size=4)
    _close(fp32, tuple(value.float() for value in _ours(data, tile_size=4)), rtol=1e-5, atol=1e-6)


def test_neither_direction_assigns_a_number_into_a_tensor() -> None:
    """The tiles' running states start filled on the device: on CUDA, ``state[:2] = -inf`` is a copy
    from the host that waits for the device, at every block of every step."""
    with numbers_assigned_into_tensors() as assigned:
        _ours(_batch(13), tile_size=4)
    assert assigned == []


def test_a_teacher_equal_to_the_student_gives_the_softmaxes_entropy() -> None:
    """The cross-entropy of a distribution with itself: a check that needs no open_clip."""
    data = _batch(11)
    same = {**data, "teacher_images": data["images"], "teacher_texts": data["texts"]}
    scale = torch.tensor(SCALE, dtype=torch.float64)
    _, distillation = contrastive_and_distillation_loss(
        same["images"], same["texts"], scale, same["images"], same["texts"], scale, tile_size=3
    )
    logits = SCALE * data["images"] @ data["texts"].t()
    entropy = [-(p * p.log()).sum(1).mean() for p in (logits.softmax(1), logits.t().softmax(1))]
    torch.testing.assert_close(distillation, sum(entropy) / 2, rtol=1e-12, atol=0)


def test_teacher_features_of_another_length_are_named() -> None:
    data = _batch(4)
    leaves = list(_leaves(data))
    leaves[3] = leaves[3][:3]
    with pytest.raises(ValueError, match=r"teacher's features must be \(4, d'\).*\(3, 7\)"):
        contrastive_and_distillation_loss(*leaves)


# Rank r backpropagates UPSTREAM[world][r] · (its contrastive loss, its distillation term). Three
# ranks, not two: on two, the next rank and the previous one are the same, and a ring turning the
# wrong way, or a column coefficient taken from the wrong owner, would pass.
UPSTREAM = {3: ((0.7, 0.0), (0.0, 1.0), (2.0, -1.0))}


def _rank(rank: int, world: int) -> dict:
    data = _batch(ROWS_PER_RANK * world, seed=world)
    own = {key: value[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK] for key, value in data.items()}
    return {tile: _ours(own, UPSTREAM[world][rank], tile_size=tile) for tile in (4, 64)}


def _reference(data: dict[str, torch.Tensor], upstream: tuple[tuple[float, float], ...]) -> tuple:
    """Each rank's two terms (its rows' and own columns', open_clip's formulas written per row so they
    can be weighted by rank) and the single-process gradients of Σ_r upstream_r · terms_r."""
    images, texts = (data[key].clone().requires_grad_() for key in ("images", "texts"))
    scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    student = scale * images @ texts.t()
    teacher = TEACHER_SCALE * data["teacher_images"] @ data["teacher_texts"].t()
    diagonal = student.diagonal()
    contrastive = (student.logsumexp(1) - diagonal + student.logsumexp(0) - diagonal) / 2
    rows = -(teacher.softmax(1) * student.log_softmax(1)).sum(1)
    cols = -(teacher.t().softmax(1) * student.t().log_softmax(1)).sum(1)
    terms = torch.stack([contrastive, (rows + cols) / 2]).view(2, len(upstream), -1).mean(2).t()  # (W, 2)
    (torch.tensor(upstream, dtype=torch.float64) * terms).sum().backward()
    return terms.detach(), images.grad, texts.grad, scale.grad


def test_three_ranks_match_the_single_process_full_batch() -> None:
    world = 3
    data = _batch(ROWS_PER_RANK * world, seed=world)
    results = run_distributed(_rank, world)
    terms, grad_images, grad_texts, grad_scale = _reference(data, UPSTREAM[world])
    for tile in (4, 64):
        for rank, result in enumerate(results):
            rank_terms, rank_images, rank_texts, _ = result[tile]
            own = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
            _close((rank_terms, rank_images, rank_texts), (terms[rank], grad_images[own], grad_texts[own]))
        # Each rank's scale gradient is its own terms'; their sum is the reference's.
        _close((sum(result[tile][3] for result in results),), (grad_scale,))
