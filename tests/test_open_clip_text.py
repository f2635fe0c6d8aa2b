"""open_clip's own CLIP text transformer (OpenAI's and LAION's CLIPs) as clip_train's text tower.

The open_clip models are real and random: ``open_clip.CLIP`` built from a config, every weight moved
off its initial value, saved as open_clip saves a model. After ``model.init_from=open_clip:…`` clip_train
must give open_clip's embeddings, train (Gradient Cache chunks, LiT locking), and export back to an
open_clip model that gives the trained model's embeddings.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import open_clip
import pytest
import torch
from dist_utils import run_distributed
from open_clip.constants import OPENAI_DATASET_MEAN
from safetensors.torch import load_file, save_file
from small_runs import ROOT, TINY_MODEL_CONFIG
from test_fsdp_gradcache import Case, check, fsdp_rank, reference
from test_init_from import trainer
from test_init_from_open_clip import (
    VIT,
    VIT_RUN,
    initialised,
    one_line_error,
    perturbed,
    put_in_hub_cache,
    save_open_clip_folder,
)

import clip_train
from clip_train import load_config
from clip_train.checkpoint import MODEL_FILE
from clip_train.cli import main as cli_main
from clip_train.errors import UserError
from clip_train.export import export_open_clip
from clip_train.init_from import check_init_from, load_init_from
from clip_train.logs import setup_logging
from clip_train.model import CLIP, build_model
from clip_train.model.from_open_clip import (
    Source,
    fitted,
    normalisation_problem,
    resolve,
    to_clip_train,
    tower_maps,
)

TEXT = {"context_length": 12, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}
CAPTIONS = ["a photo of a seven", "3", "", "zero " * 20]  # the last one is cut to the context length
DIFFER = "open_clip's text transformer and model.text differ (open_clip's vs the run's {})"
TOLERANCE = 1e-5  # fp32, as the issue asks; the towers compute the same operations in another order


def clip_text_run(quick_gelu: bool) -> list[str]:
    """The run config of the tiny open_clip CLIP below: timm's CLIP ViT and a CLIPTextModel."""
    timm = "vit_base_patch32_clip_quickgelu_224" if quick_gelu else "vit_base_patch32_clip_224"
    act = "quick_gelu" if quick_gelu else "gelu"
    return [
        *VIT_RUN,
        f"model.image.timm={timm}",
        "model.text.hf_config={model_type: clip_text_model, hidden_size: 32, intermediate_size: 128, "
        f"num_hidden_layers: 2, num_attention_heads: 2, max_position_embeddings: 12, hidden_act: {act}}}",
        "model.text.tokenizer=open_clip",
        "model.text.pooling=eot",
        "model.text.context_length=12",
    ]


@pytest.fixture(scope="module", params=[False, True], ids=["gelu", "quickgelu"])
def tiny_clip(request, tmp_path_factory) -> tuple[Path, bool]:
    """A tiny open_clip CLIP (its ViT and its text transformer) as a local-dir folder."""
    model_cfg = {"embed_dim": 16, "quick_gelu": request.param, "vision_cfg": VIT, "text_cfg": TEXT}
    model = perturbed(open_clip.CLIP(**model_cfg))
    return save_open_clip_folder(tmp_path_factory.mktemp("clip"), model, model_cfg), request.param


def open_clip_model(folder: Path) -> torch.nn.Module:
    """open_clip's own model of a model folder."""
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    return model.eval()


def max_differences(ours: CLIP, theirs: torch.nn.Module, images: torch.Tensor) -> tuple[float, float]:
    """Largest |difference| of the image and the text embeddings; clip_train's model takes the mask its
    tokenizer makes, open_clip's the ids alone."""
    tokens = ours.tokenizer(CAPTIONS)
    with torch.no_grad():
        image = ours.encode_image(images) - theirs.encode_image(images, normalize=True)
        ours_text = ours.encode_text(**tokens)
        text = ours_text - theirs.encode_text(tokens["input_ids"], normalize=True)
    assert not torch.allclose(ours_text[0], ours_text[1], atol=1e-3)  # the captions do give different rows
    return float(image.abs().max()), float(text.abs().max())


