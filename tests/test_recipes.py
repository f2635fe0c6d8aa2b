"""Every shipped config loads and validates at the world sizes it is written for; nothing is built."""

import math
from pathlib import Path

import pytest

from clip_train import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = {
    "laion400m-lit-vitb16-bert-256k.yaml": (8, 32),
    "laion400m-vitl14-1m.yaml": (8, 32),
    "laion2b-vitg14-bert-large-fsdp.yaml": (8, 32),
    "cc12m-vitb32-32k.yaml": (8,),
    "finetune-vitb32-laion2b-lit-64k.yaml": (8,),
    "demo-digits.yaml": (1, 2),
    "demo-digits-siglip.yaml": (1, 2),
}


def test_every_config_is_covered():
    shipped = {p.name for p in CONFIGS.glob("*.yaml")}
    assert shipped == set(RECIPES)


@pytest.mark.parametrize(("name", "worlds"), RECIPES.items())
def test_recipe_validates(name, worlds):
    config = load_config(CONFIGS / name)
    for world in worlds:
        config.validate(world_size=world)


def test_lit_recipe_matches_inf_cl():
    config = load_config(CONFIGS / "laion400m-lit-vitb16-bert-256k.yaml")
    assert config.model.image.lock and config.model.image.timm.startswith("vit_base_patch16_224")
    assert config.model.text.hf == "bert-base-uncased" and not config.model.text.lock
    assert config.batch.global_size == 256 * 1024 and config.batch.offload and config.loss.impl == "inf"
    assert (config.optim.name, config.optim.lr, config.optim.weight_decay) == ("adafactor", 1e-3, 1e-4)
    steps_per_epoch = config.data.num_samples // config.batch.global_size
    assert config.train.max_steps == 8 * steps_per_epoch
    assert config.optim.warmup_steps == steps_per_epoch // 2
    assert config.train.precision == "bf16"


def test_finetune_recipe_is_open_clips_vitb32_with_a_locked_image_tower():
    config = load_config(CONFIGS / "finetune-vitb32-laion2b-lit-64k.yaml")
    assert (
        config.model
        == load_config(
            CONFIGS / "model/ViT-B-32.yaml",
            [
                "model.init_from=open_clip:ViT-B-32/laion2b_s34b_b79k",
                "model.image.lock=true",
                "model.image.lock_head=true",
            ],
        ).model
    )
    assert (config.model.text.pooling, config.model.text.tokenizer) == ("eot", "open_clip")
    assert config.batch.global_size == 64 * 1024 and config.loss.impl == "inf"
    assert config.data.num_samples // config.batch.global_size * 5 == config.train.max_steps


def test_million_batch_recipe():
    config = load_config(CONFIGS / "laion400m-vitl14-1m.yaml")
    assert config.batch.global_size == 2**20 and config.model.image.timm.startswith("vit_large_patch14")


def test_vitg_recipe_shards_a_giant_at_256k():
    config = load_config(CONFIGS / "laion2b-vitg14-bert-large-fsdp.yaml")
    assert config.model.image.timm == "vit_giant_patch14_clip_224" and not config.model.image.pretrained
    assert (config.model.text.hf, config.model.embed_dim) == ("bert-large-uncased", 1024)
    assert config.batch.global_size == 256 * 1024 and config.loss.impl == "inf"
    assert (config.train.parallel, config.train.precision, config.checkpoint.resume) == (
        "fsdp",
        "bf16",
        "auto",
    )
    steps_per_epoch = config.data.num_samples // config.batch.global_size
    assert config.train.max_steps == 6 * steps_per_epoch
    assert config.optim.warmup_steps == steps_per_epoch // 2


def test_siglip_demo_differs_from_the_demo_in_its_loss_and_length():
    demo, siglip = (load_config(CONFIGS / name) for name in ("demo-digits.yaml", "demo-digits-siglip.yaml"))
    assert (siglip.loss.kind, siglip.model.init_logit_bias) == ("sigmoid", -5.0)
    assert siglip.model.init_logit_scale == pytest.approx(math.log(10))
    assert (siglip.data, siglip.batch, siglip.optim) == (demo.data, demo.batch, demo.optim)
    assert siglip.train.max_steps > demo.train.max_steps
