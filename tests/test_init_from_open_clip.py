"""``model.init_from=open_clip:…``: a run starts from an open_clip CLIP's weights, offline.

The open_clip models here are real ones, tiny and random: clip_train's own export and an open_clip
``VisionTransformer`` with a transformers text tower, each saved as open_clip saves a model folder
and, for the hub specs, laid out in a Hugging Face cache the way ``hf download`` leaves it. open_clip's
plain ``CLIP``, with its own text transformer, is test_open_clip_text.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import huggingface_hub
import open_clip
import pytest
import torch
import torch.nn.functional as F
from processes import run_to_end
from safetensors.torch import load_file, save_file
from small_runs import DEMO_CONFIG, TINY_MODEL, TINY_MODEL_CONFIG, run_overrides
from test_init_from import trainer
from test_model import write_bert_dir

from clip_train import load_config
from clip_train.errors import UserError
from clip_train.export import export_open_clip
from clip_train.init_from import built_from, check_init_from
from clip_train.model import CLIP, ModelLoadError, build_model
from clip_train.model.from_open_clip import resolve
from clip_train.model.tokenizer import HFTokenizer

VIT = {"image_size": 16, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16}  # 2 heads
VIT_RUN = [  # the clip_train config of the same ViT: timm's CLIP ViT (pre-norm, LayerNorm eps 1e-5)
    "model.embed_dim=16",
    "model.image.timm=vit_base_patch32_clip_224",
    "model.image.timm_kwargs={img_size: 16, patch_size: 8, depth: 2, embed_dim: 32, num_heads: 2}",
]


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight moved off its initial value (LayerNorm 1/0, zero biases), so a swapped key shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def save_open_clip_folder(folder: Path, model: torch.nn.Module, model_cfg: dict) -> Path:
    """What open_clip reads as ``local-dir:``: its config json beside the weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg}))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, folder / "open_clip_model.safetensors"
    )
    return folder


def put_in_hub_cache(cache: Path, repo: str, files: dict[str, Path]) -> None:
    """Lay ``files`` out as huggingface_hub's cache holds a download: refs/main names a snapshot."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "snapshots" / commit).mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for name, source in files.items():
        shutil.copy(source, root / "snapshots" / commit / name)


def initialised(overrides: list[str], spec: str, key: str = "model.init_from") -> CLIP:
    """A model built as a run with ``model.init_from=spec`` builds it, then given the weights (what
    a teacher or a WiSE-FT start is too, named by its own ``key``)."""
    cfg = load_config(TINY_MODEL_CONFIG, [*overrides, f"model.init_from={spec}"]).model
    return built_from(cfg, key).eval()


def one_line_error(overrides: list[str], spec: str) -> str:
    with pytest.raises(UserError) as err:
        initialised(overrides, spec)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.fixture(scope="module")
def demo_export(tmp_path_factory) -> tuple[CLIP, Path]:
    """The demo recipe's tiny model (random, perturbed) and its open_clip export by clip_train."""
    model = perturbed(build_model(load_config(DEMO_CONFIG, TINY_MODEL).model))
    out = tmp_path_factory.mktemp("export") / "demo"
    export_open_clip(model, out)
    return model, out


@pytest.fixture(scope="module")
def vit_bert(tmp_path_factory) -> tuple[Path, list[str]]:
    """An open_clip VisionTransformer + a transformers BERT (mean pooling), and the matching run config."""
    folder = tmp_path_factory.mktemp("vit_bert")
    write_bert_dir(folder / "bert")
    text = {
        "hf_model_name": str(folder / "bert"),
        "hf_pooler_type": "mean_pooler",
        "hf_proj_type": "linear",
        "context_length": 12,
    }
    model_cfg = {"embed_dim": 16, "vision_cfg": VIT, "text_cfg": text}
    model = open_clip.CustomTextCLIP(16, VIT, {**text, "hf_model_pretrained": False})
    save_open_clip_folder(folder, perturbed(model), model_cfg)
    text_run = [f"model.text.hf={folder / 'bert'}", "model.text.hf_config={}", "model.text.tokenizer="]
    return folder, [*VIT_RUN, *text_run, "model.text.pooling=mean", "model.text.context_length=12"]


# --------------------------------------------------------------------------------------------
# Towers that map: the same embeddings
# --------------------------------------------------------------------------------------------


