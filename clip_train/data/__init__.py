"""The data layer: WebDataset shards in, per-rank uint8 batches out (see ``pipeline`` for the design)."""

from clip_train.data.pipeline import (
    Batch,
    TrainLoader,
    build_eval_loader,
    build_train_loader,
    check_caption_options,
    source_urls,
)
from clip_train.data.samples import SKIP_REASONS, DataError
from clip_train.data.sources import check_readable, dataset_size, expand_urls

__all__ = [
    "SKIP_REASONS",
    "Batch",
    "DataError",
    "TrainLoader",
    "build_eval_loader",
    "build_train_loader",
    "check_caption_options",
    "check_readable",
    "dataset_size",
    "expand_urls",
    "source_urls",
]
