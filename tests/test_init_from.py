"""``model.init_from``: a fresh run that starts from another run's weights and nothing else."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from small_runs import DEMO_CONFIG, run_overrides

from clip_train import load_config
from clip_train.checkpoint import MODEL_FILE, checkpoint_init_from
from clip_train.distributed import DistEnv
from clip_train.errors import UserError
from clip_train.init_from import pinned
from clip_train.trainer import Trainer

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def trainer(digits: Path, out_dir: Path, steps: int, *extra: str) -> Trainer:
    overrides = run_overrides(digits, out_dir, steps, "data.workers=0", "optim.warmup_steps=0", *extra)
    return Trainer(load_config(DEMO_CONFIG, overrides).validate(world_size=1), CPU)


def source_weights(demo_run: Path) -> dict[str, torch.Tensor]:
    return load_file(demo_run / "checkpoints" / "step_00000040" / MODEL_FILE)


def test_weights_only_then_a_fresh_run(demo_run, digits, tmp_path):
    run = trainer(digits, tmp_path, 2, f"model.init_from={demo_run}")  # a run dir: its newest checkpoint
    start = source_weights(demo_run)
    assert all(torch.equal(tensor, start[name]) for name, tensor in run.model.state_dict().items())
    assert run.step == 0 and run.resumed_from is None
    assert run.update.optimizer.state_dict()["state"] == {} and run.update.scheduler.last_epoch == 0
    run.run()
    assert run.step == 2 and (tmp_path / "checkpoints" / "step_00000002").is_dir()
    trained = run.model.state_dict()
    assert any(not torch.equal(trained[name], start[name]) for name in start)


def test_lit_locking_keeps_the_initial_trunk(demo_run, digits, tmp_path):
    start = source_weights(demo_run)
    run = trainer(digits, tmp_path, 2, f"model.init_from={demo_run}", "model.image.lock=true")
    run.run()
    trained = run.model.state_dict()
    trunk = [name for name in start if name.startswith("visual.trunk.")]
    assert trunk and all(torch.equal(trained[name], start[name]) for name in trunk)
    assert not torch.equal(trained["visual.proj.weight"], start["visual.proj.weight"])
    assert not torch.equal(trained["text.proj.weight"], start["text.proj.weight"])


def test_a_sigmoid_loss_run_from_softmax_weights_keeps_its_initial_logit_bias(demo_run, digits, tmp_path):
    """As from an open_clip model: the weights have no logit bias to take."""
    sigmoid = ["loss.kind=sigmoid", "model.init_logit_bias=-5"]
    run = trainer(digits, tmp_path, 2, f"model.init_from={demo_run}", *sigmoid)
    start = source_weights(demo_run)
    assert "logit_bias" not in start and run.model.logit_bias.item() == -5
    assert all(torch.equal(tensor, run.model.state_dict()[name]) for name, tensor in start.items())


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_resumed_run_keeps_its_own_weights_and_never_reads_init_from(demo_run, digits, tmp_path, parallel):
    """A requeued job with init_from still set must resume, not start over from init_from, and
    must not need it: the file may be gone by then (FSDP decides before it shards the towers)."""
    source = tmp_path / "source"
    shutil.copytree(demo_run / "checkpoints" / "step_00000040", source)
    out = tmp_path / "run"
    first = trainer(digits, out, 2, f"model.init_from={source}", f"train.parallel={parallel}")
    assert all(torch.equal(t, source_weights(demo_run)[k]) for k, t in first.model.state_dict().items())
    first.run()
    own = {name: tensor.clone() for name, tensor in first.model.state_dict().items()}
    shutil.rmtree(source)
    overrides = (f"model.init_from={source}", f"train.parallel={parallel}", "checkpoint.resume=auto")
    again = trainer(digits, out, 3, *overrides)
    assert again.step == 2 and again.resumed_from == out / "checkpoints" / "step_00000002"
    assert all(torch.equal(tensor, own[name]) for name, tensor in again.model.state_dict().items())


def test_a_resumed_run_never_reads_the_image_towers_pretrained_weights(digits, tmp_path):
    """The checkpoint holds every weight: a requeued run whose ``model.image.pretrained`` file is gone
    resumes rather than failing on it (nor spends its start-up loading it)."""
    first = trainer(digits, tmp_path / "run", 2)
    pretrained = tmp_path / "vit.safetensors"
    save_file(first.model.visual.trunk.state_dict(), pretrained)
    first.loader.close()
    started = trainer(digits, tmp_path / "run", 2, f"model.image.pretrained={pretrained}")
    trunk = first.model.visual.trunk.state_dict()
    assert all(torch.equal(t, trunk[k]) for k, t in started.model.visual.trunk.state_dict().items())
    started.run()
    own = {name: tensor.clone() for name, tensor in started.model.state_dict().items()}
    pretrained.unlink()
    again = trainer(
        digits, tmp_path / "run", 3, f"model.image.pretrained={pretrained}", "checkpoint.resume=auto"
    )
    assert again.step == 2 and all(torch.equal(t, own[k]) for k, t in again.model.state_dict().items())
    again.loader.close()


def test_a_run_directory_named_as_the_start_is_pinned_to_the_checkpoint_it_held(demo_run, digits, tmp_path):
    """The run directory may go on training: WiSE-FT's start (the checkpoints' model.yaml) and a
    resumed run stay on the checkpoint the run started from."""
    source = tmp_path / "source"
    shutil.copytree(demo_run, source)
    started = source / "checkpoints" / "step_00000040" / MODEL_FILE
    out = tmp_path / "run"
    first = trainer(digits, out, 2, f"model.init_from={source}")
    assert first.cfg.model.init_from == str(started)
    first.run()
    shutil.copytree(started.parent, source / "checkpoints" / "step_00000060")  # the source goes on
    assert checkpoint_init_from(out / "checkpoints" / "step_00000002") == str(started)
    again = trainer(digits, out, 3, f"model.init_from={source}", "checkpoint.resume=auto")
    assert again.step == 2 and again.cfg.model.init_from == str(started)
    again.run()
    assert checkpoint_init_from(out / "checkpoints" / "step_00000003") == str(started)
    (out / "config.yaml").write_text("model: {init_from: [")  # cut short as it was written
    finished = trainer(digits, out, 3, f"model.init_from={source}", "checkpoint.resume=auto")
    assert finished.step == 3 and finished.cfg.model.init_from == str(source)  # resumes; nothing pinned
    finished.loader.close()


def test_a_pin_holds_under_another_spelling_and_a_pruned_one_gives_way_to_the_newest(
    demo_run, tmp_path, capsys
):
    source = tmp_path / "source"
    shutil.copytree(demo_run, source)
    newest = str(source / "checkpoints" / "step_00000040" / MODEL_FILE)
    earlier = str(source / "checkpoints" / "step_00000020" / MODEL_FILE)
    assert pinned(os.path.relpath(source), earlier, resolve=True) == earlier
    # a directory recorded before pins existed is no pin
    assert pinned(str(source), str(source), resolve=True) == newest
    assert pinned(str(source), str(source), resolve=False) == str(source)
    shutil.rmtree(Path(earlier).parent)  # the source run's checkpoint.keep pruned it
    assert pinned(str(source), earlier, resolve=False) == earlier  # a record, never read
    assert pinned(str(source), earlier, resolve=True) == newest
    assert f"{earlier}, the weights this run started with, is gone from {source}: {newest}" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        (
            "model.embed_dim=8",
            "mis-shaped (weights vs model) 2 keys (text.proj.weight (16, 32) vs (8, 32), "
            "visual.proj.weight (16, 32) vs (8, 32))",
        ),
        (
            "model.image.timm_kwargs={img_size: 16, patch_size: 8, depth: 1, embed_dim: 32, num_heads: 2}",
            "unexpected 12 keys (visual.trunk.blocks.1.attn.proj.bias, "
            "visual.trunk.blocks.1.attn.proj.weight, visual.trunk.blocks.1.attn.qkv.bias and 9 more)",
        ),
    ],
)
def test_weights_that_do_not_fit_fail_at_start_up(demo_run, digits, tmp_path, override, problem):
    weights = demo_run / "checkpoints" / "step_00000040" / MODEL_FILE
    with pytest.raises(UserError) as err:
        trainer(digits, tmp_path, 2, f"model.init_from={weights}", override)
    assert str(err.value) == f"model.init_from={weights}: {weights} does not fit the model: {problem}"
    assert not (tmp_path / "checkpoints").exists()


def test_a_run_at_another_image_size_resamples_the_position_embedding_and_trains(demo_run, digits, tmp_path):
    """The demo's 2x2 patch grid at 16 px into a run at 24 px (3x3): the position embedding's grid is
    resampled, the rest loads as saved, and the run trains on 24 px images."""
    start = source_weights(demo_run)
    run = trainer(digits, tmp_path, 1, f"model.init_from={demo_run}", "model.image.timm_kwargs.img_size=24")
    key = "visual.trunk.pos_embed"
    weights = run.model.state_dict()
    assert tuple(start[key].shape) == (1, 5, 32) and tuple(weights[key].shape) == (1, 10, 32)
    assert torch.equal(weights[key][:, :1], start[key][:, :1])
    assert all(torch.equal(tensor, start[name]) for name, tensor in weights.items() if name != key)
    run.run()
    assert run.step == 1 and (tmp_path / "checkpoints" / "step_00000001").is_dir()


def test_a_missing_source_is_one_line(digits, tmp_path):
    message = f"model.init_from={tmp_path / 'nope'}: checkpoint not found: {tmp_path / 'nope'} does not exist"
    with pytest.raises(UserError, match=re.escape(message)):
        trainer(digits, tmp_path, 2, f"model.init_from={tmp_path / 'nope'}")
