"""The open_clip export: a folder (or hub repo) that ``open_clip.create_model_and_transforms``
loads as a ``CustomTextCLIP`` giving clip_train's embeddings, which the export checks before it keeps.

It holds ``open_clip_config.json`` (model and preprocessing), ``open_clip_model.safetensors``, one
``config.json`` that serves both towers (timm reads its ``architecture``/``model_args``, transformers
the encoder keys), a transformers tokenizer's files, a model card and the ``.clip_train_export``
marker: an export replaces only an empty folder or an earlier export, never a folder of the user's.
open_clip resolves the tower names relative to the working directory, so a folder export names
itself by its absolute path.
A transformers text tower becomes open_clip's ``HFTextEncoder``; CLIP's text transformer
(``CLIPTextModel``, end-token pooling) becomes open_clip's own ``TextTransformer``. For the first,
open_clip masks every token equal to the pad id, clip_train everything after the end token: with
the bundled BPE, whose pad id 0 is also "!" before some punctuation ("!("), such captions differ.
The second masks nothing but the future in both.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import open_clip
import torch
from huggingface_hub import CommitOperationAdd, HfApi, RepoUrl
from huggingface_hub.errors import HfHubHTTPError
from open_clip.constants import HF_CONFIG_NAME, HF_SAFE_WEIGHTS_NAME
from open_clip.hf_configs import arch_dict
from open_clip.push_to_hf_hub import generate_readme
from timm.layers import PatchDropout
from timm.models._hub import save_config_for_hf  # timm's own writer; timm.models does not re-export it

from clip_train.checkpoint import WRITE_ERRORS, replace_folder, save_weights, write_failure
from clip_train.errors import UserError
from clip_train.eval.encode import inference
from clip_train.model import CLIP, HFTokenizer
from clip_train.model.clip_text_names import PROJECTION, encoder_names, open_clip_text_cfg
from clip_train.model.text import POOLERS

FORMATS = ("open_clip",)
TOWERS_CONFIG = "config.json"
MODEL_CARD = "README.md"
MARKER = ".clip_train_export"  # in every export: a folder that a later export may replace
RENAMES = (("visual.proj.", "visual.head.proj."), ("text.encoder.", "text.transformer."))  # ours, open_clip's
VERIFY_TOLERANCE = 1e-4  # largest |difference| of unit-norm embeddings the export may show
PROBE_CAPTIONS = ["a photo of a dog", "A handwritten digit seven,  on paper!", "zero " * 40]
T = TypeVar("T")


class ExportError(UserError):
    """The model cannot be written in the asked format, or the copy does not reproduce it."""


@dataclass(frozen=True)
class Location:
    """How the libraries name an export: a local folder or a Hugging Face Hub repo."""

    name: str  # for open_clip (create_model_and_transforms, get_tokenizer) and timm.create_model
    hf_name: str  # for transformers' from_pretrained

    @classmethod
    def folder(cls, path: Path) -> Location:
        return cls(f"local-dir:{path}", str(path))

    @classmethod
    def hub(cls, repo: str) -> Location:
        return cls(f"hf-hub:{repo}", repo)


def check_expressible(model: CLIP) -> None:
    """One-line ``ExportError`` naming the config key for what open_clip's towers cannot build."""
    encoder = model.text.encoder.config
    if model.text.causal:
        if model.text.pooling != "eot":
            raise ExportError(
                f"model.text.pooling={model.text.pooling}: open_clip pools its text transformer at the "
                "end token (eot)"
            )
        if encoder.hidden_act not in ("gelu", "quick_gelu"):
            raise ExportError(
                f"model.text.hf_config.hidden_act={encoder.hidden_act}: open_clip's text transformer "
                "has gelu or quick_gelu"
            )
        return
    if model.text.pooling not in POOLERS:
        raise ExportError(
            f"model.text.pooling={model.text.pooling}: open_clip pools a transformers encoder with "
            + ", ".join(f"{name} ({theirs})" for name, theirs in POOLERS.items())
        )
    if encoder.model_type not in arch_dict:
        raise ExportError(
            f"model.text.hf: open_clip's text tower supports {', '.join(sorted(arch_dict))} encoders, "
            f"not {encoder.model_type}"
        )
    pad = model.tokenizer.pad_token_id
    if pad != encoder.pad_token_id:
        raise ExportError(
            f"model.text.tokenizer pads with id {pad} but the encoder's pad_token_id is "
            f"{encoder.pad_token_id}, from which open_clip derives the attention mask"
        )
    tokens = model.tokenizer(PROBE_CAPTIONS[:1])
    if (tokens["input_ids"][tokens["attention_mask"].bool()] == pad).any():
        raise ExportError(
            f"model.text.tokenizer: its pad id {pad} also stands for a token of every caption (e.g. the "
            "end token), which open_clip would mask as padding"
        )


