"""Gradient Cache across 2 real gloo ranks: one optimizer step equals a single-process step on the
concatenated global batch (fp64, dropout and drop-path on), and each tower all-reduces once."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from test_gradcache import DROPOUT, SEED, assert_grads_close, grads, make_batch, make_model
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from clip_train.engine import GradCache
from clip_train.engine.offload import chunk_bounds
from clip_train.loss import contrastive_loss

WORLD, ROWS_PER_RANK, LR = 2, 6, 0.5


def rank_batch(rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(
        t[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK] for t in make_batch(WORLD * ROWS_PER_RANK)
    )


def counting_hook(tower: str, calls: list):
    """DDP's default all-reduce, recording which bucket of which tower it reduced."""

    def hook(state, bucket):
        calls.append((tower, bucket.index(), bucket.buffer().numel()))
        return allreduce_hook(state, bucket)

    return hook


SIGMOID = ("model.init_logit_bias=-4.0",)  # a model with a logit bias trains with the sigmoid loss


def gradcache_rank(
    rank: int, world_size: int, impl: str, chunks: tuple[int, int], extra: tuple[str, ...]
) -> dict:
    model = make_model(*DROPOUT, *extra)  # the same initial weights on every rank
    calls: list = []
    engine = GradCache(model, image_chunk=chunks[0], text_chunk=chunks[1], precision="fp64", loss_impl=impl)
    assert all(isinstance(tower.head, DistributedDataParallel) for tower in (engine.image, engine.text))
    engine.image.head.register_comm_hook(None, counting_hook("image", calls))
    engine.text.head.register_comm_hook(None, counting_hook("text", calls))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    # Where each chunk's backward leaves the replayed projection's gradient, and where its step's
    # sync leaves it (a view of DDP's bucket): the same place, from the first step on.
    proj, landed = model.visual.proj.weight, []
    proj.register_post_accumulate_grad_hook(lambda p: landed[-1][0].append(p.grad.data_ptr()))
    calls_per_step, losses = [], []
    for step in range(2):  # the second step runs after DDP has rebuilt its buckets
        optimizer.zero_grad(set_to_none=not engine.grads_in_buckets)  # as the trainer does
        landed.append(([], None))
        torch.manual_seed(SEED + rank)
        losses.append(engine.step(*rank_batch(rank)).loss.item())
        landed[-1] = (landed[-1][0], proj.grad.data_ptr())
        if step == 0:
            step_grads = grads(model)
        optimizer.step()
        if step == 0:
            weights = {name: p.detach().clone() for name, p in model.named_parameters()}
        calls_per_step.append(list(calls))
        calls.clear()
    trainable = {
        tower: sum(p.numel() for p in getattr(model, attr).parameters() if p.requires_grad)
        for tower, attr in (("image", "visual"), ("text", "text"))
    }
    return {
        "grads": step_grads,
        "weights": weights,
        "loss": losses[0],
        "calls": calls_per_step,
        "trainable": trainable,
        "landed": landed,
    }


def single_process_reference(chunks: tuple[int, int], extra: tuple[str, ...]) -> tuple[float, dict, dict]:
    """Plain autograd on the global batch: rank r's chunks encoded from rank r's seed, as the ranks did."""
    model = make_model(*DROPOUT, *extra)
    image_features, text_features = [], []
    for rank in range(WORLD):
        images, input_ids, attention_mask = rank_batch(rank)
        torch.manual_seed(SEED + rank)
        image_features += [model.visual(images[a:b]) for a, b in chunk_bounds(ROWS_PER_RANK, chunks[0])]
        text_features += [
            model.text(input_ids[a:b], attention_mask[a:b]) for a, b in chunk_bounds(ROWS_PER_RANK, chunks[1])
        ]
    kind = "sigmoid" if model.logit_bias is not None else "softmax"
    features = (torch.cat(image_features), torch.cat(text_features), model.logit_scale.exp())
    loss = contrastive_loss(*features, logit_bias=model.logit_bias, kind=kind)
    loss.backward()
    reference_grads = grads(model)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.item(), reference_grads, {name: p.detach().clone() for name, p in model.named_parameters()}


# Images in 3 chunks; text in 2, or in 1: each tower's last chunk keeps its graph (the text tower's
# is then its only backward); both towers in 1: no replay at all. The sigmoid loss: its bias and
# scale gradients are averaged over ranks like the softmax scale's.
CASES = [((2, 4), ()), ((2, 0), ()), ((0, 0), ()), ((2, 4), SIGMOID)]


def every_case(rank: int, world_size: int) -> list[dict]:
    return [gradcache_rank(rank, world_size, "auto", chunks, extra) for chunks, extra in CASES]


@pytest.fixture(scope="module")
def ranks_by_case() -> list[list[dict]]:
    """Each case's results on both ranks, from one start of the two ranks: ``[case][rank]``."""
    return list(zip(*run_distributed(every_case, WORLD), strict=True))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"chunks{c}-extra{len(e)}" for c, e in CASES])
def test_two_ranks_match_one_process_on_the_global_batch_and_sync_once_per_tower(ranks_by_case, case):
    chunks, extra = CASES[case]
    results = ranks_by_case[case]
    loss, want_grads, want_weights = single_process_reference(chunks, extra)

    assert sum(r["loss"] for r in results) / WORLD == pytest.approx(
        loss, rel=1e-12
    )  # ranks average to global
    for result in results:
        assert_grads_close(result["grads"], want_grads, rtol=1e-10)
        for name, want in want_weights.items():
            torch.testing.assert_close(result["weights"][name], want, rtol=1e-12, atol=1e-14)
    for name, weight in results[0]["weights"].items():
        assert torch.equal(weight, results[1]["weights"][name]), f"{name} differs between ranks"
    image_chunks = len(chunk_bounds(ROWS_PER_RANK, chunks[0])) if any(chunks) else 1
    for result in results:  # every chunk accumulated into DDP's bucket, no second copy beside it
        for pointers, bucket in result["landed"]:
            assert pointers == [bucket] * image_chunks

    for result in results:
        for calls in result["calls"]:  # per step: every bucket of each tower reduced exactly once
            for tower, numel in result["trainable"].items():
                buckets = [(index, size) for name, index, size in calls if name == tower]
                assert len({index for index, _ in buckets}) == len(buckets), (
                    f"{tower}: a bucket reduced twice"
                )
                assert sum(size for _, size in buckets) == numel, f"{tower}: not every gradient reduced once"
