"""``model.init_from=open_clip:…``: start a run from the weights of an open_clip CLIP.

Three sources: ``open_clip:local-dir:DIR`` (a folder with ``open_clip_config.json`` and the weights,
as ``clip-train export`` or ``hf download`` writes it), ``open_clip:hf-hub:ORG/REPO`` and
``open_clip:ARCH/PRETRAINED`` (a built-in architecture with a pretrained tag or a weights file). Hub
files are read from the local Hugging Face cache only: a run never downloads, and a file that is not
there fails at start-up in one line that says how to fetch it.

The run's model config defines the architecture; the open_clip model supplies every weight. Towers map
where clip_train has the same computation: a timm trunk with a bias-free linear projection (open_clip's
``TimmModel``), open_clip's own ``VisionTransformer`` (into a timm ViT), a transformers encoder
(``HFTextEncoder``) with CLS or mean pooling, and open_clip's own CLIP text transformer (causal, pooled
at the end token: OpenAI's and LAION's CLIPs) into transformers' ``CLIPTextModel``. What does not map
(e.g. SigLIP's text transformer, bidirectional and pooled at the last position) fails in one line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import open_clip
import torch
from huggingface_hub import constants, try_to_load_from_cache
from open_clip.constants import (
    HF_CONFIG_NAME,
    HF_SAFE_WEIGHTS_NAME,
    HF_WEIGHTS_NAME,
    OPENAI_DATASET_MEAN,
    OPENAI_DATASET_STD,
)
from open_clip.factory import load_state_dict, parse_model_name
from open_clip.hf_configs import arch_dict
from open_clip.model import CLIPTextCfg, CLIPVisionCfg
from open_clip.timm_model import TimmModel
from timm.layers import DropPath, PatchDropout, QuickGELU
from timm.models.vision_transformer import VisionTransformer
from transformers import AutoConfig

from clip_train.config import ModelConfig
from clip_train.model import CLIP
from clip_train.model.clip_text_names import PROJECTION, encoder_names
from clip_train.model.hub import ModelLoadError
from clip_train.model.state_dicts import Adapt, listed
from clip_train.model.text import POOLERS

PREFIX = "open_clip:"
WEIGHT_NAMES = (HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME)  # open_clip's names in a folder or repo, first wins
NORMALISATION = (("mean", OPENAI_DATASET_MEAN), ("std", OPENAI_DATASET_STD))  # open_clip's defaults
TEXT_POSITIONS = "text.encoder.embeddings.position_embedding.weight"  # an export keeps context_length rows
KEPT_IF_ABSENT = ("logit_bias",)  # a sigmoid-loss run from softmax weights starts at model.init_logit_bias


@dataclass(frozen=True)
class Source:
    """An open_clip model on this machine: its ``model_cfg`` (as in ``open_clip_config.json``), weights
    and the image normalisation it was trained with (a tag's or ``preprocess_cfg``, else open_clip's)."""

    model_cfg: dict
    weights: Path
    mean: tuple[float, ...] = OPENAI_DATASET_MEAN
    std: tuple[float, ...] = OPENAI_DATASET_STD
    bare_file: bool = False  # a weights file named alone: no preprocessing settings, the mean and std assumed


def is_open_clip(spec: str) -> bool:
    return spec.startswith(PREFIX)


def resolve(spec: str) -> Source:
    """The config and weights file ``spec`` names, without reading the weights or downloading anything."""
    try:
        schema, name = parse_model_name(spec.removeprefix(PREFIX))
    except ValueError as err:
        raise ModelLoadError(str(err)) from None
    if schema == "local-dir":
        return from_folder(Path(name).expanduser())
    if schema == "hf-hub":
        return from_hub(name)
    return from_builtin(name)


def from_folder(folder: Path) -> Source:
    if not (folder / HF_CONFIG_NAME).is_file():
        what = "holds no " + HF_CONFIG_NAME if folder.is_dir() else "is not a directory"
        raise ModelLoadError(f"{folder} {what}: not an open_clip model folder")
    found = [folder / name for name in WEIGHT_NAMES if (folder / name).is_file()]
    if not found:
        raise ModelLoadError(f"{folder} holds none of {', '.join(WEIGHT_NAMES)}")
    return read_config(folder / HF_CONFIG_NAME, found[0])


def from_hub(repo: str) -> Source:
    config = cached_file(repo, (HF_CONFIG_NAME,))
    return read_config(config, cached_file(repo, WEIGHT_NAMES))


def from_builtin(name: str) -> Source:
    """``ARCH/TAG`` (a pretrained tag, from the hub cache) or ``ARCH/FILE`` (a local weights file)."""
    arch, _, pretrained = name.partition("/")
    model_cfg = open_clip.get_model_config(arch)
    if model_cfg is None:
        raise ModelLoadError(f"open_clip has no built-in model {arch!r} (see open_clip.list_models())")
    if not pretrained:
        raise ModelLoadError(f"name the weights: {PREFIX}{arch}/TAG or {PREFIX}{arch}/FILE")
    if Path(pretrained).expanduser().is_file():
        return Source(model_cfg, Path(pretrained).expanduser(), bare_file=True)
    tag = open_clip.get_pretrained_cfg(arch, pretrained)
    if not tag:
        tags = ", ".join(open_clip.list_pretrained_tags_by_model(arch)) or "none"
        raise ModelLoadError(
            f"{pretrained!r} is neither a file nor a pretrained tag of {arch} (tags: {tags})"
        )
    # OpenAI's weights were trained with QuickGELU, which ViT-B-32's own config does not say
    model_cfg["quick_gelu"] = model_cfg.get("quick_gelu", False) or tag.get("quick_gelu", False)
    repo, _, filename = tag["hf_hub"].rpartition("/")  # "org/repo/" (the default file) or "org/repo/file"
    weights = cached_file(repo, weight_names(filename))
    return Source(model_cfg, weights, *(tuple(tag.get(key, default)) for key, default in NORMALISATION))


def weight_names(filename: str) -> tuple[str, ...]:
    """The files open_clip would fetch for a tag's ``filename`` ("" = the default), safetensors first."""
    if not filename:
        return WEIGHT_NAMES
    if filename.endswith((".bin", ".pth")):
        return (filename[:-4] + ".safetensors", filename)
    return (filename,)


