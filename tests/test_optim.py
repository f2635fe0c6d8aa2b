import copy
import itertools
import math
import re

import pytest
import torch
from small_runs import TINY_MODEL_CONFIG
from torch import nn

from clip_train.config import ConfigError, OptimConfig, load_config
from clip_train.errors import UserError
from clip_train.logs import setup_logging
from clip_train.model import build_model
from clip_train.optim import (
    MAX_LOGIT_SCALE,
    Update,
    block_index,
    build_optimizer,
    build_scheduler,
    lr_factor,
    parameter_groups,
)
from clip_train.skipped_steps import TrainingAborted


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.pos = nn.Parameter(torch.zeros(3, 4))
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))


def test_only_layer_weights_decay_and_frozen_are_left_out():
    model = Toy()
    decayed, plain = parameter_groups(model, OptimConfig(weight_decay=0.1))
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {id(p) for p in decayed["params"]} == {id(model.proj.weight)}
    expected_plain = [model.embed.weight, model.pos, model.proj.bias, model.norm.weight, model.norm.bias]
    assert {id(p) for p in plain["params"]} == {id(p) for p in [*expected_plain, model.logit_scale]}
    everything = {id(p) for g in (decayed, plain) for p in g["params"]}
    assert id(model.frozen.weight) not in everything and id(model.frozen.bias) not in everything


def test_a_gpt2_text_towers_linear_layers_decay_as_bert_ones_do():
    """GPT-2's linear layers are transformers' ``Conv1D``, not ``nn.Linear``: their weights decay
    too, while its token and position embeddings and norms do not."""
    gpt2 = "model.text.hf_config={model_type: gpt2, n_embd: 32, n_layer: 2, n_head: 2, n_positions: 16}"
    cfg = load_config(TINY_MODEL_CONFIG, [gpt2, "model.text.pooling=mean", "model.text.context_length=16"])
    model = build_model(cfg.model)
    decayed, plain = parameter_groups(model, OptimConfig(weight_decay=0.1))
    decayed_names = {
        name for name, p in model.text.named_parameters() if any(p is q for q in decayed["params"])
    }
    layers = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert decayed_names == {"proj.weight"} | {
        f"encoder.h.{i}.{layer}.weight" for i in (0, 1) for layer in layers
    }
    assert {id(model.text.encoder.wte.weight), id(model.text.encoder.wpe.weight)} <= {
        id(p) for p in plain["params"]
    }


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_optimizers_step_and_skip_frozen(name):
    model = Toy()
    optimizer = build_optimizer(OptimConfig(name=name, lr=1e-2, weight_decay=0.1), model)
    before = model.frozen.weight.clone()
    model.proj(model.embed(torch.tensor([1, 2]))).sum().backward()
    proj = model.proj.weight.clone()
    optimizer.step()
    assert torch.equal(model.frozen.weight, before)
    assert not torch.equal(model.proj.weight, proj)


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
    factors = [lr_factor(s, cfg, max_steps=14) for s in range(16)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0)
    assert factors[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[14] == pytest.approx(0.1) and factors[15] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[3:]))


def test_scheduler_drives_optimizer_lr():
    model = Toy()
    cfg = OptimConfig(lr=0.5, min_lr=0.0, warmup_steps=2)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, max_steps=10)
    seen = []
    for _ in range(3):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.25, 0.5, 0.5])


