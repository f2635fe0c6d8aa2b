"""Reading a checkpoint's weights (verified against its manifest, loaded strictly), its train state
(``weights_only``) and the model config that rebuilds it offline."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
from open_clip.constants import HF_CONFIG_NAME
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from clip_train.checkpoint.layout import (
    MANIFEST_FILE,
    MODEL_CONFIG_FILE,
    MODEL_FILE,
    RUN_CONFIG_FILE,
    STATE_FILE,
    TEXT_DIR,
    checkpoint_problem,
    run_config_file,
    step_dirs,
)
from clip_train.config import ModelConfig, load_config
from clip_train.errors import UserError
from clip_train.model.state_dicts import Adapt, misfit
from clip_train.model.tokenizer import OPEN_CLIP


def checkpoint_model_config(checkpoint: Path) -> ModelConfig:
    """The checkpoint's ``model.yaml``, pointed at its own ``text/`` and at no pretrained weights, so
    nothing outside it is needed; an older checkpoint without one falls back to the run's config."""
    cfg = saved_model_config(checkpoint)
    if cfg is None:
        raise UserError(
            f"{checkpoint} has no {MODEL_CONFIG_FILE} and is not inside a run directory with a "
            f"{RUN_CONFIG_FILE}; give the config the model was trained with"
        )
    if not (checkpoint / MODEL_CONFIG_FILE).is_file():  # the run's config: its own files, as they were
        return cfg
    return self_contained(cfg, checkpoint)


def self_contained(cfg: ModelConfig, checkpoint: Path) -> ModelConfig:
    """``cfg``, the ``model.yaml`` of ``checkpoint``, pointed in place at the checkpoint's own
    ``text/`` (the tokenizer too, unless open_clip's) and at no pretrained weights."""
    cfg.init_from = cfg.image.pretrained = ""
    cfg.text.hf, cfg.text.hf_config = str(checkpoint / TEXT_DIR), {}
    if cfg.text.tokenizer != OPEN_CLIP:
        cfg.text.tokenizer = cfg.text.hf
    return cfg


def saved_model_config(checkpoint: Path) -> ModelConfig | None:
    """The model config the checkpoint was saved with, as its run set it: its ``model.yaml``, or an
    older checkpoint's run's ``config.yaml``; None when neither is there."""
    own = checkpoint / MODEL_CONFIG_FILE
    config = own if own.is_file() else run_config_file(checkpoint)
    return None if config is None else load_config(config, saved=True).model


def checkpoint_init_from(checkpoint: Path) -> str:
    """The ``model.init_from`` of the run that wrote the checkpoint: "" for a run from scratch."""
    saved = saved_model_config(checkpoint)
    return "" if saved is None else saved.init_from


def find_weights(path: str | os.PathLike, *, verify: bool = False) -> Path:
    """The weights of a checkpoint directory or of a run directory's newest checkpoint, or ``path``
    itself when it is a weights file. A checkpoint's files (all but ``train_state.pt``) are compared
    with its manifest, by size, and with ``verify`` by checksum: one that differs is a one-line
    ``UserError`` naming it."""
    path = Path(path)
    file = path if path.is_file() else _weights_in(path)
    if file.name == MODEL_FILE and (
        problem := checkpoint_problem(file.parent, checksums=verify, with_state=False)
    ):
        raise UserError(f"checkpoint {file.parent}: {problem}")
    return file


def _weights_in(folder: Path) -> Path:
    """The weights file a checkpoint directory holds, or the newest checkpoint's of a run directory."""
    if (folder / MODEL_FILE).is_file() or (folder / MANIFEST_FILE).is_file():
        return folder / MODEL_FILE
    if found := step_dirs(folder):
        return found[-1] / MODEL_FILE
    if (folder / HF_CONFIG_NAME).is_file():
        raise UserError(
            f"{folder} is an open_clip model folder, not a clip_train checkpoint: start a run from it with "
            f"model.init_from=open_clip:local-dir:{folder}, or load it with open_clip"
        )
    missing = f"has no {MODEL_FILE} and no complete checkpoints" if folder.is_dir() else "does not exist"
    raise UserError(
        f"checkpoint not found: {folder} {missing}; pass a checkpoint directory, a run directory or a "
        ".safetensors file"
    )


def load_weights(
    path: str | os.PathLike,
    model: nn.Module,
    *,
    kept_if_absent: tuple[str, ...] = (),
    adapt: Adapt | None = None,
) -> None:
    """Load the weights ``find_weights(path, verify=True)`` names, as ``load_weights_file`` does."""
    load_weights_file(find_weights(path, verify=True), model, kept_if_absent=kept_if_absent, adapt=adapt)


def load_weights_file(
    file: Path, model: nn.Module, *, kept_if_absent: tuple[str, ...] = (), adapt: Adapt | None = None
) -> None:
    """Load a weights file strictly: a file that does not fit raises a one-line ``UserError`` naming
    the first few missing, unexpected and mis-shaped keys, a damaged one a line naming the file. The
    model keeps its own values of the ``kept_if_absent`` keys that the file lacks. ``adapt`` may
    replace the file's tensors before they are checked (fine-tuning at another image size)."""
    try:
        weights = load_file(file, device=str(next(model.parameters()).device))
    except SafetensorError as err:
        raise UserError(f"{file} is damaged (truncated or not a safetensors file): {err}") from None
    if adapt is not None:
        adapt(weights)
    if problem := misfit(weights, model.state_dict(), kept_if_absent):
        raise UserError(f"{file} does not fit the model: {problem}")
    model.load_state_dict(weights, strict=not kept_if_absent)  # checked above: only those may be missing


def load_train_state(checkpoint: str | os.PathLike) -> dict:
    """``train_state.pt`` under ``torch.load(weights_only=True)``: a file holding more than tensors
    and plain data (a pickle that would run code) is refused, never loaded with fewer checks."""
    file = Path(checkpoint) / STATE_FILE
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(
            f"{file} is not a trusted clip_train checkpoint: it holds Python objects that clip_train never "
            "saves, so it is not loaded"
        ) from None
    except (RuntimeError, EOFError):
        raise UserError(
            f"{file} is damaged: torch.load cannot read it (truncated or not a torch file)"
        ) from None
