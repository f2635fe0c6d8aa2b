"""The loss across real gloo ranks against the single-process full-batch loss, in fp64.

Convention under test (``clip_train.loss``'s docstring): rank r returns the mean loss over its own
rows; backward gives its features W × ∂L_global/∂(its rows); the per-rank scale (and sigmoid bias)
gradients average to the global ones. One spawn per world size checks every implementation of the softmax
loss (symmetric and hard negatives) and of the sigmoid loss.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from test_gradcache import make_model
from test_gradcache_distributed import SIGMOID, rank_batch
from test_loss_tiles import _CountOps, _host_read

import clip_train.loss.sigmoid
from clip_train.engine import GradCache
from clip_train.loss import contrastive_loss, ring
from clip_train.loss.sigmoid import SigmoidLoss
from tests.dist_utils import run_distributed

IMPLS_AND_TILES = [("vanilla", None), ("local", None), ("inf", 3), ("inf", 64)]
N_PER_RANK, M_PER_RANK, DIM, SCALE, BIAS = 5, 7, 6, 20.0, -3.0
# Upstream gradients that differ by rank (rank r backpropagates weight[r] · its loss), zero and
# negative ones included: each rank's features must get the gradient of Σ_r weight[r] · loss_r.
WEIGHTS = {2: [(1.0, 0.0), (0.5, -1.5)], 3: [(0.7, 0.0, -1.5)], 4: [(1.0, -0.25, 0.0, 2.0)]}


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


def _loss_and_grads(images, texts, scale, weight: float = 1.0, **kwargs) -> tuple[torch.Tensor, ...]:
    """Loss and gradients w.r.t. both feature sets, the scale and (sigmoid) the bias."""
    images, texts = images.clone().requires_grad_(), texts.clone().requires_grad_()
    scalars = [torch.tensor(scale, dtype=torch.float64, requires_grad=True)]
    if kwargs.get("kind") == "sigmoid":
        scalars.append(torch.tensor(BIAS, dtype=torch.float64, requires_grad=True))
        kwargs["logit_bias"] = scalars[1]
    loss = contrastive_loss(images, texts, scalars[0], **kwargs)
    (weight * loss).backward()
    return loss.detach(), images.grad, texts.grad, *(s.grad for s in scalars)


def _worker(rank: int, world: int) -> dict:
    data = _global_batch(world)
    own = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    own_negatives = slice(rank * M_PER_RANK, (rank + 1) * M_PER_RANK)
    results = {}
    for impl, tile in IMPLS_AND_TILES:
        for weights in [None, *WEIGHTS[world]]:
            weight = 1.0 if weights is None else weights[rank]
            results[("clip", impl, tile, weights)] = _loss_and_grads(
                data["images"][own], data["texts"][own], SCALE, weight, impl=impl, tile_size=tile
            )
            results[("hard", impl, tile, weights)] = _loss_and_grads(
                data["images"][own],
                data["negatives"][own_negatives],
                SCALE,
                weight,
                labels=data["labels"][own],
                impl=impl,
                tile_size=tile,
            )
            if impl != "local":  # the sigmoid loss has no local variant
                results[("siglip", impl, tile, weights)] = _loss_and_grads(
                    data["images"][own],
                    data["texts"][own],
                    SCALE,
                    weight,
                    kind="sigmoid",
                    impl=impl,
                    tile_size=tile,
                )
    with _ring_events() as events:
        _loss_and_grads(
            data["images"][own], data["texts"][own], SCALE, kind="sigmoid", impl="inf", tile_size=3
        )
    results["sigmoid_events"] = events
    if world == 2:  # ranks disagreeing on n must fail loudly on every rank, not hang or mis-index
        try:
            contrastive_loss(data["images"][: 3 + rank], data["texts"][: 3 + rank], torch.tensor(SCALE))
        except ValueError as error:
            results["mismatch"] = str(error)
    return results


@contextlib.contextmanager
def _ring_events() -> Iterator[list[str]]:
    """What the ring does, in order: ``post`` (transfers posted), ``compute`` (a block's tiles) and
    ``wait`` (for the transfers posted)."""
    events: list[str] = []
    exchange, wait, tiles = ring._exchange, ring._wait, clip_train.loss.sigmoid.sigmoid_forward_backward

    def record(event, fn):
        def run(*args, **kwargs):
            events.append(event)
            return fn(*args, **kwargs)

        return run

    ring._exchange, ring._wait = record("post", exchange), record("wait", wait)
    clip_train.loss.sigmoid.sigmoid_forward_backward = record("compute", tiles)
    try:
        yield events
    finally:
        ring._exchange, ring._wait, clip_train.loss.sigmoid.sigmoid_forward_backward = exchange, wait, tiles


def _reference(mode, images, texts, scale, labels=None, weights=None) -> tuple[torch.Tensor, ...]:
    """Single-process loss straight from the formula, with autograd gradients: the global mean,
    or with ``weights`` the sum over ranks of weight[r] · (mean over rank r's rows)."""
    images, texts = images.clone().requires_grad_(), texts.clone().requires_grad_()
    scalars = [torch.tensor(scale, dtype=torch.float64, requires_grad=True)]
    logits = scalars[0] * images @ texts.t()
    if mode == "siglip":  # per image: the sum over all texts of each pair's binary loss
        scalars.append(torch.tensor(BIAS, dtype=torch.float64, requires_grad=True))
        signs = 2 * torch.eye(len(images), dtype=torch.float64) - 1
        margins = -signs * (logits + scalars[1])
        per_row = (margins.clamp(min=0) + torch.log1p(torch.exp(-margins.abs()))).sum(1)
    elif labels is None:
        diagonal = logits.diagonal()
        per_row = (logits.logsumexp(1) - diagonal + logits.logsumexp(0) - diagonal) / 2
    else:
        per_row = logits.logsumexp(1) - logits.gather(1, labels[:, None]).squeeze(1)
    if weights is None:
        per_row.mean().backward()
    else:
        rank_losses = per_row.view(len(weights), -1).mean(1)
        (torch.tensor(weights, dtype=torch.float64) * rank_losses).sum().backward()
    return per_row.detach(), images.grad, texts.grad, *(s.grad for s in scalars)


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
        "siglip": (data["texts"], None, N_PER_RANK),
    }
    for (mode, (texts, labels, m)), weights in itertools.product(modes.items(), [None, *WEIGHTS[world]]):
        per_row, grad_images, grad_texts, *grad_scalars = _reference(
            mode, data["images"], texts, SCALE, labels, weights
        )
        # Unweighted, every rank backpropagates its share of the global mean: W × its gradient.
        factor = world if weights is None else 1
        for impl, tile in IMPLS_AND_TILES:
            if (mode, impl, tile, weights) not in results[0]:
                continue
            rank_scalars = []
            for rank, result in enumerate(results):
                loss, rank_grad_images, rank_grad_texts, *scalars = result[(mode, impl, tile, weights)]
                own, own_texts = (
                    slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK),
                    slice(rank * m, (rank + 1) * m),
                )
                _close(loss, per_row[own].mean())
                _close(rank_grad_images, factor * grad_images[own])
                _close(rank_grad_texts, factor * grad_texts[own_texts])
                rank_scalars.append(torch.stack(scalars))
            _close(torch.stack(rank_scalars).sum(0) / factor, torch.stack(grad_scalars))
    for result in results:  # the sigmoid's text gradients cross while the next block computes
        events = " ".join(result["sigmoid_events"])
        assert events == " ".join(["post compute wait"] * world + ["post wait"]), (
            events
        )  # but the last hop home
    if world == 2:
        for result in results:
            assert "same number of rows" in result["mismatch"]
            assert "rank 0: n=3" in result["mismatch"] and "rank 1: n=4" in result["mismatch"]


