"""Evaluate a checkpoint: ``clip-train eval CHECKPOINT [CONFIG] [key=value ...]``.

Zero-shot classification (class names × prompt templates → one text embedding per class) and
image↔text retrieval recall@k. Every rank encodes its own share of the data; features, or just
hit counts, are gathered at the end, so the work scales with the number of ranks instead of
leaving them idle while rank 0 evaluates. Runs as one process or under torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clip_train.errors import UserError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch import nn

    from clip_train.config import Config, DataConfig, EvalConfig

RECALL_KS = (1, 5, 10)
ZEROSHOT_KS = (1, 5)
# eval.zeroshot names served from open_clip's ImageNet lists instead of a JSON file
BUILTIN_ZEROSHOT = {"imagenet": "OPENAI_IMAGENET_TEMPLATES", "imagenet-simple": "SIMPLE_IMAGENET_TEMPLATES"}
_RETRIEVAL_BLOCK = 1024  # queries scored at once: bounds the score matrix to block × n


class EvalError(UserError):
    """A problem with what to evaluate: class-name file, labelled data or the checkpoint."""


# --------------------------------------------------------------------------------------------
# Ranking
# --------------------------------------------------------------------------------------------


def hits_at_k(scores: torch.Tensor, positive: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """Expected number of rows whose ``positive`` column is in their top k, for each k (float64).

    Ties are broken at random, in expectation: with ``a`` columns scoring higher and ``t`` tying
    (the positive included), the positive makes the top k with probability clamp((k − a) / t, 0, 1).
    So duplicate captions share the credit, and a collapsed model (all features equal) scores
    chance, k / n, rather than 1 or 0. NaN scores count as higher; a NaN positive is a miss.
    """
    import torch

    target = scores.gather(1, positive[:, None])
    above = ((scores > target) | scores.isnan()).sum(1)
    tied = (scores == target).sum(1).clamp(min=1)
    valid = ~target[:, 0].isnan()
    return torch.stack([((k - above) / tied.double()).clamp(0, 1)[valid].sum() for k in ks])


def _retrieval_hits(queries: torch.Tensor, keys: torch.Tensor, first: int, ks: Sequence[int]) -> torch.Tensor:
    """Query i's positive is key ``first + i``; scored block by block to bound memory."""
    import torch

    hits = torch.zeros(len(ks), dtype=torch.float64, device=queries.device)
    for start in range(0, queries.shape[0], _RETRIEVAL_BLOCK):
        block = queries[start : start + _RETRIEVAL_BLOCK]
        positive = torch.arange(first + start, first + start + block.shape[0], device=block.device)
        hits += hits_at_k(block @ keys.T, positive, ks)
    return hits


def retrieval_recall(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    ks: Sequence[int] = RECALL_KS,
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Image→text and text→image recall@k, where row i of both is one pair.

    Under torch.distributed each rank passes its own pairs (any count, even zero); it gathers the
    other side's features, ranks its own queries against all of them and the hits are summed, so
    the result is the single-process one on the concatenated features. Ties: see ``hits_at_k``.
    """
    import torch

    from clip_train.distributed import gather_rows, rank_and_world, sum_over_ranks

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
    metrics = {f"image_to_text_R@{k}": hits[i] / total for i, k in enumerate(ks)}
    metrics |= {f"text_to_image_R@{k}": hits[len(ks) + i] / total for i, k in enumerate(ks)}
    return metrics | {"n": float(total)}


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def inference(model: nn.Module, device: torch.device, precision: str) -> Iterator[None]:
    """no_grad, eval mode (no dropout) and autocast; the model's train/eval mode is restored after."""
    import torch

    from clip_train.precision import autocast

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device, precision):
            yield
    finally:
        model.train(was_training)


def _feature_dtype(precision: str) -> torch.dtype:
    """Scores are compared in fp32 at least (fp64 runs keep fp64), whatever autocast produced."""
    import torch

    return torch.float64 if precision == "fp64" else torch.float32


