"""``model.init_from``: a clip_train checkpoint (a file, checkpoint or run directory) or, with the
``open_clip:`` prefix, an open_clip CLIP; the run takes its weights and nothing else. A ViT's
position embedding from another image size is resampled to the run's (fine-tuning at a new
resolution, as OpenCLIP's ``--force-image-size``)."""

from __future__ import annotations

from pathlib import Path

import torch

from clip_train.checkpoint import find_weights, load_weights
from clip_train.config import ModelConfig
from clip_train.logs import get_logger
from clip_train.model import CLIP, build_model
from clip_train.model.from_open_clip import KEPT_IF_ABSENT, check_open_clip, is_open_clip, load_open_clip
from clip_train.model.image import resampled_position_embedding
from clip_train.model.state_dicts import Adapt

POSITION_EMBEDDING = "visual.trunk.pos_embed"


def check_init_from(spec: str) -> None:
    """Find what ``spec`` names without reading the weights, so that a missing file (e.g. hub weights
    not in the local cache) or an open_clip tower that never maps fails before the model is built."""
    if is_open_clip(spec):
        check_open_clip(spec)
    else:
        find_weights(spec)


def pinned(spec: str, earlier: str, *, resolve: bool) -> str:
    """A clip_train run or checkpoint directory as the weights file it holds (a run directory's newest
    checkpoint's): ``earlier`` when that is one of its files (what the run's start pinned), else with
    ``resolve`` the one it holds now. A run still training in that directory would otherwise give a
    resumed run another teacher, and WiSE-FT another start. Files and open_clip names stay as named;
    a pinned file since pruned there is said, and with ``resolve`` replaced by the newest."""
    if not spec or is_open_clip(spec) or Path(spec).is_file():
        return spec
    folder = Path(spec).resolve()
    if earlier and Path(earlier).resolve() != folder and Path(earlier).resolve().is_relative_to(folder):
        if Path(earlier).is_file() or not resolve:
            return earlier
        now = find_weights(spec)
        get_logger().warning(f"{earlier}, the weights this run started with, is gone from {spec}: {now}")
        return str(now)
    return str(find_weights(spec)) if resolve else spec


def load_init_from(cfg: ModelConfig, model: CLIP, key: str = "model.init_from") -> None:
    """Replace every weight of ``model`` with those ``cfg.init_from`` names (given as ``key``); a
    sigmoid-loss run from softmax weights keeps its ``model.init_logit_bias``."""
    adapt = at_the_run_image_size(model, key)
    if is_open_clip(cfg.init_from):
        load_open_clip(cfg.init_from, model, cfg, adapt=adapt)
    else:
        load_weights(cfg.init_from, model, kept_if_absent=KEPT_IF_ABSENT, adapt=adapt)


def built_from(cfg: ModelConfig, key: str) -> CLIP:
    """A model of ``cfg`` holding the weights its ``init_from`` names: a teacher, a WiSE-FT start."""
    model = build_model(cfg, load_pretrained=False)
    load_init_from(cfg, model, key)
    return model


def at_the_run_image_size(model: CLIP, key: str) -> Adapt:
    """Resamples the weights' ViT position embedding to ``model``'s patch grid, saying so."""

    def adapt(weights: dict[str, torch.Tensor]) -> None:
        embedding = weights.get(POSITION_EMBEDDING)
        if embedding is None or (resampled := resampled_position_embedding(model.visual, embedding)) is None:
            return
        weights[POSITION_EMBEDDING] = resampled
        get_logger().info(
            f"{key}: {POSITION_EMBEDDING} resampled (bicubic) from {tuple(embedding.shape)} to "
            f"{tuple(resampled.shape)}, the patch grid of {model.image_size} px images"
        )

    return adapt
