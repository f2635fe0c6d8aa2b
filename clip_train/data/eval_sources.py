"""Eval data split over ranks: captioned or labelled WebDataset shards, or a labelled ImageFolder."""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes

from clip_train.config import DataConfig, EvalConfig
from clip_train.data.eval_loader import build_eval_loader
from clip_train.data.samples import IMAGE_EXTENSIONS, load_rgb
from clip_train.data.transforms import eval_transform
from clip_train.errors import UserError
from clip_train.logs import get_logger
from clip_train.preemption import signal_free_workers


class EvalError(UserError):
    """A problem with what to evaluate: class-name file, labelled data or the checkpoint."""


@dataclass
class LabelledImages:
    """An ImageFolder batch in the shape ``encode_split`` reads (no captions)."""

    images: torch.Tensor
    labels: torch.Tensor
    skipped: dict[str, int] = field(default_factory=dict)  # files left out, by reason (SKIP_REASONS)

    def pin_memory(self) -> LabelledImages:
        """Called by the DataLoader's pin-memory thread."""
        return LabelledImages(self.images.pin_memory(), self.labels.pin_memory(), self.skipped)


def zeroshot_sources(eval_cfg: EvalConfig, data_cfg: DataConfig) -> dict[str, tuple[str, str]]:
    """Each zero-shot set's metric prefix, key and images: ``zeroshot`` reads ``eval.zeroshot_data``,
    else ``data.val``; ``zeroshot/NAME`` each of ``eval.zeroshot_sets``."""
    source = eval_cfg.zeroshot_data or data_cfg.val
    if not source:
        raise EvalError(
            "eval.zeroshot is set but neither eval.zeroshot_data nor data.val names labelled images"
        )
    main = {"zeroshot": ("eval.zeroshot_data" if eval_cfg.zeroshot_data else "data.val", source)}
    extra = {
        f"zeroshot/{name}": (f"eval.zeroshot_sets.{name}", path)
        for name, path in eval_cfg.zeroshot_sets.items()
    }
    return main | extra


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
    labels: list[int] | None,
    image_size: int,
    batch_size: int,
    workers: int,
    rank: int,
    world_size: int,
    pin_memory: bool = False,
) -> DataLoader:
    """This rank's strided share of an ImageFolder as uint8 centre crops (``LabelledImages``);
    ``labels``: each class folder's label (``folder_classes``), None for its sorted place. Files of
    every image format that shards take are read; one that does not decode is skipped and counted,
    as a shard's sample is. Its workers start when it is iterated, so that only the set being
    encoded holds worker processes and prefetched batches."""
    dataset = ImageFolder(
        root,
        loader=_image_or_skip_reason,
        transform=functools.partial(_crop_decoded, crop=eval_transform(image_size)),
        target_transform=None if labels is None else labels.__getitem__,
        is_valid_file=lambda path: Path(path).suffix.lower() in FOLDER_IMAGE_SUFFIXES,
    )
    share = Subset(dataset, range(rank, len(dataset), world_size))
    return DataLoader(
        share,
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=pin_memory,
        collate_fn=functools.partial(_collate_decoded, image_size=image_size),
        **signal_free_workers(),
    )


# An evaluation folder's images: the formats shards take, and those torchvision's ImageFolder reads.
FOLDER_IMAGE_SUFFIXES = frozenset({f".{ext}" for ext in IMAGE_EXTENSIONS} | set(IMG_EXTENSIONS))


def _image_or_skip_reason(path: str) -> Image.Image | str:
    """The file's image as a sample's is decoded (``load_rgb``), or the reason to skip it."""
    try:
        return load_rgb(path)
    except Exception:  # arbitrary bytes make PIL raise many types; all mean "undecodable"
        return "empty_file" if os.path.getsize(path) == 0 else "bad_image"


def _crop_decoded(
    image: Image.Image | str, crop: Callable[[Image.Image], torch.Tensor]
) -> torch.Tensor | str:
    return image if isinstance(image, str) else crop(image)  # a skip reason passes through