def test_an_export_round_trips_into_a_fresh_run(demo_export, digits, tmp_path):
    source, export = demo_export
    run = trainer(digits, tmp_path, 2, f"model.init_from=open_clip:local-dir:{export}")
    model = run.model.eval()
    own = source.state_dict()
    assert all(torch.equal(tensor, own[name]) for name, tensor in model.state_dict().items())
    assert run.step == 0 and run.update.optimizer.state_dict()["state"] == {}
    images = torch.randint(
        0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    tokens = source.tokenizer(["a photo of a seven", "3", ""])
    with torch.no_grad():
        assert torch.equal(model.encode_image(images), source.encode_image(images))
        assert torch.equal(model.encode_text(**tokens), source.encode_text(**tokens))


def test_an_open_clip_vit_and_transformers_text_tower_give_open_clips_embeddings(vit_bert):
    folder, run = vit_bert
    ours = initialised(run, f"open_clip:local-dir:{folder}")
    theirs, _, _ = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    theirs.eval()
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    ids = ours.tokenizer(["seven", "a photo of three", ""])
    with torch.no_grad():
        image = ours.encode_image(images)
        torch.testing.assert_close(image, theirs.encode_image(images, normalize=True), rtol=0, atol=1e-6)
        text = ours.encode_text(**ids)
        torch.testing.assert_close(
            text, theirs.encode_text(ids["input_ids"], normalize=True), rtol=0, atol=1e-6
        )
    assert not torch.allclose(image[0], image[1], atol=1e-3) and not torch.allclose(
        text[0], text[1], atol=1e-3
    )
    assert torch.equal(ours.logit_scale, theirs.logit_scale)


def test_older_transformers_position_ids_are_ignored(demo_export, tmp_path):
    """transformers < 4.31 saved ``embeddings.position_ids``; the encoder now recomputes it."""
    source, export = demo_export
    copy = Path(shutil.copytree(export, tmp_path / "old"))
    weights = load_file(copy / "open_clip_model.safetensors")
    weights["text.transformer.embeddings.position_ids"] = torch.arange(12)[None]
    save_file(weights, copy / "open_clip_model.safetensors")
    model = initialised([*TINY_MODEL, "model.text.pooling=mean"], f"open_clip:local-dir:{copy}")
    assert torch.equal(
        model.text.encoder.embeddings.word_embeddings.weight,
        source.text.encoder.embeddings.word_embeddings.weight,
    )


def test_an_export_named_without_the_prefix_says_how_to_name_it(demo_export):
    _, export = demo_export
    with pytest.raises(
        UserError, match=rf"^{export} is an open_clip model folder.*init_from=open_clip:local-dir:"
    ):
        check_init_from(str(export))


def test_a_sigmoid_loss_run_keeps_its_initial_logit_bias(demo_export):
    source, export = demo_export
    model = initialised(
        [*TINY_MODEL, "model.text.pooling=mean", "model.init_logit_bias=-5"], f"open_clip:local-dir:{export}"
    )
    assert model.logit_bias.item() == -5 and torch.equal(model.logit_scale, source.logit_scale)


# --------------------------------------------------------------------------------------------
# What does not map or fit: one line
# --------------------------------------------------------------------------------------------


VIT_SIZE = "img_size: 16, patch_size: 8, embed_dim: 32"
DIFFER = "open_clip's ViT and model.image.timm={} differ (open_clip's vs the run's {})"
SHAPE = "{} (open_clip's {}) is {} in the weights but {} in the model: make the model config match"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.text.pooling=cls"],
            "open_clip's text tower pools with mean_pooler, the run's with cls: set model.text.pooling=mean",
        ),
        (
            [f"model.image.timm_kwargs={{{VIT_SIZE}, depth: 2, num_heads: 4}}"],
            DIFFER.format("vit_base_patch32_clip_224", "heads 2 vs 4"),
        ),
        (
            ["model.image.timm=vit_base_patch32_clip_quickgelu_224"],
            DIFFER.format("vit_base_patch32_clip_quickgelu_224", "activation GELU vs QuickGELU"),
        ),
        (
            [f"model.image.timm_kwargs={{{VIT_SIZE}, depth: 2, num_heads: 2, global_pool: avg}}"],
            DIFFER.format(
                "vit_base_patch32_clip_224", "pooling tok vs avg, final norm before vs after pooling"
            ),
        ),
        (
            ["model.image.timm=vit_base_patch16_224"],
            DIFFER.format("vit_base_patch16_224", "norm eps 1e-05 vs 1e-06"),
        ),
        (
            ["model.image.timm_kwargs={img_size: 16, patch_size: 4, embed_dim: 32, depth: 2, num_heads: 2}"],
            SHAPE.format(
                "visual.trunk.patch_embed.proj.weight", "visual.conv1.weight", (32, 3, 8, 8), (32, 3, 4, 4)
            ),
        ),
        (["model.embed_dim=8"], SHAPE.format("visual.proj.weight", "visual.proj", (16, 32), (8, 32))),
        (
            [f"model.image.timm_kwargs={{{VIT_SIZE}, depth: 3, num_heads: 2}}"],
            "the open_clip weights do not fit the model: missing 12 keys "
            "(visual.trunk.blocks.2.attn.proj.bias, visual.trunk.blocks.2.attn.proj.weight, "
            "visual.trunk.blocks.2.attn.qkv.bias and 9 more)",
        ),
        (
            ["model.image.timm=resnet18", "model.image.timm_kwargs={}"],
            "open_clip's image tower is a ViT but model.image.timm=resnet18 is a ResNet: pick a timm CLIP",
        ),
    ],
    ids=[
        "pooling",
        "heads",
        "activation",
        "global-pool",
        "norm-eps",
        "patch-size",
        "embed-dim",
        "depth",
        "resnet",
    ],
)
def test_a_run_config_that_differs_fails_in_one_line(vit_bert, overrides, message):
    folder, run = vit_bert
    assert one_line_error([*run, *overrides], f"open_clip:local-dir:{folder}").startswith(message)


