"""Zero-shot classification: class names and prompt templates, and the classifier built from them."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from open_clip import zero_shot_metadata
from timm.data import ImageNetInfo
from torch import nn

from clip_train.data.eval_sources import EvalError
from clip_train.distributed import gather_rows, rank_and_world
from clip_train.eval.encode import feature_dtype, inference
from clip_train.logs import Progress

Template = Callable[[str], str]
# eval.zeroshot names served from open_clip's ImageNet lists instead of a JSON file
BUILTIN_ZEROSHOT: dict[str, Sequence[Template]] = {
    "imagenet": zero_shot_metadata.OPENAI_IMAGENET_TEMPLATES,
    "imagenet-simple": zero_shot_metadata.SIMPLE_IMAGENET_TEMPLATES,
}


def zeroshot_metadata(spec: str) -> tuple[list[str], list[Template]]:
    """Class names (in label order) and prompt templates from ``imagenet``/``imagenet-simple`` or a
    JSON file of ``{"classnames": [...], "templates": ["a photo of a {}.", ...]}``."""
    if spec in BUILTIN_ZEROSHOT:
        return list(zero_shot_metadata.IMAGENET_CLASSNAMES), list(BUILTIN_ZEROSHOT[spec])
    path = Path(spec)
    if not path.is_file():
        problem = "is a directory" if path.is_dir() else "no such file"
        raise EvalError(
            f"eval.zeroshot={spec!r}: {problem}; give a class-name JSON file or one of "
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
    for template in templates:
        if not _fills_one_name(template):
            raise EvalError(
                f"eval.zeroshot={spec}: template {template!r} must hold one '{{}}' for the class name and "
                "no other field (a literal brace is written twice: '{{' or '}}')"
            )
    return classnames, [t.format for t in templates]


def synsets_of(spec: str) -> list[str]:
    """The WordNet ids of the built-in ImageNet classes, in label order (timm ships them; they sort
    as the labels run), so class folders named by them map to labels; none for a JSON file."""
    return ImageNetInfo().label_names() if spec in BUILTIN_ZEROSHOT else []


def _fills_one_name(template: str) -> bool:
    """Whether ``template.format(name)`` works and puts the name in: checked at start-up, since the
    classifier is built after the whole retrieval pass."""
    try:
        return template.format("x") != template.format("y")
    except (IndexError, KeyError, ValueError):
        return False


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
    Ranks encode contiguous blocks of classes and gather them, so the rows stay in class order."""
    fill = [t if callable(t) else t.format for t in templates]
    dtype = feature_dtype(precision)
    rank, world = rank_and_world(group)
    first, stop = rank * len(classnames) // world, (rank + 1) * len(classnames) // world
    per_forward = max(1, batch_size // len(fill))
    rows: list[torch.Tensor] = []
    shown = Progress("zero-shot classifier", stop - first, unit="class")
    with inference(model, device, precision):
        for start in range(first, stop, per_forward):
            names = classnames[start : min(start + per_forward, stop)]
            tokens = model.tokenizer([template(name) for name in names for template in fill])
            features = model.encode_text(
                tokens["input_ids"].to(device), attention_mask=tokens["attention_mask"].to(device)
            )
            features = features.to(dtype).view(len(names), len(fill), -1).mean(1)
            rows.append(F.normalize(features, dim=-1))
            shown.update(len(names))
    shown.close()
    local = torch.cat(rows) if rows else torch.zeros((0, 0), dtype=dtype, device=device)
    return gather_rows(local, group)[0]