@dataclass
class EncodedSplit:
    """One rank's share of a split: features in sample order, and labels when asked for."""

    image_features: torch.Tensor
    text_features: torch.Tensor | None
    labels: torch.Tensor | None


def encode_split(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    device: torch.device,
    precision: str,
    text: bool,
    labels: bool,
    source: str = "eval data",
) -> EncodedSplit:
    """Encode every batch (``.images``; ``.input_ids``/``.attention_mask``; ``.labels``)."""
    import torch

    dtype = _feature_dtype(precision)
    images: list[torch.Tensor] = []
    texts: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    with inference(model, device, precision):
        for batch in batches:
            images.append(model.encode_image(batch.images.to(device, non_blocking=True)).to(dtype))
            if text:
                ids = batch.input_ids.to(device, non_blocking=True)
                mask = batch.attention_mask.to(device, non_blocking=True)
                texts.append(model.encode_text(ids, mask).to(dtype))
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


# --------------------------------------------------------------------------------------------
# Zero-shot classification
# --------------------------------------------------------------------------------------------

Template = Callable[[str], str]


def zeroshot_metadata(spec: str) -> tuple[list[str], list[Template]]:
    """Class names and prompt templates from ``imagenet``/``imagenet-simple`` or a JSON file.

    The JSON holds ``{"classnames": [...], "templates": ["a photo of a {}.", ...]}``; the class
    order is the label order.
    """
    if spec in BUILTIN_ZEROSHOT:
        from open_clip import zero_shot_metadata

        templates = getattr(zero_shot_metadata, BUILTIN_ZEROSHOT[spec])
        return list(zero_shot_metadata.IMAGENET_CLASSNAMES), list(templates)
    path = Path(spec)
    if not path.is_file():
        raise EvalError(
            f"eval.zeroshot={spec!r}: no such file; give a class-name JSON file or one of "
            f"{', '.join(BUILTIN_ZEROSHOT)}"
        )
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise EvalError(f"eval.zeroshot={spec}: not valid JSON: {err}") from None
    classnames = meta.get("classnames") if isinstance(meta, dict) else None
    templates = meta.get("templates") if isinstance(meta, dict) else None
    for key, values in (("classnames", classnames), ("templates", templates)):
        if not (isinstance(values, list) and values and all(isinstance(v, str) for v in values)):
            raise EvalError(f"eval.zeroshot={spec}: {key!r} must be a non-empty list of strings")
    bad = [t for t in templates if "{}" not in t]
    if bad:
        raise EvalError(f"eval.zeroshot={spec}: template {bad[0]!r} has no '{{}}' for the class name")
    return classnames, [t.format for t in templates]


