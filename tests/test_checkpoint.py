import dataclasses
import json
import os
import random
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from small_runs import TINY_MODEL, TINY_MODEL_CONFIG

from clip_train import load_config
from clip_train.checkpoint import (
    MANIFEST_FILE,
    MODEL_CONFIG_FILE,
    MODEL_FILE,
    SHARDS_DIR,
    STATE_FILE,
    TEXT_DIR,
    checkpoint_problem,
    checkpoint_step,
    complete_checkpoints,
    find_weights,
    load_train_state,
    load_weights,
    record_launch,
    remove_stale_temp_dirs,
    replace_folder,
    resolve_resume,
    resume_at_restart,
    run_config_file,
    save_checkpoint,
    saved_step,
    step_dirs,
)
from clip_train.engine.rng import ProcessRng
from clip_train.errors import UserError
from clip_train.model import CLIP, build_model

MODEL_CFG = load_config(TINY_MODEL_CONFIG, TINY_MODEL).model


def _state(step: int) -> dict:
    return {"step": step, "rng": [ProcessRng().state_dict()], "data": {"epoch": 0, "consumed": [3, 4]}}


@pytest.fixture(scope="module")
def model() -> CLIP:
    torch.manual_seed(0)
    return build_model(MODEL_CFG)


def test_save_load_round_trip_weights_only(tmp_path, model):
    optimizer = torch.optim.AdamW(model.parameters())
    model.logit_scale.grad = torch.ones(())
    optimizer.step()
    state = {**_state(7), "optimizer": optimizer.state_dict()}
    path = save_checkpoint(tmp_path, 7, model, MODEL_CFG, state, keep=2)
    assert path.name == "step_00000007"
    raw = load_file(path / MODEL_FILE)  # readable without project code
    assert raw.keys() == model.state_dict().keys()
    assert all(torch.equal(raw[k], v) for k, v in model.state_dict().items())
    state = torch.load(path / STATE_FILE, weights_only=True)
    assert state["step"] == 7 and state["data"]["consumed"] == [3, 4]
    torch.manual_seed(1)
    other = build_model(MODEL_CFG)
    assert not torch.equal(other.visual.proj.weight, model.visual.proj.weight)
    load_weights(path, other)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in other.state_dict().items())
    restored = torch.optim.AdamW(other.parameters())
    restored.load_state_dict(load_train_state(path)["optimizer"])
    want, got = optimizer.state_dict()["state"], restored.state_dict()["state"]
    assert len(want) == 1 and got.keys() == want.keys()
    assert all(torch.equal(got[i]["exp_avg"], want[i]["exp_avg"]) for i in want)


def test_checkpoint_holds_the_model_config_and_text_encoder_config(tmp_path, model):
    path = save_checkpoint(tmp_path, 3, model, MODEL_CFG, _state(3), keep=1)
    assert yaml.safe_load((path / MODEL_CONFIG_FILE).read_text()) == {"model": dataclasses.asdict(MODEL_CFG)}
    encoder = json.loads((path / TEXT_DIR / "config.json").read_text())
    assert encoder["model_type"] == "bert" and encoder["hidden_size"] == 32
    assert encoder["vocab_size"] == model.tokenizer.vocab_size  # filled in from the tokenizer
    assert not list((tmp_path / "checkpoints").glob(".tmp*"))


def test_weights_are_as_readable_as_the_train_state(tmp_path, model):
    """safetensors creates its file 0600; a checkpoint's files all follow the umask, like torch.save's."""
    previous = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path, 1, model, MODEL_CFG, _state(1), keep=1)
    finally:
        os.umask(previous)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (path / MODEL_FILE, path / STATE_FILE)}
    assert modes == {MODEL_FILE: 0o644, STATE_FILE: 0o644}


def test_keep_prunes_oldest_and_auto_picks_newest(tmp_path, model):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, MODEL_CFG, _state(step), keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert resolve_resume("auto", tmp_path).name == "step_00000004"
    newest = tmp_path / "checkpoints" / "step_00000004" / MODEL_FILE
    assert find_weights(tmp_path) == find_weights(newest.parent) == find_weights(newest) == newest


def test_milestones_are_kept_beside_the_newest(tmp_path, model):
    for step in range(2, 13, 2):
        save_checkpoint(tmp_path, step, model, MODEL_CFG, _state(step), keep=2, keep_every=4)
    assert [checkpoint_step(p) for p in complete_checkpoints(tmp_path)] == [4, 8, 10, 12]


def test_a_rerun_of_a_step_replaces_its_checkpoint_and_a_failed_swap_keeps_the_old_one(tmp_path, model):
    """A restarted run saves a step again (``publish_checkpoint``); exports and remote pulls swap
    folders the same way (``replace_folder``)."""
    first = save_checkpoint(tmp_path, 5, model, MODEL_CFG, _state(5), keep=2)
    again = save_checkpoint(tmp_path, 5, model, MODEL_CFG, {**_state(5), "again": True}, keep=2)
    assert again == first and load_train_state(again)["again"] is True
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000005"]  # nothing aside
    aside = tmp_path / "aside"
    with pytest.raises(FileNotFoundError):  # the new folder cannot be moved in (here: it is gone)
        replace_folder(tmp_path / "vanished", again, aside=aside)
    assert load_train_state(again)["again"] is True and not aside.exists()