def test_an_average_pooled_vit_normalised_after_pooling_is_refused_where_the_run_normalises_first(
    tmp_path,
):
    """open_clip's ``final_ln_after_pool`` with average pooling against a timm ViT without ``fc_norm``:
    the weights fit, the embeddings would not."""
    vit = {**VIT, "pool_type": "avg", "final_ln_after_pool": True}
    text = {"context_length": 12, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}
    model_cfg = {"embed_dim": 16, "vision_cfg": vit, "text_cfg": text}
    save_open_clip_folder(tmp_path, open_clip.CLIP(**model_cfg), model_cfg)
    run = [
        *VIT_RUN[:2],
        f"model.image.timm_kwargs={{{VIT_SIZE}, depth: 2, num_heads: 2, global_pool: avg, fc_norm: false}}",
        "model.text.hf_config={model_type: clip_text_model, hidden_size: 32, intermediate_size: 128, "
        "num_hidden_layers: 1, num_attention_heads: 2, max_position_embeddings: 12}",
        "model.text.tokenizer=open_clip",
        "model.text.pooling=eot",
        "model.text.context_length=12",
    ]
    message = DIFFER.format("vit_base_patch32_clip_224", "final norm after pooling vs before")
    assert one_line_error(run, f"open_clip:local-dir:{tmp_path}").startswith(message)


