"""Step checkpoints: ``{out_dir}/checkpoints/step_{N:08d}/``, written to a hidden directory and renamed,
so a ``step_*`` directory is always complete.

It holds ``model.safetensors`` (readable without this project), ``train_state.pt`` (every component's
state; ``torch.load(weights_only=True)``), and what rebuilds the model offline: ``model.yaml`` (the
model config) and ``text/`` (the text encoder's transformers config and tokenizer files).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from clip_train.config import CheckpointConfig, ModelConfig, load_config
from clip_train.distributed import barrier, gather_to_main, rank_and_world
from clip_train.errors import UserError
from clip_train.model import CLIP
from clip_train.model.tokenizer import OPEN_CLIP

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
MODEL_CONFIG_FILE = "model.yaml"
TEXT_DIR = "text"
RUN_CONFIG_FILE = "config.yaml"  # the resolved config the trainer writes into the run directory
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_root(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


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
    section = {"model": dataclasses.asdict(model_cfg)}
    (tmp / MODEL_CONFIG_FILE).write_text(yaml.safe_dump(section, sort_keys=False))
    model.text.encoder.config.save_pretrained(tmp / TEXT_DIR)
    model.tokenizer.save_pretrained(tmp / TEXT_DIR)
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


def checkpoint_model_config(checkpoint: Path) -> ModelConfig:
    """The checkpoint's ``model.yaml``, pointed at its own ``text/`` and at no pretrained weights, so
    nothing outside it is needed; an older checkpoint without one falls back to the run's config."""
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


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run directory, if it has one."""
    found = complete_checkpoints(out_dir)
    return found[-1] if found else None


def checkpoint_step(checkpoint: Path) -> int:
    """The step in a ``step_NNNNNNNN`` directory's name."""
    return int(_STEP_DIR.match(checkpoint.name).group(1))


def resolve_resume(resume: str, out_dir: str | os.PathLike) -> Path | None:
    """``""`` → None; ``auto`` → the newest complete checkpoint (or None); else that path."""
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(out_dir)
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
    if (latest := latest_checkpoint(path)) is not None:
        return latest / MODEL_FILE
    missing = f"has no {MODEL_FILE} and no complete checkpoints" if path.is_dir() else "does not exist"
    raise UserError(
        f"checkpoint not found: {path} {missing}; pass a checkpoint directory, a run directory or a "
        ".safetensors file"
    )


def load_weights(path: str | os.PathLike, model: nn.Module) -> None:
    """Load the weights ``find_weights(path)`` names, strictly: a file that does not fit raises a
    one-line ``UserError`` naming the first few missing, unexpected and mis-shaped keys."""
    file = find_weights(path)
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


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass(eq=False)
class Checkpointer:
    """A run's checkpoints: saves, pruning and resume, over the model and every component's state.

    ``shared`` components hold the same state on every rank (rank 0's is saved); ``per_rank`` ones
    differ by rank (RNG streams, data position) and are gathered, one entry per rank. A
    checkpoint from another world size restores the shared state and the weights only.
    """

    run_dir: Path
    cfg: CheckpointConfig
    model: CLIP
    model_cfg: ModelConfig
    _: dataclasses.KW_ONLY
    shared: dict[str, Stateful]
    per_rank: dict[str, Stateful]

    def save(self, step: int) -> None:
        """Every rank contributes its own state; rank 0 writes. A collective."""
        gathered = {name: gather_to_main(part.state_dict()) for name, part in self.per_rank.items()}
        rank, world = rank_and_world()
        if rank == 0:
            state = {"world_size": world, **gathered}
            state.update({name: part.state_dict() for name, part in self.shared.items()})
            keep, keep_every = self.cfg.keep, self.cfg.keep_every
            save_checkpoint(self.run_dir, step, self.model, self.model_cfg, state, keep, keep_every)
        barrier()

    def restore(self) -> Path | None:
        """Load ``checkpoint.resume`` (none, ``auto`` or a path); refuse to write over another run's."""
        path = resolve_resume(self.cfg.resume, self.run_dir)
        if path is None:
            if self.cfg.resume != "auto" and complete_checkpoints(self.run_dir):
                raise UserError(
                    f"train.out_dir={self.run_dir} already holds checkpoints of another run; continue it "
                    "with checkpoint.resume=auto or pick a new train.out_dir"
                )
            return None
        load_weights(path, self.model)
        state = load_train_state(path)
        for name, part in self.shared.items():
            part.load_state_dict(state[name])
        rank, world = rank_and_world()
        if state["world_size"] == world:
            for name, part in self.per_rank.items():
                part.load_state_dict(state[name][rank])
        elif rank == 0:
            print(
                f"clip-train: resuming on {world} ranks from a {state['world_size']}-rank checkpoint: "
                "weights and optimizer are exact; dropout and data streams restart at the step",
                file=sys.stderr,
            )
        return path
