"""Text tower: a transformers encoder (BERT family first), CLS or mean pooling, linear projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedConfig, PreTrainedModel
from transformers.masking_utils import create_bidirectional_mask

from clip_train.config import ConfigError, TextTowerConfig
from clip_train.model.freezing import LockableTower, init_projection
from clip_train.model.hub import load_hf

ATTN_IMPLEMENTATION = "sdpa"


class TextTower(LockableTower):
    """HF encoder → pooling → projection → L2 norm.

    Split points: unlocked, ``encode_frozen`` only moves ids and mask to the device; locked with
    ``unlocked_layers=0`` it returns the pooled (n, width) features; locked with
    ``unlocked_layers=N`` (BERT-style: ``embeddings`` + ``encoder.layer``) it returns the hidden
    states after the first L−N layers together with the 2-D attention mask.
    """

    def __init__(
        self,
        encoder: PreTrainedModel,
        embed_dim: int,
        *,
        pooling: str = "cls",
        lock: bool = False,
        unlocked_layers: int = 0,
        lock_head: bool = False,
    ) -> None:
        super().__init__()
        if pooling not in ("cls", "mean"):
            raise ConfigError(f"model.text.pooling={pooling!r} must be cls or mean")
        if getattr(encoder, "pooler", None) is not None:
            encoder.pooler = None  # BERT's NSP pooler is unused here; DDP rejects unused parameters
        self.encoder = encoder
        self.pooling = pooling
        self.proj = init_projection(encoder.config.hidden_size, embed_dim)
        self.unlocked_layers = unlocked_layers
        if lock:
            self.lock(self._trainable_modules([] if lock_head else [self.proj]))

    @property
    def layers(self) -> nn.ModuleList:
        return self.encoder.encoder.layer

    @property
    def _split_layers(self) -> bool:
        return self.locked and self.unlocked_layers > 0

    def _trainable_modules(self, head: list[nn.Module]) -> list[nn.Module]:
        if self.unlocked_layers == 0:
            return head
        stack = getattr(self.encoder, "encoder", None)
        if not (hasattr(self.encoder, "embeddings") and hasattr(stack, "layer")):
            raise ConfigError(
                f"model.text.unlocked_layers={self.unlocked_layers} needs a BERT-style encoder "
                f"(embeddings + encoder.layer), got {type(self.encoder).__name__}; use unlocked_layers=0"
            )
        depth = len(self.layers)
        if self.unlocked_layers > depth:
            raise ConfigError(
                f"model.text.unlocked_layers={self.unlocked_layers} exceeds the encoder's {depth} layers"
            )
        return [*self.layers[depth - self.unlocked_layers :], *head]

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.pooling == "cls":
            return hidden[:, 0]
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)

    def _run_layers(self, hidden: torch.Tensor, attention_mask: torch.Tensor, layers: nn.ModuleList):
        mask = create_bidirectional_mask(
            config=self.encoder.config, inputs_embeds=hidden, attention_mask=attention_mask
        )
        for layer in layers:
            out = layer(hidden, mask)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def encode_frozen(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        device = self.proj.weight.device
        input_ids = input_ids.to(device, non_blocking=True)
        attention_mask = attention_mask.to(device, non_blocking=True)
        if not self.locked:
            return input_ids, attention_mask
        if not self._split_layers:
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return (self.pool(hidden, attention_mask),)
        hidden = self.encoder.embeddings(input_ids=input_ids)
        frozen = self.layers[: len(self.layers) - self.unlocked_layers]
        return self._run_layers(hidden, attention_mask, frozen), attention_mask

    def encode_trainable(self, *hidden: torch.Tensor) -> torch.Tensor:
        if not self.locked:
            input_ids, attention_mask = hidden
            states = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            pooled = self.pool(states, attention_mask)
        elif not self._split_layers:
            (pooled,) = hidden
        else:
            states, attention_mask = hidden
            unlocked = self.layers[len(self.layers) - self.unlocked_layers :]
            pooled = self.pool(self._run_layers(states, attention_mask, unlocked), attention_mask)
        return F.normalize(self.proj(pooled), dim=-1)


def create_encoder(
    cfg: TextTowerConfig, vocab_size: int | None = None, *, load_pretrained: bool = True
) -> PreTrainedModel:
    """Random init from ``hf_config`` when given (``vocab_size`` fills a missing one), else pretrained.

    ``load_pretrained=False`` reads only the config of ``model.text.hf``: a full checkpoint supplies
    the weights.
    """
    if cfg.hf_config or not load_pretrained:
        config = (
            _config_from_keys(cfg.hf_config, vocab_size)
            if cfg.hf_config
            else load_hf(AutoConfig, cfg.hf, "model.text.hf")
        )
        # from_config would take the dtype recorded in the config; training wants fp32 master weights
        encoder = AutoModel.from_config(config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32)
    else:
        encoder = load_hf(
            AutoModel, cfg.hf, "model.text.hf", attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32
        )
    encoder.config.use_cache = False  # an encoder has no KV cache to keep
    if cfg.grad_checkpointing:
        encoder.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return encoder


def _config_from_keys(hf_config: dict, vocab_size: int | None) -> PreTrainedConfig:
    """``model.text.hf_config`` as a transformers config; unknown keys are a ConfigError."""
    kwargs = dict(hf_config)
    model_type = kwargs.pop("model_type", "bert")
    try:
        default = AutoConfig.for_model(model_type)
    except ValueError:
        key = "model.text.hf_config.model_type"
        raise ConfigError(f"{key}={model_type!r} is not a transformers model type") from None
    unknown = sorted(k for k in kwargs if not hasattr(default, k))
    if unknown:
        names = ", ".join(unknown)
        raise ConfigError(f"model.text.hf_config: unknown {model_type} config key(s) {names}")
    if vocab_size is not None:
        kwargs.setdefault("vocab_size", vocab_size)
    return AutoConfig.for_model(model_type, **kwargs)


def build_text_tower(
    cfg: TextTowerConfig, embed_dim: int, vocab_size: int | None = None, *, load_pretrained: bool = True
) -> TextTower:
    if cfg.lock_head and not cfg.lock:
        raise ConfigError("model.text.lock_head=true needs model.text.lock=true")
    return TextTower(
        create_encoder(cfg, vocab_size, load_pretrained=load_pretrained),
        embed_dim,
        pooling=cfg.pooling,
        lock=cfg.lock,
        unlocked_layers=cfg.unlocked_layers,
        lock_head=cfg.lock_head,
    )