def test_const_and_const_cooldown_schedules():
    """OpenCLIP's const (warmup, then lr) and const-cooldown (then a decay over the last steps to
    min_lr, linear at power 1, quadratic at 2)."""
    const = OptimConfig(lr=1.0, warmup_steps=2, schedule="const")
    assert [lr_factor(s, const, max_steps=10) for s in range(12)] == [0.5] + [1.0] * 11
    for power in (1.0, 2.0):
        cfg = OptimConfig(lr=1.0, min_lr=0.2, warmup_steps=2, schedule="const-cooldown", cooldown_steps=4)
        cfg.cooldown_power = power
        factors = [lr_factor(s, cfg, max_steps=10) for s in range(12)]
        assert factors[:6] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
        assert factors[6:] == pytest.approx([0.2 + 0.8 * (1 - k / 4) ** power for k in (0, 1, 2, 3, 4, 4)])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["optim.schedule=const-cooldown"],
            r"optim.cooldown_steps=0: optim.schedule=const-cooldown needs 1 to 1000",
        ),
        (
            ["optim.schedule=const-cooldown", "optim.cooldown_steps=999", "optim.warmup_steps=2"],
            "needs 1 to 998",
        ),
        (
            ["optim.schedule=const-cooldown", "optim.cooldown_steps=8", "optim.warmup_steps=1016"],
            r"^optim\.warmup_steps=1016 leaves no step of train\.max_steps=1000 for the cooldown of "
            r"optim\.schedule=const-cooldown; shorten the warmup or raise train\.max_steps$",
        ),
        (
            ["optim.schedule=const-cooldown", "optim.warmup_steps=1000"],
            r"^optim\.warmup_steps=1000 leaves no step of train\.max_steps=1000",
        ),
        (["optim.cooldown_steps=5"], r"no effect with optim.schedule=cosine"),
        (["optim.schedule=linear"], "optim.schedule"),
    ],
)
def test_bad_schedules_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides).validate(world_size=1)


# -- per-tower rates and layer-wise decay ----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "found"),
    [
        ("visual.trunk.blocks.3.attn.qkv.weight", ("visual.trunk.blocks.", 3)),  # timm ViT
        ("text.encoder.encoder.layer.11.output.dense.bias", ("text.encoder.encoder.layer.", 11)),  # BERT
        (  # transformers' CLIPTextModel (open_clip's text transformer)
            "text.encoder.text_model.encoder.layers.0.mlp.fc1.weight",
            ("text.encoder.text_model.encoder.layers.", 0),
        ),
        ("visual.trunk.pos_embed", None),
        ("visual.trunk.norm.weight", None),
        ("text.encoder.embeddings.word_embeddings.weight", None),
        ("text.encoder.text_model.final_layer_norm.weight", None),
        ("visual.trunk.layers_norm.weight", None),
    ],
)
def test_block_index_finds_the_block_list_of_each_naming(name, found):
    assert block_index(name) == found


VIT_DEPTH, BERT_DEPTH = 4, 2  # configs/model/tiny.yaml
IMAGE_LR, TEXT_LR, LR, DECAY = 3e-4, 7e-5, 1e-3, 0.65


def tiny_model(*overrides: str):
    torch.manual_seed(0)
    return build_model(load_config(TINY_MODEL_CONFIG, overrides).model)


def expected_rate(name: str) -> float:
    """The formula: block k of L at rate * decay^(L - k), the embeddings at decay^L, the rest at rate."""
    if name.startswith("visual."):
        rate, depth, block = IMAGE_LR, VIT_DEPTH, re.search(r"\.blocks\.(\d+)\.", name)
        embeddings = ("visual.trunk.cls_token", "visual.trunk.pos_embed", "visual.trunk.patch_embed.")
    elif name.startswith("text."):
        rate, depth, block = TEXT_LR, BERT_DEPTH, re.search(r"\.encoder\.layer\.(\d+)\.", name)
        embeddings = ("text.encoder.embeddings.",)
    else:
        return LR  # the logit scale
    if block:
        return rate * DECAY ** (depth - (int(block[1]) + 1))
    return rate * DECAY**depth if name.startswith(embeddings) else rate


def decays(name: str, p: torch.Tensor) -> bool:
    return name.endswith(".weight") and p.ndim >= 2 and "embeddings." not in name


