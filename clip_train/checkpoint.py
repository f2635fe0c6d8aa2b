"""Step checkpoints: ``{out_dir}/checkpoints/step_{N:08d}/`` written atomically.

A checkpoint directory holds ``model.safetensors`` (the weights, readable with no project code)
and ``train_state.pt`` (optimizer, scheduler, scaler, step, data position and every rank's RNG
state), which loads with ``torch.load(weights_only=True)``. It is first written to a hidden
temporary directory and then renamed, so a directory named ``step_*`` is always complete.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from clip_train.errors import UserError

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
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
    out_dir: str | os.PathLike, step: int, model: nn.Module, train_state: dict, keep: int
) -> Path:
    """Write one checkpoint atomically and prune all but the newest ``keep``. Call on one rank."""
    root = checkpoint_root(out_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(weights, tmp / MODEL_FILE, metadata={"step": str(step)})
    torch.save(train_state, tmp / STATE_FILE)
    for path in (tmp / MODEL_FILE, tmp / STATE_FILE):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():  # a rerun of the same step after a restart replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in complete_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """Finished checkpoint directories, oldest first; temporary or partial ones are ignored."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if _STEP_DIR.match(d.name) and _is_complete(d)]
    return sorted(found, key=lambda d: int(_STEP_DIR.match(d.name).group(1)))


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


def load_weights(path: str | os.PathLike, model: nn.Module) -> None:
    """Load ``model.safetensors`` from a checkpoint directory (or the file itself), strictly."""
    path = Path(path)
    file = path / MODEL_FILE if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"no weights at {file}")
    model.load_state_dict(load_file(file, device=str(next(model.parameters()).device)))


def load_train_state(path: str | os.PathLike) -> dict:
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
