"""The two-tower model: shapes, the encode_frozen/encode_trainable contract, LiT, loading, tokenizers."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import BertConfig, BertModel, BertTokenizerFast

from clip_train import ConfigError, load_config
from clip_train.model import CLIP, ModelLoadError, OpenCLIPTokenizer, build_model, build_tokenizer
from clip_train.model.image import build_image_tower
from clip_train.model.text import build_text_tower, create_encoder

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
TEXTS = ["a handwritten seven", "the digit 7!", "zero", "a photo of a very small handwritten digit four " * 3]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These shapes are tiny: one thread is faster and avoids oversubscribing a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(*overrides: str) -> CLIP:
    torch.manual_seed(0)
    return build_model(load_config(CONFIGS / "tiny.yaml", overrides).model)


def uint8_images(n: int, size: int = 32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=gen)


LOCK_MODES = {
    "unlocked": [],
    "locked": ["model.image.lock=true", "model.text.lock=true"],
    "locked-last-2": [
        "model.image.lock=true",
        "model.image.unlocked_layers=2",
        "model.text.lock=true",
        "model.text.unlocked_layers=1",
    ],
}


# ---------------------------------------------------------------------------------------------
# Shapes, normalisation, the tower contract
# ---------------------------------------------------------------------------------------------


def test_tiny_model_outputs_unit_vectors_and_uint8_matches_manual_normalisation():
    model = tiny().double().eval()
    assert model.image_size == 32
    images = uint8_images(5)
    tokens = model.tokenizer(TEXTS)
    with torch.no_grad():
        img, txt, scale = model(images, tokens["input_ids"], tokens["attention_mask"])
        mean = torch.tensor(model.image_mean, dtype=torch.float64).view(1, 3, 1, 1)
        std = torch.tensor(model.image_std, dtype=torch.float64).view(1, 3, 1, 1)
        from_float = model.encode_image((images.double() / 255 - mean) / std)
    assert img.shape == (5, 128) and txt.shape == (len(TEXTS), 128)
    assert img.dtype == txt.dtype == torch.float64
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(5, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(txt.norm(dim=-1), torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(from_float, img, rtol=0, atol=1e-12)
    assert scale.item() == pytest.approx(1 / 0.07)


@pytest.mark.parametrize("mode", LOCK_MODES)
def test_forward_equals_trainable_of_frozen(mode):
    model = tiny(*LOCK_MODES[mode]).double().eval()
    tokens = model.tokenizer(TEXTS)
    text_inputs = (tokens["input_ids"], tokens["attention_mask"])
    with torch.no_grad():
        for tower, inputs in ((model.visual, (uint8_images(3),)), (model.text, text_inputs)):
            assert tower.has_frozen_trunk == (mode != "unlocked")
            hidden = tower.encode_frozen(*inputs)
            assert isinstance(hidden, tuple)
            assert torch.equal(tower(*inputs), tower.encode_trainable(*hidden))
    if mode == "locked":  # a fully locked trunk hands over the pooled (n, width) features only
        (pooled,) = model.visual.encode_frozen(uint8_images(3))
        assert pooled.shape == (3, 128)


@pytest.mark.parametrize(("image_unlocked", "text_unlocked"), [(0, 0), (1, 1), (4, 2)])
def test_locked_split_matches_the_libraries_own_forward(image_unlocked, text_unlocked):
    """The hand-made split through timm's and transformers' pieces computes their forward exactly."""
    reference = tiny("model.text.pooling=mean").double().eval()
    locked = tiny(
        "model.text.pooling=mean",
        "model.image.lock=true",
        f"model.image.unlocked_layers={image_unlocked}",
        "model.text.lock=true",
        f"model.text.unlocked_layers={text_unlocked}",
    ).double()
    locked.load_state_dict(reference.state_dict())
    locked.eval()
    images, tokens = uint8_images(4), reference.tokenizer(TEXTS)
    with torch.no_grad():
        x = reference.visual.prepare(images)
        want_img = F.normalize(reference.visual.trunk(x) @ reference.visual.proj.weight.T, dim=-1)
        states = reference.text.encoder(**tokens).last_hidden_state
        mask = tokens["attention_mask"].unsqueeze(-1).double()
        mean_pooled = (states * mask).sum(1) / mask.sum(1)
        want_txt = F.normalize(mean_pooled @ reference.text.proj.weight.T, dim=-1)
        got_img = locked.encode_image(images)
        got_txt = locked.encode_text(**tokens)
    torch.testing.assert_close(got_img, want_img, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_txt, want_txt, rtol=0, atol=1e-12)


def test_a_locked_split_runs_electras_embedding_projection():
    """ELECTRA widens its embeddings to the layers' width between the two (electra-small: 128 to 256)."""
    electra = (
        "model.text.hf_config={model_type: electra, embedding_size: 16, hidden_size: 32, "
        "intermediate_size: 37, num_attention_heads: 2, num_hidden_layers: 2}"
    )
    reference = tiny(electra).double().eval()
    locked = tiny(electra, "model.text.lock=true", "model.text.unlocked_layers=1").double()
    locked.load_state_dict(reference.state_dict())
    tokens = reference.tokenizer(TEXTS)
    with torch.no_grad():
        got, want = (model.eval().encode_text(**tokens) for model in (locked, reference))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# LiT
