"""The two-tower CLIP model: a timm image tower and a transformers text tower in one embedding space."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from clip_train.config import ConfigError, ModelConfig
from clip_train.model.freezing import LockableTower
from clip_train.model.hub import ModelLoadError
from clip_train.model.image import ImageTower, build_image_tower
from clip_train.model.text import TextTower, build_text_tower
from clip_train.model.tokenizer import HFTokenizer, OpenCLIPTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "CLIP",
    "HFTokenizer",
    "ImageTower",
    "LockableTower",
    "ModelLoadError",
    "OpenCLIPTokenizer",
    "TextTower",
    "build_model",
    "build_tokenizer",
]


class CLIP(nn.Module):
    """Image and text towers plus the learnable log logit scale (the loss takes ``logit_scale.exp()``)
    and, for the sigmoid loss, a learnable logit bias (``None`` otherwise)."""

    def __init__(
        self,
        visual: ImageTower,
        text: TextTower,
        tokenizer: Tokenizer,
        init_logit_scale: float,
        init_logit_bias: float | None = None,
    ):
        super().__init__()
        self.visual = visual
        self.text = text
        self.tokenizer = tokenizer
        self.logit_scale = nn.Parameter(torch.tensor(float(init_logit_scale)))
        bias = None if init_logit_bias is None else nn.Parameter(torch.tensor(float(init_logit_bias)))
        self.register_parameter("logit_bias", bias)

    @property
    def image_size(self) -> int:
        return self.visual.image_size

    @property
    def image_mean(self) -> tuple[float, ...]:
        return self.visual.image_mean

    @property
    def image_std(self) -> tuple[float, ...]:
        return self.visual.image_std

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW (normalised here) or normalised float images → L2-normalised (n, embed_dim)."""
        return self.visual(images)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.text(input_ids, attention_mask)

    def forward(
        self, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Image features, text features and the logit scale as a multiplier."""
        return self.encode_image(images), self.encode_text(input_ids, attention_mask), self.logit_scale.exp()

    def named_trainable_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """What the optimizer gets: LiT-frozen parameters never reach it."""
        return ((name, p) for name, p in self.named_parameters() if p.requires_grad)

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_trainable_parameters())


def build_model(model_cfg: ModelConfig, *, load_pretrained: bool = True, on_meta: bool = False) -> CLIP:
    """Build both towers and the tokenizer; missing weights raise ``ModelLoadError`` with a fix.

    ``load_pretrained=False`` builds the architectures without loading the towers' pretrained
    weights, for a full checkpoint that replaces every weight anyway (eval, ``load``, ``init_from``).
    ``on_meta`` builds every tensor on the meta device (shapes only, nothing loaded), for an FSDP
    rank that receives its shards of rank 0's weights.
    """
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        return _build_model(model_cfg, load_pretrained=load_pretrained and not on_meta)


def _build_model(model_cfg: ModelConfig, *, load_pretrained: bool) -> CLIP:
    text_cfg = model_cfg.text
    key = "model.text.tokenizer" if text_cfg.tokenizer else "model.text.hf"
    tokenizer = build_tokenizer(text_cfg.tokenizer or text_cfg.hf, text_cfg.context_length, key)
    text = build_text_tower(
        text_cfg, model_cfg.embed_dim, vocab_size=tokenizer.vocab_size, load_pretrained=load_pretrained
    )
    rows = text.encoder.get_input_embeddings().num_embeddings
    if rows < tokenizer.vocab_size:
        raise ConfigError(
            f"the text encoder has {rows} token embeddings but the tokenizer has {tokenizer.vocab_size} "
            f"tokens; set model.text.hf_config.vocab_size={tokenizer.vocab_size} or pick a matching tokenizer"
        )
    max_positions = getattr(text.encoder.config, "max_position_embeddings", None)
    # RoBERTa's family numbers positions from its padding id + 1 (2), not 0
    padding = getattr(getattr(text.encoder, "embeddings", None), "padding_idx", None)
    first = 0 if padding is None else padding + 1
    if max_positions is not None and text_cfg.context_length > max_positions - first:
        offset = f" less the {first} its positions start at (RoBERTa's padding offset)" if first else ""
        raise ConfigError(
            f"model.text.context_length={text_cfg.context_length} exceeds the encoder's "
            f"max_position_embeddings={max_positions}{offset}"
        )
    visual = build_image_tower(model_cfg.image, model_cfg.embed_dim, load_pretrained=load_pretrained)
    return CLIP(visual, text, tokenizer, model_cfg.init_logit_scale, model_cfg.init_logit_bias)