def _collate_decoded(items: list[tuple[torch.Tensor | str, int]], image_size: int) -> LabelledImages:
    """The decoded crops and their labels; the others counted by their reason."""
    decoded = [(image, label) for image, label in items if not isinstance(image, str)]
    skipped = collections.Counter(image for image, _ in items if isinstance(image, str))
    if not decoded:
        empty = torch.zeros((0, 3, image_size, image_size), dtype=torch.uint8)
        return LabelledImages(empty, torch.zeros(0, dtype=torch.long), dict(skipped))
    images, labels = zip(*decoded, strict=True)
    return LabelledImages(torch.stack(images), torch.tensor(labels), dict(skipped))


@dataclass(frozen=True)
class FolderClasses:
    """How a folder of class folders maps to the class names: the classes its images are scored
    among (None: all) and each folder's label (None: its sorted place)."""

    scored: list[int] | None = None
    labels: list[int] | None = None


def class_map(
    source: str, classnames: Sequence[str], synsets: Sequence[str], key: str
) -> FolderClasses | None:
    """How a zero-shot set's class folders map to the class names (``folder_classes``); None for
    shards and tables, whose samples carry their labels."""
    return folder_classes(source, classnames, synsets, key) if is_image_folder(source) else None


def folder_classes(root: str, classnames: Sequence[str], synsets: Sequence[str], key: str) -> FolderClasses:
    """Read from the class folders' names alone, so that it is checked at start-up:

    * Folders named by ``synsets`` (the class names' WordNet ids: ImageNet's ``n01440764``, …): a
      subset, such as ImageNet-R's or ImageNet-A's 200 classes, is scored among itself, as those
      sets are evaluated.
    * Folders named by numbers (ImageNet-V2's ``0`` to ``999``): the number is the label, which sorting
      the names as text (``10`` before ``2``) would not give.
    * Folders named by the class names themselves (``cat/``, ``dog/``), in whatever order the list has
      them: the name is the label.
    * Otherwise one folder per class name, in sorted order (ImageNet's val layout).
    """
    folders, _ = find_classes(root)
    if synsets and set(folders) <= set(synsets):
        if len(folders) == len(synsets):
            return FolderClasses()
        index = {synset: i for i, synset in enumerate(synsets)}
        _say_scored_among(root, len(folders), len(synsets))
        return FolderClasses(scored=[index[folder] for folder in folders])  # sorted synsets: label order
    if all(folder.isdecimal() for folder in folders):
        if max(int(folder) for folder in folders) >= len(classnames):
            raise EvalError(
                f"{key}={root}: class folder {max(folders, key=int)} names no class of {len(classnames)} "
                f"(folders named by number are labels 0 to {len(classnames) - 1})"
            )
        return FolderClasses(labels=[int(folder) for folder in folders])
    if set(folders) == set(classnames) and len(set(classnames)) == len(classnames):
        index = {name: i for i, name in enumerate(classnames)}
        return FolderClasses(labels=[index[folder] for folder in folders])
    if len(folders) != len(classnames):
        raise EvalError(f"{key}={root}: {len(folders)} class folders but {len(classnames)} class names")
    return FolderClasses()


@functools.cache
def _say_scored_among(root: str, count: int, total: int) -> None:
    get_logger().info(
        f"eval: {root} holds {count} of the {total} classes (folders named by their WordNet ids); its "
        "images are scored among those"
    )


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
    what: str = "eval data",
    captions: bool = True,
    labels: bool = True,
) -> DataLoader:
    """This rank's samples of a set of WebDataset shards or tables (read with ``data_cfg``'s
    ``csv_*`` keys), each sample seen by exactly one rank; ``captions``/``labels``: what the pass
    needs of a sample (``build_eval_loader``)."""
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
        what=what,
        captions=captions,
        labels=labels,
    )
