"""Step checkpoints: ``{out_dir}/checkpoints/step_{N:08d}/``, written to a hidden directory and renamed,
so a ``step_*`` directory is never half-written.

It holds ``model.safetensors`` (readable without this project), ``train_state.pt`` (every
component's state; ``torch.load(weights_only=True)``), with ``train.ema_decay`` ``ema.safetensors``
(the moving average of the trainable parameters, ``clip_train/ema.py``), what rebuilds the model
offline: ``model.yaml`` (the model config) and ``text/`` (the text encoder's transformers config and
tokenizer files), and, written last, ``manifest.json``: every other file's size and SHA-256. Listing
a run's checkpoints compares the sizes; resuming, evaluating, loading and exporting compare the
checksums too, so a file damaged after the save (a truncated copy, a failing disk) is never used.
Checkpoints from before manifests load unverified.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import yaml
from open_clip.constants import HF_CONFIG_NAME
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from clip_train.config import CheckpointConfig, ModelConfig, load_config
from clip_train.distributed import decided_by_main, gather_to_main, rank_and_world
from clip_train.errors import UserError
from clip_train.logs import get_logger
from clip_train.memory import format_bytes, tensor_bytes
from clip_train.model import CLIP
from clip_train.model.state_dicts import Adapt, misfit
from clip_train.model.tokenizer import OPEN_CLIP

if TYPE_CHECKING:
    from clip_train.ema import WeightsEMA
    from clip_train.remote import RemoteMirror

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
EMA_FILE = "ema.safetensors"
MODEL_CONFIG_FILE = "model.yaml"
TEXT_DIR = "text"
MANIFEST_FILE = "manifest.json"
SHARDS_DIR = (
    "shards"  # a sharded (FSDP) checkpoint's model and optimizer, torch.distributed.checkpoint's files
)
HASH = "sha256"  # hashlib's name, and the manifest's key for each file's checksum
TEMP_PREFIX = ".tmp_step_"  # a save in progress, or one whose process died
REPLACED_SUFFIX = "_replaced"  # on a temporary folder: the checkpoint a rerun of its step moved aside
SUPERSEDED_DIR = "superseded"  # checkpoints newer than a resume's, moved aside (never deleted)
RUN_CONFIG_FILE = "config.yaml"  # the resolved config the trainer writes into the run directory
_STEP_DIR = re.compile(r"^step_(\d{8,})$")  # 8 digits, more from step 10^8
# What a failed write raises: Python's OSError, torch.save's RuntimeError, safetensors' own error.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


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
    *,
    check_space: bool = True,
    ema: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write one checkpoint atomically and prune all but the newest ``keep``, and the milestones
    (steps divisible by ``keep_every``, when it is not 0). Call on one rank.

    A write that fails (a full disk, a quota, an I/O error) removes its temporary folder and raises a
    one-line ``UserError`` with the space the save needs and the space free; with ``check_space`` a
    disk that has less free space than the tensors is refused before anything is written. Older
    checkpoints are pruned only once the new one is in place. ``ema``: the weights' moving average.
    """
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    needed = tensor_bytes(weights) + tensor_bytes(train_state) + tensor_bytes(ema or {})
    tmp = fresh_temp_dir(out_dir, step, needed, check_space=check_space)
    try:
        write_checkpoint_files(tmp, step, weights, train_state, model, model_cfg, ema)
    except WRITE_ERRORS as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(cannot_save(checkpoint_dir(out_dir, step), needed, write_failure(err))) from None
    return publish_checkpoint(tmp, out_dir, step, keep, keep_every)