def float_images(size: int, count: int = 3) -> torch.Tensor:
    return torch.randn(count, 3, size, size, generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------------------------
# The same embeddings as open_clip
# --------------------------------------------------------------------------------------------


def test_init_from_gives_open_clips_embeddings(tiny_clip):
    folder, quick_gelu = tiny_clip
    ours = initialised(clip_text_run(quick_gelu), f"open_clip:local-dir:{folder}")
    theirs = open_clip_model(folder)
    assert max(max_differences(ours, theirs, float_images(16))) <= TOLERANCE
    assert torch.equal(ours.logit_scale, theirs.logit_scale)


@pytest.mark.parametrize("arch", ["ViT-B-32", "ViT-B-32-quickgelu"])
def test_the_shipped_model_config_needs_nothing_but_the_weights(arch, tmp_path):
    """``include: [model/ARCH.yaml]`` plus ``init_from=open_clip:ARCH/…`` (a file standing in for a
    pretrained tag's download): the full-size architecture as open_clip builds it."""
    torch.manual_seed(0)
    theirs = open_clip.create_model(arch).eval()
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, weights)
    cfg = load_config(
        ROOT / "configs" / "model" / f"{arch}.yaml", [f"model.init_from=open_clip:{arch}/{weights}"]
    )
    check_init_from(cfg.model.init_from)
    ours = build_model(cfg.model, load_pretrained=False)
    load_init_from(cfg.model, ours)
    ours.eval()
    assert max(max_differences(ours, theirs, float_images(224, count=2))) <= TOLERANCE


@pytest.mark.parametrize("arch", ["ViT-B-32", "ViT-B-32-quickgelu", "ViT-L-14", "ViT-L-14-quickgelu"])
def test_every_shipped_model_config_fits_its_open_clip_architecture(arch):
    """Keys, shapes, activation, heads, norm epsilon and image normalisation, on the meta device (no
    weights: ViT-L-14 is too large to run here; the ViT-B-32 configs also run above)."""
    model_cfg = open_clip.get_model_config(arch)
    with torch.device("meta"):
        theirs = open_clip.CLIP(**model_cfg)
    cfg = load_config(ROOT / "configs" / "model" / f"{arch}.yaml").model
    ours = build_model(cfg, load_pretrained=False, on_meta=True)
    maps = tower_maps(model_cfg)
    weights = to_clip_train(theirs.state_dict(), maps)
    assert [tower.problem(ours, cfg) for tower in maps.values() if tower.problem] == [None, None]
    assert normalisation_problem(Source(model_cfg, Path("unread")), ours) is None
    assert fitted(weights, ours).keys() == ours.state_dict().keys()


def test_a_run_from_open_clip_loads_with_its_embeddings_then_trains_and_exports_back(
    tiny_clip, digits, tmp_path, capsys
):
    """Both towers locked: the checkpoint has open_clip's embeddings. Then real steps with Gradient Cache
    (chunks of 4 images and 8 captions in batches of 16), LiT (the image tower locked, the text
    tower's first layer too), and an export that open_clip loads with the trained model's embeddings."""
    folder, quick_gelu = tiny_clip
    spec = f"model.init_from=open_clip:local-dir:{folder}"
    theirs = open_clip_model(folder)
    frozen = [f"model.{tower}.{key}=true" for tower in ("image", "text") for key in ("lock", "lock_head")]
    trainer(digits, tmp_path / "frozen", 1, *clip_text_run(quick_gelu), spec, *frozen).run()
    loaded, _, _ = clip_train.load(tmp_path / "frozen")  # only the logit scale trained
    assert max(max_differences(loaded, theirs, float_images(16))) <= TOLERANCE

    lit = ["model.image.lock=true", "model.text.lock=true", "model.text.unlocked_layers=1"]
    run = trainer(digits, tmp_path / "lit", 2, *clip_text_run(quick_gelu), spec, *lit)
    start = {name: tensor.clone() for name, tensor in run.model.state_dict().items()}
    run.run()
    trained, _, _ = clip_train.load(tmp_path / "lit")
    after = trained.state_dict()
    changed = {name for name, tensor in start.items() if not torch.equal(tensor, after[name])}
    trainable = {name for name, p in run.model.named_parameters() if p.requires_grad}
    assert changed == trainable
    assert "text.encoder.encoder.layers.1.self_attn.q_proj.weight" in changed
    assert "text.encoder.final_layer_norm.weight" in changed and "text.proj.weight" in changed
    assert not any(name.startswith(("visual.trunk.", "text.encoder.encoder.layers.0.")) for name in changed)

    setup_logging()
    assert cli_main(["export", str(tmp_path / "lit"), str(tmp_path / "export"), "--format", "open_clip"]) == 0
    said = capsys.readouterr().err
    assert "open_clip gives clip_train's embeddings" in said
    assert "treats token id 0 as padding" not in said  # open_clip's text transformer masks nothing
    exported = open_clip_model(tmp_path / "export")
    assert max(max_differences(trained, exported, float_images(16))) <= TOLERANCE
    config = json.loads((tmp_path / "export" / "open_clip_config.json").read_text())["model_cfg"]
    assert config["quick_gelu"] is quick_gelu and config["text_cfg"]["layers"] == 2
    assert (tmp_path / "lit" / "checkpoints" / "step_00000002" / MODEL_FILE).is_file()