def test_a_vit_at_another_image_size_takes_the_position_embedding_resampled(vit_bert, capsys):
    """Fine-tuning at a new resolution (OpenCLIP's ``--force-image-size``): open_clip's 2x2 patch grid
    at 16 px becomes the run's 4x4 at 32 px, bicubically (antialiased, as timm resamples); the class
    token's entry and every other weight load as they are, and the tower encodes 32 px images."""
    folder, run = vit_bert
    spec = f"open_clip:local-dir:{folder}"
    same = initialised(run, spec).state_dict()
    capsys.readouterr()
    model = initialised([*run, "model.image.timm_kwargs.img_size=32"], spec)
    key, width = "visual.trunk.pos_embed", 32
    said = f"{key} resampled (bicubic) from (1, 5, {width}) to (1, 17, {width})"
    assert f"model.init_from: {said}" in capsys.readouterr().err
    initialised([*run, "model.image.timm_kwargs.img_size=32"], spec, key="distill.teacher")
    assert f"distill.teacher: {said}" in capsys.readouterr().err  # a teacher's load names its own key
    theirs, ours = same[key], model.state_dict()[key]
    grid = theirs[:, 1:].reshape(1, 2, 2, width).permute(0, 3, 1, 2)
    resampled = F.interpolate(grid, size=(4, 4), mode="bicubic", antialias=True)
    assert torch.equal(ours[:, 1:], resampled.permute(0, 2, 3, 1).reshape(1, 16, width))
    assert torch.equal(ours[:, :1], theirs[:, :1])
    assert all(torch.equal(t, same[name]) for name, t in model.state_dict().items() if name != key)
    images = torch.randint(
        0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert model.encode_image(images).isfinite().all()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model.text.hf_config.num_hidden_layers=2",
            "the open_clip weights do not fit the model: missing 16 keys (text.encoder.encoder.layer.1.",
        ),
        (
            "model.image.timm_kwargs.global_pool=avg",
            "open_clip's timm trunk local-dir:{export} and the run's model.image differ (the trunk: "
            "global_pool=token vs global_pool=avg, open_clip's vs the run's): set model.image.timm and "
            "model.image.timm_kwargs as the weights' model has them",
        ),
        (
            "model.image.timm_kwargs.num_heads=4",
            "open_clip's timm trunk local-dir:{export} and the run's model.image differ (blocks.0.attn: "
            "Attention num_heads=2 vs Attention num_heads=4, ",
        ),
        (
            "model.image.timm_kwargs.act_layer=quick_gelu",
            "open_clip's timm trunk local-dir:{export} and the run's model.image differ (blocks.0.mlp.act: "
            "GELU approximate=none vs QuickGELU, ",
        ),
        (
            "model.text.hf_config.num_attention_heads=4",
            "open_clip's text tower {export} and the run's model.text differ (open_clip's vs the run's "
            "num_attention_heads 2 vs 4): set model.text.hf or model.text.hf_config to match",
        ),
        (
            "model.text.hf_config.hidden_act=gelu_new",
            "open_clip's text tower {export} and the run's model.text differ (open_clip's vs the run's "
            "hidden_act gelu vs gelu_new)",
        ),
    ],
    ids=["text-depth", "global-pool", "image-heads", "image-activation", "text-heads", "text-activation"],
)
def test_an_export_into_a_run_that_differs_fails_in_one_line(demo_export, override, message):
    """What changes the embeddings but no weight's shape too: the pooling in effect, heads, activations
    (a run of another architecture would train from weights that do not compute what they did)."""
    _, export = demo_export
    run = [*TINY_MODEL, "model.text.pooling=mean", override]
    assert one_line_error(run, f"open_clip:local-dir:{export}").startswith(message.format(export=export))


def test_an_export_of_an_average_pooled_vit_round_trips(tmp_path):
    """Its pooling is the export's timm config's (open_clip's timm_pool "" keeps the trunk's own)."""
    pooled = [*TINY_MODEL, "model.image.timm_kwargs.global_pool=avg"]
    model = perturbed(build_model(load_config(DEMO_CONFIG, pooled).model))
    export_open_clip(model, tmp_path / "export")
    loaded = initialised([*pooled, "model.text.pooling=mean"], f"open_clip:local-dir:{tmp_path / 'export'}")
    own = model.state_dict()
    assert all(torch.equal(tensor, own[name]) for name, tensor in loaded.state_dict().items())


# --------------------------------------------------------------------------------------------
# Finding the weights: a folder, or the local hub cache and nothing else
# --------------------------------------------------------------------------------------------


def test_a_hub_name_in_the_cache_loads_without_asking_the_hub(tmp_path, monkeypatch):
    """Online too: every rank of a large run would otherwise ask the hub at start-up (and, without
    network, retry for half a minute before reading the cache)."""
    bert, _ = write_bert_dir(tmp_path / "bert")
    files = {f.name: f for f in (tmp_path / "bert").iterdir()}
    put_in_hub_cache(tmp_path / "hub", "someone/tiny-bert", files)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def asked(*args, **kwargs):
        raise AssertionError(f"asked the hub for {args} {kwargs}")

    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", asked)
    overrides = ["model.text.hf=someone/tiny-bert", "model.text.hf_config={}", "model.text.tokenizer="]
    model = build_model(load_config(TINY_MODEL_CONFIG, overrides).model)
    loaded = model.text.encoder.state_dict()
    assert all(torch.equal(tensor, bert.state_dict()[name]) for name, tensor in loaded.items())


