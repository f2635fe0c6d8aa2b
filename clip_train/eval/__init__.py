"""Zero-shot classification and image↔text retrieval recall@k, as one process or under torchrun.

Every rank encodes its own share of the data and only features or hit counts are gathered, so the
work scales with the ranks instead of leaving them idle while rank 0 evaluates.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from clip_train.checkpoint import checkpoint_model_config, run_config_file
from clip_train.config import (
    Config,
    DataConfig,
    EvalConfig,
    check_evaluation,
    evaluates_anything,
    load_config,
)
from clip_train.data.eval_sources import (
    EvalError,
    FolderClasses,
    class_map,
    image_folder_batches,
    shard_batches,
    zeroshot_sources,
)
from clip_train.distributed import rank_and_world, require_host_collectives
from clip_train.eval.encode import encode_split
from clip_train.eval.metrics import hits_at_k, retrieval_recall, validation_loss, zeroshot_from_features
from clip_train.eval.zeroshot import (
    build_zeroshot_classifier,
    synsets_of,
    zeroshot_metadata,
)

__all__ = [
    "EvalError",
    "build_zeroshot_classifier",
    "encode_split",
    "eval_config",
    "evaluate",
    "evaluates_anything",
    "hits_at_k",
    "retrieval_recall",
    "synsets_of",
    "zeroshot_from_features",
    "zeroshot_metadata",
]


@torch.no_grad()  # the logit scale is a parameter: a graph would keep every block of the loss's logits
def evaluate(
    model: nn.Module,
    eval_cfg: EvalConfig,
    data_cfg: DataConfig,
    *,
    device: torch.device,
    precision: str,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Zero-shot and retrieval metrics (``zeroshot/top1``, for each of ``eval.zeroshot_sets``
    ``zeroshot/NAME/top1``, ``retrieval/image_to_text_R@1``, …),
    with retrieval the loss over ``data.val`` as one batch (``val/loss``), and for each the samples
    counted (``/n``) and the bad ones skipped (``/skipped``).

    Call on every rank with the unwrapped model (not the DDP wrapper). When zero-shot reads
    ``data.val`` too, one pass over it serves both.
    """
    require_host_collectives(group)
    rank, world = rank_and_world(group)
    retrieval = eval_cfg.retrieval and bool(data_cfg.val)
    encode = dict(device=device, precision=precision, group=group)
    share = dict(
        batch_size=eval_cfg.batch_size,
        workers=data_cfg.workers,
        rank=rank,
        world_size=world,
        pin_memory=device.type == "cuda",
    )
    sets: dict[
        str, tuple[str, FolderClasses | None, Iterable | None]
    ] = {}  # prefix: source, classes, batches
    if eval_cfg.zeroshot:  # check the class names and every labelled set before any long work
        classnames, templates = zeroshot_metadata(eval_cfg.zeroshot)
        synsets = synsets_of(eval_cfg.zeroshot)
        for prefix, (key, source) in zeroshot_sources(eval_cfg, data_cfg).items():
            classes = class_map(source, classnames, synsets, key)
            shared_pass = retrieval and source == data_cfg.val  # labels read in the retrieval pass
            batches = None if shared_pass else _labelled_batches(source, key, classes, model, data_cfg, share)
            sets[prefix] = source, classes, batches
    metrics: dict[str, float] = {}
    if retrieval:
        labels = any(batches is None for _, _, batches in sets.values())
        val_batches = shard_batches(
            data_cfg.val, model, data_cfg=data_cfg, what="data.val", labels=labels, **share
        )
        val_split = encode_split(model, val_batches, text=True, labels=labels, source=data_cfg.val, **encode)
        recall = retrieval_recall(val_split.image_features, val_split.text_features, group=group)
        metrics |= {f"retrieval/{k}": v for k, v in recall.items()}
        metrics["retrieval/skipped"] = sum(val_split.skipped.values())
        scale, bias = model.logit_scale.exp(), model.logit_bias
        features = val_split.image_features, val_split.text_features
        metrics["val/loss"] = validation_loss(*features, scale, bias, group=group)
    if sets:
        classifier = build_zeroshot_classifier(
            model, classnames, templates, batch_size=eval_cfg.batch_size, **encode
        )
        for prefix, (source, classes, batches) in sets.items():
            if batches is None:
                split = val_split
            else:
                split = encode_split(model, batches, text=False, labels=True, source=source, **encode)
            scored = None if classes is None else classes.scored
            rows = classifier if scored is None else classifier[scored]
            accuracy = zeroshot_from_features(split.image_features, split.labels, rows, group=group)
            metrics |= {f"{prefix}/{k}": v for k, v in accuracy.items()}
            metrics[f"{prefix}/skipped"] = sum(split.skipped.values())
    return metrics


def _labelled_batches(
    source: str, key: str, classes: FolderClasses | None, model: nn.Module, data_cfg: DataConfig, share: dict
) -> Iterable:
    """This rank's batches of a zero-shot set: a folder of class folders (``classes``), or shards or a
    table (None)."""
    if classes is not None:
        return image_folder_batches(source, labels=classes.labels, image_size=model.image_size, **share)
    return shard_batches(source, model, data_cfg=data_cfg, what=key, captions=False, **share)


def eval_config(weights: Path, config: str | None, overrides: list[str]) -> Config:
    """The config to evaluate ``weights`` with: ``config`` with ``overrides``; without one, the
    checkpoint's own model section and, for the rest (data, eval, train), the config.yaml of the
    run it belongs to, if it is still beside it. Checked as training checks its eval settings, and for
    something to evaluate."""
    if config is not None:
        cfg = load_config(config, overrides)
    else:
        model_overrides = [item for item in overrides if item.startswith("model.")]
        if model_overrides:
            raise EvalError(
                f"override {model_overrides[0]}: without a CONFIG the checkpoint's own model config is "
                "used; give the config to change the model"
            )
        cfg = load_config(run_config_file(weights.parent), overrides, saved=True)
        cfg.model = checkpoint_model_config(weights.parent)
    check_evaluation(cfg.eval, cfg.data)
    if not evaluates_anything(cfg.eval, cfg.data):
        raise EvalError("nothing to evaluate: set eval.zeroshot=FILE|imagenet and/or data.val=SHARDS")
    return cfg
