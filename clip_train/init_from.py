"""``model.init_from``: a clip_train checkpoint (a file, checkpoint or run directory) or, with the
``open_clip:`` prefix, an open_clip CLIP; the run takes its weights and nothing else."""

from __future__ import annotations

from clip_train.checkpoint import find_weights, load_weights
from clip_train.config import ModelConfig
from clip_train.model import CLIP
from clip_train.model.from_open_clip import KEPT_IF_ABSENT, check_open_clip, is_open_clip, load_open_clip


def check_init_from(spec: str) -> None:
    """Find what ``spec`` names without reading the weights, so that a missing file (e.g. hub weights
    not in the local cache) or an open_clip tower that never maps fails before the model is built."""
    if is_open_clip(spec):
        check_open_clip(spec)
    else:
        find_weights(spec)


def load_init_from(cfg: ModelConfig, model: CLIP) -> None:
    """Replace every weight of ``model`` with those ``cfg.init_from`` names; a sigmoid-loss run from
    softmax weights keeps its ``model.init_logit_bias``."""
    if is_open_clip(cfg.init_from):
        load_open_clip(cfg.init_from, model, cfg)
    else:
        load_weights(cfg.init_from, model, kept_if_absent=KEPT_IF_ABSENT)
