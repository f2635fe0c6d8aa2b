"""``clip_train.load``: a run or checkpoint to (model, preprocess, tokenizer), offline and self-contained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from small_runs import TINY_MODEL_CONFIG
from test_model import write_bert_dir

import clip_train
from clip_train import load_config
from clip_train.checkpoint import MANIFEST_FILE, MODEL_CONFIG_FILE, MODEL_FILE, TEXT_DIR, save_checkpoint
from clip_train.config import DataConfig, EvalConfig
from clip_train.data import build_eval_loader
from clip_train.data.sources import read_shard
from clip_train.errors import UserError
from clip_train.eval import evaluate
from clip_train.model import build_model

CAPTIONS = ["a photo of the digit 3", "a handwritten seven", "zero"]


def val_images(digits: Path, count: int) -> list:
    """The first ``count`` val samples as PIL images, decoded here from the shard's PNG bytes."""
    from io import BytesIO

    from PIL import Image

    first_shard = sorted((digits / "val").glob("*.tar"))[0]
    raws = [raw for _, raw in zip(range(count), read_shard(str(first_shard)), strict=False)]
    return [Image.open(BytesIO(raw["png"])) for raw in raws]


def final_eval(run: Path) -> dict[str, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [metrics for metrics in lines if "zeroshot/top1" in metrics][-1]


def test_a_run_loads_its_newest_checkpoint_and_reproduces_its_own_eval(demo_run, digits):
    model, _, _ = clip_train.load(demo_run)
    saved = load_file(demo_run / "checkpoints" / "step_00000040" / MODEL_FILE)
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(tensor, saved[name]) for name, tensor in model.state_dict().items())
    assert not model.training and model.text.pooling == "mean"  # the demo recipe's, from model.yaml
    run_eval = final_eval(demo_run)  # what the training process measured on its in-memory model
    eval_cfg = EvalConfig(zeroshot=f"{digits}/zeroshot.json", zeroshot_data=f"{digits}/val", retrieval=False)
    metrics = evaluate(model, eval_cfg, DataConfig(workers=0), device=torch.device("cpu"), precision="fp32")
    assert metrics == pytest.approx({k: v for k, v in run_eval.items() if k.startswith("zeroshot/")}, abs=0)


def test_preprocess_and_tokenizer_are_the_eval_pipelines(demo_run, digits):
    """The README's three lines see exactly the pixels and tokens the eval loader gives the model."""
    model, preprocess, tokenizer = clip_train.load(demo_run)
    images = val_images(digits, 8)
    loader = build_eval_loader(
        f"{digits}/val", batch_size=8, rank=0, world_size=1, image_size=model.image_size, tokenizer=tokenizer
    )
    batch = next(iter(loader))
    assert torch.equal(torch.stack([preprocess(image) for image in images]), batch.images)
    with torch.no_grad():
        image_features = model.encode_image(torch.stack([preprocess(image) for image in images]))
        text_features = model.encode_text(**tokenizer(CAPTIONS))
    assert image_features.shape == (8, 16) and text_features.shape == (3, 16)
    torch.testing.assert_close(image_features.norm(dim=-1), torch.ones(8))
    assert (
        preprocess(images[0].convert("L")).shape == preprocess(images[0].convert("RGBA")).shape == (3, 16, 16)
    )


def test_a_checkpoint_needs_none_of_the_files_its_towers_came_from(tmp_path):
    """Pretrained BERT + WordPiece tokenizer and timm weights from local paths, all deleted before loading."""
    write_bert_dir(tmp_path / "bert")
    torch.manual_seed(3)
    vit_args = dict(img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=2, num_classes=0)
    save_file(
        timm.create_model("vit_base_patch16_224", **vit_args).state_dict(), tmp_path / "vit.safetensors"
    )
    overrides = [
        f"model.text.hf={tmp_path / 'bert'}",
        "model.text.hf_config={}",
        "model.text.tokenizer=",
        "model.image.timm_kwargs={img_size: 32, patch_size: 8, depth: 2, embed_dim: 64, num_heads: 2}",
        f"model.image.pretrained={tmp_path / 'vit.safetensors'}",
    ]
    model_cfg = load_config(TINY_MODEL_CONFIG, overrides).model
    model = build_model(model_cfg).eval()
    checkpoint = save_checkpoint(tmp_path / "run", 5, model, model_cfg, {"step": 5}, keep=1)
    shutil.rmtree(tmp_path / "bert")
    (tmp_path / "vit.safetensors").unlink()

    loaded, _, tokenizer = clip_train.load(checkpoint)
    texts = ["a handwritten seven!", "the digit zero " * 20]
    assert all(
        torch.equal(tokenizer(texts)[k], model.tokenizer(texts)[k]) for k in ("input_ids", "attention_mask")
    )
    images = torch.randint(
        0, 256, (3, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert torch.equal(loaded.encode_image(images), model.encode_image(images))
        assert torch.equal(
            loaded.encode_text(**tokenizer(texts)), model.encode_text(**model.tokenizer(texts))
        )
    assert sorted(p.name for p in (checkpoint / TEXT_DIR).iterdir()) == [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_a_checkpoint_from_before_model_yaml_uses_its_runs_config(demo_run, tmp_path):
    run = tmp_path / "old_run"
    shutil.copytree(demo_run / "checkpoints" / "step_00000040", run / "checkpoints" / "step_00000040")
    shutil.copy(demo_run / "config.yaml", run / "config.yaml")
    old = run / "checkpoints" / "step_00000040"
    (old / MANIFEST_FILE).unlink()  # older still than manifests
    (old / MODEL_CONFIG_FILE).unlink()
    shutil.rmtree(old / TEXT_DIR)
    model, _, tokenizer = clip_train.load(old)
    reference, _, _ = clip_train.load(demo_run)
    with torch.no_grad():
        assert torch.equal(
            model.encode_text(**tokenizer(CAPTIONS)), reference.encode_text(**tokenizer(CAPTIONS))
        )
    (run / "config.yaml").unlink()
    with pytest.raises(UserError, match=f"{old} has no model.yaml and is not inside a run directory"):
        clip_train.load(old)


def test_a_path_that_holds_no_checkpoint_is_one_line(tmp_path):
    with pytest.raises(UserError) as err:
        clip_train.load(tmp_path)
    assert str(err.value) == (
        f"checkpoint not found: {tmp_path} has no model.safetensors and no complete checkpoints; "
        "pass a checkpoint directory, a run directory or a .safetensors file"
    )
