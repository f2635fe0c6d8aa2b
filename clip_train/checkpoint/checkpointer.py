"""A run's ``Checkpointer``: saves on rank 0 of every component's state, and the resume point picked
and verified at start-up."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from safetensors.torch import load_file

from clip_train.checkpoint.layout import (
    EMA_FILE,
    MODEL_CONFIG_FILE,
    MODEL_FILE,
    SHARDS_DIR,
    checkpoint_root,
    resolve_resume,
    saved_step,
    step_dirs,
)
from clip_train.checkpoint.reading import (
    load_train_state,
    load_weights_file,
    saved_model_config,
    self_contained,
)
from clip_train.checkpoint.writing import remove_stale_temp_dirs, save_checkpoint, set_aside_newer
from clip_train.config import CheckpointConfig, ModelConfig, TextTowerConfig, TowerConfig
from clip_train.distributed import decided_by_main, gather_to_main, rank_and_world
from clip_train.errors import UserError
from clip_train.logs import get_logger
from clip_train.model import CLIP
from clip_train.model.tokenizer import build_tokenizer, how_tokens_differ

if TYPE_CHECKING:
    from clip_train.ema import WeightsEMA
    from clip_train.remote import RemoteMirror


# The model.* settings a resume may change: where the first weights came from (the checkpoint holds
# every weight, and a file or hub name may have moved), and how a tower trains rather than what it
# computes (a changed locking is said by the optimizer's groups; gradient checkpointing saves memory).
RESUMES_WITH_ANY = frozenset(
    {"init_from", "init_logit_scale", "init_logit_bias", "image.pretrained", "text.hf", "text.tokenizer"}
    | {f"{tower}.{field.name}" for tower in ("image", "text") for field in dataclasses.fields(TowerConfig)}
)

_UNSET = object()  # a dict's key that one config lacks


def _leaves(value: Any, key: str) -> dict[str, Any]:
    """A config's values by dotted key, its dicts (``timm_kwargs``, ``hf_config``) opened too."""
    if not isinstance(value, dict):
        return {key: value}
    return {
        name: leaf for part, item in value.items() for name, leaf in _leaves(item, f"{key}.{part}").items()
    }


