"""What both loaders share: shards and tables to checked samples to uint8 batches, which the
DataLoader workers make; the caption options checked at start-up."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from clip_train.config import DataConfig
from clip_train.data.samples import DEFAULT_CAPTION_KEYS, BadSample, DataError, Decoded, SkipTally
from clip_train.data.sources import expand_urls, read_shard
from clip_train.data.tables import TableFormat, expand_tables, is_piece, is_table, read_piece

Tokenizer = Callable[[list[str]], Any]  # texts -> {"input_ids", "attention_mask"} (B, L) tensors
RawSample = dict[str, Any]  # a tar sample as ``read_shard`` yields it
Decode = Callable[[RawSample, int], Decoded]  # (raw sample, its number in the stream) -> checked sample


@dataclass
class Batch:
    """One rank's batch. Images stay uint8 (B, 3, H, W); the device side normalises them."""

    images: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    keys: list[str]
    labels: torch.Tensor | None = None  # from ``{key}.json`` ``{"label": int}`` when every sample has one
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count since the worker's last batch
    sources: dict[str, int] = field(default_factory=dict)  # mixture source name -> samples in this batch
    position: tuple[int, int, int, int] | None = None  # (role, epoch, done, consumed): resume bookkeeping

    def __len__(self) -> int:
        return len(self.keys)

    def pin_memory(self) -> Batch:
        """Called by the DataLoader's pin-memory thread."""
        return dataclasses.replace(
            self,
            images=self.images.pin_memory(),
            input_ids=self.input_ids.pin_memory(),
            attention_mask=self.attention_mask.pin_memory(),
            labels=None if self.labels is None else self.labels.pin_memory(),
        )


class BatchBuilder:
    """A batch filled a sample at a time. Each image goes into the batch's uint8 tensor as it is
    cropped and only the sample's caption, key and label are kept, so a worker building a large
    rank batch (32,768 rows of 224 px: 4.9 GB) holds each sample once, not its decoded picture, its
    crop and, at the end, a stacked copy of the crops (4.5 times as much, measured at 256 px)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.images: torch.Tensor | None = None
        self.samples: list[Decoded] = []  # without their pictures

    def __len__(self) -> int:
        return len(self.samples)

    def full(self) -> bool:
        return len(self) == self.size

    def add(self, sample: Decoded, image: torch.Tensor) -> None:
        if self.images is None:
            self.images = torch.empty((self.size, *image.shape), dtype=image.dtype)
        self.images[len(self)] = image
        self.samples.append(dataclasses.replace(sample, image=None))

    def batch(self, tokenizer: Tokenizer | None, **extra: Any) -> Batch:
        """The batch so far (labels only where every sample has one; no tokens, (B, 0), without a
        ``tokenizer``: a pass that needs no caption); the builder starts anew."""
        assert self.images is not None, "an empty batch"
        samples, images = self.samples, self.images if self.full() else self.images[: len(self)].clone()
        self.images, self.samples = None, []
        if tokenizer is not None:
            tokens = tokenizer([sample.caption for sample in samples])
        else:
            no_tokens = torch.zeros((len(samples), 0), dtype=torch.long)
            tokens = {"input_ids": no_tokens, "attention_mask": no_tokens}
        labels = [sample.meta.get("label") for sample in samples]
        has_labels = all(isinstance(label, int) and not isinstance(label, bool) for label in labels)
        return Batch(
            images=images,
            input_ids=torch.as_tensor(tokens["input_ids"]).long(),
            attention_mask=torch.as_tensor(tokens["attention_mask"]).long(),
            keys=[sample.key for sample in samples],
            labels=torch.tensor(labels) if has_labels else None,
            **extra,
        )


def source_urls(spec: str, data_cfg: DataConfig, *, what: str) -> list[str]:
    """The URLs of ``spec``'s shards, each CSV/TSV table replaced by its pieces (read with the
    ``data.csv_*`` keys, which its header is checked against here)."""
    table_format = TableFormat(data_cfg.csv_separator, data_cfg.csv_image_key, data_cfg.csv_caption_key)
    return expand_tables(expand_urls(spec, what=what), table_format, data_cfg.csv_shard_rows)


# The records that stand for what of a shard could not be read (``read_shard``): where the failure
# is the reader's own (a shard staged on one node, a transient pipe: or S3 error), so is the record.
UNREAD_REASONS = frozenset({"shard_open", "truncated_tar"})


def read_source(url: str, first: int = 0, every: int = 1) -> Iterator[RawSample]:
    """The raw samples of a shard or of a table's piece, every ``every``-th from ``first`` (a rank's
    share): a piece reads only those rows' images, a tar is read through. A shard's unread-rest
    record goes to every share that meets it, so a rank that lost its samples counts the loss."""
    if is_piece(url):
        return read_piece(url, first, every)
    return _share(read_shard(url), first, every)


def _share(records: Iterator[RawSample], first: int, every: int) -> Iterator[RawSample]:
    """Every ``every``-th record from ``first``, and each unread-rest record wherever it falls."""
    for index, raw in enumerate(records):
        if index % every == first or raw.get("__bad__") in UNREAD_REASONS:
            yield raw


def keys_for(raw: RawSample, keys: tuple[str, ...]) -> tuple[str, ...]:
    """The caption keys of ``raw``: a table's rows hold their caption (the ``data.csv_caption_key``
    column) as ``txt``, whatever ``data.caption_key`` picks in tar shards."""
    return DEFAULT_CAPTION_KEYS if is_piece(raw["__url__"]) else keys


def check_source_options(data_cfg: DataConfig, urls: list[str]) -> None:
    """``data.caption_key`` picks a tar member, the ``data.csv_*`` keys read a table: set where
    ``urls`` (data.train's and data.val's) hold no data of their kind, they are a mix-up of the two."""
    tables = sum(is_table(url) or is_piece(url) for url in urls)
    if data_cfg.caption_keys != DEFAULT_CAPTION_KEYS and tables == len(urls):
        raise DataError(
            f"data.caption_key={data_cfg.caption_key!r} picks a member of tar shards, but data.train and "
            "data.val are CSV/TSV tables: name their caption column with data.csv_caption_key"
        )
    if data_cfg.csv_caption_key and not tables:
        raise DataError(
            f"data.csv_caption_key={data_cfg.csv_caption_key!r} names a column of CSV/TSV tables, but "
            "data.train and data.val are tar shards: pick their caption member with data.caption_key "
            "(txt, caption, json:FIELD, or a list of them)"
        )
    defaults = DataConfig()
    for key in ("csv_separator", "csv_image_key", "csv_shard_rows"):
        if not tables and (value := getattr(data_cfg, key)) != getattr(defaults, key):
            raise DataError(
                f"data.{key}={value!r} reads CSV/TSV tables, but data.train and data.val are tar shards: "
                "drop it"
            )


def usable(
    items: Iterable[RawSample], tally: SkipTally, decode: Decode, start: int = 0
) -> Iterator[tuple[int, Decoded]]:
    """Each usable sample with the count of items taken up to it, ``start`` of them before ``items``;
    the unusable ones are counted in ``tally``."""
    for taken, raw in enumerate(items, start + 1):
        try:
            sample = decode(raw, taken)
        except BadSample as bad:
            tally.add_bad(bad, raw)
            continue
        tally.add_good(sample.source)
        yield taken, sample
