"""The data layer: WebDataset shards in, per-rank uint8 batches out (see ``train_loader`` for the design)."""

from clip_train.data.batches import Batch, check_source_options, source_urls
from clip_train.data.eval_loader import build_eval_loader
from clip_train.data.samples import SKIP_REASONS, DataError
from clip_train.data.sources import check_readable, dataset_size, expand_urls
from clip_train.data.train_loader import TrainLoader, build_train_loader

__all__ = [
    "SKIP_REASONS",
    "Batch",
    "DataError",
    "TrainLoader",
    "build_eval_loader",
    "build_train_loader",
    "check_readable",
    "check_source_options",
    "dataset_size",
    "expand_urls",
    "source_urls",
]
