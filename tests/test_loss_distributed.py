"""The loss across real gloo ranks against the single-process full-batch loss, in fp64.

Convention under test (DESIGN.md §3): rank r returns the mean loss over its own rows; backward
gives its features W × ∂L_global/∂(its rows); the per-rank scale gradients average to
∂L_global/∂s. One spawn per world size checks every implementation and both loss modes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clip_train.loss import contrastive_loss
from tests.dist_utils import run_distributed

IMPLS_AND_TILES = [("vanilla", None), ("local", None), ("inf", 3), ("inf", 64)]
N_PER_RANK, M_PER_RANK, DIM, SCALE = 5, 7, 6, 20.0


def _global_batch(world: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234 + world)
    b = N_PER_RANK * world

    def features(rows: int) -> torch.Tensor:
        return F.normalize(torch.randn(rows, DIM, generator=gen, dtype=torch.float64), dim=1)

    return {
        "images": features(b),
        "texts": features(b),
        "negatives": features(M_PER_RANK * world),  # hard-negative mode: m > n text rows per rank
        "labels": torch.randint(0, M_PER_RANK * world, (b,), generator=gen),
    }


def _loss_and_grads(images, texts, scale, **kwargs) -> tuple[torch.Tensor, ...]:
    images, texts = images.clone().requires_grad_(), texts.clone().requires_grad_()
    scale = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    loss = contrastive_loss(images, texts, scale, **kwargs)
    loss.backward()
    return loss.detach(), images.grad, texts.grad, scale.grad


def _worker(rank: int, world: int) -> dict:
    data = _global_batch(world)
    own = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    own_negatives = slice(rank * M_PER_RANK, (rank + 1) * M_PER_RANK)
    results = {}
    for impl, tile in IMPLS_AND_TILES:
        results[("clip", impl, tile)] = _loss_and_grads(
            data["images"][own], data["texts"][own], SCALE, impl=impl, tile_size=tile
        )
        results[("hard", impl, tile)] = _loss_and_grads(
            data["images"][own],
            data["negatives"][own_negatives],
            SCALE,
            labels=data["labels"][own],
            impl=impl,
            tile_size=tile,
        )
    if world == 2:  # ranks disagreeing on n must fail loudly on every rank, not hang or mis-index
        try:
            contrastive_loss(data["images"][: 3 + rank], data["texts"][: 3 + rank], torch.tensor(SCALE))
        except ValueError as error:
            results["mismatch"] = str(error)
    return results


def _reference(images, texts, scale, labels=None) -> tuple[torch.Tensor, ...]:
    """Single-process global loss straight from the formula, with autograd gradients."""
    images, texts = images.clone().requires_grad_(), texts.clone().requires_grad_()
    scale = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    logits = scale * images @ texts.t()
    if labels is None:
        diagonal = logits.diagonal()
        per_row = (logits.logsumexp(1) - diagonal + logits.logsumexp(0) - diagonal) / 2
    else:
        per_row = logits.logsumexp(1) - logits.gather(1, labels[:, None]).squeeze(1)
    per_row.mean().backward()
    return per_row.detach(), images.grad, texts.grad, scale.grad


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_match_full_batch(world: int) -> None:
    data = _global_batch(world)
    results = run_distributed(_worker, world)
    modes = {
        "clip": (data["texts"], None, N_PER_RANK),
        "hard": (data["negatives"], data["labels"], M_PER_RANK),
    }
    for mode, (texts, labels, m) in modes.items():
        per_row, grad_images, grad_texts, grad_scale = _reference(data["images"], texts, SCALE, labels)
        for impl, tile in IMPLS_AND_TILES:
            scale_grads = []
            for rank, result in enumerate(results):
                loss, rank_grad_images, rank_grad_texts, rank_grad_scale = result[(mode, impl, tile)]
                own, own_texts = (
                    slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK),
                    slice(rank * m, (rank + 1) * m),
                )
                _close(loss, per_row[own].mean())
                _close(rank_grad_images, world * grad_images[own])
                _close(rank_grad_texts, world * grad_texts[own_texts])
                scale_grads.append(rank_grad_scale)
            _close(torch.stack(scale_grads).mean(), grad_scale)
    if world == 2:
        for result in results:
            assert "same number of rows" in result["mismatch"]
            assert "rank 0: n=3" in result["mismatch"] and "rank 1: n=4" in result["mismatch"]
