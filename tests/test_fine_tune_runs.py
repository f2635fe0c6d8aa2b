"""Per-tower rates, layer decay and the EMA in real runs: 2-rank torchrun processes on CPU (gloo),
fp64, DDP and FSDP, each a checkpoint every step.

The EMA saved at the last step equals the formula applied to the weights saved at every step; a run
resumed from a mid-run checkpoint ends with weights, EMA and learning rates bit-identical to the
uninterrupted run's; the rates follow the formula by parameter name on the sharded parameters; the
EMA's shards have their parameters' placements; evaluation, ``load`` and ``export`` take the EMA.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from safetensors.torch import load_file
from small_runs import DEMO_CONFIG, run_overrides
from test_trainer import assert_bit_identical, finish, torchrun
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

import clip_train
from clip_train import load_config
from clip_train.checkpoint import EMA_FILE, MODEL_FILE, SHARDS_DIR, STATE_FILE, load_weights_file
from clip_train.cli import main as cli_main
from clip_train.distributed import DistEnv
from clip_train.ema import load_ema_weights
from clip_train.errors import UserError
from clip_train.eval import evaluate
from clip_train.model import build_model
from clip_train.optim import AS_SAVED, lr_factor
from clip_train.trainer import Trainer

STEPS, RESUME_AT = 4, 2
LR, IMAGE_LR, TEXT_LR, DECAY = 1e-3, 3e-4, 2e-3, 0.7  # LR: configs/demo-digits.yaml
VIT_DEPTH, BERT_DEPTH = 2, 1  # small_runs.TINY_MODEL
RATES = [f"optim.image_lr={IMAGE_LR}", f"optim.text_lr={TEXT_LR}", f"optim.layer_decay={DECAY}"]
DDP = [*RATES, "train.ema_decay=0.8", "model.image.lock=true", "model.image.unlocked_layers=1"]
FSDP = [*RATES, "train.parallel=fsdp", "train.ema_decay=0.9", "train.ema_warmup_power=0.75"]


def overrides(digits: Path, out_dir: Path, *extra: str) -> list[str]:
    every_step = ["checkpoint.every_steps=1", "checkpoint.keep=10", "log.every_steps=1"]
    return run_overrides(digits, out_dir, STEPS, "train.precision=fp64", *every_step, *extra)


def step_dir(out_dir: Path, step: int) -> Path:
    return out_dir / "checkpoints" / f"step_{step:08d}"


def saved(out_dir: Path, file: str, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(step_dir(out_dir, step) / file)


def expected_rate(name: str) -> float:
    """The formula: block k of L at rate * decay^(L - k), the embeddings at decay^L, the rest at rate."""
    if name.startswith("visual."):
        rate, depth, prefix = IMAGE_LR, VIT_DEPTH, "visual.trunk.blocks."
        embeddings = ("visual.trunk.cls_token", "visual.trunk.pos_embed", "visual.trunk.patch_embed.")
    elif name.startswith("text."):
        rate, depth, prefix = TEXT_LR, BERT_DEPTH, "text.encoder.encoder.layer."
        embeddings = ("text.encoder.embeddings.",)
    else:
        return LR
    if name.startswith(prefix):
        k = int(name.removeprefix(prefix).split(".")[0]) + 1
        return rate * DECAY ** (depth - k)
    return rate * DECAY**depth if name.startswith(embeddings) else rate


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def runs(request, digits, tmp_path_factory) -> tuple[list[str], Path, Path]:
    """The run's arguments, the uninterrupted run, and a fresh run resumed from its step 2."""
    extra = DDP if request.param == "ddp" else FSDP
    root = tmp_path_factory.mktemp(request.param)
    finish(torchrun(*overrides(digits, root / "reference", *extra)))
    copy = root / "from" / f"step_{RESUME_AT:08d}"
    shutil.copytree(step_dir(root / "reference", RESUME_AT), copy)
    output = finish(torchrun(*overrides(digits, root / "resumed", *extra, f"checkpoint.resume={copy}")))
    assert f"resumed from {copy}" in output
    return overrides(digits, root / "reference", *extra), root / "reference", root / "resumed"


