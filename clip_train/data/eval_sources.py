"""Eval data split over ranks: captioned or labelled WebDataset shards, or a labelled ImageFolder."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import ImageFolder

from clip_train.config import DataConfig, EvalConfig
from clip_train.data.pipeline import build_eval_loader
from clip_train.data.transforms import eval_transform
from clip_train.errors import UserError
from clip_train.preemption import signal_free_workers


class EvalError(UserError):
    """A problem with what to evaluate: class-name file, labelled data or the checkpoint."""


@dataclass
class LabelledImages:
    """An ImageFolder batch in the shape ``encode_split`` reads (no captions)."""

    images: torch.Tensor
    labels: torch.Tensor
    skipped: dict[str, int] = field(default_factory=dict)  # always empty: an ImageFolder skips no file


def labelled_images(eval_cfg: EvalConfig, data_cfg: DataConfig) -> str:
    """Where zero-shot classification reads its images: ``eval.zeroshot_data``, else ``data.val``."""
    source = eval_cfg.zeroshot_data or data_cfg.val
    if not source:
        raise EvalError(
            "eval.zeroshot is set but neither eval.zeroshot_data nor data.val names labelled images"
        )
    return source


def is_image_folder(source: str) -> bool:
    """A directory of class sub-folders (ImageNet's val layout) rather than of tar shards."""
    path = Path(source)
    if not path.is_dir():
        return False
    entries = list(path.iterdir())
    return not any(e.name.endswith(".tar") for e in entries) and any(e.is_dir() for e in entries)


def image_folder_batches(
    root: str,
    *,
    num_classes: int,
    image_size: int,
    batch_size: int,
    workers: int,
    rank: int,
    world_size: int,
    pin_memory: bool = False,
) -> Iterator[LabelledImages]:
    """This rank's strided share of an ImageFolder as uint8 centre crops, checked now, before any
    encoding. Class folders sort into label order, for ImageNet's synsets open_clip's class order."""
    dataset = ImageFolder(root, transform=eval_transform(image_size))
    if len(dataset.classes) != num_classes:
        raise EvalError(
            f"eval.zeroshot_data={root}: {len(dataset.classes)} class folders but {num_classes} class names"
        )
    share = Subset(dataset, range(rank, len(dataset), world_size))
    loader = DataLoader(
        share,
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=pin_memory,
        **signal_free_workers(),
    )
    return (LabelledImages(images, labels) for images, labels in loader)


def shard_batches(
    urls: str,
    model: nn.Module,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    workers: int = 0,
    pin_memory: bool = False,
    data_cfg: DataConfig | None = None,
) -> DataLoader:
    """This rank's samples of a set of WebDataset shards or tables (read with ``data_cfg``'s
    ``csv_*`` keys), each sample seen by exactly one rank."""
    return build_eval_loader(
        urls,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        image_size=model.image_size,
        tokenizer=model.tokenizer,
        workers=workers,
        pin_memory=pin_memory,
        data_cfg=data_cfg,
    )