def cached_file(repo: str, names: tuple[str, ...]) -> Path:
    """The first of ``names`` in the local Hugging Face cache of ``repo``; a one-line error says how to
    fetch it otherwise."""
    for name in names:
        found = try_to_load_from_cache(repo, name)
        if isinstance(found, str):
            return Path(found)
    either = " or ".join(names)
    raise ModelLoadError(
        f"{either} of {repo} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and a run never "
        f"downloads; on a machine with network run `hf download {repo} {names[0]}` and bring that cache "
        f"here (HF_HOME), or `hf download {repo} --local-dir DIR` and use {PREFIX}local-dir:DIR"
    )


def read_config(path: Path, weights: Path) -> Source:
    """The model and the image normalisation of an ``open_clip_config.json``, with ``weights``."""
    try:
        config = json.loads(path.read_text())
        model_cfg, preprocess = config.get("model_cfg"), config.get("preprocess_cfg") or {}
    except (OSError, ValueError, AttributeError) as err:
        raise ModelLoadError(f"{path}: not an open_clip config: {err}") from None
    if not isinstance(model_cfg, dict) or not {"vision_cfg", "text_cfg"} <= model_cfg.keys():
        raise ModelLoadError(f"{path}: not an open_clip config (no model_cfg with vision_cfg and text_cfg)")
    return Source(
        model_cfg, weights, *(tuple(preprocess.get(key, default)) for key, default in NORMALISATION)
    )


# --------------------------------------------------------------------------------------------
# open_clip's names → clip_train's
# --------------------------------------------------------------------------------------------

Convert = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """An open_clip key (``pattern``, matched whole) and its clip_train name (a ``re`` template), or
    several names that split the tensor into equal parts along its first dimension."""

    pattern: str
    target: str | tuple[str, ...]
    convert: Convert | None = None  # for tensors whose layout differs, not only their name


@dataclass(frozen=True)
class TowerMap:
    """How one open_clip tower's keys become clip_train's. ``leftover`` says what the keys that no rule
    matches are; ``problem`` finds config differences that change the embeddings but no shape."""

    rules: tuple[Rule, ...]
    leftover: str
    problem: Callable[[CLIP, ModelConfig], str | None] | None = None


