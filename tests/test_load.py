"""``clip_train.load``: a run or checkpoint to (model, preprocess, tokenizer), offline and self-contained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import open_clip
import pytest
import timm
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file, save_file
from small_runs import TINY_MODEL, TINY_MODEL_CONFIG
from test_model import write_bert_dir

import clip_train
from clip_train import load_config
from clip_train.checkpoint import (
    MANIFEST_FILE,
    MODEL_CONFIG_FILE,
    MODEL_FILE,
    TEXT_DIR,
    checkpoint_model_config,
    find_weights,
    load_weights_file,
    save_checkpoint,
)
from clip_train.config import DataConfig, EvalConfig
from clip_train.data import build_eval_loader
from clip_train.data.sources import read_shard
from clip_train.errors import UserError
from clip_train.eval import eval_config, evaluate
from clip_train.export import export_open_clip
from clip_train.model import CLIP, HFTokenizer, build_model
from clip_train.model.tokenizer import IdsTokenizer

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
    """The three lines in docs/use-the-model.md see exactly the pixels and tokens the eval loader
    gives the model."""
    model, preprocess, tokenizer = clip_train.load(demo_run)
    images = val_images(digits, 8)
    loader = build_eval_loader(
        f"{digits}/val",
        batch_size=8,
        rank=0,
        world_size=1,
        image_size=model.image_size,
        tokenizer=model.tokenizer,
    )
    batch = next(iter(loader))
    assert torch.equal(torch.stack([preprocess(image) for image in images]), batch.images)
    with torch.no_grad():
        image_features = model.encode_image(torch.stack([preprocess(image) for image in images]))
        text_features = model.encode_text(tokenizer(CAPTIONS))
    assert image_features.shape == (8, 16) and text_features.shape == (3, 16)
    torch.testing.assert_close(image_features.norm(dim=-1), torch.ones(8))
    assert (
        preprocess(images[0].convert("L")).shape == preprocess(images[0].convert("RGBA")).shape == (3, 16, 16)
    )


def test_preprocess_takes_a_16_bit_grey_image_by_its_top_8_bits(demo_run):
    """open_clip's transform (PIL's RGB conversion) clips 16-bit grey at 255, a near-white image;
    the loaded preprocess sees what the 8-bit image of the same top bits gives."""
    _, preprocess, _ = clip_train.load(demo_run)
    grey = np.random.default_rng(0).integers(0, 1 << 16, (20, 24), dtype=np.uint16)
    sixteen_bit = Image.fromarray(grey)
    assert sixteen_bit.mode == "I;16"
    assert torch.equal(preprocess(sixteen_bit), preprocess(Image.fromarray((grey >> 8).astype(np.uint8))))


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
    made = model.tokenizer(texts)
    assert torch.equal(tokenizer(texts), made["input_ids"])
    assert torch.equal(tokenizer.attention_mask(tokenizer(texts)), made["attention_mask"])
    images = torch.randint(
        0, 256, (3, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert torch.equal(loaded.encode_image(images), model.encode_image(images))
        assert torch.equal(loaded.encode_text(tokenizer(texts)), model.encode_text(**made))
    assert sorted(p.name for p in (checkpoint / TEXT_DIR).iterdir()) == [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_a_checkpoint_from_before_model_yaml_uses_its_runs_config(demo_run, tmp_path):
    """Older still: its run's config.yaml holds the retired loss.kernel, which loading and
    evaluating the checkpoint drop."""
    run = tmp_path / "old_run"
    shutil.copytree(demo_run / "checkpoints" / "step_00000040", run / "checkpoints" / "step_00000040")
    run_config = yaml.safe_load((demo_run / "config.yaml").read_text())
    run_config["loss"]["kernel"] = "auto"
    (run / "config.yaml").write_text(yaml.safe_dump(run_config, sort_keys=False))
    old = run / "checkpoints" / "step_00000040"
    (old / MANIFEST_FILE).unlink()  # older still than manifests
    (old / MODEL_CONFIG_FILE).unlink()
    shutil.rmtree(old / TEXT_DIR)
    model, _, tokenizer = clip_train.load(old)
    reference, _, _ = clip_train.load(demo_run)
    with torch.no_grad():
        assert torch.equal(model.encode_text(tokenizer(CAPTIONS)), reference.encode_text(tokenizer(CAPTIONS)))
    assert eval_config(old / MODEL_FILE, None, []) == load_config(demo_run / "config.yaml")
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


# --------------------------------------------------------------------------------------------
# open_clip's call shapes
# --------------------------------------------------------------------------------------------


def open_clip_readme_example(model, preprocess, tokenizer, image) -> torch.Tensor:
    """open_clip's README example after its loading lines, as written there for an open_clip model."""
    image = preprocess(image).unsqueeze(0)
    text = tokenizer(["a diagram", "a dog", "a cat"])
    with torch.no_grad():
        image_features = model.encode_image(image)
        text_features = model.encode_text(text)
        image_features /= image_features.norm(dim=-1, keepdim=True)
        text_features /= text_features.norm(dim=-1, keepdim=True)
        text_probs = (100.0 * image_features @ text_features.T).softmax(dim=-1)
    return text_probs


