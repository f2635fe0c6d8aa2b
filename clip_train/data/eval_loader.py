"""The evaluation loader: every sample of eval shards or tables once across ranks, centre-cropped."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from clip_train.config import DataConfig
from clip_train.data.batches import (
    Batch,
    BatchBuilder,
    RawSample,
    Tokenizer,
    keys_for,
    read_source,
    source_urls,
    usable,
)
from clip_train.data.samples import Decoded, SkipTally, decode_sample
from clip_train.data.transforms import ImageTransform, eval_transform
from clip_train.preemption import signal_free_workers


@dataclass
class EvalStream(IterableDataset):
    """Every sample once across ranks: workers split the shards, ranks split each shard's samples
    (sample i goes to rank i % world_size), so any number of shards serves any world size."""

    urls: list[str]
    rank: int
    world_size: int
    batch_size: int
    transform: ImageTransform
    tokenizer: Tokenizer
    caption_keys: tuple[str, ...]  # several: the first usable one (no randomness in evaluation)
    captions: bool = True  # what the pass needs of a sample: no sample is skipped for what it does not
    labels: bool = True

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        tally = SkipTally.counting_only()
        batch = BatchBuilder(self.batch_size)
        tokenizer = self.tokenizer if self.captions else None

        def decode(raw: RawSample, _: int) -> Decoded:
            keys = keys_for(raw, self.caption_keys)
            return decode_sample(raw, keys, meta_needed=self.labels, caption_needed=self.captions)

        for url in self.urls[worker::workers]:
            mine = read_source(url, self.rank, self.world_size)
            for _, sample in usable(mine, tally, decode):
                # A full batch goes once the next sample is usable: the last one then counts the
                # samples skipped after it too.
                if batch.full():
                    yield batch.batch(tokenizer, skipped=tally.take_pending())
                batch.add(sample, self.transform(sample.image))
        skipped = tally.take_pending()
        if len(batch):
            yield batch.batch(tokenizer, skipped=skipped)
        elif skipped:  # a share without one usable sample: its skips must still be counted
            no_rows = torch.zeros(0, dtype=torch.long)
            yield Batch(no_rows.byte(), no_rows, no_rows, keys=[], skipped=skipped)


def build_eval_loader(
    urls: str,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    image_size: int,
    tokenizer: Tokenizer,
    workers: int = 2,
    pin_memory: bool = False,
    data_cfg: DataConfig | None = None,
    what: str = "eval data",
    captions: bool = True,
    labels: bool = True,
) -> DataLoader:
    """A re-iterable loader over eval shards or tables (a spec as for ``data.val``, tables read
    with ``data_cfg``'s ``csv_*`` keys, shards' captions with its ``caption_key``): deterministic,
    centre crops, each sample exactly once across ranks, the last batch partial, and a share with
    no usable sample one empty batch that carries its skip counts. Ranks may get different numbers
    of batches; gather features after the loop, not per batch. ``captions``/``labels``: what the
    pass needs of each sample (retrieval no label, zero-shot alone no caption), and so what costs a
    sample where it is missing or broken; a batch has labels only where read, with every sample's."""
    data_cfg = data_cfg or DataConfig()
    shard_urls = source_urls(urls, data_cfg, what=what)  # what: the key that names them, for errors
    dataset = EvalStream(
        shard_urls,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        transform=eval_transform(image_size),
        tokenizer=tokenizer,
        caption_keys=data_cfg.caption_keys,
        captions=captions,
        labels=labels,
    )
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=min(workers, len(shard_urls)),
        pin_memory=pin_memory and torch.cuda.is_available(),
        **signal_free_workers(),
    )
