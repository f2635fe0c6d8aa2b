"""Features of an eval split, encoded in eval mode without a graph and kept in fp32 or wider."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from clip_train.data import Batch
from clip_train.data.eval_sources import EvalError, LabelledImages
from clip_train.distributed import failing_together
from clip_train.logs import progress
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
    """One rank's share of a split: features in sample order, and labels when asked for."""

    image_features: torch.Tensor
    text_features: torch.Tensor | None
    labels: torch.Tensor | None


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
    """Encode every batch (``.images``; ``.input_ids``/``.attention_mask``; ``.labels``). A collective:
    samples without a label on one rank stop every rank of ``group`` with the same error."""
    dtype = feature_dtype(precision)
    images: list[torch.Tensor] = []
    texts: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    with failing_together(group), inference(model, device, precision):
        for batch in progress(batches, f"encoding {source}", unit="batch"):
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
    )