@pytest.mark.parametrize("lit", [False, True])
def test_vit_and_bert_groups_follow_the_per_tower_layer_decay_formula(lit):
    lock = ["model.image.lock=true", "model.image.unlocked_layers=1"] if lit else []
    model = tiny_model(*lock)
    cfg = OptimConfig(lr=LR, image_lr=IMAGE_LR, text_lr=TEXT_LR, layer_decay=DECAY, weight_decay=0.1)
    groups = build_optimizer(cfg, model).param_groups
    names = {id(p): name for name, p in model.named_parameters()}
    grouped = {names[id(p)]: group for group in groups for p in group["params"]}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert grouped.keys() == trainable and sum(len(g["params"]) for g in groups) == len(trainable)
    for name, p in model.named_parameters():
        if name in grouped:
            assert grouped[name]["lr"] == expected_rate(name), name  # exact, in Python's fp64
            assert grouped[name]["weight_decay"] == (0.1 if decays(name, p) else 0.0), name
    full_rate = {name for name in grouped if name.startswith("visual.") and grouped[name]["lr"] == IMAGE_LR}
    last_block = {n for n in grouped if n.startswith(f"visual.trunk.blocks.{VIT_DEPTH - 1}.")}
    head = {"visual.trunk.norm.weight", "visual.trunk.norm.bias", "visual.proj.weight"}
    assert full_rate == head | last_block
    if lit:  # the locked blocks and embeddings get no group; the unlocked last block its full rate
        assert not any(n.startswith(("visual.trunk.blocks.0.", "visual.trunk.pos_embed")) for n in grouped)
    else:
        assert grouped["visual.trunk.pos_embed"]["lr"] == IMAGE_LR * DECAY**VIT_DEPTH
        assert grouped["text.encoder.embeddings.word_embeddings.weight"]["lr"] == TEXT_LR * DECAY**BERT_DEPTH


def test_one_rate_for_all_keeps_the_two_groups():
    model = tiny_model()
    groups = build_optimizer(OptimConfig(lr=LR, weight_decay=0.1), model).param_groups
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(LR, 0.1), (LR, 0.0)]


@pytest.mark.parametrize("timm", ["resnet18", "efficientnet_b0"])  # stages of blocks: blocks.S.B.
def test_a_tower_without_one_list_of_blocks_takes_no_layer_decay(timm):
    hierarchical = (f"model.image.timm={timm}", "model.image.timm_kwargs={}")
    with pytest.raises(ConfigError, match=r"optim.layer_decay=0.7 needs one list .* model.image, which has"):
        parameter_groups(tiny_model(*hierarchical), OptimConfig(layer_decay=0.7))


def test_layer_decay_on_a_tower_without_blocks_names_the_key_unless_nothing_there_trains():
    resnet = ("model.image.timm=resnet18", "model.image.timm_kwargs={}")
    model = tiny_model(*resnet, "model.image.lock=true", "model.image.lock_head=true")  # LiT: locked whole
    cfg = OptimConfig(lr=LR, text_lr=TEXT_LR, layer_decay=DECAY)
    rates = {p: group["lr"] for group in parameter_groups(model, cfg) for p in group["params"]}
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and not any(name.startswith("visual.") for name in trainable)
    for name, p in trainable.items():  # the text tower's layer decay as with a ViT beside it
        assert rates[p] == expected_rate(name), name


@pytest.mark.parametrize(
    "schedule",
    [
        {"schedule": "cosine", "warmup_steps": 3, "min_lr": 1e-5},
        {"schedule": "const-cooldown", "warmup_steps": 2, "cooldown_steps": 4, "min_lr": 1e-4},
    ],
)
def test_the_schedule_scales_each_group_own_rate(schedule):
    model = tiny_model()
    cfg = OptimConfig(lr=LR, image_lr=IMAGE_LR, text_lr=TEXT_LR, layer_decay=DECAY, **schedule)
    optimizer = build_optimizer(cfg, model)
    peaks = [g["lr"] for g in optimizer.param_groups]
    assert len(set(peaks)) > 4
    scheduler = build_scheduler(cfg, optimizer, max_steps=12)
    for step in range(14):
        factor = lr_factor(step, cfg, max_steps=12)
        assert [g["lr"] for g in optimizer.param_groups] == [peak * factor for peak in peaks], step
        optimizer.step()
        scheduler.step()
    # each group ends at the same fraction min_lr / lr of its own rate
    assert [g["lr"] for g in optimizer.param_groups] == [p * (cfg.min_lr / LR) for p in peaks]