def test_a_logit_scale_and_bias_of_shape_one_load_as_the_numbers_they_hold(tmp_path):
    """open_clip's ``nonscalar_logit_scale`` (and releases made with it) saves both with shape (1,),
    which open_clip loads; more than one number is refused in one line."""
    scales = {"init_logit_bias": -10.0, "nonscalar_logit_scale": True}
    model_cfg = {"embed_dim": 16, "vision_cfg": VIT, "text_cfg": TEXT, **scales}
    theirs = perturbed(open_clip.CLIP(**model_cfg))
    folder = save_open_clip_folder(tmp_path, theirs, model_cfg)
    run, spec = [*clip_text_run(False), "model.init_logit_bias=-5"], f"open_clip:local-dir:{folder}"
    ours = initialised(run, spec)
    assert theirs.logit_scale.shape == theirs.logit_bias.shape == (1,)
    assert torch.equal(ours.logit_scale, theirs.logit_scale.reshape(()))
    assert torch.equal(ours.logit_bias, theirs.logit_bias.reshape(()))
    weights = folder / "open_clip_model.safetensors"
    save_file({**load_file(weights), "logit_scale": torch.ones(2)}, weights)
    assert (
        one_line_error(run, spec)
        == "the weights' logit scale or bias has shape (2,): clip_train's is one number"
    )


def test_a_locked_text_tower_with_unlocked_layers_computes_the_same_embeddings(tiny_clip):
    """The causal layers run one by one (frozen, then trainable) give what the whole encoder gives."""
    folder, quick_gelu = tiny_clip
    whole = initialised(clip_text_run(quick_gelu), f"open_clip:local-dir:{folder}")
    split = initialised(
        [*clip_text_run(quick_gelu), "model.text.lock=true", "model.text.unlocked_layers=1"],
        f"open_clip:local-dir:{folder}",
    )
    tokens = whole.tokenizer(CAPTIONS)
    with torch.no_grad():
        hidden = split.text.encode_frozen(**tokens)
        assert len(hidden) == 3  # hidden states after layer 0, ids, mask
        torch.testing.assert_close(
            split.text.encode_trainable(*hidden), whole.encode_text(**tokens), rtol=0, atol=1e-6
        )


# --------------------------------------------------------------------------------------------
# What does not map: one line
# --------------------------------------------------------------------------------------------


def test_siglip_text_tower_fails_at_start_up_in_one_line(tmp_path):
    """SigLIP's text transformer is bidirectional, pooled at the last position, with a biased
    projection and its own tokenizer: none of it is CLIP's."""
    (tmp_path / "weights").write_bytes(b"not read: the check comes first")
    with pytest.raises(UserError) as err:
        check_init_from(f"open_clip:ViT-B-16-SigLIP/{tmp_path / 'weights'}")
    assert str(err.value) == (
        "the text tower does not map (open_clip's text transformer here has pool_type='last', no causal "
        "mask, a projection bias, its own tokenizer timm/ViT-B-16-SigLIP, tokenizer arguments "
        "{'clean': 'canonicalize'}; clip_train maps the CLIP text transformer: causal, pooled at the end "
        "token (argmax), a bias-free projection, open_clip's BPE)"
    )