def test_a_checkpoint_moved_aside_by_a_rerun_of_its_step_is_put_back_if_the_rerun_died_mid_swap(
    tmp_path, model
):
    """Killed between ``replace_folder``'s two renames, a rerun of step 5 left step 5 only under its
    temporary aside name, which start-up removed with the rest: no checkpoint of step 5 at all. Killed
    after them (step 6), the aside is the old copy, which goes."""
    for step in (5, 6):
        save_checkpoint(tmp_path, step, model, MODEL_CFG, _state(step), keep=3)
    root = tmp_path / "checkpoints"
    os.replace(root / "step_00000005", root / ".tmp_step_00000005_123_replaced")
    (root / ".tmp_step_00000005_123").mkdir()  # the rerun's complete save, never renamed into place
    shutil.copytree(root / "step_00000006", root / ".tmp_step_00000006_77_replaced")
    removed = remove_stale_temp_dirs(tmp_path)
    assert [p.name for p in removed] == [".tmp_step_00000005_123", ".tmp_step_00000006_77_replaced"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000005", "step_00000006"]
    assert checkpoint_problem(root / "step_00000005", checksums=True) is None
    assert load_train_state(root / "step_00000005")["step"] == 5


def test_a_prune_cut_short_leaves_no_part_of_the_checkpoint_under_its_name(tmp_path, model, monkeypatch):
    """A deletion killed part way may have removed the manifest and left the weights and train state:
    under its own name that passed for a checkpoint from before manifests, which ``resume=auto``
    took. The checkpoint is moved to a temporary name first, which start-up removes."""
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, MODEL_CFG, _state(step), keep=2)
    real_rmtree = shutil.rmtree

    def killed_after_the_manifest(path, ignore_errors=False):
        if not (Path(path) / MANIFEST_FILE).is_file():  # not a checkpoint: a save's own clean-up
            return real_rmtree(path, ignore_errors=ignore_errors)
        (Path(path) / MANIFEST_FILE).unlink()
        raise KeyboardInterrupt  # the process ends here

    monkeypatch.setattr(shutil, "rmtree", killed_after_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, model, MODEL_CFG, _state(3), keep=2)  # prunes step 1
    monkeypatch.undo()
    assert [checkpoint_step(p) for p in step_dirs(tmp_path)] == [2, 3]
    assert [p.name for p in remove_stale_temp_dirs(tmp_path)] == [f".tmp_step_00000001_{os.getpid()}_pruned"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]


def test_a_sharded_checkpoint_without_its_manifest_is_incomplete(tmp_path, model):
    """Sharded checkpoints came after manifests: one without its manifest was deleted in part, however
    whole its weights and train state look. ``resume=auto`` passes over it."""
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, MODEL_CFG, _state(step), keep=2)
    partial = tmp_path / "checkpoints" / "step_00000002"
    (partial / SHARDS_DIR).mkdir()
    (partial / SHARDS_DIR / "__0_0.distcp").write_bytes(b"a rank's shards")
    (partial / MANIFEST_FILE).unlink()
    for checksums, with_state in ((True, True), (False, False)):
        assert (
            checkpoint_problem(partial, checksums=checksums, with_state=with_state)
            == "manifest.json is missing"
        )
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000001"]
    assert resolve_resume("auto", tmp_path, verify=True).name == "step_00000001"


def test_steps_past_eight_digits_are_checkpoints_and_copies_keep_their_step(tmp_path, model):
    for step in (99_999_999, 100_000_000):
        save_checkpoint(tmp_path, step, model, MODEL_CFG, _state(step), keep=1)
    (newest,) = complete_checkpoints(tmp_path)  # the older one pruned: ordered by number, not name
    assert newest.name == "step_100000000" and checkpoint_step(newest) == 100_000_000
    assert resolve_resume("auto", tmp_path) == newest
    copy = shutil.copytree(newest, tmp_path / "best")
    assert saved_step(copy) == saved_step(newest) == 100_000_000
    assert saved_step(tmp_path) is None  # no weights there, and no step in its name


def test_find_weights_names_what_is_missing(tmp_path):
    message = (
        "checkpoint not found: {} {}; pass a checkpoint directory, a run directory or a .safetensors file"
    )
    with pytest.raises(UserError, match=re.escape(message.format(tmp_path / "nope", "does not exist"))):
        find_weights(tmp_path / "nope")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path} has no {MODEL_FILE} and no complete")):
        find_weights(tmp_path)


def test_weights_that_do_not_fit_are_one_line_naming_the_keys(tmp_path, model):
    weights = dict(model.state_dict())
    weights.pop("logit_scale")
    weights["visual.proj.weight"] = torch.zeros(8, 32)
    weights["extra.bias"] = torch.zeros(2)
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "bad.safetensors")
    with pytest.raises(UserError) as err:
        load_weights(tmp_path / "bad.safetensors", model)
    assert str(err.value) == (
        f"{tmp_path / 'bad.safetensors'} does not fit the model: missing 1 key (logit_scale); "
        "unexpected 1 key (extra.bias); "
        "mis-shaped (weights vs model) 1 key (visual.proj.weight (8, 32) vs (16, 32))"
    )