# ---------------------------------------------------------------------------------------------


def contrastive_loss(model: CLIP, images: torch.Tensor, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
    img, txt, scale = model(images, tokens["input_ids"], tokens["attention_mask"])
    logits = scale * img @ txt.T
    labels = torch.arange(len(img))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def test_lit_keeps_frozen_parameters_bit_identical_and_trains_the_rest():
    model = tiny(*LOCK_MODES["locked-last-2"]).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainable = dict(model.named_trainable_parameters())
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-3)
    images, tokens = uint8_images(4), model.tokenizer(TEXTS)
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        contrastive_loss(model, images, tokens).backward()
        if step == 0:  # every trainable parameter is used (DDP requires it) and nothing else has a grad
            assert all(p.grad is not None for p in trainable.values())
            assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
        optimizer.step()

    visual_trainable = {n for n in trainable if n.startswith("visual.")}
    assert visual_trainable == {
        n
        for n, _ in model.named_parameters()
        if n.startswith(("visual.trunk.blocks.2.", "visual.trunk.blocks.3."))
    } | {"visual.trunk.norm.weight", "visual.trunk.norm.bias", "visual.proj.weight"}
    text_trainable = {n for n in trainable if n.startswith("text.")}
    assert text_trainable == {
        n for n, _ in model.named_parameters() if n.startswith("text.encoder.encoder.layer.1.")
    } | {"text.proj.weight"}
    for name, p in model.named_parameters():
        if name in trainable:
            assert not torch.equal(p, before[name]), f"{name} did not train"
        else:
            assert torch.equal(p, before[name]), f"frozen {name} changed"
    # frozen submodules stay in eval() under model.train(); the unlocked ones train
    assert not model.visual.trunk.blocks[1].training and not model.visual.trunk.patch_embed.training
    assert not model.text.encoder.embeddings.training and not model.text.encoder.encoder.layer[0].training
    assert model.visual.trunk.blocks[2].training and model.text.encoder.encoder.layer[1].training


def test_fully_locked_trunk_is_deterministic_in_train_mode():
    dropout = ["model.image.timm_kwargs.drop_rate=0.3", "model.text.hf_config.hidden_dropout_prob=0.3"]
    images, texts = uint8_images(4), TEXTS

    def twice(model: CLIP) -> list[bool]:
        tokens = model.tokenizer(texts)
        model.train()
        return [
            torch.equal(model.encode_image(images), model.encode_image(images)),
            torch.equal(model.encode_text(**tokens), model.encode_text(**tokens)),
        ]

    assert twice(tiny(*dropout)) == [False, False]  # dropout is live when unlocked...
    assert twice(tiny(*dropout, *LOCK_MODES["locked"])) == [True, True]  # ...and off in a frozen trunk