def one_number(tensor: torch.Tensor) -> torch.Tensor:
    """The scalar in a logit scale or bias of open_clip's ``nonscalar_logit_scale`` shape, (1,)."""
    if tensor.numel() != 1:
        raise ModelLoadError(
            f"the weights' logit scale or bias has shape {tuple(tensor.shape)}: clip_train's is one number"
        )
    return tensor.reshape(())


SCALES = (Rule(r"logit_(scale|bias)", r"logit_\1", one_number),)
TIMM_IMAGE = (  # open_clip's TimmModel: the trunk as is, the head's bias-free linear projection
    Rule(r"visual\.trunk\.(.+)", r"visual.trunk.\1"),
    Rule(r"visual\.head\.proj\.weight", "visual.proj.weight"),
)
HF_TEXT = (  # open_clip's HFTextEncoder: the transformers model and its linear projection
    Rule(r"text\.transformer\.(.+)", r"text.encoder.\1"),
    Rule(r"text\.proj\.weight", "text.proj.weight"),
)
BLOCK = r"visual\.transformer\.resblocks\.(\d+)\."
VIT_IMAGE = (  # open_clip's VisionTransformer into a timm VisionTransformer trunk plus clip_train's proj
    Rule(r"visual\.class_embedding", "visual.trunk.cls_token", lambda t: t.reshape(1, 1, -1)),
    Rule(r"visual\.positional_embedding", "visual.trunk.pos_embed", lambda t: t.unsqueeze(0)),
    Rule(r"visual\.conv1\.weight", "visual.trunk.patch_embed.proj.weight"),
    Rule(r"visual\.ln_pre\.(weight|bias)", r"visual.trunk.norm_pre.\1"),
    Rule(BLOCK + r"ln_([12])\.(weight|bias)", r"visual.trunk.blocks.\1.norm\2.\3"),
    Rule(BLOCK + r"attn\.in_proj_(weight|bias)", r"visual.trunk.blocks.\1.attn.qkv.\2"),
    Rule(BLOCK + r"attn\.out_proj\.(weight|bias)", r"visual.trunk.blocks.\1.attn.proj.\2"),
    Rule(BLOCK + r"mlp\.c_fc\.(weight|bias)", r"visual.trunk.blocks.\1.mlp.fc1.\2"),
    Rule(BLOCK + r"mlp\.c_proj\.(weight|bias)", r"visual.trunk.blocks.\1.mlp.fc2.\2"),
    Rule(BLOCK + r"ls_([12])\.gamma", r"visual.trunk.blocks.\1.ls\2.gamma"),
    Rule(r"visual\.ln_post\.(weight|bias)", r"visual.trunk.norm.\1"),
    Rule(r"visual\.proj", "visual.proj.weight", lambda t: t.t()),  # open_clip computes x @ proj
)


def clip_text_rules(layers: int) -> tuple[Rule, ...]:
    """open_clip's CLIP text transformer into a ``CLIPTextModel``: its names at the top of a ``CLIP``,
    under ``text.`` in a ``CustomTextCLIP``."""
    rules = [
        Rule(r"(?:text\.)?" + re.escape(theirs), tuple(f"text.encoder.{name}" for name in ours))
        for theirs, ours in encoder_names(layers).items()
    ]
    return (*rules, Rule(r"(?:text\.)?" + PROJECTION, "text.proj.weight", lambda t: t.t()))


def image_map(model_cfg: dict) -> TowerMap:
    vision = CLIPVisionCfg(**model_cfg["vision_cfg"])
    if vision.timm_model_name:
        return TowerMap(
            TIMM_IMAGE,
            "head layers other than a bias-free linear projection",
            lambda model, cfg: timm_trunk_problem(vision, model_cfg["embed_dim"], model.visual.trunk),
        )
    if isinstance(vision.layers, int):  # a VisionTransformer (a ModifiedResNet has one count per stage)
        if vision.act_kwargs:  # e.g. GELU(approximate="tanh"): another activation under the same name
            return TowerMap(
                (),
                f"open_clip's ViT here has activation arguments {vision.act_kwargs}; clip_train maps a ViT "
                "whose GELU or QuickGELU takes none",
            )
        quick_gelu = model_cfg.get("quick_gelu", False)
        return TowerMap(
            VIT_IMAGE,
            "parts with no timm ViT counterpart",
            lambda model, cfg: vit_problem(vision, quick_gelu, model.visual.trunk, cfg.image.timm),
        )
    return TowerMap((), "open_clip's ModifiedResNet has no timm counterpart")