@pytest.mark.parametrize(
    ("tower", "arguments", "message"),
    [
        (
            "text_cfg",
            {"tokenizer_kwargs": {"clean": "canonicalize"}},
            "the text tower does not map (open_clip's text transformer here has tokenizer arguments "
            "{'clean': 'canonicalize'}; clip_train maps the CLIP text transformer: causal, pooled at the end "
            "token (argmax), a bias-free projection, open_clip's BPE)",
        ),
        (
            "vision_cfg",
            {"act_kwargs": {"approximate": "tanh"}},
            "the image tower does not map (open_clip's ViT here has activation arguments "
            "{'approximate': 'tanh'}; clip_train maps a ViT whose GELU or QuickGELU takes none)",
        ),
    ],
    ids=["tokenizer", "vit-activation"],
)
def test_tokenizer_or_activation_arguments_fail_at_start_up_in_one_line(tmp_path, tower, arguments, message):
    """Neither shows in a weight: clip_train's BPE cleans captions as open_clip's default does (lower),
    and its ViT's activation takes no arguments, so the tokens or the embeddings would differ."""
    model_cfg = {"embed_dim": 16, "vision_cfg": VIT, "text_cfg": TEXT}
    model_cfg[tower] = {**model_cfg[tower], **arguments}
    save_open_clip_folder(tmp_path, open_clip.CLIP(**model_cfg), model_cfg)
    with pytest.raises(UserError) as err:
        check_init_from(f"open_clip:local-dir:{tmp_path}")
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.text.pooling=mean"],
            DIFFER.format("pooling eot vs mean"),
        ),
        (
            ["model.text.hf_config.num_attention_heads=4"],
            DIFFER.format("heads 2 vs 4"),
        ),
        (
            ["model.text.hf_config.layer_norm_eps=1.0e-6"],
            DIFFER.format("norm eps 1e-05 vs 1e-06"),
        ),
        (
            ["model.text.hf_config.num_hidden_layers=3"],
            "the open_clip weights do not fit the model: missing 16 keys (text.encoder.encoder.layers.2.",
        ),
        (
            ["model.text.hf_config.max_position_embeddings=16", "model.text.context_length=16"],
            "text.encoder.embeddings.position_embedding.weight (open_clip's positional_embedding) is "
            "(12, 32) in the weights but (16, 32) in the model: set "
            "model.text.hf_config.max_position_embeddings=12 (open_clip's context_length)",
        ),
        (
            [
                "model.text.hf_config={model_type: bert, hidden_size: 32, num_hidden_layers: 2, "
                "num_attention_heads: 2, intermediate_size: 128, max_position_embeddings: 12}",
                "model.text.pooling=cls",
            ],
            "open_clip's text tower is its CLIP text transformer but the run's is a BertModel: set "
            "model.text.hf_config.model_type=clip_text_model and model.text.pooling=eot",
        ),
    ],
    ids=["pooling", "heads", "norm-eps", "depth", "context", "bert"],
)
def test_a_text_tower_that_differs_fails_in_one_line(tiny_clip, overrides, message):
    folder, quick_gelu = tiny_clip
    run = [*clip_text_run(quick_gelu), *overrides]
    assert one_line_error(run, f"open_clip:local-dir:{folder}").startswith(message)


def test_weights_of_the_other_activation_fail_in_one_line(tiny_clip):
    """OpenAI's QuickGELU weights with model/ViT-B-32.yaml's GELU text tower, and the reverse."""
    folder, quick_gelu = tiny_clip
    theirs, ours = ("quick_gelu", "gelu") if quick_gelu else ("gelu", "quick_gelu")
    run = [*clip_text_run(quick_gelu), f"model.text.hf_config.hidden_act={ours}"]
    assert one_line_error(run, f"open_clip:local-dir:{folder}").startswith(
        DIFFER.format(f"activation {theirs} vs {ours}")
        + ": set model.text.pooling=eot and model.text.hf_config"
    )