def open_clip_config(model: CLIP, at: Location) -> dict:
    """``open_clip_config.json``: the model and preprocessing, the towers named by ``at``."""
    if model.text.causal:
        text_cfg = open_clip_text_cfg(model.text.encoder.config, model.tokenizer.context_length)
    else:
        text_cfg = {
            "hf_model_name": at.hf_name,
            "hf_pooler_type": POOLERS[model.text.pooling],
            "hf_proj_type": "linear",
            "context_length": model.tokenizer.context_length,
        }
    if isinstance(model.tokenizer, HFTokenizer):
        text_cfg["hf_tokenizer_name"] = at.hf_name
    vision_cfg = {
        "timm_model_name": at.name,
        "timm_pool": "",
        "timm_proj": "linear",
        "timm_proj_bias": False,
        "image_size": model.image_size,
    }
    if model.visual.drop_path_rate is not None:  # training the export in OpenCLIP regularises alike
        vision_cfg["timm_drop_path"] = model.visual.drop_path_rate
    patch_drop = getattr(model.visual.trunk, "patch_drop", None)  # a timm ViT's, when its rate is > 0
    if isinstance(patch_drop, PatchDropout):  # and drops patches alike (open_clip hands it to timm)
        vision_cfg["patch_dropout"] = patch_drop.prob
    preprocess = {
        "mean": list(model.image_mean),
        "std": list(model.image_std),
        "interpolation": "bicubic",
        "resize_mode": "shortest",
    }
    model_cfg = {"embed_dim": model.text.proj.out_features, "vision_cfg": vision_cfg, "text_cfg": text_cfg}
    if model.text.causal:  # CustomTextCLIP (text weights under text.); QuickGELU is a model-level flag
        model_cfg |= {"custom_text": True, "quick_gelu": model.text.encoder.config.hidden_act == "quick_gelu"}
    if model.logit_bias is not None:  # a sigmoid-loss (SigLIP) model: open_clip builds the parameter
        model_cfg["init_logit_bias"] = model.logit_bias.item()
    return {"model_cfg": model_cfg, "preprocess_cfg": preprocess}


def open_clip_weights(model: CLIP) -> dict[str, torch.Tensor]:
    """The state dict under open_clip's names (``CustomTextCLIP`` with ``TimmModel`` and ``HFTextEncoder``
    or ``TextTransformer``)."""
    state = model.state_dict()
    if model.text.causal:
        text = {name: tensor for name, tensor in state.items() if name.startswith("text.")}
        state = {name: tensor for name, tensor in state.items() if name not in text}
        state |= clip_text_weights(
            text, model.text.encoder.config.num_hidden_layers, model.tokenizer.context_length
        )
    weights = {}
    for name, tensor in state.items():
        for ours, theirs in RENAMES:  # disjoint prefixes: at most one applies
            if name.startswith(ours):
                name = theirs + name.removeprefix(ours)
        weights[name] = tensor.contiguous().cpu()
    return weights


def clip_text_weights(
    text: dict[str, torch.Tensor], layers: int, context_length: int
) -> dict[str, torch.Tensor]:
    """CLIP's text tower under the names of open_clip's ``TextTransformer`` (q, k, v stacked in_proj),
    with the positions the run's captions use: open_clip then tokenizes to the run's length."""
    weights = {
        f"text.{theirs}": torch.cat([text[f"text.encoder.{name}"] for name in ours])
        for theirs, ours in encoder_names(layers).items()
    }
    weights["text.positional_embedding"] = weights["text.positional_embedding"][:context_length]
    return weights | {f"text.{PROJECTION}": text["text.proj.weight"].t()}


def write_towers_config(model: CLIP, path: Path) -> None:
    """One ``config.json`` for both towers: timm's export of the trunk merged with the encoder's config
    (which open_clip's own text transformer does not read)."""
    try:
        save_config_for_hf(model.visual.trunk, path)
    except ValueError as err:
        raise ExportError(f"model.image.timm_kwargs: {err}") from None
    image = json.loads(path.read_text())
    text = model.text.encoder.config.to_dict() | {"dtype": "float32"}  # open_clip builds it from config
    path.write_text(json.dumps(text | image, indent=2))


def model_card(model: CLIP, at: Location) -> str:
    """A Hugging Face model card (open_clip's generator): the towers and how to load the export."""
    usage = (
        "```python\nimport open_clip\n\n"
        f'model, _, preprocess = open_clip.create_model_and_transforms("{at.name}")\n'
        f'tokenizer = open_clip.get_tokenizer("{at.name}")\n```\n'
    )
    details = {
        "Trained with": "clip_train",
        "Image tower": f"timm {model.visual.trunk.pretrained_cfg['architecture']}, {model.image_size} px",
        "Text tower": f"transformers {model.text.encoder.config.model_type}, {model.text.pooling} pooling",
        "Embedding dimension": model.text.proj.out_features,
    }
    card = {"license": "other", "tags": ["clip", "clip_train"], "details": details, "usage": usage}
    return generate_readme(card, at.name.split("/")[-1])


def location_files(model: CLIP, at: Location) -> dict[str, bytes]:
    """The files whose content depends on where the export lives."""
    return {
        HF_CONFIG_NAME: json.dumps(open_clip_config(model, at), indent=2).encode(),
        MODEL_CARD: model_card(model, at).encode(),
    }