@pytest.mark.parametrize(
    ("lr", "image_lr", "decay"),
    [
        (LR / 2, IMAGE_LR / 3, DECAY),
        (IMAGE_LR, IMAGE_LR, DECAY**2),  # the text tower's rates now the image tower's: no merged groups
    ],
)
def test_a_resume_goes_on_at_the_configs_rates_and_logs_them(capsys, lr, image_lr, decay):
    """Three steps at one set of rates, resumed with others: the moments and the schedule's position
    come back, the rates are the new config's (the saved ones won, while train/lr showed the new).
    The groups are those the checkpoint has whatever the new values, equal ones included."""
    model = tiny_model()
    grads = {name: torch.randn_like(p) for name, p in model.named_parameters() if p.requires_grad}

    def update_for(*rates: str) -> Update:
        overrides = ["optim.warmup_steps=2", "train.max_steps=10", "train.device=cpu", *rates]
        return Update(model, load_config(TINY_MODEL_CONFIG, overrides), torch.device("cpu"))

    first = update_for(f"optim.lr={LR}", f"optim.image_lr={IMAGE_LR}", f"optim.layer_decay={DECAY}")
    for step in range(1, 4):
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.grad = grads[name].clone()
        first(torch.tensor(1.0), step)
    state = first.state_dict()
    saved = copy.deepcopy(state["optimizer"]["state"])  # load_state_dict may take the tensors as they are
    resumed = update_for(f"optim.lr={lr}", f"optim.image_lr={image_lr}", f"optim.layer_decay={decay}")
    peaks = [group["initial_lr"] for group in resumed.optimizer.param_groups]  # this config's
    assert resumed.members == first.members
    setup_logging()
    resumed.load_state_dict(state)
    resumed_cfg = OptimConfig(lr=lr, warmup_steps=2)
    factor = lr_factor(3, resumed_cfg, max_steps=10)  # the next step's, the 4th
    assert resumed.base_lr == lr and resumed.lr == lr * lr_factor(2, resumed_cfg, max_steps=10)
    assert [group["lr"] for group in resumed.optimizer.param_groups] == [peak * factor for peak in peaks]
    assert resumed.scheduler.last_epoch == 3
    loaded = resumed.optimizer.state_dict()["state"]
    assert loaded.keys() == saved.keys() and saved
    for index, before in saved.items():
        assert before.keys() == loaded[index].keys()
        assert all(torch.equal(before[k], loaded[index][k]) for k in before), index
    assert "the learning rates differ from the checkpoint's" in capsys.readouterr().err
    regrouped = update_for(f"optim.lr={LR}")  # no layer decay, no image_lr: other groups
    with pytest.raises(UserError, match=r"groups the parameters otherwise than this run \(visual\.trunk\."):
        regrouped.load_state_dict(state)
    del state["members"]  # a checkpoint from before they were saved: torch's check of the sizes
    with pytest.raises(UserError, match=r"optimizer state does not fit this run's parameter groups \(loaded"):
        regrouped.load_state_dict(state)


@pytest.mark.parametrize(("saved", "resumed"), [("bf16", "fp16"), ("fp16", "bf16"), ("fp32", "fp16")])
def test_a_resume_may_turn_the_fp16_loss_scale_on_or_off(capsys, saved, resumed):
    """A run saved without a loss scale (bf16, fp32) resumes in fp16 from the initial scale, where
    torch's scaler refuses the saved empty state; one saved in fp16 resumes without it."""
    model = tiny_model()

    def update_for(precision: str) -> Update:
        overrides = ["train.max_steps=10", "train.device=cpu", f"train.precision={precision}"]
        return Update(model, load_config(TINY_MODEL_CONFIG, overrides), torch.device("cpu"))

    state = update_for(saved).state_dict()
    update = update_for(resumed)
    fresh = update.scaler.state_dict()
    setup_logging()
    update.load_state_dict(state)
    assert update.scaler.state_dict() == fresh and update.scaler.is_enabled() == (resumed == "fp16")
    said = (
        "the checkpoint has no fp16 loss scale: the run starts at the initial scale"
        in capsys.readouterr().err
    )
    assert said == (resumed == "fp16")