def test_weights_trained_with_another_image_normalisation_fail_in_one_line(tiny_clip, tmp_path):
    """The mean and std come from the run's timm name; LAION-2B's ViT-L-14 was trained with 0.5."""
    folder, quick_gelu = tiny_clip
    copy = Path(shutil.copytree(folder, tmp_path / "half"))
    config = json.loads((copy / "open_clip_config.json").read_text())
    config["preprocess_cfg"] = {"mean": [0.5] * 3, "std": [0.5] * 3}
    (copy / "open_clip_config.json").write_text(json.dumps(config))
    spec = f"open_clip:local-dir:{copy}"
    assert one_line_error(clip_text_run(quick_gelu), spec).startswith(
        "open_clip's model normalises images with mean (0.5, 0.5, 0.5) and std (0.5, 0.5, 0.5), the run's "
        "model.image.timm with (0.48145466, 0.4578275, 0.40821073) and (0.26862954, 0.26130258, 0.27577711)"
    )
    overlay = "model.image.timm_kwargs.pretrained_cfg_overlay={mean: [0.5, 0.5, 0.5], std: [0.5, 0.5, 0.5]}"
    assert initialised([*clip_text_run(quick_gelu), overlay], spec).image_mean == (0.5, 0.5, 0.5)


def test_a_bare_weights_file_says_its_normalisation_is_assumed(tmp_path):
    """``open_clip:ARCH/FILE`` carries no preprocessing settings: the check can only assume OpenAI's
    mean and std, and names the sources that carry them."""
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"not read")
    overlay = "model.image.timm_kwargs.pretrained_cfg_overlay={mean: [0.5, 0.5, 0.5], std: [0.5, 0.5, 0.5]}"
    cfg = load_config(ROOT / "configs" / "model" / "ViT-B-32.yaml", [overlay]).model
    problem = normalisation_problem(resolve(f"open_clip:ViT-B-32/{weights}"), build_model(cfg, on_meta=True))
    assert problem.startswith(
        f"{weights} is a bare weights file, which carries no preprocessing settings, so the check assumes "
        "OpenAI's mean (0.48145466, 0.4578275, 0.40821073) and std (0.26862954, 0.26130258, 0.27577711), "
        "the run's model.image.timm with (0.5, 0.5, 0.5) and (0.5, 0.5, 0.5): name the weights by their "
        "pretrained tag (open_clip:ARCH/TAG) or as a folder with its open_clip_config.json "
        "(open_clip:local-dir:DIR) instead, or pick a timm tag trained with them"
    )


@pytest.mark.parametrize(
    ("name", "repo", "mean"),
    [
        ("ViT-L-14/laion2b_s32b_b82k", "laion/CLIP-ViT-L-14-laion2B-s32B-b82K", (0.5, 0.5, 0.5)),
        ("ViT-L-14/datacomp_xl_s13b_b90k", "laion/CLIP-ViT-L-14-DataComp.XL-s13B-b90K", OPENAI_DATASET_MEAN),
    ],
)
def test_a_pretrained_tag_brings_its_image_normalisation(tmp_path, monkeypatch, name, repo, mean):
    (tmp_path / "weights").write_bytes(b"not read")
    put_in_hub_cache(tmp_path, repo, {"open_clip_model.safetensors": tmp_path / "weights"})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve(f"open_clip:{name}").mean == mean


def test_a_config_value_of_the_wrong_type_is_a_config_error():
    """A string where transformers' config wants a float: refused, naming the field (1e-6, which
    PyYAML reads as a string, is a float here: test_config)."""
    cfg = load_config(TINY_MODEL_CONFIG, [*clip_text_run(False), "model.text.hf_config.layer_norm_eps=small"])
    with pytest.raises(UserError, match=r"^model.text.hf_config: .*'layer_norm_eps'.*expected float"):
        build_model(cfg.model)


def test_cls_pooling_of_the_causal_text_transformer_fails_at_build():
    """Its first token sees no other: every caption would embed alike, and training would not say so."""
    cfg = load_config(TINY_MODEL_CONFIG, [*clip_text_run(False), "model.text.pooling=cls"])
    with pytest.raises(UserError, match=r"^model.text.pooling=cls on CLIP's causal text transformer"):
        build_model(cfg.model)