def check_target(out: Path) -> None:
    """One-line ``ExportError``, before anything is written, unless ``out`` is absent, an empty
    folder or an earlier export (which holds the marker): what is there is replaced."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file; give a folder to export into")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ExportError(
            f"{out} holds files and is not an earlier export (it has no {MARKER}); pick a new or empty folder"
        )
    blocking = next(p for p in out.parents if p.exists())  # exists() is False below a file
    if not blocking.is_dir():
        raise ExportError(f"cannot export to {out}: {blocking} is a file, not a folder")


def write_export(model: CLIP, out: Path, check: Callable[[Path], T]) -> T:
    """Write the export into a temporary sibling of ``out``, ``check`` it there and swap it into
    place: a failed write (a full disk) is one line, and neither it nor a failed check leaves a
    temporary folder or touches what was at ``out``. Returns what ``check`` returns."""
    check_target(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    earlier = out.is_dir() and any(out.iterdir())
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_export_files(model, tmp, Location.folder(tmp))
        checked = check(tmp)
        for name, content in location_files(model, Location.folder(out)).items():  # now naming ``out``
            (tmp / name).write_bytes(content)
        replace_folder(tmp, out, aside=out.with_name(f".{out.name}.old-{os.getpid()}"))
    except WRITE_ERRORS as err:
        kept = "the earlier export there is unchanged" if earlier else "nothing was written there"
        raise ExportError(f"cannot export to {out}: {write_failure(err)}; {kept}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once swapped into place
    return checked


def write_export_files(model: CLIP, folder: Path, at: Location) -> None:
    """Every file of the export, into ``folder``, naming itself ``at``."""
    (folder / MARKER).write_text(
        "written by clip-train export, which replaces this folder when exporting into it\n"
    )
    save_weights(open_clip_weights(model), folder / HF_SAFE_WEIGHTS_NAME)
    write_towers_config(model, folder / TOWERS_CONFIG)
    model.tokenizer.save_pretrained(folder)
    for name, content in location_files(model, at).items():
        (folder / name).write_bytes(content)


def verify(model: CLIP, at: Location) -> tuple[float, float]:
    """Largest |difference| between open_clip's image and text embeddings and clip_train's, both in
    eval mode (a training model is compared without its dropout, then handed back training)."""
    theirs, _, _ = open_clip.create_model_and_transforms(at.name)
    tokenizer = open_clip.get_tokenizer(at.name)
    theirs.eval()
    size = model.image_size
    images = torch.randint(
        0, 256, (4, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    with inference(model, model.logit_scale.device, "fp32"):
        image = model.encode_image(images) - theirs.encode_image(model.visual.prepare(images), normalize=True)
        tokens = model.tokenizer(PROBE_CAPTIONS)
        text = model.encode_text(tokens["input_ids"], attention_mask=tokens["attention_mask"])
        text -= theirs.encode_text(tokenizer(PROBE_CAPTIONS), normalize=True)
    return float(image.abs().max()), float(text.abs().max())


def hub_files(model: CLIP, out: Path, repo: str) -> dict[str, Path | bytes]:
    """What ``--push-to-hub`` uploads: the export's files, with names that point at ``repo``."""
    renamed = location_files(model, Location.hub(repo))
    not_copied = {*renamed, MARKER}
    files: dict[str, Path | bytes] = {f.name: f for f in sorted(out.iterdir()) if f.name not in not_copied}
    return files | renamed


def push_to_hub(model: CLIP, out: Path, repo: str, *, private: bool) -> RepoUrl:
    """Upload to the Hugging Face Hub (a README already there is kept); returns the repo's URL."""
    # OSError covers offline mode and HTTP errors; the bases add the HTTP client's own network errors
    unreachable = (OSError, *HfHubHTTPError.__bases__)
    api = HfApi()
    try:
        url = api.create_repo(repo, private=private, exist_ok=True)
        keep_card = api.file_exists(url.repo_id, MODEL_CARD)
        files = hub_files(model, out, url.repo_id)
        operations = [
            CommitOperationAdd(name, content if isinstance(content, bytes) else str(content))
            for name, content in files.items()
            if not (keep_card and name == MODEL_CARD)
        ]
        api.create_commit(url.repo_id, operations, commit_message="Export from clip_train")
    except unreachable as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ExportError(
            f"--push-to-hub {repo}: {reason}; the export in {out} is complete, rerun with --push-to-hub "
            "when the hub is reachable"
        ) from None
    return url


def export_open_clip(model: CLIP, out: Path) -> tuple[float, float]:
    """Write ``out`` once open_clip reproduces the model from it: the largest |difference| of its
    image and text embeddings. An export that does not match is not written, with a one-line error."""
    check_expressible(model)

    def reproduced(staged: Path) -> tuple[float, float]:
        image, text = verify(model, Location.folder(staged))
        if max(image, text) > VERIFY_TOLERANCE:
            tower = "model.image.timm" if image > VERIFY_TOLERANCE else "model.text.hf"
            raise ExportError(
                f"{tower}: open_clip's copy differs from the model by up to {max(image, text):.1e} "
                f"(image {image:.1e}, text {text:.1e}); this tower cannot be exported exactly"
            )
        return image, text

    return write_export(model, out, reproduced)
