"""Verified checkpoints on real files: damage found by the manifest, resume=auto passing over it,
readers refusing it in one line, dead saves cleaned up, and saves that fail on a full disk or at a
file-size limit leaving the older checkpoints intact."""

from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from processes import run_to_end
from small_runs import DEMO_CONFIG, ROOT, run_overrides

import clip_train
from clip_train.checkpoint import (
    MANIFEST_FILE,
    MODEL_FILE,
    SHARDS_DIR,
    STATE_FILE,
    SUPERSEDED_DIR,
    checkpoint_problem,
    find_weights,
    latest_checkpoint,
    load_train_state,
    read_manifest,
    resolve_resume,
    step_dirs,
    write_manifest,
)
from clip_train.cli import main as cli_main
from clip_train.distributed import decided_by_main
from clip_train.errors import UserError

STEP_20, STEP_40 = "checkpoints/step_00000020", "checkpoints/step_00000040"


@pytest.fixture
def run_copy(demo_run, tmp_path) -> Path:
    """The demo run's directory (checkpoints at steps 20 and 40), copied to be damaged."""
    return Path(shutil.copytree(demo_run, tmp_path / "run"))


def truncate(file: Path) -> int:
    """Cut ``file`` to half its size, as an interrupted copy leaves it; returns the new size."""
    size = file.stat().st_size // 2
    os.truncate(file, size)
    return size


def flip_a_byte(file: Path) -> None:
    """Same size, different content: only the checksum can tell."""
    with open(file, "r+b") as f:
        f.seek(file.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def recorded_size(checkpoint: Path, name: str) -> int:
    return read_manifest(checkpoint)[name][0]


def train(run: Path, digits: Path, steps: int, **popen) -> subprocess.CompletedProcess:
    """``clip-train train checkpoint.resume=auto`` of the demo recipe, continuing ``run`` in a fresh
    process."""
    overrides = run_overrides(digits, run, steps, "checkpoint.every_steps=20", "checkpoint.resume=auto")
    return run_to_end(
        [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *overrides],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        **popen,
    )


def test_a_checkpoint_records_each_file_it_wrote(demo_run):
    checkpoint = demo_run / STEP_40
    recorded = read_manifest(checkpoint)
    on_disk = sorted(
        p.relative_to(checkpoint).as_posix()
        for p in checkpoint.rglob("*")
        if p.is_file() and p.name != MANIFEST_FILE
    )
    assert sorted(recorded) == on_disk
    assert {MODEL_FILE, STATE_FILE, "model.yaml", "text/config.json"} <= set(on_disk)
    assert all(size == (checkpoint / name).stat().st_size for name, (size, _) in recorded.items())
    assert checkpoint_problem(checkpoint, checksums=True) is None


def test_resume_auto_passes_over_a_truncated_checkpoint_and_removes_dead_saves(run_copy, digits):
    """The user's path: a requeued job (``checkpoint.resume=auto``) after the newest checkpoint's
    weights were truncated and a killed save left its temporary folder."""
    full = recorded_size(run_copy / STEP_40, MODEL_FILE)
    half = truncate(run_copy / STEP_40 / MODEL_FILE)
    dead_save = run_copy / "checkpoints" / ".tmp_step_00000060_4242"
    dead_save.mkdir()
    (dead_save / MODEL_FILE).write_bytes(b"partial")
    result = train(run_copy, digits, 21)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"clip-train: removed {dead_save}, left by a save that did not finish" in result.stderr.splitlines()
    )
    problem = f"{MODEL_FILE} has {half} bytes, the manifest says {full}"
    assert f"clip-train: checkpoint step_00000040 skipped: {problem}" in result.stderr.splitlines()
    assert f"resumed from {run_copy / STEP_20} at step 20" in result.stderr
    assert not dead_save.exists()
    assert latest_checkpoint(run_copy) == run_copy / "checkpoints/step_00000021"
    assert checkpoint_problem(latest_checkpoint(run_copy), checksums=True) is None