def trained_clip(run: Path) -> CLIP:
    """The run's newest weights in the CLIP that training builds, which takes explicit masks."""
    weights = find_weights(run)
    model = build_model(checkpoint_model_config(weights.parent), load_pretrained=False)
    load_weights_file(weights, model)
    return model.eval()


def test_open_clips_readme_example_runs_unchanged_and_agrees_with_open_clip(demo_run, digits, tmp_path):
    """The same lines on the loaded model and on its open_clip export give the same probabilities."""
    (image,) = val_images(digits, 1)
    loaded = clip_train.load(demo_run)
    ours = open_clip_readme_example(*loaded, image)
    export_open_clip(loaded[0], tmp_path / "export")
    name = f"local-dir:{tmp_path / 'export'}"
    model, _, preprocess = open_clip.create_model_and_transforms(name)
    theirs = open_clip_readme_example(model.eval(), preprocess, open_clip.get_tokenizer(name), image)
    assert ours.shape == (1, 3)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_features_are_the_trained_models_with_the_mask_the_tokenizer_made(demo_run, digits):
    model, preprocess, tokenizer = clip_train.load(demo_run)
    reference = trained_clip(demo_run)
    images = torch.stack([preprocess(image) for image in val_images(digits, 4)])
    ids = tokenizer(CAPTIONS)
    assert ids.dtype == torch.long and ids.shape == (3, 12)
    with torch.no_grad():
        image_features = reference.encode_image(images)
        text_features = reference.encode_text(**reference.tokenizer(CAPTIONS))
        assert torch.equal(model.encode_image(images, normalize=True), image_features)
        assert torch.equal(model.encode_text(ids, normalize=True), text_features)
        assert torch.equal(
            model.encode_text(ids, attention_mask=tokenizer.attention_mask(ids)), text_features
        )
        got_images, got_texts, logit_scale = model(images, ids)
    assert torch.equal(got_images, image_features) and torch.equal(got_texts, text_features)
    assert logit_scale == reference.logit_scale.exp()


def test_padding_in_the_ids_is_masked(tmp_path):
    """A short caption padded beside a long one embeds as it does alone with no padding at all; its
    "!", which the bundled BPE writes with the pad id 0 before "(", is not taken for padding."""
    model_cfg = load_config(TINY_MODEL_CONFIG, [*TINY_MODEL, "model.text.tokenizer=open_clip"]).model
    torch.manual_seed(0)
    checkpoint = save_checkpoint(tmp_path / "run", 1, build_model(model_cfg), model_cfg, {"step": 1}, keep=1)
    model, _, tokenizer = clip_train.load(checkpoint)
    short, long = "seven!(", "a photo of the handwritten digit seven on a white page"
    batch = tokenizer([short, long])
    assert batch[0, 2] == 0 and tokenizer.attention_mask(batch).tolist() == [[1] * 5 + [0] * 7, [1] * 12]
    with torch.no_grad():
        together = model.encode_text(batch)
        unpadded = tokenizer(short, context_length=5)  # [sot] seven ! ( [eot]
        alone = torch.cat([model.encode_text(unpadded), model.encode_text(tokenizer(long))])
        unmasked = model.encode_text(batch, attention_mask=torch.ones_like(batch))
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-6)
    # the padding, if attended, shows: a thousand times the difference allowed above (random weights)
    assert not torch.allclose(unmasked[0], together[0], rtol=0, atol=1e-4)


