"""Step checkpoints: ``{out_dir}/checkpoints/step_{N:08d}/`` written atomically.

A checkpoint directory holds ``model.safetensors`` (the weights, readable with no project code)
and ``train_state.pt`` (optimizer, scheduler, scaler, step, data position and every rank's RNG
state), which loads with ``torch.load(weights_only=True)``. It also holds what rebuilds the model
offline, without the run's config or the original weight directories: ``model.yaml`` (the model
section of the resolved config) and ``text/`` (the text encoder's transformers config and the
tokenizer files). It is first written to a hidden temporary directory and then renamed, so a
directory named ``step_*`` is always complete.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from clip_train.config import ModelConfig, load_config
from clip_train.errors import UserError

if TYPE_CHECKING:
    from clip_train.model import CLIP

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
MODEL_CONFIG_FILE = "model.yaml"
TEXT_DIR = "text"
RUN_CONFIG_FILE = "config.yaml"  # the resolved config the trainer writes into the run directory
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_root(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    """This process's RNG streams: Python, torch CPU and, when present, every CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    out_dir: str | os.PathLike,
    step: int,
    model: CLIP,
    model_cfg: ModelConfig,
    train_state: dict,
    keep: int,
    keep_every: int = 0,
) -> Path:
    """Write one checkpoint atomically and prune all but the newest ``keep``, and the milestones
    (steps divisible by ``keep_every``, when it is not 0). Call on one rank."""
    root = checkpoint_root(out_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_weights(weights, tmp / MODEL_FILE, metadata={"step": str(step)})
    torch.save(train_state, tmp / STATE_FILE)
    _write_model_files(tmp, model, model_cfg)
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    if final.exists():  # a rerun of the same step after a restart replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in complete_checkpoints(out_dir)[:-keep]:
        if not (keep_every and checkpoint_step(old) % keep_every == 0):
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_weights(
    weights: dict[str, torch.Tensor], file: Path, metadata: dict[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file``, readable as the umask allows (safetensors itself makes it 0600)."""
    save_file(weights, file, metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file, 0o666 & ~umask)  # what open() gives a new file: 0644 under the usual umask 022


def _write_model_files(directory: Path, model: CLIP, model_cfg: ModelConfig) -> None:
    """The model section, and the text encoder's config and tokenizer, which the weights file lacks."""
    section = {"model": dataclasses.asdict(model_cfg)}
    (directory / MODEL_CONFIG_FILE).write_text(yaml.safe_dump(section, sort_keys=False))
    model.text.encoder.config.save_pretrained(directory / TEXT_DIR)
    model.tokenizer.save_pretrained(directory / TEXT_DIR)


def checkpoint_model_config(checkpoint: Path) -> ModelConfig:
    """The model config of a checkpoint, to rebuild it before loading its weights.

    It is the checkpoint's ``model.yaml`` with the text encoder and tokenizer read from its own
    ``text/`` and no pretrained or ``init_from`` weights named, so nothing outside the directory
    is needed. A checkpoint written before checkpoints held these falls back to the run's
    ``config.yaml`` (and the weight directories it names).
    """
    from clip_train.model.tokenizer import OPEN_CLIP

    own = checkpoint / MODEL_CONFIG_FILE
    if not own.is_file():
        run_config = run_config_file(checkpoint)
        if run_config is None:
            raise UserError(
                f"{checkpoint} has no {MODEL_CONFIG_FILE} and is not inside a run directory with a "
                f"{RUN_CONFIG_FILE}; give the config the model was trained with"
            )
        return load_config(run_config).model
    cfg = load_config(own).model
    cfg.init_from = cfg.image.pretrained = ""
    cfg.text.hf, cfg.text.hf_config = str(checkpoint / TEXT_DIR), {}
    if cfg.text.tokenizer != OPEN_CLIP:
        cfg.text.tokenizer = cfg.text.hf
    return cfg


def run_config_file(checkpoint: Path) -> Path | None:
    """The config.yaml of the run a checkpoint directory belongs to, while it is still beside it."""
    path = checkpoint.parent.parent / RUN_CONFIG_FILE  # {out_dir}/checkpoints/step_N
    return path if path.is_file() else None


def complete_checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """Finished checkpoint directories, oldest first; temporary or partial ones are ignored."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if _STEP_DIR.match(d.name) and _is_complete(d)]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(checkpoint: Path) -> int:
    """The step in a ``step_NNNNNNNN`` directory's name."""
    return int(_STEP_DIR.match(checkpoint.name).group(1))


def resolve_resume(resume: str, out_dir: str | os.PathLike) -> Path | None:
    """``""`` → None; ``auto`` → the newest complete checkpoint (or None); else that path."""
    if not resume:
        return None
    if resume == "auto":
        found = complete_checkpoints(out_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not _is_complete(path):
        raise UserError(
            f"checkpoint.resume={resume}: not a complete checkpoint (needs {MODEL_FILE}, {STATE_FILE})"
        )
    return path


def _is_complete(path: Path) -> bool:
    return (path / MODEL_FILE).is_file() and (path / STATE_FILE).is_file()


def find_weights(path: str | os.PathLike) -> Path:
    """The weights of a checkpoint directory or of a run directory's newest complete checkpoint,
    or ``path`` itself when it is a weights file."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / MODEL_FILE).is_file():
        return path / MODEL_FILE
    found = complete_checkpoints(path)
    if found:
        return found[-1] / MODEL_FILE
    missing = f"has no {MODEL_FILE} and no complete checkpoints" if path.is_dir() else "does not exist"
    raise UserError(
        f"checkpoint not found: {path} {missing}; pass a checkpoint directory, a run directory or a "
        ".safetensors file"
    )


def load_weights(path: str | os.PathLike, model: nn.Module) -> None:
    """Load ``model.safetensors`` from a checkpoint directory (or the file itself), strictly.

    A file that does not fit raises a one-line ``UserError`` naming the missing, unexpected and
    mis-shaped keys (the first few of each).
    """
    path = Path(path)
    file = path / MODEL_FILE if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"no weights at {file}")
    weights = load_file(file, device=str(next(model.parameters()).device))
    own = model.state_dict()
    problems = {
        "Missing key(s)": sorted(own.keys() - weights.keys()),
        "Unexpected key(s)": sorted(weights.keys() - own.keys()),
        "Size mismatch": [
            f"{k} {tuple(weights[k].shape)} in the file, {tuple(own[k].shape)} in the model"
            for k in sorted(own.keys() & weights.keys())
            if weights[k].shape != own[k].shape
        ],
    }
    found = [f"{what} {_first(names)}" for what, names in problems.items() if names]
    if found:
        raise UserError(f"{file} does not fit the model: {'; '.join(found)}")
    model.load_state_dict(weights)


def _first(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def load_train_state(path: str | os.PathLike) -> dict:
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
