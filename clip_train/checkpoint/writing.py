"""Writing checkpoints atomically: into a temporary folder, every file flushed and listed in the
manifest, then renamed into place; pruning, and the start-up's clean-up of saves that never finished."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from clip_train.checkpoint.layout import (
    EMA_FILE,
    HASH,
    MANIFEST_FILE,
    MODEL_CONFIG_FILE,
    MODEL_FILE,
    PRUNED_SUFFIX,
    REPLACED_SUFFIX,
    STATE_FILE,
    SUPERSEDED_DIR,
    TEMP_PREFIX,
    TEXT_DIR,
    checkpoint_dir,
    checkpoint_root,
    checkpoint_step,
    complete_checkpoints,
    step_dirs,
    temp_checkpoint_dir,
)
from clip_train.config import ModelConfig, model_config_yaml
from clip_train.errors import UserError
from clip_train.logs import get_logger
from clip_train.memory import format_bytes, tensor_bytes
from clip_train.model import CLIP

# What a failed write raises: Python's OSError, torch.save's RuntimeError, safetensors' own error.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


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


def publish_checkpoint(tmp: Path, out_dir: str | os.PathLike, step: int, keep: int, keep_every: int) -> Path:
    """Rename a complete ``tmp`` into place and prune all but the newest ``keep`` and the milestones."""
    root, final = checkpoint_root(out_dir), checkpoint_dir(out_dir, step)
    replace_checkpoint(tmp, final)
    _fsync(root)  # the rename itself reaches the disk
    for old in beyond_keep(complete_checkpoints(out_dir), keep, keep_every):
        _remove_checkpoint(old, out_dir)
    return final


def _remove_checkpoint(checkpoint: Path, out_dir: str | os.PathLike) -> None:
    """Delete a checkpoint (pruning it) so that no crash leaves part of it under its own name, where it
    could pass for a checkpoint from before manifests: it is renamed to a temporary name first, which
    start-up removes if this process dies before the deletion ends. One that cannot be moved is kept."""
    temp = temp_checkpoint_dir(out_dir, checkpoint_step(checkpoint))
    doomed = temp.with_name(temp.name + PRUNED_SUFFIX)
    try:
        os.replace(checkpoint, doomed)
    except OSError as err:
        get_logger().warning(f"{checkpoint} is kept: it could not be pruned ({err.strerror or err})")
        return
    shutil.rmtree(doomed, ignore_errors=True)


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
    (tmp / MODEL_CONFIG_FILE).write_text(model_config_yaml(model_cfg))
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


def remove_stale_temp_dirs(out_dir: str | os.PathLike) -> list[Path]:
    """Delete the temporary folders of saves that never finished (their process was killed), and of
    pruned checkpoints whose deletion did not, and return them. A checkpoint that a rerun of its step
    moved aside goes back first when its replacement never took its place (killed between the two
    renames). Only while no other process saves into ``out_dir``: at a run's start-up."""
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