def test_resume_auto_stops_when_no_checkpoint_is_sound(run_copy, digits, capsys):
    """Training afresh would overwrite the evidence and waste the run's compute: it is an error."""
    for checkpoint in (STEP_20, STEP_40):
        truncate(run_copy / checkpoint / MODEL_FILE)
    args = ["train", str(DEMO_CONFIG), *run_overrides(digits, run_copy, 41, "checkpoint.resume=auto")]
    assert cli_main(args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line.partition(" skipped: ")[0] for line in lines[:2]] == [
        "clip-train: checkpoint step_00000040",
        "clip-train: checkpoint step_00000020",
    ]
    assert lines[2:] == [
        f"clip-train: rank 0: error: checkpoint.resume=auto: no checkpoint in {run_copy / 'checkpoints'} is "
        "sound (see above); resume from one with checkpoint.resume=PATH, or move them away to start afresh"
    ]
    assert (run_copy / STEP_20).is_dir() and (run_copy / STEP_40).is_dir()


@pytest.mark.parametrize("resume", ["older_step", "auto_below_a_damaged_one", "a_copy_named_otherwise"])
def test_a_resume_below_the_newest_checkpoint_sets_the_newer_ones_aside_and_keeps_its_own_saves(
    run_copy, digits, capsys, tmp_path, resume
):
    """A rollback (``resume=PATH`` to an older step, e.g. before a loss spike, or to a copy of one kept
    as ``best/``) or ``resume=auto`` passing over a damaged newest checkpoint: with ``keep=1`` pruning
    kept the newer step_40 and deleted each of the resumed run's own saves, and the next
    ``resume=auto``, ``load`` or ``export`` took step_40."""
    resumed = run_copy / STEP_20
    if resume == "a_copy_named_otherwise":
        resumed = Path(shutil.copytree(resumed, tmp_path / "best"))
    if resume == "auto_below_a_damaged_one":
        flip_a_byte(run_copy / STEP_40 / MODEL_FILE)  # only the checksum tells
    chosen = "auto" if resume == "auto_below_a_damaged_one" else str(resumed)
    extra = ("checkpoint.every_steps=1", "checkpoint.keep=1", f"checkpoint.resume={chosen}")
    assert cli_main(["train", str(DEMO_CONFIG), *run_overrides(digits, run_copy, 22, *extra)]) == 0
    err = capsys.readouterr().err
    assert f"resumed from {resumed} at step 20" in err
    assert [path.name for path in step_dirs(run_copy)] == ["step_00000022"]
    (aside,) = (run_copy / "checkpoints" / SUPERSEDED_DIR).iterdir()
    moved = (
        f"clip-train: step_00000040, newer than the resumed step 20, moved to {aside}: the run goes "
        "on from step 20 (delete it there once it is not wanted)"
    )
    assert moved in err.splitlines()
    assert (
        latest_checkpoint(run_copy) == find_weights(run_copy).parent == run_copy / "checkpoints/step_00000022"
    )
    assert checkpoint_problem(run_copy / "checkpoints/step_00000022", checksums=True) is None
    problem = checkpoint_problem(aside / "step_00000040", checksums=True)  # moved whole, damage and all
    assert (problem is None) == (resume != "auto_below_a_damaged_one")


@pytest.mark.parametrize(
    ("file", "damage", "problem"),
    [
        (STATE_FILE, truncate, "{file} has {size} bytes, the manifest says {recorded}"),
        (
            MODEL_FILE,
            flip_a_byte,
            "{file} does not match its sha256 in the manifest: changed or corrupted since the save",
        ),
        (
            "text/config.json",
            flip_a_byte,
            "{file} does not match its sha256 in the manifest: changed or corrupted since the save",
        ),
    ],
    ids=["truncated train state", "a byte changed in the weights", "a byte changed in text/"],
)
def test_resume_verifies_every_file(run_copy, capsys, file, damage, problem):
    checkpoint = run_copy / STEP_40
    recorded = recorded_size(checkpoint, file)
    damage(checkpoint / file)
    problem = problem.format(file=file, size=(checkpoint / file).stat().st_size, recorded=recorded)
    assert resolve_resume("auto", run_copy, verify=True) == run_copy / STEP_20
    assert capsys.readouterr().err.splitlines() == [
        f"clip-train: checkpoint step_00000040 skipped: {problem}"
    ]
    with pytest.raises(UserError) as err:
        resolve_resume(str(checkpoint), run_copy, verify=True)
    assert str(err.value) == f"checkpoint.resume={checkpoint}: not a complete checkpoint: {problem}"