def test_lock_head_freezes_the_whole_tower():
    model = tiny("model.image.lock=true", "model.image.lock_head=true", "model.text.lock=true")
    assert model.visual.is_frozen and list(model.visual.trainable_parameters()) == []
    assert not model.text.is_frozen and list(model.text.trainable_parameters()) == [model.text.proj.weight]
    with pytest.raises(ConfigError, match=r"lock_head=true needs model\.image\.lock=true"):
        tiny("model.image.lock_head=true")


def test_freeze_norms_keeps_the_unlocked_blocks_norms_frozen_and_in_eval():
    """For either tower: the unlocked blocks train, their norm layers do not, and those stay in
    eval() when the model trains."""
    unlocked = [*LOCK_MODES["locked-last-2"]]
    plain, frozen = (
        tiny(*unlocked),
        tiny(*unlocked, "model.image.freeze_norms=true", "model.text.freeze_norms=true"),
    )
    frozen.train()
    for tower, plain_tower in ((frozen.visual, plain.visual), (frozen.text, plain.text)):
        trained = {name for name, p in plain_tower.named_parameters() if p.requires_grad}
        still = {name for name, p in tower.named_parameters() if p.requires_grad}
        norms = {name for name in trained if any(k in name for k in ("norm", "LayerNorm"))}
        assert norms and still == trained - norms  # exactly the norms left out
        norm_modules = [m for m in tower.modules() if isinstance(m, torch.nn.LayerNorm)]
        assert all(not m.training for m in norm_modules)
    with pytest.raises(ConfigError, match=r"freeze_norms=true needs model\.text\.lock=true"):
        tiny("model.text.freeze_norms=true")


def test_freeze_norms_keeps_timms_rms_norms_frozen_too():
    """timm's RmsNorm (a ViT with norm_layer=rmsnorm) subclasses no torch norm: it kept training."""
    rms = (
        "model.image.timm_kwargs.norm_layer=rmsnorm",
        "model.image.lock=true",
        "model.image.unlocked_layers=1",
    )
    tower = tiny(*rms, "model.image.freeze_norms=true").visual
    norms = [m for m in tower.modules() if isinstance(m, timm.layers.RmsNorm)]
    assert norms and not any(p.requires_grad for m in norms for p in m.parameters())
    trained = [name for name, p in tower.named_parameters() if p.requires_grad]
    assert trained and not any("norm" in name for name in trained)


PRE_LAYERNORM = [  # transformers runs a LayerNorm after the layers' stack
    "model.text.hf_config={model_type: xlm-roberta-xl, hidden_size: 32, num_hidden_layers: 2, "
    "num_attention_heads: 2, intermediate_size: 64, max_position_embeddings: 40, vocab_size: 49408}",
    "model.text.hf_config={model_type: roberta-prelayernorm, hidden_size: 32, num_hidden_layers: 2, "
    "num_attention_heads: 2, intermediate_size: 64, max_position_embeddings: 40, vocab_size: 49408}",
]


@pytest.mark.parametrize("encoder", PRE_LAYERNORM, ids=["xlm-roberta-xl", "roberta-prelayernorm"])
def test_a_split_that_would_skip_a_pre_layernorm_encoders_final_norm_is_refused(encoder):
    """Locked whole, the tower is transformers' own forward; split at a layer it would drop the final
    LayerNorm (cosine 0.88 to the encoder's output), so that is refused naming the weight."""
    tiny(encoder, "model.text.lock=true")
    with pytest.raises(ConfigError, match=r"unlocked_layers=1: \w+ has weights outside .*LayerNorm"):
        tiny(encoder, "model.text.lock=true", "model.text.unlocked_layers=1")