def build_zeroshot_classifier(
    model: nn.Module,
    classnames: Sequence[str],
    templates: Sequence[Template | str],
    *,
    device: torch.device,
    batch_size: int = 256,
    precision: str = "fp32",
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """(classes, d) L2-normalised class embeddings: each the mean over templates, re-normalised.

    Ranks split the classes into contiguous blocks and gather them, so the rows stay in class
    order and ImageNet's 80 000 prompts cost 1/world of the time on each rank.
    """
    import torch
    import torch.nn.functional as F

    from clip_train.distributed import gather_rows, rank_and_world

    fill = [t if callable(t) else t.format for t in templates]
    rank, world = rank_and_world(group)
    first, stop = rank * len(classnames) // world, (rank + 1) * len(classnames) // world
    per_forward = max(1, batch_size // len(fill))
    rows: list[torch.Tensor] = []
    with inference(model, device, precision):
        for start in range(first, stop, per_forward):
            names = classnames[start : min(start + per_forward, stop)]
            tokens = model.tokenizer([template(name) for name in names for template in fill])
            features = model.encode_text(tokens["input_ids"].to(device), tokens["attention_mask"].to(device))
            features = features.to(_feature_dtype(precision)).view(len(names), len(fill), -1).mean(1)
            rows.append(F.normalize(features, dim=-1))
    local = torch.cat(rows) if rows else torch.zeros((0, 0), dtype=_feature_dtype(precision), device=device)
    return gather_rows(local, group)[0]


def zeroshot_from_features(
    image_features: torch.Tensor,
    labels: torch.Tensor,
    classifier: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Top-1/top-5 accuracy of this rank's features, counts summed over ranks."""
    import torch

    from clip_train.distributed import sum_over_ranks

    num_classes = classifier.shape[0]
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


def zeroshot_accuracy(
    model: nn.Module,
    loader: Iterable[Any],
    classifier: torch.Tensor,
    *,
    device: torch.device,
    precision: str = "fp32",
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Encode this rank's labelled images and score them against ``classifier``: top1, top5, n."""
    split = encode_split(model, loader, device=device, precision=precision, text=False, labels=True)
    return zeroshot_from_features(split.image_features, split.labels, classifier, group=group)


# --------------------------------------------------------------------------------------------
# Data sources
# --------------------------------------------------------------------------------------------


@dataclass
class LabelledImages:
    """An ImageFolder batch in the shape ``encode_split`` reads (no captions)."""

    images: torch.Tensor
    labels: torch.Tensor


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
    """This rank's strided share of a torchvision ImageFolder, as uint8 centre crops.

    Class folders sort into label order, which for ImageNet's synset folders is the order of
    open_clip's class names. The folder is checked now, before any encoding.
    """
    from torch.utils.data import DataLoader, Subset
    from torchvision.datasets import ImageFolder

    from clip_train.data.transforms import eval_transform
    from clip_train.preemption import ignore_preemption_signals

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
        worker_init_fn=ignore_preemption_signals,
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
) -> Iterable[Any]:
    """This rank's samples of a set of WebDataset shards, each sample seen by exactly one rank."""
    from clip_train.data import build_eval_loader

    return build_eval_loader(
        urls,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        image_size=model.image_size,
        tokenizer=model.tokenizer,
        workers=workers,
        pin_memory=pin_memory,
    )


# --------------------------------------------------------------------------------------------
# Everything the config asks for
# --------------------------------------------------------------------------------------------


def labelled_images(eval_cfg: EvalConfig, data_cfg: DataConfig) -> str:
    """Where zero-shot classification reads its images: ``eval.zeroshot_data``, else ``data.val``."""
    source = eval_cfg.zeroshot_data or data_cfg.val
    if not source:
        raise EvalError(
            "eval.zeroshot is set but neither eval.zeroshot_data nor data.val names labelled images"
        )
    return source


def evaluate(
    model: nn.Module,
    eval_cfg: EvalConfig,
    data_cfg: DataConfig,
    *,
    device: torch.device,
    precision: str,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Zero-shot and retrieval metrics (``zeroshot/top1``, ``retrieval/image_to_text_R@1``, …).

    Call on every rank with the unwrapped model (not the DDP wrapper). When zero-shot reads
    ``data.val`` too, one pass over it serves both.
    """
    from clip_train.distributed import rank_and_world

    rank, world = rank_and_world(group)
    zeroshot_source = labelled_images(eval_cfg, data_cfg) if eval_cfg.zeroshot else ""
    retrieval = eval_cfg.retrieval and bool(data_cfg.val)
    shared_pass = retrieval and bool(eval_cfg.zeroshot) and zeroshot_source == data_cfg.val
    encode = dict(device=device, precision=precision)
    share = dict(
        batch_size=eval_cfg.batch_size,
        workers=data_cfg.workers,
        rank=rank,
        world_size=world,
        pin_memory=device.type == "cuda",
    )
    if eval_cfg.zeroshot:  # check the class names and the labelled data before any long work
        classnames, templates = zeroshot_metadata(eval_cfg.zeroshot)
        if shared_pass:
            zeroshot_batches = None
        elif is_image_folder(zeroshot_source):
            zeroshot_batches = image_folder_batches(
                zeroshot_source, num_classes=len(classnames), image_size=model.image_size, **share
            )
        else:
            zeroshot_batches = shard_batches(zeroshot_source, model, **share)
    metrics: dict[str, float] = {}
    if retrieval:
        batches = shard_batches(data_cfg.val, model, **share)
        val_split = encode_split(model, batches, text=True, labels=shared_pass, source=data_cfg.val, **encode)
        recall = retrieval_recall(val_split.image_features, val_split.text_features, group=group)
        metrics |= {f"retrieval/{k}": v for k, v in recall.items()}
    if eval_cfg.zeroshot:
        classifier = build_zeroshot_classifier(
            model, classnames, templates, batch_size=eval_cfg.batch_size, group=group, **encode
        )
        if shared_pass:
            split = val_split
        else:
            split = encode_split(
                model, zeroshot_batches, text=False, labels=True, source=zeroshot_source, **encode
            )
        accuracy = zeroshot_from_features(split.image_features, split.labels, classifier, group=group)
        metrics |= {f"zeroshot/{k}": v for k, v in accuracy.items()}
    return metrics


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        help="checkpoint directory, run directory (its newest checkpoint) or a .safetensors file",
    )
    parser.add_argument(
        "config",
        nargs="?",
        help="YAML run config whose model, data and eval sections are used; without it, the "
        "checkpoint's own model config and the other sections of its run's config.yaml",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="e.g. eval.zeroshot=imagenet eval.zeroshot_data=/data/imagenet/val train.precision=bf16",
    )


def eval_config(weights: Path, config: str | None, overrides: list[str]) -> Config:
    """``config`` with ``overrides``; without one, the checkpoint's own model section and, for the
    rest (data, eval, train), the config.yaml of the run it belongs to, if it is still beside it."""
    from clip_train.checkpoint import checkpoint_model_config, run_config_file
    from clip_train.config import load_config

    if config is not None:
        return load_config(config, overrides)
    model_overrides = [item for item in overrides if item.startswith("model.")]
    if model_overrides:
        raise EvalError(
            f"override {model_overrides[0]}: without a CONFIG the checkpoint's own model config is used; "
            "give the config to change the model"
        )
    cfg = load_config(run_config_file(weights.parent), overrides)
    cfg.model = checkpoint_model_config(weights.parent)
    return cfg


def run(args: argparse.Namespace) -> int:
    import torch

    from clip_train.checkpoint import find_weights, load_weights
    from clip_train.distributed import init_distributed, shutdown_distributed
    from clip_train.model import build_model

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).is_file():  # CONFIG left out
        config, overrides = None, [config, *overrides]
    file = find_weights(args.checkpoint)
    cfg = eval_config(file, config, overrides)
    if cfg.eval.batch_size <= 0:
        raise EvalError(f"eval.batch_size={cfg.eval.batch_size} must be > 0")
    if not cfg.eval.zeroshot and not (cfg.eval.retrieval and cfg.data.val):
        raise EvalError("nothing to evaluate: set eval.zeroshot=FILE|imagenet and/or data.val=SHARDS")
    env = init_distributed(cfg.train.device, cfg.train.dist_timeout_s)
    try:
        model = build_model(cfg.model, load_pretrained=False).to(env.device)
        if cfg.train.precision == "fp64":
            model = model.to(torch.float64)
        load_weights(file, model)
        metrics = evaluate(model, cfg.eval, cfg.data, device=env.device, precision=cfg.train.precision)
        if env.is_main:
            for key, value in metrics.items():
                print(f"{key:<32} {int(value) if key.endswith('/n') else f'{value:.4f}'}")
            print(json.dumps({"checkpoint": str(file), **metrics}))
    finally:
        shutdown_distributed()
    return 0