def test_the_ema_is_the_formula_over_the_weights_saved_at_every_step(runs):
    args, reference, _ = runs
    cfg = load_config(DEMO_CONFIG, args)
    torch.manual_seed(cfg.train.seed)  # the weights the run built before its first step
    model = build_model(cfg.model).double()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    ema = {name: p.detach().clone() for name, p in model.named_parameters() if name in trainable}
    for step in range(1, STEPS + 1):
        weights = saved(reference, MODEL_FILE, step)
        power, decay = cfg.train.ema_warmup_power, cfg.train.ema_decay
        d = min(decay, 1 - (1 + step) ** -power) if power else decay
        ema = {name: d * average + (1 - d) * weights[name] for name, average in ema.items()}
    got = saved(reference, EMA_FILE)
    assert got.keys() == trainable  # under LiT the locked trunk is not averaged
    if cfg.model.image.lock:
        assert "visual.trunk.blocks.0.attn.qkv.weight" not in got and "visual.proj.weight" in got
    for name, want in ema.items():
        assert got[name].dtype == torch.float64
        torch.testing.assert_close(got[name], want, rtol=1e-12, atol=1e-14, msg=name)
    assert not torch.equal(got["visual.proj.weight"], saved(reference, MODEL_FILE)["visual.proj.weight"])


def test_a_resumed_run_ends_bit_identical_in_weights_ema_and_learning_rates(runs):
    args, reference, resumed = runs
    assert_bit_identical(saved(resumed, MODEL_FILE), saved(reference, MODEL_FILE))
    assert_bit_identical(saved(resumed, EMA_FILE), saved(reference, EMA_FILE))
    optim = load_config(DEMO_CONFIG, args).optim
    groups = [param_groups(out)[0] for out in (reference, resumed)]
    assert groups[0] == groups[1]
    for group in groups[0]:
        assert group["lr"] == group["initial_lr"] * lr_factor(STEPS, optim, STEPS)
    peaks = {group["initial_lr"] for group in groups[0]}
    logged = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    for record in logged:  # optim.lr as the step ran at it (step N is the scheduler's N - 1)
        assert record["train/lr"] == LR * lr_factor(record["step"] - 1, optim, STEPS)
    names = param_groups(reference)[1]
    if names is not None:  # FSDP: the shards name each group's parameters
        for group in groups[0]:
            for name in group["params"]:
                assert group["initial_lr"] == expected_rate(name), name
        assert set(names) >= {"visual.trunk.pos_embed", "text.encoder.encoder.layer.0.output.dense.weight"}
    else:  # the LiT run: the unlocked last block, head and projection at image_lr
        want = {LR, IMAGE_LR, TEXT_LR, TEXT_LR * DECAY**BERT_DEPTH}
        assert peaks == want


def param_groups(out_dir: Path) -> tuple[list[dict], list[str] | None]:
    """The optimizer's parameter groups at the last step, and for a sharded checkpoint (whose
    groups name their parameters) every parameter's name."""
    checkpoint = step_dir(out_dir, STEPS)
    if not (checkpoint / SHARDS_DIR).is_dir():
        state = torch.load(checkpoint / STATE_FILE, weights_only=True)
        return state["update"]["optimizer"]["param_groups"], None
    whole = out_dir / "shards.pt"
    dcp_to_torch_save(checkpoint / SHARDS_DIR, whole)
    groups = torch.load(whole, weights_only=True)["optimizer"]["param_groups"]
    return groups, [name for group in groups for name in group["params"]]