def test_a_snapshot_without_the_tokenizer_files_is_not_a_cached_tokenizer(tmp_path, monkeypatch):
    """transformers builds a BERT tokenizer with an empty vocabulary from the model's config alone
    (every word [UNK]): a snapshot that holds just config.json sends the tokenizer to the hub."""
    write_bert_dir(tmp_path / "bert")
    config_only = {"config.json": tmp_path / "bert" / "config.json"}
    put_in_hub_cache(tmp_path / "hub", "someone/tiny-bert", config_only)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="is neither a local directory nor in the local hub cache"):
        HFTokenizer("someone/tiny-bert", 8)


def test_hub_weights_are_read_from_the_local_cache(vit_bert, tmp_path, monkeypatch):
    folder, run = vit_bert
    names = ("open_clip_config.json", "open_clip_model.safetensors")
    put_in_hub_cache(tmp_path, "someone/tiny-clip", {name: folder / name for name in names})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    from_hub = initialised(run, "open_clip:hf-hub:someone/tiny-clip").state_dict()
    from_folder = initialised(run, f"open_clip:local-dir:{folder}").state_dict()
    assert all(torch.equal(tensor, from_folder[name]) for name, tensor in from_hub.items())


@pytest.mark.parametrize(
    ("tag", "repo", "quick_gelu"),
    [
        ("laion2b_s34b_b79k", "laion/CLIP-ViT-B-32-laion2B-s34B-b79K", False),
        ("openai", "timm/vit_base_patch32_clip_224.openai", True),
    ],
)
def test_a_pretrained_tag_resolves_to_its_cached_file(tmp_path, monkeypatch, tag, repo, quick_gelu):
    """open_clip's registry names the repo; OpenAI's weights need QuickGELU, whatever ViT-B-32 says."""
    (tmp_path / "weights").write_bytes(b"not read until the model is built")
    put_in_hub_cache(tmp_path, repo, {"open_clip_model.safetensors": tmp_path / "weights"})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    source = resolve(f"open_clip:ViT-B-32/{tag}")
    assert source.weights.read_bytes() == b"not read until the model is built"
    assert source.model_cfg == {**open_clip.get_model_config("ViT-B-32"), "quick_gelu": quick_gelu}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "open_clip:ViT-B-32/laion2b",
            "'laion2b' is neither a file nor a pretrained tag of ViT-B-32 (tags: openai, ",
        ),
        (
            "open_clip:ViT-Z-99/openai",
            "open_clip has no built-in model 'ViT-Z-99' (see open_clip.list_models())",
        ),
        ("open_clip:ViT-B-32", "name the weights: open_clip:ViT-B-32/TAG or open_clip:ViT-B-32/FILE"),
        ("open_clip:local-dir:{tmp}/nope", "{tmp}/nope is not a directory: not an open_clip model folder"),
        ("open_clip:local-dir:{tmp}", "{tmp} holds no open_clip_config.json: not an open_clip model folder"),
        (
            "open_clip:hf-hub:someone/tiny-clip",
            "open_clip_config.json of someone/tiny-clip is not in the Hugging Face cache {tmp}",
        ),
    ],
    ids=["tag", "arch", "no-weights", "no-folder", "not-open-clip", "not-cached"],
)
def test_a_source_that_is_not_there_fails_at_start_up(tmp_path, monkeypatch, spec, message):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(UserError) as err:
        check_init_from(spec.format(tmp=tmp_path))
    assert str(err.value).startswith(message.format(tmp=tmp_path)) and "\n" not in str(err.value)


def test_a_hub_name_offline_fails_in_one_line_from_the_cli(digits, tmp_path):
    """The real command with an empty HF_HOME: the error comes from the start-up checks, before the run
    directory exists, and says what to download where."""
    out = tmp_path / "run"
    overrides = run_overrides(digits, out, 1, "model.init_from=open_clip:ViT-B-32/laion2b_s34b_b79k")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    result = run_to_end([sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *overrides], env=env)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    repo = "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
    assert "model.init_from=open_clip:ViT-B-32/laion2b_s34b_b79k: open_clip_model.safetensors or " in line
    assert f"of {repo} is not in the Hugging Face cache {tmp_path / 'hf' / 'hub'}" in line
    assert f"`hf download {repo} open_clip_model.safetensors`" in line
    assert not out.exists()
