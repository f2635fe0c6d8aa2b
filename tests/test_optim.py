import itertools
import math

import pytest
import torch
from torch import nn

from clip_train.config import ConfigError, OptimConfig, load_config
from clip_train.optim import build_optimizer, build_scheduler, lr_factor, parameter_groups


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
    decayed, plain = parameter_groups(model, weight_decay=0.1)
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {id(p) for p in decayed["params"]} == {id(model.proj.weight)}
    expected_plain = [model.embed.weight, model.pos, model.proj.bias, model.norm.weight, model.norm.bias]
    assert {id(p) for p in plain["params"]} == {id(p) for p in [*expected_plain, model.logit_scale]}
    everything = {id(p) for g in (decayed, plain) for p in g["params"]}
    assert id(model.frozen.weight) not in everything and id(model.frozen.bias) not in everything


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
        (["optim.cooldown_steps=5"], r"no effect with optim.schedule=cosine"),
        (["optim.schedule=linear"], "optim.schedule"),
    ],
)
def test_bad_schedules_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides).validate(world_size=1)


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