def test_a_model_with_a_logit_bias_returns_it_as_open_clip_does(tmp_path):
    model_cfg = load_config(TINY_MODEL_CONFIG, [*TINY_MODEL, "loss.kind=sigmoid"]).model
    checkpoint = save_checkpoint(tmp_path / "run", 1, build_model(model_cfg), model_cfg, {"step": 1}, keep=1)
    model, _, tokenizer = clip_train.load(checkpoint)
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        image_features, text_features, logit_scale, logit_bias = model(images, tokenizer(CAPTIONS))
        only_images = model(images)
    assert image_features.shape == (2, 16) and text_features.shape == (3, 16)
    assert logit_scale == pytest.approx(10.0) and logit_bias is model.logit_bias and logit_bias == -10.0
    assert only_images[1] is None and torch.equal(only_images[0], image_features)


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_open_clips_keyword_and_one_sided_calls_give_the_positional_results(tmp_path, loss):
    """``model(image=, text=)``, ``model(text=)``, ``encode_image(image=)``, ``encode_text(text=)`` and
    ``encode_text(text, True)`` as open_clip's CLIP takes them: what the positional calls give, None
    for the input not given, and the logit bias only for a sigmoid-loss model."""
    model_cfg = load_config(TINY_MODEL_CONFIG, [*TINY_MODEL, f"loss.kind={loss}"]).model
    checkpoint = save_checkpoint(tmp_path / "run", 1, build_model(model_cfg), model_cfg, {"step": 1}, keep=1)
    model, _, tokenizer = clip_train.load(checkpoint)
    images, ids = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8), tokenizer(CAPTIONS)
    with torch.no_grad():
        image_features, text_features, *scales = model(images, ids)
        assert len(scales) == (2 if loss == "sigmoid" else 1)
        assert torch.equal(model.encode_image(image=images, normalize=True), image_features)
        assert torch.equal(model.encode_text(text=ids, normalize=True), text_features)
        assert torch.equal(model.encode_text(ids, True), text_features)
        assert torch.equal(
            model.encode_text(**model.tokenizer(CAPTIONS)), text_features
        )  # clip_train's names
        with pytest.raises(TypeError, match="pass the mask by name"):
            model.encode_text(ids, tokenizer.attention_mask(ids))
        both = model(image=images, text=ids)
        only_text = model(text=ids)
        only_images = model(image=images)
    assert torch.equal(both[0], image_features) and torch.equal(both[1], text_features)
    assert only_text[0] is None and torch.equal(only_text[1], text_features)
    assert torch.equal(only_images[0], image_features) and only_images[1] is None
    for outputs in (both, only_text, only_images):
        assert len(outputs) == 2 + len(scales)
        assert all(torch.equal(got, want) for got, want in zip(outputs[2:], scales, strict=True))


def test_ids_alone_cannot_mask_a_pad_token_that_every_caption_also_has(tmp_path):
    """A tokenizer padding with its [SEP] id: the mask must come from the tokenizer's call."""
    _, hf_tokenizer = write_bert_dir(tmp_path / "bert")
    hf_tokenizer.pad_token = "[SEP]"
    hf_tokenizer.save_pretrained(tmp_path / "bert")
    hf = HFTokenizer(str(tmp_path / "bert"), context_length=12)
    assert torch.equal(
        hf(CAPTIONS[0])["input_ids"], hf(CAPTIONS[:1])["input_ids"]
    )  # one caption: a batch of one
    tokenizer = IdsTokenizer(hf)
    with pytest.raises(ValueError, match="pad id 3 also stands for a token of every caption"):
        tokenizer.attention_mask(tokenizer(CAPTIONS))