def test_eot_pooling_needs_open_clips_tokenizer():
    overrides = ["model.text.pooling=eot", "model.text.tokenizer=bert-base-uncased"]
    with pytest.raises(UserError, match=r"^model.text.pooling=eot pools at the largest token id"):
        load_config(TINY_MODEL_CONFIG, overrides).validate(world_size=1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.text.hf_config.hidden_act=gelu_new"],
            "model.text.hf_config.hidden_act=gelu_new: open_clip's text transformer has gelu or quick_gelu",
        ),
        (
            [
                "model.text.hf_config={model_type: bert, hidden_size: 32, num_hidden_layers: 1, "
                "num_attention_heads: 2, intermediate_size: 64, max_position_embeddings: 12}"
            ],
            "model.text.pooling=eot: open_clip pools a transformers encoder with cls "
            "(cls_last_hidden_state_pooler), mean (mean_pooler)",
        ),
        (
            ["model.text.pooling=mean"],
            "model.text.pooling=mean: open_clip pools its text transformer at the end token (eot)",
        ),
    ],
    ids=["activation", "bert-eot", "clip-mean"],
)
def test_what_open_clip_cannot_build_is_not_exported(tmp_path, overrides, message):
    model = build_model(load_config(TINY_MODEL_CONFIG, [*clip_text_run(False), *overrides]).model)
    with pytest.raises(UserError) as err:
        export_open_clip(model, tmp_path / "out")
    assert str(err.value) == message and not (tmp_path / "out").exists()


def test_an_export_tokenizes_to_the_runs_context_length(tmp_path):
    """A run may use fewer positions than the transformer has: open_clip gets those, so its tokenizer
    cuts captions where the run's does."""
    run = [*clip_text_run(False), "model.text.hf_config.max_position_embeddings=16"]
    model = perturbed(build_model(load_config(TINY_MODEL_CONFIG, run).model))
    image, text = export_open_clip(model, tmp_path / "out")
    assert max(image, text) <= TOLERANCE
    theirs = open_clip_model(tmp_path / "out")
    assert theirs.text.positional_embedding.shape == (12, 32)
    assert torch.equal(
        open_clip.get_tokenizer(f"local-dir:{tmp_path / 'out'}")(CAPTIONS),
        model.tokenizer(CAPTIONS)["input_ids"],
    )
    assert max(max_differences(model, theirs, float_images(16))) <= TOLERANCE


def test_activation_checkpointing_keeps_the_embeddings_and_gradients(tiny_clip):
    folder, quick_gelu = tiny_clip
    spec = f"open_clip:local-dir:{folder}"
    plain = initialised(clip_text_run(quick_gelu), spec).train()
    recomputed = initialised([*clip_text_run(quick_gelu), "model.text.grad_checkpointing=true"], spec).train()
    assert (
        recomputed.text.encoder.is_activation_checkpointing
        and not plain.text.encoder.is_activation_checkpointing
    )
    tokens = plain.tokenizer(CAPTIONS)
    for model in (plain, recomputed):
        model.encode_text(**tokens).square().sum().backward()
    grads = [p.grad for p in recomputed.text.parameters()]
    for ours, theirs in zip(grads, (p.grad for p in plain.text.parameters()), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert all(grad is not None for grad in grads)


CLIP_TEXT_TINY = (  # after test_gradcache's DROPOUT overrides, whose BERT keys it replaces
    "model.text.hf_config={model_type: clip_text_model, hidden_size: 32, intermediate_size: 64, "
    "num_hidden_layers: 2, num_attention_heads: 2, max_position_embeddings: 16, attention_dropout: 0.1}",
    "model.text.pooling=eot",
)
FSDP_CASES = [
    Case((1, 2), CLIP_TEXT_TINY),  # both towers replayed in chunks, the text tower's layers sharded
    Case(
        (1, 2),
        (*CLIP_TEXT_TINY, "model.image.lock=true", "model.text.lock=true", "model.text.unlocked_layers=1"),
    ),
]


def test_fsdp_steps_of_the_clip_text_tower_equal_one_process_full_batch_steps():
    """FSDP2 on 2 gloo ranks, Gradient Cache, fp64: the CLIP text tower's layers are FSDP units, and
    two steps equal plain autograd on the global batch, unlocked and LiT with one layer unlocked."""
    results = run_distributed(fsdp_rank, 2, FSDP_CASES, timeout_s=300)
    for index, case in enumerate(FSDP_CASES):
        per_rank = [rank_results[index] for rank_results in results]
        check(per_rank, reference(2, case), world=2)
        assert per_rank[0]["units"]["text"] == 3  # two layers and the tower's root