def text_map(model_cfg: dict) -> TowerMap:
    text = CLIPTextCfg(**model_cfg["text_cfg"])
    if text.hf_model_name:
        return TowerMap(
            HF_TEXT,
            "parts other than the encoder and a linear projection",
            lambda model, cfg: pooling_problem(text, model) or hf_text_problem(text, model),
        )
    if unmapped := text_transformer_differences(text):
        return TowerMap(
            (),
            f"open_clip's text transformer here has {', '.join(unmapped)}; clip_train maps the CLIP text "
            "transformer: causal, pooled at the end token (argmax), a bias-free projection, open_clip's BPE",
        )
    quick_gelu = model_cfg.get("quick_gelu", False)
    return TowerMap(
        clip_text_rules(text.layers),
        "parts with no CLIPTextModel counterpart",
        lambda model, cfg: clip_text_problem(text, quick_gelu, model, cfg),
    )


def text_transformer_differences(text: CLIPTextCfg) -> list[str]:
    """What sets open_clip's text transformer apart from the CLIP one that ``CLIPTextModel`` computes."""
    custom_block = text.block_type == "custom" or any(
        getattr(text, flag)
        for flag in (
            "qk_norm",
            "scaled_cosine_attn",
            "scale_heads",
            "scale_attn_inner",
            "scale_attn",
            "scale_fc",
        )
    )
    differences = {
        f"pool_type={text.pool_type!r}": text.pool_type != "argmax",
        "no causal mask": text.no_causal_mask,
        "a projection bias": text.proj_bias,
        f"proj_type={text.proj_type!r}": text.proj_type != "linear",
        "a class token": text.embed_cls,
        "layer scale": text.ls_init_value is not None,
        "the final LayerNorm after pooling": text.final_ln_after_pool,
        f"activation arguments {text.act_kwargs}": bool(text.act_kwargs),
        "custom attention blocks": custom_block,
        f"its own tokenizer {text.hf_tokenizer_name}": bool(text.hf_tokenizer_name),
        f"tokenizer arguments {text.tokenizer_kwargs}": bool(text.tokenizer_kwargs),
    }
    return [what for what, differs in differences.items() if differs]


def tower_of(key: str) -> str:
    if key.startswith("visual."):
        return "image"
    return "scale" if key.startswith("logit_") else "text"


def to_clip_train(
    state: dict[str, torch.Tensor], maps: dict[str, TowerMap]
) -> dict[str, tuple[str, torch.Tensor]]:
    """clip_train key → (open_clip key, tensor); keys no rule matches are a one-line error by tower."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    leftovers: dict[str, list[str]] = {}
    for key, tensor in state.items():
        tower = tower_of(key)
        if found := renamed(key, tensor, maps[tower].rules):
            out |= {name: (key, part) for name, part in found}
        else:
            leftovers.setdefault(tower, []).append(key)
    if leftovers:
        parts = (
            f"the {tower} tower does not map ({maps[tower].leftover}): {listed(keys)}"
            for tower, keys in leftovers.items()
        )
        raise ModelLoadError("; ".join(parts))
    return out


def renamed(key: str, tensor: torch.Tensor, rules: tuple[Rule, ...]) -> list[tuple[str, torch.Tensor]]:
    """The first rule that matches ``key`` applied to it (a name and tensor per target), or []."""
    for rule in rules:
        if match := re.fullmatch(rule.pattern, key):
            tensor = rule.convert(tensor) if rule.convert else tensor
            targets = (rule.target,) if isinstance(rule.target, str) else rule.target
            parts = tensor.chunk(len(targets)) if len(targets) > 1 else (tensor,)
            return [(match.expand(target), part) for target, part in zip(targets, parts, strict=True)]
    return []


# --------------------------------------------------------------------------------------------
# What shapes do not show
# --------------------------------------------------------------------------------------------


def pooling_problem(text: CLIPTextCfg, model: CLIP) -> str | None:
    """open_clip pools with ``hf_pooler_type``, else the default for the encoder's architecture."""
    pooler = text.hf_pooler_type or arch_dict.get(model.text.encoder.config.model_type, {}).get("pooler")
    if pooler == POOLERS.get(model.text.pooling):
        return None
    ours = {theirs: name for name, theirs in POOLERS.items()}
    fix = (
        f"set model.text.pooling={ours[pooler]}"
        if pooler in ours
        else "clip_train has only " + ", ".join(f"{name} ({theirs})" for name, theirs in POOLERS.items())
    )
    return f"open_clip's text tower pools with {pooler}, the run's with {model.text.pooling}: {fix}"


