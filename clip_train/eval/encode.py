"""Features of an eval split, encoded in eval mode without a graph and kept in fp32 or wider."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from clip_train.data import SKIP_REASONS, Batch
from clip_train.data.eval_sources import EvalError, LabelledImages
from clip_train.distributed import failing_together, rank_and_world, sum_counts_over_ranks
from clip_train.logs import get_logger, progress
from clip_train.precision import autocast


@contextlib.contextmanager
def inference(model: nn.Module, device: torch.device, precision: str) -> Iterator[None]:
    """no_grad, eval mode (no dropout) and autocast; the model's train/eval mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device, precision):
            yield
    finally:
        model.train(was_training)


def feature_dtype(precision: str) -> torch.dtype:
    """Scores are compared in fp32 at least (fp64 runs keep fp64), whatever autocast produced."""
    return torch.float64 if precision == "fp64" else torch.float32


@dataclass
class EncodedSplit:
    """One rank's share of a split: features in sample order, and labels when asked for; the bad
    samples left out, by reason, summed over every rank."""

    image_features: torch.Tensor
    text_features: torch.Tensor | None
    labels: torch.Tensor | None
    skipped: dict[str, int]


def encode_split(
    model: nn.Module,
    batches: Iterable[Batch | LabelledImages],
    *,
    device: torch.device,
    precision: str,
    text: bool,
    labels: bool,
    source: str = "eval data",
    group: dist.ProcessGroup | None = None,
) -> EncodedSplit:
    """Encode every batch (``.images``; ``.input_ids``/``.attention_mask``; ``.labels``) and count
    the bad samples the batches left out (``.skipped``), with a line on rank 0 when there were any.
    A collective: samples without a label on one rank stop every rank of ``group`` with the same
    error."""
    dtype = feature_dtype(precision)
    images: list[torch.Tensor] = []
    texts: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    skipped: Counter[str] = Counter()
    with failing_together(group), inference(model, device, precision):
        for batch in progress(batches, f"encoding {source}", unit="batch"):
            skipped.update(batch.skipped)
            if not len(batch.images):  # a share that held nothing usable: only its skips
                continue
            images.append(model.encode_image(batch.images.to(device, non_blocking=True)).to(dtype))
            if text:
                ids = batch.input_ids.to(device, non_blocking=True)
                mask = batch.attention_mask.to(device, non_blocking=True)
                texts.append(model.encode_text(ids, attention_mask=mask).to(dtype))
            if labels:
                if batch.labels is None:
                    raise EvalError(
                        f"{source}: samples have no label (zero-shot needs a json {{'label': int}})"
                    )
                targets.append(batch.labels.to(device))

    def cat(parts: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
        return torch.cat(parts) if parts else empty

    no_rows = torch.zeros((0, 0), dtype=dtype, device=device)
    return EncodedSplit(
        image_features=cat(images, no_rows),
        text_features=cat(texts, no_rows) if text else None,
        labels=cat(targets, torch.zeros(0, dtype=torch.long, device=device)) if labels else None,
        skipped=_skipped_over_ranks(skipped, source, group),
    )


def _skipped_over_ranks(local: Counter[str], source: str, group: dist.ProcessGroup | None) -> dict[str, int]:
    """Every rank's skipped samples, by reason; rank 0 says so when there were any, since the
    metrics are then over fewer samples than the split holds."""
    counts = {reason: n for reason, n in sum_counts_over_ranks(local, SKIP_REASONS, group).items() if n}
    if counts and rank_and_world(group)[0] == 0:
        get_logger().warning(
            f"eval: {sum(counts.values())} bad samples of {source} skipped ({counts}); its metrics "
            "leave them out"
        )
    return counts
