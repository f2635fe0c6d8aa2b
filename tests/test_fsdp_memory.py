"""Per-rank training state under FSDP falls as 1/W: the bytes of parameters, gradients and AdamW
states a rank holds after a Gradient Cache step of ViT-B/16 + BERT-base at two blocks each (their
widths and embeddings, random weights, 68 M parameters), on 1, 2 and 4 real gloo ranks, each within
15 % of 1/W of the one-rank figure; and ``clip-train plan``'s sharded terms predict each of them."""

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
from clip_train.plan import breakdown, profile_model
from clip_train.plan.auto_chunks import run_setting

MODEL = Path(__file__).resolve().parents[1] / "configs/model/vit-b16-bert-base-random.yaml"
# Two blocks a tower keep the widths, the embeddings and the sharding units' kinds at a third of
# the full models' cost (the twelve-block figures are in docs/fsdp.md).
SHAPE = (
    "model.text.context_length=8",
    "model.image.timm_kwargs.depth=2",
    "model.text.hf_config.num_hidden_layers=2",
)
WORLDS = (1, 2, 4)


def one_step_state(rank: int, world: int) -> dict[str, int]:
    cfg = load_config(MODEL, list(SHAPE))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    shard_towers(model, FsdpConfig(), "fp32", torch.device("cpu"))
    optimizer = build_optimizer(cfg.optim, model)
    engine = GradCache(model, image_chunk=1, text_chunk=1)
    gen = torch.Generator().manual_seed(rank)
    images = torch.randint(0, 256, (1, 3, 224, 224), dtype=torch.uint8, generator=gen)
    input_ids = torch.randint(1, 49408, (1, 8), generator=gen)
    engine.step(images, input_ids, torch.ones_like(input_ids))
    optimizer.step()
    return {**state_bytes(model, optimizer), "numel": sum(p.numel() for p in model.parameters())}


@pytest.fixture(scope="module")
def measured() -> dict[int, list[dict[str, int]]]:
    """Each rank's state after one step (1 sample per rank, one chunk per tower), by world size."""
    return {world: run_distributed(one_step_state, world, timeout_s=600) for world in WORLDS}


def test_parameters_gradients_and_optimizer_states_per_rank_fall_as_one_over_w(measured):
    (alone,) = measured[1]
    assert alone["parameters"] == alone["gradients"] == alone["numel"] * 4  # fp32, every weight trains
    assert alone["optimizer"] >= 2 * alone["parameters"]  # AdamW's two moments
    for world in WORLDS[1:]:
        for rank in measured[world]:
            for part in ("parameters", "gradients", "optimizer"):
                ratio = rank[part] / alone[part]
                assert ratio == pytest.approx(1 / world, rel=0.15), (
                    f"W={world} {part}: {ratio:.3f} of one rank's"
                )


def test_the_plans_sharded_terms_match_what_each_rank_holds_after_the_step(measured):
    """What stays after the step: the plan's weights, grads and optimizer terms, each 1/W; the step
    leaves nothing gathered (not compared: the plan holds it as static). One-chunk towers
    reduce-scatter as each block's backward ends, so nothing accumulates unsharded."""
    overrides = [*SHAPE, "train.parallel=fsdp", "batch.image_chunk=1", "batch.text_chunk=1"]
    profile = profile_model(load_config(MODEL, overrides).model, "fp32", (1, 2), "cpu")
    for world in WORLDS:
        cfg = load_config(MODEL, [*overrides, f"batch.global_size={world}"])
        planned = breakdown(profile, run_setting(cfg, world, "cpu"))
        assert planned.accumulated == 0
        for rank in measured[world]:
            for part, term in (
                ("parameters", planned.weights),
                ("gradients", planned.grads),
                ("optimizer", planned.optimizer),
            ):
                assert rank[part] == pytest.approx(term, rel=0.01), f"W={world} {part}"