def test_half_written_checkpoints_are_ignored_and_dead_saves_removed(tmp_path, model):
    save_checkpoint(tmp_path, 5, model, MODEL_CFG, _state(5), keep=3)
    root = tmp_path / "checkpoints"
    dead_save = root / ".tmp_step_00000009_123"  # killed before the rename
    dead_save.mkdir()
    (dead_save / MODEL_FILE).write_bytes(b"partial")
    (root / "step_00000008").mkdir()  # a directory that lost its files
    (root / "step_00000008" / MODEL_FILE).write_bytes(b"x")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000005"]
    assert resolve_resume("auto", tmp_path).name == "step_00000005"
    assert resolve_resume("", tmp_path) is None
    assert resolve_resume("auto", tmp_path / "elsewhere") is None
    assert remove_stale_temp_dirs(tmp_path) == [dead_save] and not dead_save.exists()
    assert remove_stale_temp_dirs(tmp_path / "elsewhere") == []


def test_resume_from_bad_path_is_clear(tmp_path):
    with pytest.raises(
        UserError,
        match=re.escape(f"checkpoint.resume={tmp_path / 'nope'}: not a complete checkpoint: does not exist"),
    ):
        resolve_resume(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(
        UserError,
        match=re.escape(f"checkpoint.resume={tmp_path}: not a complete checkpoint: {MODEL_FILE} is missing"),
    ):
        resolve_resume(str(tmp_path), tmp_path)


def test_rng_state_round_trip():
    rng = ProcessRng()
    state = rng.state_dict()
    first = (random.random(), torch.rand(3))
    rng.load_state_dict(state)
    again = (random.random(), torch.rand(3))
    assert first[0] == again[0] and torch.equal(first[1], again[1])


def test_a_checkpoints_run_config_is_the_one_of_its_run_directory_only(tmp_path):
    """A copied checkpoint outside a run directory has none: a config.yaml two folders up belongs to
    something else, and its pins would become the run's."""
    in_run = tmp_path / "run" / "checkpoints" / "step_00000002"
    copied = tmp_path / "data" / "ckpts" / "step_00000002"
    for checkpoint in (in_run, copied):
        checkpoint.mkdir(parents=True)
        (checkpoint.parent.parent / "config.yaml").write_text("train: {}\n")
    assert run_config_file(in_run) == tmp_path / "run" / "config.yaml"
    assert run_config_file(copied) is None


@pytest.mark.parametrize(
    ("restart", "launch"),
    [("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"), ("SLURM_RESTART_COUNT", "SLURM_JOB_ID")],
)
def test_a_restart_goes_on_from_its_launchs_newest_checkpoint_whatever_checkpoint_resume_says(
    tmp_path, model, restart, launch
):
    """torchrun's restart of a failed group, or a Slurm requeue: once the launch took the folder as
    its run (``record_launch``) and a checkpoint is there, ``checkpoint.resume`` (unset, or a PATH
    since pruned or older than the run's saves) gives way to ``auto``. Before that the checkpoints
    there are not the launch's own: another run's (whose refusal the restart must repeat), or newer
    ones than the PATH a launch goes back to, which its resume had yet to set aside."""
    started_from = str(tmp_path / "elsewhere" / "checkpoints" / "step_00000002")  # gone by now
    settings = {"": "it starts afresh", "auto": "checkpoint.resume=auto applies"}
    settings[started_from] = f"checkpoint.resume={started_from} applies"

    def as_at_the_first_start(environ: dict[str, str]) -> None:
        for resume, start in settings.items():
            assert resume_at_restart(resume, tmp_path, {**environ, restart: "0"}) == (resume, None)
            said = f"{restart}=1, a restart: no checkpoint of this launch's in {tmp_path}; {start}"
            assert resume_at_restart(resume, tmp_path, {**environ, restart: "1"}) == (resume, said)

    this_launch, other_launch = {launch: "job-7"}, {launch: "job-6"}
    record_launch(tmp_path, this_launch)
    as_at_the_first_start(this_launch)  # taken, no checkpoint yet
    save_checkpoint(tmp_path, 4, model, MODEL_CFG, _state(4), keep=2)
    record_launch(tmp_path, other_launch)
    as_at_the_first_start(this_launch)  # another launch's checkpoint
    (tmp_path / "launch.json").unlink()
    as_at_the_first_start(this_launch)  # a launch that never took it (a run before launches were recorded)
    record_launch(tmp_path, this_launch)
    for resume in settings:
        assert resume_at_restart(resume, tmp_path, {**this_launch, restart: "0"}) == (resume, None)
        instead = "" if resume == "auto" else f", in place of checkpoint.resume={resume}"
        assert resume_at_restart(resume, tmp_path, {**this_launch, restart: "2"}) == (
            "auto",
            f"{restart}=2, a restart: it goes on from the newest checkpoint in {tmp_path / 'checkpoints'} "
            f"(checkpoint.resume=auto{instead})",
        )