def test_a_context_past_robertas_shifted_positions_is_refused_at_start_up():
    """RoBERTa numbers positions from 2: 40 position rows hold 38 tokens, and 39 failed at the first
    forward with an index error."""
    roberta = (
        "model.text.hf_config={model_type: roberta, hidden_size: 32, num_hidden_layers: 1, "
        "num_attention_heads: 2, intermediate_size: 64, max_position_embeddings: 40, vocab_size: 49408}"
    )
    model = tiny(roberta, "model.text.context_length=38")
    assert model.encode_text(**model.tokenizer(["a seven " * 30])).isfinite().all()  # a full context
    with pytest.raises(
        ConfigError, match=r"context_length=39 exceeds .*=40 less the 2 its positions start at"
    ):
        tiny(roberta, "model.text.context_length=39")


def test_bad_lock_settings_are_config_errors():
    with pytest.raises(ConfigError, match="unlocked_layers=5 exceeds the trunk's 4 blocks"):
        tiny("model.image.lock=true", "model.image.unlocked_layers=5")
    with pytest.raises(ConfigError, match="unlocked_layers=3 exceeds the encoder's 2 layers"):
        tiny("model.text.lock=true", "model.text.unlocked_layers=3")
    cnn = ["model.image.timm=resnet10t", "model.image.lock=true"]
    with pytest.raises(ConfigError, match="needs a timm VisionTransformer, got ResNet"):
        build_image_tower(load_config(overrides=[*cnn, "model.image.unlocked_layers=1"]).model.image, 8)
    tower = build_image_tower(load_config(overrides=cnn).model.image, 8).double().eval()
    with torch.no_grad():  # a whole locked CNN trunk is supported
        (pooled,) = tower.encode_frozen(uint8_images(2, size=64))
        assert pooled.shape == (2, tower.trunk.num_features)
        assert torch.equal(tower(uint8_images(2, size=64)), tower.encode_trainable(pooled))
    assert [p is tower.proj.weight for p in tower.trainable_parameters()] == [True]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model.image.timm_kwargs.patch_drop_rate=1.5",
            r"^model\.image\.timm_kwargs=\{.*'patch_drop_rate': 1\.5\}: "
            r"assert 0 <= prob < 1\. \(patch_dropout\.py:\d+\)$",
        ),
        (
            "model.image.timm_kwargs.patch_drops=0.5",
            r"^model\.image\.timm_kwargs=\{.*\}: .*unexpected keyword argument "
            r"'patch_drops'$",
        ),
        (
            "model.text.hf_config.hidden_size=130",
            r"^model\.text\.hf_config: The hidden size \(130\) is not a "
            r"multiple of the number of attention heads \(4\)$",
        ),
        (
            "model.image.timm_kwargs.img_size=4",
            r"^model\.image\.timm_kwargs=\{.*\}: 4x4 px images hold no 8x8 px patch; raise img_size or "
            r"lower patch_size$",
        ),
        (
            "model.text.hf_config.num_attention_heads=0",
            r"^model\.text\.hf_config: integer modulo by zero: .*num_attention_heads.* "
            r"\(modeling_bert\.py:\d+\)$",
        ),
        (  # AutoModel builds the whole seq2seq model, whose forward needs a decoder input
            "model.text.hf_config={model_type: mt5, d_model: 32, num_layers: 1, num_heads: 2, d_kv: 16}",
            r"^model\.text\.hf_config\.model_type=mt5: an encoder-decoder model; the text tower takes an "
            r"encoder",
        ),
        (  # AutoModel builds CLIPModel, both towers, from a whole CLIP's config or checkpoint
            "model.text.hf_config={model_type: clip, text_config: {hidden_size: 32, intermediate_size: 37, "
            "num_attention_heads: 2, num_hidden_layers: 1}, vision_config: {hidden_size: 32, "
            "intermediate_size: 37, num_attention_heads: 2, num_hidden_layers: 1, image_size: 32, "
            "patch_size: 16}}",
            r"^model\.text\.hf_config\.model_type=clip: a whole image-text model \(CLIPModel\), not a text "
            r"encoder\. To start from a released CLIP, use model\.init_from=open_clip:",
        ),
    ],
    ids=[
        "timm-assert",
        "timm-keyword",
        "transformers-value",
        "no-patch",
        "transformers-division",
        "seq2seq",
        "whole-clip",
    ],
)
def test_a_value_a_tower_library_refuses_is_one_line_naming_the_key(override, message):
    """timm asserts without a message, transformers raises ValueError or divides by zero, and a ViT
    smaller than a patch builds but cannot run: each is a ConfigError naming the key, on one line
    (for an assert or a division, the line that raised)."""
    with pytest.raises(ConfigError, match=message):
        tiny(override)