def test_a_resume_goes_on_at_the_configs_weight_decay_betas_and_eps(capsys):
    """They came back from the checkpoint, silently. A run saved without weight decay keeps its
    decayed and undecayed groups apart, so weight decay can be turned on at a resume."""
    model = tiny_model()

    def update_for(*settings: str) -> Update:
        overrides = ["train.max_steps=10", "train.device=cpu", *settings]
        return Update(model, load_config(TINY_MODEL_CONFIG, overrides), torch.device("cpu"))

    state = update_for("optim.weight_decay=0").state_dict()
    setup_logging()
    update_for("optim.weight_decay=0").load_state_dict(state)
    assert "the optimizer's" not in capsys.readouterr().err
    resumed = update_for("optim.weight_decay=0.3", "optim.betas=[0.5, 0.6]", "optim.eps=1e-7")
    resumed.load_state_dict(state)
    groups = resumed.optimizer.param_groups
    assert [group["weight_decay"] for group in groups] == [0.3, 0.0]
    assert {group["betas"] for group in groups} == {(0.5, 0.6)}
    assert {group["eps"] for group in groups} == {1e-7}
    said = capsys.readouterr().err
    assert "the optimizer's betas, eps, weight_decay differ from the checkpoint's" in said


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.image_lr=0", r"optim.image_lr=0.0 must be > 0 \(or null for optim.lr\)"),
        ("optim.text_lr=-1e-4", "optim.text_lr=-0.0001 must be > 0"),
        ("optim.layer_decay=0", r"optim.layer_decay=0.0 must lie in \(0, 1\]"),
        ("optim.layer_decay=1.2", "optim.layer_decay=1.2 must lie in"),
    ],
)
def test_bad_rates_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override]).validate(world_size=1)


def test_adamw_is_fused_where_torch_has_the_kernel_and_steps_as_the_foreach_one_to_rounding():
    """Same weights, same gradients, three steps: the fused kernel and the foreach path agree to
    fp32 rounding (they order the same arithmetic differently); optim.fused=false keeps foreach."""
    models = [Toy(), Toy()]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [
        build_optimizer(OptimConfig(lr=1e-2, weight_decay=0.1, fused=fused), model)
        for fused, model in zip((True, False), models, strict=True)
    ]
    assert optimizers[0].defaults["fused"] and not optimizers[1].defaults["fused"]
    initial = models[0].proj.weight.detach().clone()
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, 10, (4,), generator=gen)
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            model.proj(model.embed(tokens)).pow(2).sum().backward()
            optimizer.step()
    for fused, foreach in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(fused, foreach, rtol=1e-6, atol=1e-7)
    assert not torch.equal(models[0].proj.weight, initial)


@pytest.mark.parametrize("fused", [True, False])
def test_the_update_keeps_the_logit_scale_between_0_and_log_100_as_openclip_does(fused):
    """Zero gradients: AdamW leaves every weight where it is, so only the clamp moves the scale."""
    model = tiny_model()
    overrides = ["train.max_steps=10", "train.device=cpu", f"optim.fused={fused}"]
    update = Update(model, load_config(TINY_MODEL_CONFIG, overrides), torch.device("cpu"))
    cases = [(-0.5, 0.0), (MAX_LOGIT_SCALE + 0.5, MAX_LOGIT_SCALE), (1.5, 1.5)]  # (set, after the update)
    for step, (start, clamped) in enumerate(cases):
        with torch.no_grad():
            model.logit_scale.fill_(start)
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        update(torch.tensor(1.0), step + 1)
        assert model.logit_scale.item() == float(torch.tensor(clamped, dtype=torch.float32)), start


def test_fp16_overflows_are_bad_steps_once_the_scale_is_down_to_1(tmp_path):
    """A gradient that is not finite unscaled overflows at every scale: GradScaler halved the scale
    each step, with no floor, to exactly 0 after 166 steps (after which no step could run), and the
    guard never counted one. Above 1 the scaler is still searching; at 1 and below each such step is
    bad, and train.max_bad_steps stops the run."""
    model = tiny_model()
    precision = ["train.precision=fp16", "train.max_bad_steps=5", f"train.out_dir={tmp_path}"]
    cfg = load_config(TINY_MODEL_CONFIG, ["train.max_steps=100", "train.device=cpu", *precision])
    update = Update(model, cfg, torch.device("cpu"))
    update.scaler.scale(torch.tensor(1.0))  # the scaler makes its scale at the first loss it scales
    scales = []
    with pytest.raises(TrainingAborted, match=r"^5 consecutive steps had a non-finite loss or gradient norm"):
        for step in range(1, 100):
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            model.logit_scale.grad.fill_(math.inf)
            scales.append(update.scaler.get_scale())
            update(torch.tensor(1.0), step)
    assert scales == [2.0**power for power in range(16, -5, -1)]  # 16 overflows searched, 5 bad steps
    assert (update.skipped_steps.total, update.skipped_steps.in_a_row) == (5, 5)