@contextlib.contextmanager
def _host_reads_in_sigmoid_backward() -> Iterator[list[int]]:
    """How many host reads each sigmoid loss's backward run inside it makes, one count a backward."""
    counts: list[int] = []
    backward = SigmoidLoss.backward

    def counted(ctx, grad_loss):
        with _CountOps(_host_read) as reads:
            grads = backward(ctx, grad_loss)
        counts.append(reads.count)
        return grads

    SigmoidLoss.backward = staticmethod(counted)
    try:
        yield counts
    finally:
        SigmoidLoss.backward = staticmethod(backward)


def _sigmoid_backward_reads(rank: int, world: int) -> dict:
    """The sigmoid loss's gradients and backward host reads, with and without ``same_upstream``;
    the backward host reads of a training step of the engine."""
    data = _global_batch(world)
    own = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    results = {}
    for same_upstream in (False, True):
        with _host_reads_in_sigmoid_backward() as reads:
            grads = _loss_and_grads(
                data["images"][own],
                data["texts"][own],
                SCALE,
                kind="sigmoid",
                tile_size=3,
                same_upstream=same_upstream,
            )
        results[same_upstream] = (grads, reads)
    engine = GradCache(make_model(*SIGMOID), image_chunk=2, text_chunk=4, precision="fp64")
    with _host_reads_in_sigmoid_backward() as reads:
        engine.step(*rank_batch(rank))
    results["engine"] = reads
    return results


def test_the_sigmoid_backward_of_ranks_known_to_agree_reads_nothing_on_the_host() -> None:
    """On several ranks the sigmoid backward compares the ranks' upstream gradients on the host, a
    read that on a GPU waits for the whole forward ring, unless its caller says they agree
    (``same_upstream``): then it reads nothing and gives the same gradients, bit for bit (the
    comparing path's are checked against the full batch above). The trainer's engine says so."""
    for result in run_distributed(_sigmoid_backward_reads, 2):
        (compared, compared_reads), (trusted, trusted_reads) = result[False], result[True]
        assert compared_reads == [1] and trusted_reads == [0]
        assert all(torch.equal(a, b) for a, b in zip(compared, trusted, strict=True))
        assert result["engine"] == [0]


BAD_ON_ONE_RANK = {  # what rank 1 passes while rank 0's inputs are fine
    "no_rows": lambda images, texts, labels: (images[:0], texts[:0], None),
    "labels_out_of_range": lambda images, texts, labels: (images, texts, labels + 1000),
    "not_2d": lambda images, texts, labels: (images[0], texts[0], None),
}


def _one_bad_rank(rank: int, world: int, case: str) -> str:
    data = _global_batch(world)
    images, texts = data["images"][:N_PER_RANK], data["negatives"][:M_PER_RANK]
    labels = data["labels"][:N_PER_RANK] % M_PER_RANK if case == "labels_out_of_range" else None
    if case != "labels_out_of_range":
        texts = texts[:N_PER_RANK]
    if rank == 1:
        images, texts, labels = BAD_ON_ONE_RANK[case](images, texts, labels)
    try:
        contrastive_loss(images, texts, torch.tensor(SCALE, dtype=torch.float64), labels=labels, impl="inf")
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_ON_ONE_RANK)
def test_rank_local_bad_input_fails_every_rank_alike(case: str) -> None:
    """Both ranks raise the same one-line error naming rank 1; a rank left waiting in a
    collective would instead hit the 20 s timeout and fail differently."""
    messages = run_distributed(_one_bad_rank, 2, case, timeout_s=20)
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("contrastive_loss: rank 1: ") and "\n" not in messages[0]