def test_a_resume_with_another_locking_is_refused_naming_the_keys_to_set_back(runs, tmp_path):
    """The EMA (of the trainable weights) does not fit such a run either; the line that says what to
    set back is the optimizer groups' (DDP), or the sharded states' (FSDP)."""
    args, reference, _ = runs
    relocked = "model.image.unlocked_layers=0" if "model.image.lock=true" in args else "model.image.lock=true"
    resume = f"checkpoint.resume={step_dir(reference, RESUME_AT)}"
    overrides = [*args, f"train.out_dir={tmp_path}", resume, relocked, "data.workers=0"]
    cfg = load_config(DEMO_CONFIG, overrides).validate(world_size=1)
    with pytest.raises(UserError) as err:
        Trainer(cfg, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    assert "\n" not in str(err.value) and str(err.value).endswith(AS_SAVED)


def test_clip_train_load_and_export_take_the_ema(runs, tmp_path):
    _, reference, _ = runs
    checkpoint = step_dir(reference, STEPS)
    ema, weights = saved(reference, EMA_FILE), saved(reference, MODEL_FILE)
    model, _, _ = clip_train.load(checkpoint, ema=True)
    for name, tensor in model.state_dict().items():
        want = ema[name] if name in ema else weights[name]  # the frozen trunk: the weights
        assert torch.equal(tensor, want.float()), name
    assert cli_main(["export", str(checkpoint), str(tmp_path / "export"), "--ema"]) == 0
    exported = load_file(tmp_path / "export" / "open_clip_model.safetensors")
    assert torch.equal(exported["visual.head.proj.weight"], ema["visual.proj.weight"].float())


# -- in-process ranks ------------------------------------------------------------------------------


def make_trainer(rank: int, world: int, args: list[str]) -> Trainer:
    cfg = load_config(DEMO_CONFIG, [*args, "data.workers=0"]).validate(world_size=world)
    return Trainer(cfg, DistEnv(rank=rank, world_size=world, local_rank=0, device=torch.device("cpu")))


def trained_with_ema_evaluation(rank: int, world: int, args: list[str]) -> dict:
    trainer = make_trainer(rank, world, args)
    params = dict(trainer.model.named_parameters())
    placed = {
        name: isinstance(average, DTensor)
        and average.placements == params[name].placements
        and average.device_mesh == params[name].device_mesh
        and average.to_local().shape == params[name].to_local().shape
        for name, average in trainer.ema.averages.items()
    }
    return {"placed": placed, "final": trainer.run()}


def fp64_model(cfg_args: list[str], checkpoint: Path, *, ema: bool) -> torch.nn.Module:
    """A checkpoint's weights (and EMA) in an fp64 model, as the run held them."""
    model = build_model(load_config(DEMO_CONFIG, cfg_args).model, load_pretrained=False).double()
    load_weights_file(checkpoint / MODEL_FILE, model)
    if ema:
        load_ema_weights(checkpoint, model)
    return model


def test_fsdp_ema_shards_like_the_weights_and_evaluation_uses_it(digits, tmp_path, capsys):
    """The averages are DTensors placed as their parameters; the final evaluation with
    ``eval.use_ema`` on 2 ranks equals one process evaluating the checkpoint's EMA in fp64, and so
    does ``clip-train eval`` with ``eval.use_ema=true``."""
    evaluation = [f"data.val={digits}/val", f"eval.zeroshot={digits}/zeroshot.json", "eval.zeroshot_data="]
    out = tmp_path / "eval"
    args = [*overrides(digits, out, *FSDP, *evaluation, "eval.use_ema=true"), "train.max_steps=2"]
    results = run_distributed(trained_with_ema_evaluation, 2, args, timeout_s=300)
    cfg, checkpoint, cpu = load_config(DEMO_CONFIG, args), step_dir(out, 2), torch.device("cpu")
    alone = evaluate(fp64_model(args, checkpoint, ema=True), cfg.eval, cfg.data, device=cpu, precision="fp64")
    plain = evaluate(
        fp64_model(args, checkpoint, ema=False), cfg.eval, cfg.data, device=cpu, precision="fp64"
    )
    assert plain["val/loss"] != alone["val/loss"]  # the EMA is not the weights
    assert cli_main(["eval", str(checkpoint), "eval.use_ema=true"]) == 0
    command = json.loads(capsys.readouterr().out.splitlines()[-1])
    towers = {name for name in results[0]["placed"] if name.startswith(("visual.", "text."))}
    assert towers and all(result["placed"][name] for result in results for name in towers)
    assert command["ema"] is True  # said, as export and load take the weights unless asked
    for got in (*(result["final"] for result in results), command):
        assert got.keys() - {"checkpoint", "ema"} == alone.keys()
        for name, value in alone.items():
            # identical captions encoded in other batches differ in the last bits (see test_fsdp_trainer)
            slack = 1 / alone["retrieval/n"] if name.startswith("retrieval/") else 1e-12
            assert got[name] == pytest.approx(value, rel=1e-9, abs=slack), name


def test_a_skipped_step_leaves_the_ema_as_it_was(digits, tmp_path):
    """A non-finite loss at step 2 skips the optimizer step, and the EMA update with it (which would
    move the average toward the unchanged weights)."""
    trainer = make_trainer(0, 1, overrides(digits, tmp_path, *DDP, "train.max_steps=3"))
    real_step, after_steps = trainer.engine.step, []

    def poisoned_second_step(*args, **kwargs):
        stats = real_step(*args, **kwargs)
        if len(after_steps) == 1:
            stats.loss = torch.full_like(stats.loss, float("nan"))
        return stats

    def train_step(batch, logged=False):
        result = Trainer.train_step(trainer, batch, logged)
        after_steps.append({name: average.clone() for name, average in trainer.ema.averages.items()})
        return result

    trainer.engine.step, trainer.train_step = poisoned_second_step, train_step
    trainer.run()
    assert trainer.update.skipped_steps.total == 1 and len(after_steps) == 3
    assert_bit_identical(after_steps[1], after_steps[0])
    moved = [name for name in after_steps[1] if not torch.equal(after_steps[2][name], after_steps[1][name])]
    assert "visual.proj.weight" in moved