def test_wrong_image_input_is_a_clear_error():
    model = tiny()
    with pytest.raises(ValueError, match="NCHW with 3 channels"):
        model.encode_image(torch.zeros(2, 1, 32, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8 or already normalised floats"):
        model.encode_image(torch.zeros(2, 3, 32, 32, dtype=torch.int32))


def test_inputs_follow_the_buffers_not_the_projection_which_sharding_moves():
    """FSDP may keep a sharded root's projection on the host (cpu_offload) or as a bf16 copy while
    gathered; the prepared inputs stay on the buffers' device, in their dtype (the master weights')."""
    model = tiny().double()
    images = uint8_images(2)
    tokens = model.tokenizer(TEXTS[:2])
    model.visual.proj.to("meta", torch.bfloat16)
    model.text.proj.to("meta")
    pixels = model.visual.prepare(images)
    mean = torch.tensor(model.image_mean, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(model.image_std, dtype=torch.float64).view(1, 3, 1, 1)
    assert (pixels.device, pixels.dtype) == (torch.device("cpu"), torch.float64)
    torch.testing.assert_close(pixels, (images.double() / 255 - mean) / std, rtol=0, atol=1e-12)
    ids, mask = model.text.encode_frozen(tokens["input_ids"], tokens["attention_mask"])
    assert ids.device == mask.device == torch.device("cpu")
    assert torch.equal(ids, tokens["input_ids"]) and torch.equal(mask, tokens["attention_mask"])


@pytest.mark.parametrize("mode", ["unlocked", "locked-last-2"])
def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(mode):
    settings = ["model.image.timm_kwargs.drop_path_rate=0", "model.text.hf_config.hidden_dropout_prob=0"]
    settings += LOCK_MODES[mode]
    checkpointing = ["model.image.grad_checkpointing=true", "model.text.grad_checkpointing=true"]
    grads, calls = [], []
    for model in (tiny(*settings), tiny(*settings, *checkpointing)):
        model.double().train()
        counter = []
        # hook a child: transformers checkpoints a layer's forward, so the layer's own hooks run once
        for attention in (model.visual.trunk.blocks[-1].attn, model.text.encoder.encoder.layer[-1].attention):
            attention.register_forward_pre_hook(lambda *_, counter=counter: counter.append(1))
        contrastive_loss(model, uint8_images(4), model.tokenizer(TEXTS)).backward()
        grads.append({n: p.grad for n, p in model.named_trainable_parameters()})
        calls.append(len(counter))
    assert calls == [2, 4]  # checkpointed blocks run again in backward
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Pretrained weights from local paths, and clear errors when they are missing
# ---------------------------------------------------------------------------------------------

WORDS = ["a", "handwritten", "digit", "the", "seven", "zero", "photo", "of", "hand", "##written", "!"]


def write_bert_dir(directory: Path) -> tuple[BertModel, BertTokenizerFast]:
    """A small BERT and a WordPiece vocab saved the way `hf download` lays out a hub repo."""
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    tokenizer = BertTokenizerFast(vocab=vocab)
    torch.manual_seed(1)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    bert = BertModel(config).eval()
    bert.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return bert, tokenizer


def test_text_tower_and_tokenizer_load_from_a_local_directory(tmp_path):
    bert, hf_tokenizer = write_bert_dir(tmp_path / "bert")
    model = build_model(
        load_config(
            CONFIGS / "tiny.yaml",
            [f"model.text.hf={tmp_path / 'bert'}", "model.text.hf_config={}", "model.text.tokenizer="],
        ).model
    ).eval()
    saved = bert.state_dict()
    loaded = model.text.encoder.state_dict()
    assert loaded.keys() == {k for k in saved if not k.startswith("pooler.")}
    assert all(torch.equal(loaded[k], saved[k]) for k in loaded)

    tokens = model.tokenizer(["a handwritten seven!", "the digit zero " * 20])
    want = hf_tokenizer(
        ["a handwritten seven!", "the digit zero " * 20], padding="max_length", truncation=True, max_length=16
    )
    assert tokens["input_ids"].tolist() == want["input_ids"]
    assert tokens["attention_mask"].tolist() == want["attention_mask"]
    assert tokens["input_ids"].dtype == tokens["attention_mask"].dtype == torch.int64
    assert pickle.loads(pickle.dumps(model.tokenizer))(["a seven"])["input_ids"].tolist() == (
        model.tokenizer(["a seven"])["input_ids"].tolist()
    )
    with torch.no_grad():  # the tower is BERT's CLS state projected and normalised
        cls = bert(**tokens).last_hidden_state[:, 0]
        torch.testing.assert_close(
            model.encode_text(**tokens), F.normalize(cls @ model.text.proj.weight.T, dim=-1)
        )


def tiny_vit(**kwargs) -> torch.nn.Module:
    overrides = dict(img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=2) | kwargs
    return timm.create_model("vit_base_patch16_224", **overrides)


@pytest.mark.parametrize("layout", ["model.safetensors", "pytorch_model.bin", "weights.pth", "dir"])
def test_image_tower_loads_a_local_state_dict(tmp_path, layout):
    torch.manual_seed(2)
    source = tiny_vit(num_classes=10)  # a classifier checkpoint: its head is dropped on load
    state = source.state_dict()
    path = tmp_path / ("model.safetensors" if layout == "dir" else layout)
    if path.suffix == ".safetensors":
        save_file(state, path)
    else:
        torch.save(state, path)
    overrides = [
        f"model.image.timm_kwargs.{k}={v}" for k, v in dict(depth=2, embed_dim=64, num_heads=2).items()
    ]
    where = tmp_path if layout in ("dir", "pytorch_model.bin") else path
    model = tiny(*overrides, f"model.image.pretrained={where}")
    loaded = model.visual.trunk.state_dict()
    assert loaded.keys() == {k for k in state if not k.startswith("head.")}
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)


def test_image_checkpoint_that_does_not_fit_is_a_clear_error(tmp_path):
    save_file(tiny_vit(embed_dim=32).state_dict(), tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="does not fit VisionTransformer") as err:
        tiny(f"model.image.pretrained={tmp_path}")
    assert "\n" not in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"holds none of model\.safetensors, pytorch_model\.bin"):
        tiny(f"model.image.pretrained={tmp_path / 'empty'}")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.image.pretrained=/no/such/weights.pth"],
            "model.image.pretrained='/no/such/weights.pth': no such",
        ),
        (
            ["model.image.pretrained=hub", "model.image.timm=vit_tiny_patch16_224.augreg_in21k"],
            "hf download timm/",
        ),
        (["model.text.tokenizer=/no/such/dir"], "model.text.tokenizer='/no/such/dir': no such directory"),
        (["model.text.tokenizer=clip-train-test/no-such-model"], "hf download clip-train-test/no-such-model"),
    ],
)
def test_missing_weights_give_one_clear_line(overrides, message):
    with pytest.raises(ModelLoadError, match=message) as err:
        tiny(*overrides)
    assert "\n" not in str(err.value)
    chained = err.value.__cause__ or (None if err.value.__suppress_context__ else err.value.__context__)
    assert chained is None  # no traceback through huggingface_hub or timm gets printed


