"""The tiled, ringed distillation term against open_clip's ``DistillClipLoss`` (which builds both b×b
matrices), in fp64: one process at several tile sizes, and real gloo ranks against the single-process
full batch under clip_train's gradient convention (rank r's features get W × ∂L_global/∂them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import DistillClipLoss

from clip_train.loss.distill import distillation_loss
from tests.dist_utils import run_distributed

ROWS_PER_RANK, DIM, TEACHER_DIM, SCALE, TEACHER_SCALE = 6, 5, 7, 12.0, 30.0


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


def _ours(data: dict[str, torch.Tensor], upstream: float = 1.0, **kwargs) -> tuple[torch.Tensor, ...]:
    """The loss and its gradients w.r.t. the student's features and scale."""
    images, texts = (data[key].clone().requires_grad_() for key in ("images", "texts"))
    scale = torch.tensor(SCALE, dtype=images.dtype, requires_grad=True)
    teacher_scale = torch.tensor(TEACHER_SCALE, dtype=images.dtype)
    loss = distillation_loss(
        images, texts, scale, data["teacher_images"], data["teacher_texts"], teacher_scale, **kwargs
    )
    (upstream * loss).backward()
    return loss.detach(), images.grad, texts.grad, scale.grad


def _open_clip(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    images, texts = (data[key].clone().requires_grad_() for key in ("images", "texts"))
    scale = torch.tensor(SCALE, dtype=images.dtype, requires_grad=True)
    teacher_scale = torch.tensor(TEACHER_SCALE, dtype=images.dtype)
    _, loss = DistillClipLoss()(
        images, texts, scale, data["teacher_images"], data["teacher_texts"], teacher_scale
    )
    loss.backward()
    return loss.detach(), images.grad, texts.grad, scale.grad


def _close(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], **tolerance) -> None:
    for ours, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(ours, theirs, **(tolerance or {"rtol": 1e-10, "atol": 1e-12}))


@pytest.mark.parametrize("tile", [1, 4, 5, 64])
def test_one_process_equals_open_clips_distill_loss_in_fp64(tile: int) -> None:
    data = _batch(13)  # 13 rows: tiles of 4 and 5 leave a ragged last tile
    _close(_ours(data, tile_size=tile), _open_clip(data))


def test_fp32_is_close_to_fp64_and_a_teacher_equal_to_the_student_gives_its_entropy() -> None:
    data = _batch(11)
    fp32 = _ours({key: value.float() for key, value in data.items()}, tile_size=4)
    fp64 = tuple(value.float() for value in _ours(data, tile_size=4))
    _close(fp32, fp64, rtol=1e-5, atol=1e-6)
    # With the student as its own teacher (same features and scale) the term is the mean entropy of
    # the softmaxes, and its gradient is the entropy's, not zero: a check that needs no open_clip.
    same = {**data, "teacher_images": data["images"], "teacher_texts": data["texts"]}
    loss = distillation_loss(
        same["images"],
        same["texts"],
        torch.tensor(SCALE, dtype=torch.float64),
        same["images"],
        same["texts"],
        torch.tensor(SCALE, dtype=torch.float64),
        tile_size=3,
    )
    logits = SCALE * data["images"] @ data["texts"].t()
    entropy = [-(p * p.log()).sum(1).mean() for p in (logits.softmax(1), logits.t().softmax(1))]
    torch.testing.assert_close(loss, sum(entropy) / 2, rtol=1e-12, atol=0)


def test_teacher_features_of_another_length_are_named() -> None:
    data = _batch(4)
    with pytest.raises(ValueError, match=r"teacher's features must be \(4, d'\).*\(3, 7\)"):
        distillation_loss(
            data["images"],
            data["texts"],
            torch.tensor(SCALE),
            data["teacher_images"][:3],
            data["teacher_texts"],
            torch.tensor(TEACHER_SCALE),
        )


UPSTREAM = {2: (1.0, -0.5), 3: (0.7, 0.0, 2.0)}  # rank r backpropagates UPSTREAM[r] · its loss


def _rank(rank: int, world: int) -> dict:
    data = _batch(ROWS_PER_RANK * world, seed=world)
    own = {key: value[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK] for key, value in data.items()}
    return {
        tile: (_ours(own, tile_size=tile), _ours(own, UPSTREAM[world][rank], tile_size=tile))
        for tile in (4, 64)
    }


def _reference(data: dict[str, torch.Tensor], upstream: tuple[float, ...]) -> tuple[torch.Tensor, ...]:
    """Single-process gradients of Σ_r upstream[r] · loss_r, each rank's loss its rows' and own
    columns' terms: open_clip's formula written per row, so it can be weighted by rank."""
    images, texts = (data[key].clone().requires_grad_() for key in ("images", "texts"))
    scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    student = scale * images @ texts.t()
    teacher = TEACHER_SCALE * data["teacher_images"] @ data["teacher_texts"].t()
    rows = -(teacher.softmax(1) * student.log_softmax(1)).sum(1)
    cols = -(teacher.t().softmax(1) * student.t().log_softmax(1)).sum(1)
    per_rank = ((rows + cols) / 2).view(len(upstream), -1).mean(1)
    (torch.tensor(upstream, dtype=torch.float64) * per_rank).sum().backward()
    return per_rank.detach(), images.grad, texts.grad, scale.grad


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_match_the_single_process_full_batch(world: int) -> None:
    data = _batch(ROWS_PER_RANK * world, seed=world)
    results = run_distributed(_rank, world)
    # The reference differentiates Σ_r upstream[r] · loss_r; unweighted (all 1) that is W × the
    # global mean's gradient, which is what each rank's features get, and the scale's per-rank
    # gradients sum to it.
    for upstream, which in (((1.0,) * world, 0), (UPSTREAM[world], 1)):
        losses, grad_images, grad_texts, grad_scale = _reference(data, upstream)
        for tile in (4, 64):
            scales = []
            for rank, result in enumerate(results):
                loss, rank_images, rank_texts, rank_scale = result[tile][which]
                own = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
                _close((loss, rank_images, rank_texts), (losses[rank], grad_images[own], grad_texts[own]))
                scales.append(rank_scale)
            _close((sum(scales),), (grad_scale,))
