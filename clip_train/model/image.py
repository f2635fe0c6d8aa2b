"""Image tower: any timm backbone (pooled features) plus a linear projection, with LiT locking."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from timm.data import resolve_model_data_config
from timm.layers import resample_abs_pos_embed
from timm.models import checkpoint_seq
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clip_train.config import ConfigError, ImageTowerConfig
from clip_train.errors import refusal
from clip_train.model.freezing import LockableTower, init_projection
from clip_train.model.hub import ModelLoadError, download_hint

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # timm's hub file names, first found wins


class ImageTower(LockableTower):
    """timm trunk → projection → L2 norm; uint8 images are normalised here, on the model's device.

    ``encode_frozen`` returns the normalised pixels when unlocked, the pooled features when locked, and
    the tokens after the first depth−N blocks when locked with ``unlocked_layers=N`` (ViT only).
    """

    def __init__(self, trunk: nn.Module, embed_dim: int, cfg: ImageTowerConfig) -> None:
        super().__init__()
        data_cfg = resolve_model_data_config(trunk)
        # timm's data config reports the pretrained resolution; a ViT built with img_size=… knows better
        fixed_size = getattr(getattr(trunk, "patch_embed", None), "img_size", None)
        self.image_size: int = int(fixed_size[-1] if fixed_size else data_cfg["input_size"][-1])
        self.image_mean: tuple[float, ...] = tuple(data_cfg["mean"])
        self.image_std: tuple[float, ...] = tuple(data_cfg["std"])
        self.register_buffer("pixel_mean", torch.tensor(self.image_mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(self.image_std).view(1, -1, 1, 1), persistent=False)
        self.trunk = trunk
        # Stochastic depth as configured (None: the architecture's default): an export hands it on.
        self.drop_path_rate: float | None = cfg.timm_kwargs.get("drop_path_rate")
        self.proj = init_projection(trunk.num_features, embed_dim)
        self.lock(cfg, "model.image")

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW → float normalised on the pixel statistics' device, in their dtype (the weights'
        master dtype), then handed on in ``input_dtype``; float input is taken as normalised. Not
        from the weights themselves: FSDP moves a sharded root's weights to the host
        (``cpu_offload``) and swaps them for bf16 copies while gathered, which would make a chunk's
        inputs depend on when it was prepared (Gradient Cache replays them)."""
        mean, std = self.pixel_mean, self.pixel_std
        if images.ndim != 4 or images.shape[1] != mean.shape[1]:
            raise ValueError(
                f"images must be NCHW with {mean.shape[1]} channels, got shape {tuple(images.shape)}"
            )
        images = images.to(mean.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = (images.to(mean.dtype) / 255 - mean) / std
        elif not images.is_floating_point():
            raise ValueError(f"images must be uint8 or already normalised floats, got {images.dtype}")
        return images.to(self.input_dtype or mean.dtype)

    def encode_frozen(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.prepare(images)
        if not self.locked:
            return (x,)
        if not self.unlocked_layers:
            return (self.trunk(x),)
        trunk = self.trunk
        x = trunk.norm_pre(trunk.patch_drop(trunk._pos_embed(trunk.patch_embed(x))))
        return (trunk.blocks[: len(trunk.blocks) - self.unlocked_layers](x),)

    def _unlocked_modules(self) -> list[nn.Module]:
        trunk, unlocked = self.trunk, self.unlocked_layers
        if not isinstance(trunk, VisionTransformer):
            raise ConfigError(
                f"model.image.unlocked_layers={unlocked} needs a timm VisionTransformer, got "
                f"{type(trunk).__name__}; use unlocked_layers=0 to lock the whole trunk"
            )
        depth = len(trunk.blocks)
        if unlocked > depth:
            raise ConfigError(f"model.image.unlocked_layers={unlocked} exceeds the trunk's {depth} blocks")
        pooling = [trunk.norm, trunk.fc_norm, trunk.head_drop, trunk.head, trunk.attn_pool]
        return [*trunk.blocks[depth - unlocked :], *(m for m in pooling if m is not None)]

    def encode_trainable(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.locked:
            pooled = self.trunk(hidden)
        elif not self.unlocked_layers:
            pooled = hidden
        else:
            trunk = self.trunk
            blocks = trunk.blocks[len(trunk.blocks) - self.unlocked_layers :]
            if trunk.grad_checkpointing and torch.is_grad_enabled():
                hidden = checkpoint_seq(blocks, hidden, use_reentrant=False)
            else:
                hidden = blocks(hidden)
            pooled = trunk.forward_head(trunk.norm(hidden))
        return F.normalize(self.proj(pooled), dim=-1)


def resampled_position_embedding(tower: ImageTower, embedding: torch.Tensor) -> torch.Tensor | None:
    """A ViT's learned position embedding from another patch grid (weights trained at another image
    size), resampled bicubically to this tower's grid, as timm and OpenCLIP do to fine-tune at a new
    resolution; the class token's entry is kept. None when there is nothing to resample (the same
    shape, not a ViT, another width, not a square grid): loading then names any mismatch."""
    trunk = tower.trunk
    if not isinstance(trunk, VisionTransformer) or embedding.shape == trunk.pos_embed.shape:
        return None
    prefix = 0 if trunk.no_embed_class else trunk.num_prefix_tokens
    if embedding.ndim != 3 or embedding.shape[2] != trunk.pos_embed.shape[2]:
        return None
    patches = embedding.shape[1] - prefix
    side = math.isqrt(max(patches, 0))
    if patches <= 0 or side * side != patches:
        return None
    grid = list(trunk.patch_embed.grid_size)
    return resample_abs_pos_embed(embedding, grid, [side, side], num_prefix_tokens=prefix)


def build_image_tower(cfg: ImageTowerConfig, embed_dim: int, *, load_pretrained: bool = True) -> ImageTower:
    """The timm model without its classifier (``num_classes=0``: pooled features out) as a tower.

    ``load_pretrained=False`` skips ``model.image.pretrained``: a checkpoint supplies the weights.
    """
    if not timm.is_model(cfg.timm):
        raise ConfigError(f"model.image.timm={cfg.timm!r} is not a timm model name (see timm.list_models())")
    hub = load_pretrained and cfg.pretrained == "hub"
    try:
        trunk = timm.create_model(cfg.timm, pretrained=hub, **cfg.timm_kwargs, num_classes=0)
    except (TypeError, ValueError, AssertionError, ArithmeticError) as err:  # a keyword or value timm refuses
        raise ConfigError(f"model.image.timm_kwargs={cfg.timm_kwargs}: {refusal(err)}") from None
    except OSError:  # huggingface_hub's "not in the local cache" errors are OSErrors
        hub_id = timm.models.get_pretrained_cfg(cfg.timm).hf_hub_id or cfg.timm
        raise ModelLoadError(
            f"model.image.pretrained=hub: weights for {cfg.timm!r} are not in the local cache and the hub "
            f"is unreachable; {download_hint(hub_id, 'model.image.pretrained')}"
        ) from None
    except RuntimeError as err:  # e.g. no pretrained weights exist for this name
        if not hub:
            raise
        raise ModelLoadError(f"model.image.pretrained=hub: {err}") from None
    patches = getattr(getattr(trunk, "patch_embed", None), "grid_size", None)
    if patches is not None and min(patches) < 1:  # timm builds it; its first forward would fail
        raise ConfigError(
            f"model.image.timm_kwargs={cfg.timm_kwargs}: {_px(trunk.patch_embed.img_size)} images hold no "
            f"{_px(trunk.patch_embed.patch_size)} patch; raise img_size or lower patch_size"
        )
    if load_pretrained and cfg.pretrained not in ("", "hub"):
        load_local_weights(trunk, cfg.pretrained)
    if cfg.grad_checkpointing:
        trunk.set_grad_checkpointing(True)
    return ImageTower(trunk, embed_dim, cfg)


def _px(size: tuple[int, int]) -> str:
    return "x".join(map(str, size)) + " px"


def local_weights_file(source: str) -> Path:
    """The state-dict file ``model.image.pretrained`` names: the file, or a ``_WEIGHT_FILES`` in the dir."""
    key, path = "model.image.pretrained", Path(source).expanduser()
    if path.is_dir():
        found = [path / name for name in _WEIGHT_FILES if (path / name).is_file()]
        if not found:
            raise ModelLoadError(f"{key}={source!r}: the directory holds none of {', '.join(_WEIGHT_FILES)}")
        return found[0]
    if not path.is_file():
        raise ModelLoadError(f"{key}={source!r}: no such file or directory")
    return path


def load_local_weights(trunk: nn.Module, source: str) -> None:
    """Load ``local_weights_file(source)`` strictly, minus the classifier. The architecture's own
    ``checkpoint_filter_fn`` adapts foreign layouts and resamples position embeddings to the image size.
    """
    key = "model.image.pretrained"
    path = local_weights_file(source)
    try:
        state_dict = timm.models.load_state_dict(str(path), weights_only=True)  # timm < 1.0.26: False
    except Exception as err:  # torch.load / safetensors raise many types for a bad file
        raise ModelLoadError(f"{key}={source!r}: not a readable state dict: {err}") from None
    filter_fn = getattr(sys.modules[type(trunk).__module__], "checkpoint_filter_fn", None)
    if filter_fn is not None:
        state_dict = filter_fn(state_dict, trunk)
    own = trunk.state_dict()
    classifier = trunk.pretrained_cfg.get("classifier") or ()  # a name or a tuple of names
    heads = {name.split(".")[0] for name in ((classifier,) if isinstance(classifier, str) else classifier)}
    state_dict = {k: v for k, v in state_dict.items() if k in own or k.split(".")[0] not in heads}
    try:
        missing, unexpected = trunk.load_state_dict(state_dict, strict=False)
    except RuntimeError as err:  # shape mismatches
        reason = " ".join(str(err).split())
        raise ModelLoadError(f"{key}={source!r} does not fit {type(trunk).__name__}: {reason}") from None
    if missing or unexpected:
        raise ModelLoadError(
            f"{key}={source!r} does not fit {type(trunk).__name__}: {len(missing)} missing keys "
            f"{missing[:3]}, {len(unexpected)} unexpected keys {unexpected[:3]}"
        )