def test_missing_text_encoder_gives_one_clear_line():
    cfg = load_config(overrides=["model.text.hf=clip-train-test/no-such-model"]).model.text
    with pytest.raises(
        ModelLoadError, match=r"model\.text\.hf='clip-train-test/no-such-model' is neither"
    ) as err:
        create_encoder(cfg)
    assert "set model.text.hf=DIR" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# The shipped configs: sizes of the real architectures, built on the meta device (no memory)
# ---------------------------------------------------------------------------------------------

VIT_B16 = 85_798_656  # timm/torchvision ViT-B/16 (86,567,656) minus its 1000-class head (769,000)
VIT_B16_CLIP = 85_799_424  # OpenAI CLIP ViT-B/16 visual (86,192,640) minus its 768x512 projection
VIT_L14_CLIP = 303_179_776  # OpenAI CLIP ViT-L/14 visual (303,966,208) minus its 1024x768 projection
BERT_BASE = 108_891_648  # bert-base-uncased (109,482,240) minus the NSP pooler (590,592)


def meta_towers(name: str):
    """Build the config's towers with random init on the meta device: architecture only, no weights."""
    cfg = load_config(
        CONFIGS / f"{name}.yaml", ["model.image.pretrained=", "model.text.hf_config={model_type: bert}"]
    )
    with torch.device("meta"):
        return (
            cfg.model,
            build_image_tower(cfg.model.image, cfg.model.embed_dim),
            build_text_tower(cfg.model.text, cfg.model.embed_dim),
        )