def clip_text_problem(text: CLIPTextCfg, quick_gelu: bool, model: CLIP, cfg: ModelConfig) -> str | None:
    """Encoder type, pooling, heads, activation and norm epsilon of open_clip's CLIP text transformer
    against the run's text tower; depth, widths, vocabulary and context show in the shapes."""
    if not model.text.causal:
        return (
            f"open_clip's text tower is its CLIP text transformer but the run's is a "
            f"{type(model.text.encoder).__name__}: set model.text.hf_config.model_type=clip_text_model "
            "and model.text.pooling=eot (see configs/model/ViT-B-32.yaml)"
        )
    config = model.text.encoder.config
    theirs = {
        "pooling": "eot",
        "heads": text.heads,
        "activation": "quick_gelu" if quick_gelu else "gelu",
        "norm eps": (text.norm_kwargs or {}).get("eps", 1e-5),  # torch's LayerNorm default
    }
    ours = {
        "pooling": model.text.pooling,
        "heads": config.num_attention_heads,
        "activation": config.hidden_act,
        "norm eps": config.layer_norm_eps,
    }
    differ = [f"{what} {theirs[what]} vs {ours[what]}" for what in theirs if theirs[what] != ours[what]]
    if not differ:
        return None
    return (
        f"open_clip's text transformer and model.text differ (open_clip's vs the run's {', '.join(differ)}): "
        "set model.text.pooling=eot and model.text.hf_config (num_attention_heads, hidden_act: gelu or "
        "quick_gelu, layer_norm_eps) to match, e.g. include model/ViT-B-32-quickgelu.yaml for QuickGELU"
    )


def normalisation_problem(source: Source, model: CLIP) -> str | None:
    """The image mean and std come from the run's timm name, not from the weights: they must agree. A
    bare weights file says nothing of its own, so the check can only assume open_clip's default."""
    theirs, ours = (*source.mean, *source.std), (*model.image_mean, *model.image_std)
    if len(theirs) == len(ours) and torch.allclose(
        torch.tensor(theirs), torch.tensor(ours), rtol=0, atol=1e-6
    ):
        return None
    normalisation = f"mean {source.mean} and std {source.std}"
    if source.bare_file:
        theirs_said = (
            f"{source.weights} is a bare weights file, which carries no preprocessing settings, so the check "
            f"assumes OpenAI's {normalisation}"
        )
        instead = (
            "name the weights by their pretrained tag (open_clip:ARCH/TAG) or as a folder with its "
            "open_clip_config.json (open_clip:local-dir:DIR) instead, or "
        )
    else:
        theirs_said, instead = f"open_clip's model normalises images with {normalisation}", ""
    return (
        f"{theirs_said}, the run's model.image.timm with {model.image_mean} and {model.image_std}: {instead}"
        "pick a timm tag trained with them (e.g. vit_large_patch14_clip_224.laion2b for mean = std = 0.5) "
        "or set model.image.timm_kwargs.pretrained_cfg_overlay={mean: [...], std: [...]}"
    )


def timm_trunk_problem(vision: CLIPVisionCfg, embed_dim: int, trunk: torch.nn.Module) -> str | None:
    """The trunk open_clip's ``TimmModel`` builds (from its timm name, or the folder's config.json for
    an export), on the meta device, against the run's by ``architecture``: what each computes is
    compared (the pooling in effect, not the text of the configs)."""
    name = vision.timm_model_name
    if name.startswith("hf-hub:"):  # read from the cache as the weights are: timm would ask the hub
        name = f"local-dir:{cached_file(name.removeprefix('hf-hub:'), ('config.json',)).parent}"
    with torch.device("meta"):
        theirs = TimmModel(
            name,
            embed_dim,
            image_size=vision.image_size,
            pool=vision.timm_pool,
            proj=vision.timm_proj,
            proj_bias=vision.timm_proj_bias,
        ).trunk
    if problem := architecture_difference(architecture(theirs), architecture(trunk)):
        return (
            f"open_clip's timm trunk {vision.timm_model_name} and the run's model.image differ ({problem}, "
            "open_clip's vs the run's): set model.image.timm and model.image.timm_kwargs as the weights' "
            "model has them"
        )
    return None