def model_changes(saved: ModelConfig, now: ModelConfig) -> list[str]:
    """Each ``model.*`` key whose value differs from the ``saved`` one, as ``key=now (saved: value)``,
    but for those a resume may change (``RESUMES_WITH_ANY``)."""
    before, after = (_leaves(dataclasses.asdict(cfg), "model") for cfg in (saved, now))
    may_change = {f"model.{key}" for key in RESUMES_WITH_ANY}
    changed = [
        key
        for key in dict.fromkeys([*before, *after])
        if key not in may_change and before.get(key, _UNSET) != after.get(key, _UNSET)
    ]
    return [f"{key}={after.get(key, 'unset')} (saved: {before.get(key, 'unset')})" for key in changed]


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
    ema: WeightsEMA | None = None  # saved beside the weights, in ema.safetensors
    remote: RemoteMirror | None = None  # checkpoint.remote, on rank 0: resume=auto pulls from it

    def save(self, step: int) -> None:
        """Every rank contributes its own state; rank 0 writes. A collective: a save that fails raises
        the same one-line ``UserError`` on every rank."""
        gathered = self._gathered_per_rank()

        def write() -> Path:
            return save_checkpoint(
                self.run_dir,
                step,
                self.model,
                self.model_cfg,
                self._train_state(gathered),
                self.cfg.keep,
                self.cfg.keep_every,
                check_space=self.cfg.check_free_space,
                ema=self.ema.full_weights(keep=True) if self.ema else None,
            )

        decided_by_main(write)

    def _gathered_per_rank(self) -> dict[str, Any]:
        """Each per-rank component's states of every rank, on rank 0 (a collective)."""
        return {name: gather_to_main(part.state_dict()) for name, part in self.per_rank.items()}

    def _train_state(self, gathered: dict[str, Any]) -> dict[str, Any]:
        """``train_state.pt``: the world size, the per-rank states gathered and the shared ones."""
        shared = {name: part.state_dict() for name, part in self.shared.items()}
        return {"world_size": rank_and_world()[1], **gathered, **shared}

    def restore(self) -> Path | None:
        """Load ``checkpoint.resume`` (none, ``auto`` or a path), which rank 0 has chosen and verified."""
        path = decided_by_main(self._resume_point)
        if path is None:
            return None
        if (path / SHARDS_DIR).is_dir():
            raise UserError(
                f"checkpoint {path} was written by a train.parallel=fsdp run: resume it with "
                f"train.parallel=fsdp, or start a new run from its weights with model.init_from={path}"
            )
        load_weights_file(path / MODEL_FILE, self.model)
        self._load_components(load_train_state(path))  # a changed locking is said by the optimizer's groups
        if self._resumes_ema(path):
            self.ema.load_full_weights(load_file(path / EMA_FILE))
        return path

    def _resumes_ema(self, path: Path) -> bool:
        """Whether the EMA this run keeps is in the checkpoint. One saved without (``train.ema_decay``
        turned on at a resume) starts the EMA from its weights, which must be loaded first."""
        if self.ema is None:
            return False
        if (path / EMA_FILE).is_file():
            return True
        if rank_and_world()[0] == 0:
            get_logger().warning(f"checkpoint {path} has no {EMA_FILE}: the EMA starts from its weights")
        self.ema.restart()
        return False

    def _load_components(self, state: dict[str, Any]) -> None:
        """Every component's state; the per-rank ones only at the world size they were saved at."""
        for name, part in self.shared.items():
            part.load_state_dict(state[name])
        rank, world = rank_and_world()
        if state["world_size"] == world:
            for name, part in self.per_rank.items():
                part.load_state_dict(state[name][rank])
        elif rank == 0:
            get_logger().info(
                f"resuming on {world} ranks from a {state['world_size']}-rank checkpoint: "
                "weights and optimizer are exact; dropout and data streams restart at the step"
            )

    def _resume_point(self) -> Path | None:
        """At start-up, on rank 0: remove dead saves' temporary folders, then pick the checkpoint to
        resume and verify its checksums (``resume=auto`` pulls a newer one from ``checkpoint.remote``);
        refuse to write over another run's or over damaged ones, or to go on with other model settings,
        and set aside the newer ones the run goes on without, on the disk and on the remote."""
        for stale in remove_stale_temp_dirs(self.run_dir):
            get_logger().warning(f"removed {stale}, left by a save that did not finish")
        path = resolve_resume(self.cfg.resume, self.run_dir, verify=True)
        if self.remote is not None and self.cfg.resume == "auto":
            path = self.remote.pull_newer_than(path) or path
        if path is None and step_dirs(self.run_dir):
            if self.cfg.resume == "auto":
                raise UserError(
                    f"checkpoint.resume=auto: no checkpoint in {checkpoint_root(self.run_dir)} is sound (see "
                    "above); resume from one with checkpoint.resume=PATH, or move them away to start afresh"
                )
            raise UserError(
                f"train.out_dir={self.run_dir} already holds checkpoints of another run; continue it "
                "with checkpoint.resume=auto or pick a new train.out_dir"
            )
        starts_here = path is None or not self._is_own(path)  # afresh, or from another directory's
        if starts_here and self.remote is not None and (newest := self.remote.newest_complete()):
            raise UserError(  # its uploads would prune them
                f"checkpoint.remote={self.remote.url} already holds checkpoints of another run (newest "
                f"{newest}); continue it with checkpoint.resume=auto or pick a new checkpoint.remote"
            )
        if path is not None:
            self._check_same_model(path)
        step = saved_step(path) if path is not None else None
        if step is not None:
            for moved in set_aside_newer(self.run_dir, step):
                get_logger().warning(
                    f"{moved.name}, newer than the resumed step {step}, moved to {moved.parent}: the run "
                    f"goes on from step {step} (delete it there once it is not wanted)"
                )
            if self.remote is not None:  # pulled by a later resume=auto, they would resume that history
                self.remote.drop_newer_than(step)
        if self.remote is not None and path is not None:
            self._mirror_if_missing(path)
        return path

    def _check_same_model(self, checkpoint: Path) -> None:
        """A resume goes on training the checkpoint's model: weights that fit this run's shapes would
        otherwise train on under other settings (another pooling, context length, dropout), with no
        word and config.yaml recording only the new ones. Refused before anything is moved aside."""
        saved = saved_model_config(checkpoint)
        if saved is not None and (changed := model_changes(saved, self.model_cfg)):
            raise UserError(
                f"checkpoint {checkpoint} was saved with other model settings: {'; '.join(changed)}; "
                "resume it with its settings, or start a new run from its weights with "
                f"model.init_from={checkpoint} (fine-tuning: a new train.out_dir, a fresh optimizer)"
            )
        if saved is not None and (checkpoint / MODEL_CONFIG_FILE).is_file():  # older ones: only a path
            self._check_same_tokenizer(checkpoint, self_contained(saved, checkpoint).text)

    def _check_same_tokenizer(self, checkpoint: Path, saved: TextTowerConfig) -> None:
        """The tokenizer's path may change (a moved copy), its tokens may not: the text tower's
        embeddings are rows of the checkpoint's ids, which another vocabulary of the same size
        would reuse for other words without an error. ``saved``: the checkpoint's text tower,
        pointed at its own copy of the tokenizer."""
        saved_source, source = (text.tokenizer or text.hf for text in (saved, self.model_cfg.text))
        saved_tokenizer = build_tokenizer(saved_source, saved.context_length)
        if difference := how_tokens_differ(saved_tokenizer, self.model.tokenizer):
            raise UserError(
                f"checkpoint {checkpoint} was trained with another tokenizer than model.text.tokenizer="
                f"{source}: {difference}; resume it with model.text.tokenizer={saved_source}, or start a new "
                f"run from its weights with model.init_from={checkpoint}"
            )

    def _mirror_if_missing(self, checkpoint: Path) -> None:
        """Upload the run's resumed checkpoint if the remote lacks it whole: an upload cut short by the
        process's end is otherwise retried by the next save, and the last step's has none."""
        if self._is_own(checkpoint) and not self.remote.holds(checkpoint.name):
            self.remote.push(checkpoint)

    def _is_own(self, checkpoint: Path) -> bool:
        """Whether ``checkpoint`` is one of this run directory's."""
        return checkpoint.parent.resolve() == checkpoint_root(self.run_dir).resolve()