def checkpoint_dir(out_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` lives once complete."""
    return checkpoint_root(out_dir) / f"step_{step:08d}"


def fresh_temp_dir(out_dir: str | os.PathLike, step: int, needed: int, *, check_space: bool) -> Path:
    """An empty ``temp_checkpoint_dir`` for a save of ``needed`` bytes; with ``check_space`` a disk
    with less room is refused before anything is written (a one-line ``UserError``, as any failure)."""
    root, tmp = checkpoint_root(out_dir), temp_checkpoint_dir(out_dir, step)
    final = checkpoint_dir(out_dir, step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if check_space and shutil.disk_usage(root).free < needed:
            raise UserError(cannot_save(final, needed, "not enough free space (checked before writing)"))
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except WRITE_ERRORS as err:
        raise UserError(cannot_save(final, needed, write_failure(err))) from None
    return tmp


def temp_checkpoint_dir(out_dir: str | os.PathLike, step: int) -> Path:
    """Where a save of ``step`` by this process writes before the rename."""
    return checkpoint_root(out_dir) / f"{TEMP_PREFIX}{step:08d}_{os.getpid()}"


def publish_checkpoint(tmp: Path, out_dir: str | os.PathLike, step: int, keep: int, keep_every: int) -> Path:
    """Rename a complete ``tmp`` into place and prune all but the newest ``keep`` and the milestones."""
    root, final = checkpoint_root(out_dir), checkpoint_dir(out_dir, step)
    replace_checkpoint(tmp, final)
    _fsync(root)  # the rename itself reaches the disk
    for old in beyond_keep(complete_checkpoints(out_dir), keep, keep_every):
        shutil.rmtree(old, ignore_errors=True)
    return final


def beyond_keep(checkpoints: list[Path], keep: int, keep_every: int) -> list[Path]:
    """Of ``checkpoints`` (oldest first), those a run deletes: all but the newest ``keep`` and the
    milestones (steps divisible by ``keep_every``, unless it is 0)."""
    return [old for old in checkpoints[:-keep] if not (keep_every and checkpoint_step(old) % keep_every == 0)]


def replace_checkpoint(tmp: Path, final: Path) -> None:
    """Move a temporary checkpoint folder into place. A rerun of the same step (after a restart, or a
    pull) replaces it; the old copy goes aside under a temporary name, which start-up removes if this
    process dies after the swap, or puts back if before (``remove_stale_temp_dirs``)."""
    replace_folder(tmp, final, aside=tmp.with_name(tmp.name + REPLACED_SUFFIX))


def replace_folder(new: Path, out: Path, *, aside: Path) -> None:
    """Move ``new`` to ``out``. What was at ``out`` is moved to ``aside`` first, put back if the move
    fails and deleted last, so no failure or crash leaves less than there was."""
    if out.exists():
        os.replace(out, aside)
    try:
        os.replace(new, out)
    except OSError:
        if aside.exists():
            os.replace(aside, out)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def write_checkpoint_files(
    tmp: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    train_state: dict,
    model: CLIP,
    model_cfg: ModelConfig,
    ema: dict[str, torch.Tensor] | None = None,
) -> None:
    """The weights (and their ``ema``), the train state, what rebuilds the model offline, and the
    manifest of every file in ``tmp`` (a sharded checkpoint's shards included), last."""
    save_weights(weights, tmp / MODEL_FILE, metadata={"step": str(step)})
    if ema is not None:
        save_weights(ema, tmp / EMA_FILE, metadata={"step": str(step)})
    with open(tmp / STATE_FILE, "wb") as f:  # a file object: torch's error then carries the OSError
        torch.save(train_state, f)
    section = {"model": dataclasses.asdict(model_cfg)}
    (tmp / MODEL_CONFIG_FILE).write_text(yaml.safe_dump(section, sort_keys=False))
    model.text.encoder.config.save_pretrained(tmp / TEXT_DIR)
    model.tokenizer.save_pretrained(tmp / TEXT_DIR)
    write_manifest(tmp)


def cannot_save(final: Path, needed: int, reason: str) -> str:
    free = shutil.disk_usage(next(p for p in final.parents if p.exists())).free
    return (
        f"cannot save checkpoint {final}: {reason}; it needs about {format_bytes(needed)} and "
        f"{format_bytes(free)} is free there; the older checkpoints are intact"
    )


def write_failure(err: Exception) -> str:
    """The system's words for a failed write (torch wraps them in a RuntimeError), else the error's."""
    cause = err if isinstance(err, OSError) else err.__context__
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def write_manifest(folder: Path) -> None:
    """Record every file's size and checksum in ``manifest.json``, each flushed to the disk first,
    and the manifest and the folders' entries last: a checkpoint verifies only once all of it is stored."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST_FILE)
    entries = {p.relative_to(folder).as_posix(): _record(p) for p in files}
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": entries}, indent=1))
    for path in (folder / MANIFEST_FILE, *(p for p in folder.rglob("*") if p.is_dir()), folder):
        _fsync(path)


def _record(file: Path) -> dict[str, int | str]:
    """A file's manifest entry, taken once the file is flushed to the disk."""
    with open(file, "rb") as f:
        os.fsync(f.fileno())
        return {"bytes": os.fstat(f.fileno()).st_size, HASH: hashlib.file_digest(f, HASH).hexdigest()}


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        return load_config(run_config, saved=True).model
    cfg = load_config(own, saved=True).model
    cfg.init_from = cfg.image.pretrained = ""
    cfg.text.hf, cfg.text.hf_config = str(checkpoint / TEXT_DIR), {}
    if cfg.text.tokenizer != OPEN_CLIP:
        cfg.text.tokenizer = cfg.text.hf
    return cfg


def checkpoint_init_from(checkpoint: Path) -> str:
    """The ``model.init_from`` of the run that wrote the checkpoint: "" for a run from scratch."""
    own = checkpoint / MODEL_CONFIG_FILE
    config = own if own.is_file() else run_config_file(checkpoint)
    return "" if config is None else load_config(config, saved=True).model.init_from


def run_config_file(checkpoint: Path) -> Path | None:
    """The config.yaml of the run a checkpoint directory belongs to, while it is still beside it."""
    out_dir = checkpoint.parent.parent  # {out_dir}/checkpoints/step_N
    path = out_dir / RUN_CONFIG_FILE
    return path if checkpoint.parent == checkpoint_root(out_dir) and path.is_file() else None


def step_dirs(out_dir: str | os.PathLike) -> list[Path]:
    """Every ``step_NNNNNNNN`` directory of a run, oldest first, whatever state its files are in."""
    root = checkpoint_root(out_dir)
    found = [d for d in root.iterdir() if is_step_name(d.name)] if root.is_dir() else []
    return sorted(found, key=checkpoint_step)


def complete_checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints whose files are all there at the sizes their manifests record, oldest first;
    temporary and damaged ones are left out. Cheap: no checksum is computed."""
    return [d for d in step_dirs(out_dir) if checkpoint_problem(d, checksums=False) is None]


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run directory, if it has one."""
    found = complete_checkpoints(out_dir)
    return found[-1] if found else None


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint's folder name, ``step_NNNNNNNN``."""
    return _STEP_DIR.match(name) is not None


def checkpoint_step(checkpoint: Path) -> int:
    """The step in a ``step_NNNNNNNN`` directory's name."""
    return int(_STEP_DIR.match(checkpoint.name).group(1))


def saved_step(checkpoint: Path) -> int | None:
    """The step ``checkpoint`` was saved at: recorded in its weights' metadata, so a copy under
    another name (``best/``) still tells, else its ``step_NNNNNNNN`` name; None when neither does."""
    try:
        with safe_open(checkpoint / MODEL_FILE, framework="pt") as weights:
            recorded = (weights.metadata() or {}).get("step")
    except (OSError, SafetensorError):
        recorded = None
    if recorded is not None:
        return int(recorded)
    return checkpoint_step(checkpoint) if is_step_name(checkpoint.name) else None


def checkpoint_problem(checkpoint: Path, *, checksums: bool, with_state: bool = True) -> str | None:
    """Why ``checkpoint`` must not be used, or None: a file missing, or differing in size (with
    ``checksums``, in content too) from the manifest. ``with_state=False`` leaves out
    ``train_state.pt`` and a sharded checkpoint's ``shards/`` (its optimizer states are most of its
    bytes), which only resuming reads. A checkpoint from before manifests only needs its files to be
    there."""
    if not checkpoint.is_dir():
        return "is not a directory" if checkpoint.exists() else "does not exist"
    required = [MODEL_FILE, STATE_FILE] if with_state else [MODEL_FILE]
    if not (checkpoint / MANIFEST_FILE).is_file():
        missing = [name for name in required if not (checkpoint / name).is_file()]
        return f"{missing[0]} is missing" if missing else None
    try:
        recorded = read_manifest(checkpoint)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST_FILE} is damaged ({type(err).__name__}: {err})"
    if unlisted := [name for name in required if name not in recorded]:
        return f"{unlisted[0]} is not in {MANIFEST_FILE}"
    resumes_only = (STATE_FILE, f"{SHARDS_DIR}/")
    checked = {
        name: entry for name, entry in recorded.items() if with_state or not name.startswith(resumes_only)
    }
    for name, (size, digest) in checked.items():
        if problem := _file_problem(checkpoint / name, size, digest if checksums else None):
            return f"{name} {problem}"
    return None


def read_manifest(checkpoint: Path) -> dict[str, tuple[int, str]]:
    """Each file's recorded (size, checksum), by its path relative to the checkpoint."""
    entries = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]
    return {name: (int(entry["bytes"]), str(entry[HASH])) for name, entry in entries.items()}


def _file_problem(file: Path, size: int, digest: str | None) -> str | None:
    """How ``file`` differs from its size and (unless None) checksum in the manifest."""
    try:
        actual = file.stat().st_size
        if actual != size:
            return f"has {actual} bytes, the manifest says {size}"
        if digest is not None:
            with open(file, "rb") as f:
                if hashlib.file_digest(f, HASH).hexdigest() != digest:
                    return f"does not match its {HASH} in the manifest: changed or corrupted since the save"
    except FileNotFoundError:
        return "is missing"
    except OSError as err:
        return f"cannot be read: {err.strerror or err}"
    return None


def newest_verified_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint whose files match their checksums; each newer one is passed over with a
    line on stderr saying why."""
    for checkpoint in reversed(step_dirs(out_dir)):
        problem = checkpoint_problem(checkpoint, checksums=True)
        if problem is None:
            return checkpoint
        get_logger().warning(f"checkpoint {checkpoint.name} skipped: {problem}")
    return None


def resolve_resume(resume: str, out_dir: str | os.PathLike, *, verify: bool = False) -> Path | None:
    """``""`` → None; ``auto`` → the newest complete checkpoint (or None); else that path, which
    must be a complete checkpoint. Without ``verify`` only the files' sizes are compared (the
    start-up check on every rank); with it their checksums too, and ``auto`` passes over damaged
    checkpoints to the newest sound one."""
    if not resume:
        return None
    if resume == "auto":
        return newest_verified_checkpoint(out_dir) if verify else latest_checkpoint(out_dir)
    path = Path(resume)
    if problem := checkpoint_problem(path, checksums=verify):
        raise UserError(f"checkpoint.resume={resume}: not a complete checkpoint: {problem}")
    return path


def remove_stale_temp_dirs(out_dir: str | os.PathLike) -> list[Path]:
    """Delete the temporary folders of saves that never finished (their process was killed), and
    return them. A checkpoint that a rerun of its step moved aside goes back first when its
    replacement never took its place (killed between the two renames). Only while no other process
    saves into ``out_dir``: at a run's start-up."""
    root = checkpoint_root(out_dir)
    for aside in sorted(root.glob(f"{TEMP_PREFIX}*{REPLACED_SUFFIX}")):
        step = int(aside.name.removeprefix(TEMP_PREFIX).partition("_")[0])
        if not (final := checkpoint_dir(out_dir, step)).exists():
            os.replace(aside, final)
            get_logger().warning(f"{final.name} put back: a save of its step again did not finish")
    stale = sorted(root.glob(f"{TEMP_PREFIX}*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def set_aside_newer(out_dir: str | os.PathLike, resumed_step: int) -> list[Path]:
    """Move the run's checkpoints newer than the resumed step (an older one resumed on purpose, the
    newest sound one below damaged ones, or a copy from elsewhere) under
    ``checkpoints/superseded/<time>/`` and return their new places. Left where they were, they would
    be another history's newest: ``resume=auto``, ``load`` and ``export`` would pick them, and
    pruning would delete the resumed run's own saves while keeping them. Only at a run's start-up,
    on one rank."""
    newer = [d for d in step_dirs(out_dir) if checkpoint_step(d) > resumed_step]
    if not newer:
        return []
    aside = checkpoint_root(out_dir) / SUPERSEDED_DIR / time.strftime("%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    moved = [Path(shutil.move(d, aside / d.name)) for d in newer]
    _fsync(checkpoint_root(out_dir))
    return moved


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
        refuse to write over another run's or over damaged ones, and set aside the newer ones the run
        goes on without, on the disk and on the remote."""
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

    def _mirror_if_missing(self, checkpoint: Path) -> None:
        """Upload the run's resumed checkpoint if the remote lacks it whole: an upload cut short by the
        process's end is otherwise retried by the next save, and the last step's has none."""
        if self._is_own(checkpoint) and not self.remote.holds(checkpoint.name):
            self.remote.push(checkpoint)

    def _is_own(self, checkpoint: Path) -> bool:
        """Whether ``checkpoint`` is one of this run directory's."""
        return checkpoint.parent.resolve() == checkpoint_root(self.run_dir).resolve()