@pytest.mark.parametrize(
    ("command", "target"),
    [("eval", "."), ("export", STEP_40), ("load", f"{STEP_40}/{MODEL_FILE}")],
    ids=["eval a run directory", "export a checkpoint", "load a weights file"],
)
def test_readers_refuse_a_truncated_checkpoint_in_one_line(run_copy, tmp_path, capsys, command, target):
    """eval, export and ``clip_train.load`` verify what they read, whichever path names it; a run
    directory's damaged newest checkpoint is an error too, not a silent fallback to an older one."""
    checkpoint = run_copy / STEP_40
    full = recorded_size(checkpoint, MODEL_FILE)
    half = truncate(checkpoint / MODEL_FILE)
    path = run_copy / target
    message = f"checkpoint {checkpoint}: {MODEL_FILE} has {half} bytes, the manifest says {full}"
    if command == "load":
        with pytest.raises(UserError, match=f"^{message}$"):
            clip_train.load(path)
        return
    args = [str(tmp_path / "export")] if command == "export" else []
    assert cli_main([command, str(path), *args]) == 2
    assert capsys.readouterr().err.splitlines() == [f"clip-train: error: {message}"]
    assert not (tmp_path / "export").exists()


def test_readers_of_the_weights_ignore_a_damaged_train_state_and_shards(run_copy):
    """Only resuming reads train_state.pt and a sharded checkpoint's shards/ (weights and optimizer
    states, several times the weights' bytes, which readers would hash for nothing): the weights of
    its checkpoint still load."""
    checkpoint = run_copy / STEP_40
    (checkpoint / SHARDS_DIR).mkdir()
    (checkpoint / SHARDS_DIR / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    write_manifest(checkpoint)
    flip_a_byte(checkpoint / SHARDS_DIR / "__0_0.distcp")
    truncate(checkpoint / STATE_FILE)
    model, _, _ = clip_train.load(checkpoint)
    assert not model.training
    assert checkpoint_problem(checkpoint, checksums=True, with_state=False) is None
    assert checkpoint_problem(checkpoint, checksums=True).startswith(f"{SHARDS_DIR}/__0_0.distcp does not")


def test_a_checkpoint_from_before_manifests_loads_unverified_and_damage_is_one_line(run_copy):
    checkpoint = run_copy / STEP_40
    (checkpoint / MANIFEST_FILE).unlink()
    assert latest_checkpoint(run_copy) == checkpoint
    assert resolve_resume("auto", run_copy, verify=True) == checkpoint
    clip_train.load(checkpoint)
    truncate(checkpoint / STATE_FILE)
    with pytest.raises(UserError) as err:
        load_train_state(checkpoint)
    assert str(err.value) == (
        f"{checkpoint / STATE_FILE} is damaged: torch.load cannot read it (truncated or not a torch file)"
    )
    truncate(checkpoint / MODEL_FILE)
    with pytest.raises(UserError) as err:
        clip_train.load(checkpoint)
    assert str(err.value).startswith(
        f"{checkpoint / MODEL_FILE} is damaged (truncated or not a safetensors file): "
    )
    assert "\n" not in str(err.value)


class RunsCode:
    """What a tampered train_state.pt could hold: unpickling it would call ``Path.touch``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_a_train_state_that_would_run_code_is_refused_in_one_line(run_copy, digits, tmp_path, capsys):
    """Through ``clip-train train checkpoint.resume=PATH``: first caught by the manifest; re-signed by
    the tamperer, refused by ``torch.load(weights_only=True)`` without running it or suggesting
    ``weights_only=False``."""
    checkpoint, marker = run_copy / STEP_40, tmp_path / "code-ran"
    torch.save({"trainer": {"step": 40}, "payload": RunsCode(marker)}, checkpoint / STATE_FILE)
    args = [
        "train",
        str(DEMO_CONFIG),
        *run_overrides(digits, tmp_path / "new", 41),
        f"checkpoint.resume={checkpoint}",
    ]
    assert cli_main(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"clip-train: error: checkpoint.resume={checkpoint}: not a complete checkpoint: {STATE_FILE} has "
    )
    write_manifest(checkpoint)
    assert cli_main(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"clip-train: rank 0: error: {checkpoint / STATE_FILE} is not a trusted clip_train checkpoint: it "
        "holds Python objects that clip_train never saves, so it is not loaded"
    ]
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):  # what the message replaces
        torch.load(checkpoint / STATE_FILE, weights_only=True)


def _limit_file_size() -> None:
    """In the child: files stop growing at 64 KiB with EFBIG, as on a full quota (SIGXFSZ ignored):
    under the run's logs, over its weights (186 KB)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**16, resource.RLIM_INFINITY))


def test_a_save_that_cannot_be_written_fails_in_one_line_and_keeps_the_older_checkpoints(run_copy, digits):
    result = train(run_copy, digits, 41, preexec_fn=_limit_file_size)
    final = run_copy / "checkpoints/step_00000041"
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    message = errors[0].removeprefix("clip-train: rank 0: error: ")
    assert message.startswith(f"cannot save checkpoint {final}: ") and "File too large" in message
    assert message.endswith(" is free there; the older checkpoints are intact")
    assert not final.exists() and not list((run_copy / "checkpoints").glob(".tmp*"))
    assert checkpoint_problem(run_copy / STEP_40, checksums=True) is None


def decide_on_each_rank(rank: int, world_size: int) -> list[str]:
    """What every rank sees of rank 0's decision, then of its failure to decide."""

    def decide(fails: bool) -> str:
        if fails:
            raise UserError(f"cannot save on rank {rank}")
        return f"decided by rank {rank}"

    seen = [decided_by_main(lambda: decide(False))]
    try:
        decided_by_main(lambda: decide(True))
    except UserError as err:
        seen.append(f"UserError: {err}")
    return seen


def test_rank_zero_decides_for_every_rank_and_its_failure_fails_them_all():
    """How a save that fails on rank 0 stops the other ranks at once, instead of leaving them waiting."""
    seen = run_distributed(decide_on_each_rank, 2, timeout_s=60)
    assert seen == [["decided by rank 0", "UserError: cannot save on rank 0"]] * 2


FULL_DISK = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from small_runs import TINY_MODEL, TINY_MODEL_CONFIG
from clip_train import load_config
from clip_train.checkpoint import checkpoint_problem, checkpoint_root, save_checkpoint
from clip_train.errors import UserError
from clip_train.model import build_model

out = Path(sys.argv[1])
cfg = load_config(TINY_MODEL_CONFIG, TINY_MODEL).model
model = build_model(cfg)
first = save_checkpoint(out, 1, model, cfg, {"step": 1}, keep=1)
with open(out / "filler", "wb", buffering=0) as filler:  # fill the disk, then free 64 KiB: not the weights
    try:
        while True:
            filler.write(bytes(2**16))
    except OSError:
        pass
    filler.truncate(max(0, filler.tell() - 2**16))
errors = []
for check_space in (True, False):
    try:
        save_checkpoint(out, 2, model, cfg, {"step": 2}, keep=1, check_space=check_space)
    except UserError as err:
        errors.append(str(err))
left = sorted(p.name for p in checkpoint_root(out).iterdir())
print(json.dumps({"errors": errors, "left": left, "first": checkpoint_problem(first, checksums=True)}))
"""


def test_a_full_disk_is_refused_up_front_or_fails_cleanly(tmp_path):
    """A real 64 MiB tmpfs, mounted in a user and mount namespace of the child's own."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("needs unshare with user namespaces to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = 'mount -t tmpfs -o size=64m tmpfs "$1" && exec "$2" -c "$3" "$1" "$4"'
    command = [
        "unshare",
        "-rm",
        "sh",
        "-c",
        script,
        "sh",
        str(disk),
        sys.executable,
        FULL_DISK,
        str(ROOT / "tests"),
    ]
    result = run_to_end(command)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    refused, failed = report["errors"]
    final = disk / "checkpoints/step_00000002"
    assert refused.startswith(
        f"cannot save checkpoint {final}: not enough free space (checked before writing); "
    )
    assert failed.startswith(f"cannot save checkpoint {final}: ") and "No space left on device" in failed
    assert report["left"] == ["step_00000001"] and report["first"] is None