ARCHITECTURE_ATTRIBUTES = ("num_heads", "eps", "global_pool", "pool_type", "approximate")
REGULARISERS = (torch.nn.Dropout, DropPath, PatchDropout, torch.nn.Identity)  # Identity: a rate of 0


def architecture(module: torch.nn.Module) -> dict[str, str]:
    """What changes a module tree's output without changing a weight's name or shape, by submodule:
    the type of each one without weights of its own (an activation, a pooling, a block), and its
    heads, norm epsilon and pooling. Regularisers are left out: a fine-tune may set its own."""
    found = {}
    for name, sub in module.named_modules():
        if isinstance(sub, REGULARISERS):
            continue
        attributes = [
            f"{attribute}={value}"
            for attribute in ARCHITECTURE_ATTRIBUTES
            if isinstance(value := getattr(sub, attribute, None), (int, float, str))
        ]
        weightless = next(sub.parameters(recurse=False), None) is None
        found[name or "the trunk"] = " ".join([type(sub).__name__] * weightless + attributes)
    return found


def architecture_difference(theirs: dict[str, str], ours: dict[str, str]) -> str | None:
    """The first submodule whose ``architecture`` differs, named with both descriptions."""
    for name in [*theirs, *(name for name in ours if name not in theirs)]:
        if theirs.get(name) != ours.get(name):
            return f"{name}: {theirs.get(name) or 'absent'} vs {ours.get(name) or 'absent'}"
    return None


HF_ARCHITECTURE = (
    "model_type",
    "num_attention_heads",
    "hidden_act",
    "layer_norm_eps",
    "position_embedding_type",
)


def hf_text_problem(text: CLIPTextCfg, model: CLIP) -> str | None:
    """The transformers config open_clip's ``HFTextEncoder`` builds from (a folder, or the hub cache)
    against the run's encoder, on what changes the embeddings but no shape."""
    folder = Path(text.hf_model_name).expanduser()
    if not folder.is_dir():  # read from the cache as the weights are, never from the hub
        folder = cached_file(text.hf_model_name, ("config.json",)).parent
    theirs, ours = AutoConfig.from_pretrained(str(folder)), model.text.encoder.config
    differ = [
        f"{key} {getattr(theirs, key, None)} vs {getattr(ours, key, None)}"
        for key in HF_ARCHITECTURE
        if getattr(theirs, key, None) != getattr(ours, key, None)
    ]
    if not differ:
        return None
    return (
        f"open_clip's text tower {text.hf_model_name} and the run's model.text differ (open_clip's vs the "
        f"run's {', '.join(differ)}): set model.text.hf or model.text.hf_config to match"
    )


def vit_problem(
    vision: CLIPVisionCfg, quick_gelu: bool, trunk: torch.nn.Module, timm_name: str
) -> str | None:
    """Heads, activation, pooling, the final norm's place and norm epsilon of open_clip's ViT against the
    run's timm ViT."""
    if not isinstance(trunk, VisionTransformer):
        return (
            f"open_clip's image tower is a ViT but model.image.timm={timm_name} is a {type(trunk).__name__}: "
            "pick a timm CLIP ViT such as vit_base_patch32_clip_224 (model.image.timm_kwargs for its size)"
        )
    block = trunk.blocks[0]
    theirs = {
        "heads": vision.width // vision.head_width,
        "activation": "QuickGELU" if quick_gelu else "GELU",
        "pooling": vision.pool_type,
        # the same for the class token alone; for an average, normalising first gives another one
        "final norm": (
            "after pooling" if vision.final_ln_after_pool and vision.pool_type != "tok" else "before"
        ),
        "norm eps": (vision.norm_kwargs or {}).get("eps", 1e-5),  # torch's LayerNorm default
    }
    ours = {
        "heads": block.attn.num_heads,
        "activation": "QuickGELU" if isinstance(block.mlp.act, QuickGELU) else type(block.mlp.act).__name__,
        "pooling": {"token": "tok"}.get(trunk.global_pool, trunk.global_pool),
        "final norm": "before" if isinstance(trunk.fc_norm, torch.nn.Identity) else "after pooling",
        "norm eps": block.norm1.eps,
    }
    differ = [f"{what} {theirs[what]} vs {ours[what]}" for what in theirs if theirs[what] != ours[what]]
    if not differ:
        return None
    return (
        f"open_clip's ViT and model.image.timm={timm_name} differ (open_clip's vs the run's "
        f"{', '.join(differ)}): use a timm CLIP ViT (e.g. vit_base_patch32_clip_224, *_clip_quickgelu_* "
        "for QuickGELU) and set model.image.timm_kwargs (num_heads, global_pool=token) to match"
    )


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def fitted(weights: dict[str, tuple[str, torch.Tensor]], model: CLIP) -> dict[str, torch.Tensor]:
    """The weights to load: every parameter and buffer the model saves, each of its shape. Buffers the
    model recomputes rather than saves (``position_ids`` of older transformers) are dropped."""
    own = model.state_dict()
    recomputed = {name for name, _ in model.named_buffers()} - own.keys()
    weights = {key: entry for key, entry in weights.items() if key not in recomputed}
    if problem := keys_problem(weights.keys(), own.keys()) or shape_problem(weights, own):
        raise ModelLoadError(problem)
    return {key: tensor for key, (_, tensor) in weights.items()}


