"""The ``train.parallel`` and ``fsdp.*`` keys: their defaults, what is refused at start-up, and what
they mean for FSDP2 (the units a tower is cut into, the mixed-precision policy); no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clip_train.config import ConfigError, FsdpConfig, load_config
from clip_train.model import build_model
from clip_train.model.freezing import tower_blocks
from clip_train.parallel.fsdp import mixed_precision

TINY = Path(__file__).resolve().parents[1] / "configs/model/tiny.yaml"


def test_ddp_is_the_default_and_fsdp_keys_parse():
    assert load_config(TINY).train.parallel == "ddp"
    cfg = load_config(
        TINY, ["train.parallel=fsdp", "fsdp.reshard_after_forward=false", "fsdp.param_dtype=bf16"]
    )
    assert (
        cfg.train.parallel == "fsdp" and not cfg.fsdp.reshard_after_forward and cfg.fsdp.param_dtype == "bf16"
    )
    with pytest.raises(ConfigError, match=r"fsdp\.param_dtype"):
        load_config(TINY, ["fsdp.param_dtype=fp8"])


def test_fp16_with_fsdp_is_refused_with_the_way_out():
    cfg = load_config(TINY, ["train.parallel=fsdp", "train.precision=fp16"])
    with pytest.raises(ConfigError, match=r"train.precision=fp16 with train.parallel=fsdp.*bf16"):
        cfg.validate(world_size=2)
    load_config(TINY, ["train.precision=fp16"]).validate(world_size=2)  # DDP keeps its GradScaler


def test_each_tower_is_cut_at_its_transformer_blocks():
    model = build_model(load_config(TINY).model)
    assert tower_blocks(model.visual) == list(model.visual.trunk.blocks)
    assert tower_blocks(model.text) == list(model.text.encoder.encoder.layer)
    assert len(tower_blocks(model.visual)) == 4 and len(tower_blocks(model.text)) == 2


@pytest.mark.parametrize(
    ("precision", "param", "reduce", "want"),
    [
        ("fp32", "auto", "auto", (None, None)),  # nothing cast: FSDP gathers and reduces fp32
        ("bf16", "auto", "auto", (torch.bfloat16, torch.float32)),  # bf16 gathers, fp32 sums
        ("bf16", "fp32", "auto", (torch.float32, torch.float32)),
        ("fp32", "bf16", "bf16", (torch.bfloat16, torch.bfloat16)),
    ],
)
def test_mixed_precision_follows_the_training_precision(precision, param, reduce, want):
    policy = mixed_precision(FsdpConfig(param_dtype=param, reduce_dtype=reduce), precision, torch.float32)
    assert (policy.param_dtype, policy.reduce_dtype) == want


def test_adafactor_with_fsdp_is_refused_with_the_way_out():
    cfg = load_config(TINY, ["train.parallel=fsdp", "optim.name=adafactor"])
    with pytest.raises(
        ConfigError, match=r"^optim.name=adafactor with train.parallel=fsdp: .* optim.name=adamw"
    ):
        cfg.validate(world_size=2)
    load_config(TINY, ["optim.name=adafactor"]).validate(world_size=2)  # DDP steps whole parameters
