"""Per-rank training state under FSDP falls as 1/W: the bytes of parameters, gradients and AdamW
states a rank holds after a Gradient Cache step of ViT-B/16 + BERT-base (random weights, ~200 M
parameters), on 1, 2 and 4 real gloo ranks, each within 15 % of 1/W of the one-rank figure."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from clip_train.config import FsdpConfig, load_config
from clip_train.engine import GradCache
from clip_train.model import build_model
from clip_train.optim import build_optimizer
from clip_train.parallel import shard_towers
from clip_train.parallel.memory import state_bytes

MODEL = Path(__file__).resolve().parents[1] / "configs/model/vit-b16-bert-base-random.yaml"


def one_step_state(rank: int, world: int) -> dict[str, int]:
    cfg = load_config(MODEL, ["model.text.context_length=8"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    shard_towers(model, FsdpConfig(), "fp32")
    optimizer = build_optimizer(cfg.optim, model)
    engine = GradCache(model, image_chunk=1, text_chunk=1)
    gen = torch.Generator().manual_seed(rank)
    images = torch.randint(0, 256, (1, 3, 224, 224), dtype=torch.uint8, generator=gen)
    input_ids = torch.randint(1, 49408, (1, 8), generator=gen)
    engine.step(images, input_ids, torch.ones_like(input_ids))
    optimizer.step()
    return {**state_bytes(model, optimizer), "numel": sum(p.numel() for p in model.parameters())}


def test_parameters_gradients_and_optimizer_states_per_rank_fall_as_one_over_w():
    (alone,) = run_distributed(one_step_state, 1, timeout_s=600)
    assert alone["parameters"] == alone["gradients"] == alone["numel"] * 4  # fp32, every weight trains
    assert alone["optimizer"] >= 2 * alone["parameters"]  # AdamW's two moments
    for world in (2, 4):
        for rank in run_distributed(one_step_state, world, timeout_s=600):
            for part in ("parameters", "gradients", "optimizer"):
                ratio = rank[part] / alone[part]
                assert ratio == pytest.approx(1 / world, rel=0.15), (
                    f"W={world} {part}: {ratio:.3f} of one rank's"
                )
