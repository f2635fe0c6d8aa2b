"""The EMA of the weights on its own: the decay (with timm's warmup), the update against the formula
in fp64, frozen parameters left out, and the swap that evaluation uses."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from clip_train.ema import WeightsEMA, ema_decay_at, load_ema_weights
from clip_train.errors import UserError


def test_the_decay_warms_up_as_timm_does_and_is_capped_by_the_setting():
    assert ema_decay_at(1, 0.999) == 0.999 and ema_decay_at(10**6, 0.999) == 0.999
    assert ema_decay_at(1, 0.999, 2 / 3) == 1 - 2 ** (-2 / 3)
    assert ema_decay_at(99, 0.999, 0.75) == 1 - 100**-0.75
    assert ema_decay_at(10**6, 0.999, 2 / 3) == 0.999  # 1 - (10^6 + 1)^(-2/3) is above the cap


def toy() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    model[2].requires_grad_(False)  # frozen, as a LiT-locked part
    return model


@pytest.mark.parametrize("warmup_power", [0.0, 0.75])
def test_the_average_follows_the_formula_skips_what_the_optimizer_skipped_and_leaves_frozen_parameters_out(
    warmup_power,
):
    model, decay = toy(), 0.8
    ema = WeightsEMA(model, decay, warmup_power)
    assert ema.averages.keys() == {"0.weight", "0.bias", "1.weight", "1.bias"}
    trainable = [p for p in model.parameters() if p.requires_grad]
    expected = [p.detach().clone() for p in trainable]
    for step in range(1, 6):
        stepped = step != 3  # step 3: skipped as non-finite, the weights as they were
        with torch.no_grad():  # a stand-in for an optimizer step
            for p in trainable:
                p.add_(torch.randn_like(p) if stepped else torch.zeros_like(p))
        before = [average.clone() for average in ema.averages.values()]
        ema.update(step, torch.tensor(stepped))
        if not stepped:  # not pulled toward the unchanged weights
            assert all(map(torch.equal, ema.averages.values(), before))
            continue
        d = min(decay, 1 - (1 + step) ** -warmup_power) if warmup_power else decay
        expected = [d * e + (1 - d) * p.detach() for e, p in zip(expected, trainable, strict=True)]
    for average, want in zip(ema.averages.values(), expected, strict=True):
        assert average.dtype == torch.float64
        torch.testing.assert_close(average, want, rtol=1e-13, atol=1e-15)


def test_averages_of_fp32_or_lower_weights_are_fp32():
    model = nn.Linear(2, 2).to(torch.bfloat16)
    assert WeightsEMA(model, 0.9).averages["weight"].dtype == torch.float32


def test_swapped_in_puts_the_averages_in_and_the_weights_back_bit_for_bit():
    model = toy()
    ema = WeightsEMA(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0).add_(0.1)
    ema.update(1, torch.tensor(True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.swapped_in():
        for name, average in ema.averages.items():
            assert torch.equal(model.get_parameter(name), average)
        assert torch.equal(model[2].weight, before["2.weight"])  # frozen: the model's own
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_checkpoint_without_an_ema_says_which_setting_saves_one(tmp_path):
    with pytest.raises(UserError, match=r"has no ema.safetensors: only runs with train.ema_decay > 0"):
        load_ema_weights(tmp_path, toy())


def test_an_ema_file_loads_without_frozen_parameters_and_one_that_does_not_fit_is_one_line(tmp_path):
    model, other = toy(), toy()
    ema = WeightsEMA(model, 0.5)
    averages = {name: torch.full_like(average, 0.25) for name, average in ema.averages.items()}
    save_file(averages, tmp_path / "ema.safetensors")
    with torch.no_grad():
        other[2].weight.fill_(7.0)
    load_ema_weights(tmp_path, other)  # the frozen layer has no average: it keeps its weights
    assert all(torch.equal(other.get_parameter(name), a) for name, a in averages.items())
    assert torch.equal(other[2].weight, torch.full_like(other[2].weight, 7.0))

    averages["0.weight"], averages["extra"] = torch.zeros(2, 3, dtype=torch.float64), torch.zeros(1)
    save_file(averages, tmp_path / "ema.safetensors")
    with pytest.raises(UserError) as err:
        load_ema_weights(tmp_path, other)
    assert str(err.value) == (
        f"{tmp_path / 'ema.safetensors'} does not fit the model: unexpected 1 key (extra); "
        "mis-shaped (weights vs model) 1 key (0.weight (2, 3) vs (4, 3))"
    )
    del averages["extra"], averages["1.bias"]
    with pytest.raises(UserError) as err:  # a resumed run's EMA needs an average of each trainable weight
        ema.load_full_weights(averages)
    assert str(err.value) == (
        "ema.safetensors does not fit the EMA of the trainable parameters: missing 1 key (1.bias); "
        "mis-shaped (weights vs model) 1 key (0.weight (2, 3) vs (4, 3))"
    )