def count(params) -> int:
    return sum(p.numel() for p in params)


@pytest.mark.parametrize(
    ("name", "trunk", "head", "trainable"),
    [
        ("vit-b16-bert-base", VIT_B16_CLIP, 768 * 512, None),
        ("lit-vit-b16-bert-base", VIT_B16, 768 * 768, BERT_BASE + 2 * 768 * 768),
        ("vit-l14-bert-base", VIT_L14_CLIP, 1024 * 768, None),
    ],
)
def test_shipped_configs_have_the_published_sizes(name, trunk, head, trainable):
    model_cfg, visual, text = meta_towers(name)
    assert count(visual.trunk.parameters()) == trunk
    assert count(visual.proj.parameters()) == head
    assert count(text.encoder.parameters()) == BERT_BASE
    assert count(text.proj.parameters()) == 768 * model_cfg.embed_dim
    total = count(visual.parameters()) + count(text.parameters())
    assert count(visual.trainable_parameters()) + count(text.trainable_parameters()) == (trainable or total)


# ---------------------------------------------------------------------------------------------
# The bundled tokenizer
# ---------------------------------------------------------------------------------------------


def test_open_clip_tokenizer_pads_truncates_and_masks():
    tokenizer = build_tokenizer("open_clip", context_length=8)
    assert isinstance(tokenizer, OpenCLIPTokenizer) and tokenizer.vocab_size == 49408
    out = tokenizer(["!a", "a handwritten seven", "one two three four five six seven eight nine", ""])
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.shape == mask.shape == (4, 8) and ids.dtype == mask.dtype == torch.int64
    sot, eot = 49406, 49407
    assert ids[:, 0].tolist() == [sot] * 4
    assert ids[0].tolist() == [sot, 256, 320, eot, 0, 0, 0, 0]  # "!", "a", zero padding
    assert mask.tolist()[0] == [1, 1, 1, 1, 0, 0, 0, 0]  # the end token is attended, padding is not
    assert mask[1].sum() == 5 and (ids[1, 5:] == 0).all()
    assert ids[2, -1] == eot and mask[2].all()  # truncation keeps the end token
    assert mask.tolist()[3] == [1, 1, 0, 0, 0, 0, 0, 0]
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert all(torch.equal(clone(["a seven"])[k], tokenizer(["a seven"])[k]) for k in out)
    # one caption is a batch of one, as open_clip takes it (it was a batch of its 7 characters)
    assert all(torch.equal(tokenizer("a seven")[k], tokenizer(["a seven"])[k]) for k in out)
