"""Metrics from features: hits@k with ties shared, retrieval recall and zero-shot accuracy.

Each rank scores its own queries (gathering the keys they need) and only hit counts are summed over
ranks, so a sharded eval gives the single-process numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from clip_train.data.eval_sources import EvalError
from clip_train.distributed import failing_together, gather_rows, rank_and_world, sum_over_ranks
from clip_train.loss.checks import Batch
from clip_train.loss.reference import vanilla_loss, vanilla_sigmoid_loss

RECALL_KS = (1, 5, 10)
ZEROSHOT_KS = (1, 5)
# Scores this close to the positive's tie with it. In fp32 a score's rounding depends on its place in
# the matmul, and a feature's on the batch it was encoded in: duplicates (a caption twice, a class
# name twice) differ by ~1e-7, so exact ties would share their credit on some world sizes only.
TIE_TOLERANCE = 1e-6
_RETRIEVAL_BLOCK = 1024  # queries scored at once: bounds the score matrix to block × n


def hits_at_k(scores: torch.Tensor, positive: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """Expected number of rows whose ``positive`` column is in their top k, for each k (float64).

    Ties (scores within ``TIE_TOLERANCE``) are broken at random, in expectation: with ``a`` columns
    scoring higher and ``t`` tying (the positive included), the positive makes the top k with
    probability clamp((k − a) / t, 0, 1). So duplicate captions share the credit, and a collapsed
    model (all features equal) scores chance, k / n, rather than 1 or 0. NaN scores count as higher;
    a NaN positive is a miss.
    """
    target = scores.gather(1, positive[:, None])
    tie = (scores - target).abs() <= TIE_TOLERANCE
    above = ((scores > target) & ~tie | scores.isnan()).sum(1)
    tied = tie.sum(1).clamp(min=1)
    valid = ~target[:, 0].isnan()
    return torch.stack([((k - above) / tied.double()).clamp(0, 1)[valid].sum() for k in ks])


def _retrieval_hits(queries: torch.Tensor, keys: torch.Tensor, first: int, ks: Sequence[int]) -> torch.Tensor:
    """Query i's positive is key ``first + i``; scored block by block to bound memory."""
    hits = torch.zeros(len(ks), dtype=torch.float64, device=queries.device)
    for start in range(0, queries.shape[0], _RETRIEVAL_BLOCK):
        block = queries[start : start + _RETRIEVAL_BLOCK]
        positive = torch.arange(first + start, first + start + block.shape[0], device=block.device)
        hits += hits_at_k(block @ keys.T, positive, ks)
    return hits


def validation_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None,
    *,
    group: dist.ProcessGroup | None = None,
) -> float:
    """The training loss (softmax, or sigmoid with a bias) over all held-out pairs as one batch:
    every image against every text of the split, so it depends on neither the sample order nor
    the ranks. Each rank scores its own rows (both directions) a block at a time."""
    rank, _ = rank_and_world(group)
    all_images, counts = gather_rows(image_features, group)
    all_texts, _ = gather_rows(text_features, group)
    first = sum(counts[:rank])
    total = torch.zeros((), dtype=torch.float64, device=image_features.device)
    for start in range(0, len(image_features), _RETRIEVAL_BLOCK):
        images = image_features[start : start + _RETRIEVAL_BLOCK]
        texts = text_features[start : start + _RETRIEVAL_BLOCK]
        positives = torch.arange(first + start, first + start + len(images), device=images.device)
        rows = Batch(group=None, rank=0, world=1, labels=positives, symmetric=False)  # vs all columns
        if logit_bias is None:
            both = vanilla_loss(images, all_texts, logit_scale, rows) + vanilla_loss(
                texts, all_images, logit_scale, rows
            )
            total += both.double() * len(images) / 2
        else:
            total += vanilla_sigmoid_loss(images, all_texts, logit_scale, logit_bias, rows).double() * len(
                images
            )
    total = sum_over_ranks(total, group)
    if sum(counts) == 0:
        raise EvalError("validation loss: no image-text pairs to evaluate")
    return (total / sum(counts)).item()


def retrieval_recall(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    ks: Sequence[int] = RECALL_KS,
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Image→text and text→image recall@k, where row i of both is one pair. Each rank passes its
    own pairs (any count, even zero); ties are shared as in ``hits_at_k``."""
    rank, _ = rank_and_world(group)
    all_images, counts = gather_rows(image_features, group)
    all_texts, _ = gather_rows(text_features, group)
    first = sum(counts[:rank])
    hits = torch.cat(
        [
            _retrieval_hits(image_features, all_texts, first, ks),
            _retrieval_hits(text_features, all_images, first, ks),
        ]
    )
    hits = sum_over_ranks(hits, group).tolist()
    total = sum(counts)
    if total == 0:
        raise EvalError("retrieval: no image-text pairs to evaluate")
    names = [f"{direction}_R@{k}" for direction in ("image_to_text", "text_to_image") for k in ks]
    return {name: h / total for name, h in zip(names, hits, strict=True)} | {"n": float(total)}


def zeroshot_from_features(
    image_features: torch.Tensor,
    labels: torch.Tensor,
    classifier: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Top-1/top-5 accuracy of this rank's features, counts summed over ranks."""
    num_classes = classifier.shape[0]
    with failing_together(group):
        if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
            raise EvalError(
                f"zero-shot labels span [{int(labels.min())}, {int(labels.max())}] but there are "
                f"{num_classes} class names"
            )
    if image_features.numel() == 0:
        image_features = classifier.new_zeros((0, classifier.shape[1]))
    hits = hits_at_k(image_features @ classifier.T, labels, ZEROSHOT_KS)
    counts = torch.cat([hits, hits.new_tensor([labels.numel()])])
    *hits_list, total = sum_over_ranks(counts, group).tolist()
    if total == 0:
        raise EvalError("zero-shot: no labelled images to evaluate")
    return {f"top{k}": h / total for k, h in zip(ZEROSHOT_KS, hits_list, strict=True)} | {"n": float(total)}
