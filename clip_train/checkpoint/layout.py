"""Where a run's checkpoints live, what each holds, and whether one is sound: every file at the size
(and, verified, the checksum) its manifest records. Reading only: nothing here writes."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from safetensors import SafetensorError, safe_open

from clip_train.errors import UserError
from clip_train.files import replace_text
from clip_train.logs import get_logger

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
PRUNED_SUFFIX = "_pruned"  # on a temporary folder: a checkpoint being deleted
SUPERSEDED_DIR = "superseded"  # checkpoints newer than a resume's, moved aside (never deleted)
RUN_CONFIG_FILE = "config.yaml"  # the resolved config the trainer writes into the run directory
_STEP_DIR = re.compile(r"^step_(\d{8,})$")  # 8 digits, more from step 10^8
# What says a launch is a restart: torchrun's count of its worker group's restarts, Slurm's of a job's
# requeues.
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
LAUNCH_FILE = "launch.json"  # in the run folder: the launch that took it as its run


def checkpoint_root(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


def checkpoint_dir(out_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` lives once complete."""
    return checkpoint_root(out_dir) / f"step_{step:08d}"


def temp_checkpoint_dir(out_dir: str | os.PathLike, step: int) -> Path:
    """Where a save of ``step`` by this process writes before the rename."""
    return checkpoint_root(out_dir) / f"{TEMP_PREFIX}{step:08d}_{os.getpid()}"


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
    there; a sharded one never lacks its manifest (they came later), unless it was deleted in part."""
    if not checkpoint.is_dir():
        return "is not a directory" if checkpoint.exists() else "does not exist"
    required = [MODEL_FILE, STATE_FILE] if with_state else [MODEL_FILE]
    if not (checkpoint / MANIFEST_FILE).is_file():
        if (checkpoint / SHARDS_DIR).is_dir():
            return f"{MANIFEST_FILE} is missing"
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


def _restart_of(environ: Mapping[str, str]) -> str | None:
    """``NAME=N``, the first of ``RESTART_COUNTS`` that says this launch is a restart; None at a
    first start."""
    for name in RESTART_COUNTS:
        if (count := environ.get(name, "").strip()).isdigit() and int(count) > 0:
            return f"{name}={count}"
    return None


def launch_id(environ: Mapping[str, str]) -> str | None:
    """What a launch's restarts keep and other launches differ in: its Slurm job (requeues keep the
    id), else torchrun's run id (``--standalone`` draws one per torchrun; a rendezvous takes its
    ``--rdzv_id``). None outside both."""
    return environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID") or None


def record_launch(out_dir: str | os.PathLike, environ: Mapping[str, str]) -> None:
    """Rank 0, once this launch took ``out_dir`` as its run (its resume checked, the checkpoints newer
    than it set aside): which launch did, for its restarts (``resume_at_restart``)."""
    if (launch := launch_id(environ)) is not None:
        replace_text(Path(out_dir) / LAUNCH_FILE, json.dumps({"launch": launch}) + "\n")


def _taken_by(out_dir: str | os.PathLike, launch: str | None) -> bool:
    """Whether ``launch`` took ``out_dir`` as its run (``record_launch``)."""
    try:
        recorded = json.loads((Path(out_dir) / LAUNCH_FILE).read_text())
    except (OSError, ValueError):
        return False
    return launch is not None and isinstance(recorded, dict) and recorded.get("launch") == launch


def resume_at_restart(
    resume: str, out_dir: str | os.PathLike, environ: Mapping[str, str]
) -> tuple[str, str | None]:
    """``checkpoint.resume`` for this launch, and at a restart the line that says what it resumes. A
    restarted launch (``_restart_of``) that had taken ``out_dir`` as its run goes on from the newest
    checkpoint there whatever ``resume`` says: a torchrun restart of a run started without
    ``resume=auto`` would refuse the folder's checkpoints as another run's, and each requeue of one
    started from ``PATH`` would go back to ``PATH`` (moving the newer ones aside), or fail once
    pruning removed it. Before it took the folder (a start refused, or one that failed before its
    resume set aside the checkpoints it goes back from) or saved a checkpoint, ``resume`` applies as
    at the first start."""
    restart = _restart_of(environ)
    if restart is None:
        return resume, None
    if not _taken_by(out_dir, launch_id(environ)) or latest_checkpoint(out_dir) is None:
        start = f"checkpoint.resume={resume} applies" if resume else "it starts afresh"
        return resume, f"{restart}, a restart: no checkpoint of this launch's in {out_dir}; {start}"
    instead = "" if resume == "auto" else f", in place of checkpoint.resume={resume}"
    return "auto", (
        f"{restart}, a restart: it goes on from the newest checkpoint in {checkpoint_root(out_dir)} "
        f"(checkpoint.resume=auto{instead})"
    )