def keys_problem(theirs: Iterable[str], ours: Iterable[str]) -> str | None:
    missing = [key for key in ours if key not in theirs and key not in KEPT_IF_ABSENT]
    unexpected = [key for key in theirs if key not in ours]
    found = [
        f"{what} {listed(keys)}" for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys
    ]
    return "the open_clip weights do not fit the model: " + "; ".join(found) if found else None


def shape_problem(weights: dict[str, tuple[str, torch.Tensor]], own: dict[str, torch.Tensor]) -> str | None:
    """The first key, in the model's order, whose shape differs."""
    for key, tensor in own.items():
        if key in weights and weights[key][1].shape != tensor.shape:
            origin, theirs = weights[key]
            fix = "make the model config match the open_clip model"
            if key == TEXT_POSITIONS:
                rows = theirs.shape[0]
                fix = f"set model.text.hf_config.max_position_embeddings={rows} (open_clip's context_length)"
            shapes = f"{tuple(theirs.shape)} in the weights but {tuple(tensor.shape)} in the model"
            return f"{key} (open_clip's {origin}) is {shapes}: {fix}"
    return None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_state_dict(str(path))
    except Exception as err:  # torch.load / safetensors raise many types for a bad file
        raise ModelLoadError(f"{path}: not a readable state dict: {err}") from None


def tower_maps(model_cfg: dict) -> dict[str, TowerMap]:
    try:
        image, text = image_map(model_cfg), text_map(model_cfg)
    except TypeError as err:  # a config key this open_clip version does not know
        raise ModelLoadError(f"not an open_clip {open_clip.__version__} model config: {err}") from None
    return {"image": image, "text": text, "scale": TowerMap(SCALES, "only logit_scale and logit_bias map")}


def check_open_clip(spec: str) -> None:
    """At start-up, before the model is built: the files exist and no tower is one that never maps."""
    for tower, tower_map in tower_maps(resolve(spec).model_cfg).items():
        if not tower_map.rules:
            raise ModelLoadError(f"the {tower} tower does not map ({tower_map.leftover})")


def load_open_clip(spec: str, model: CLIP, cfg: ModelConfig, adapt: Adapt | None = None) -> None:
    """Replace every weight of ``model`` with the open_clip model's; a one-line ``ModelLoadError`` names
    what does not map, the config difference or the first key whose shape differs. ``adapt`` may
    replace the mapped tensors before their shapes are checked."""
    source = resolve(spec)
    maps = tower_maps(source.model_cfg)
    weights = to_clip_train(read_weights(source.weights), maps)
    if adapt is not None:
        tensors = {key: tensor for key, (_, tensor) in weights.items()}
        adapt(tensors)
        weights = {key: (origin, tensors[key]) for key, (origin, _) in weights.items()}
    for tower in maps.values():
        if tower.problem and (problem := tower.problem(model, cfg)):
            raise ModelLoadError(problem)
    if problem := normalisation_problem(source, model):
        raise ModelLoadError(problem)
    model.load_state_dict(fitted(weights, model), strict=False)  # strict=False: the kept logit_bias
