"""Text tower: a transformers encoder, CLS, mean or end-token pooling, linear projection.

Two encoder layouts: BERT-style (``embeddings`` + ``encoder.layer``, bidirectional) and CLIP's text
transformer (transformers' ``CLIPTextModel``: ``embeddings`` + ``encoder.layers`` + ``final_layer_norm``,
causal), which is open_clip's own text tower and is pooled at the end token as open_clip pools it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoConfig, AutoModel, CLIPTextModel, PreTrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from clip_train.config import ConfigError, TextTowerConfig
from clip_train.errors import refusal
from clip_train.model.freezing import LockableTower, init_projection
from clip_train.model.hub import load_hf

POOLERS = {"cls": "cls_last_hidden_state_pooler", "mean": "mean_pooler"}  # each pooling's open_clip name


class TextTower(LockableTower):
    """HF encoder → pooling → projection → L2 norm.

    ``encode_frozen`` returns ids and mask on the device when unlocked, the pooled features when locked,
    and the hidden states after the first L−N layers plus ids and mask when locked with
    ``unlocked_layers=N``.
    """

    def __init__(self, encoder: PreTrainedModel, embed_dim: int, cfg: TextTowerConfig) -> None:
        super().__init__()
        if getattr(encoder, "pooler", None) is not None:
            encoder.pooler = None  # BERT's NSP pooler is unused here; DDP rejects unused parameters
        self.encoder = encoder
        self.causal = isinstance(encoder, CLIPTextModel)  # open_clip's CLIP text transformer
        if self.causal and cfg.pooling == "cls":
            raise ConfigError(
                "model.text.pooling=cls on CLIP's causal text transformer pools its first token, which "
                "sees no other: every caption would embed alike; set model.text.pooling=eot (open_clip's)"
            )
        self.pooling = cfg.pooling
        self.proj = init_projection(encoder.config.hidden_size, embed_dim)
        # Where the ids go: FSDP keeps buffers on the compute device, while a sharded root's weights
        # may live on the host (fsdp.cpu_offload).
        self.register_buffer("device_anchor", torch.zeros(()), persistent=False)
        self.lock(cfg, "model.text")

    @property
    def layers(self) -> nn.ModuleList:
        return self.encoder.encoder.layers if self.causal else self.encoder.encoder.layer

    def _after_layers(self) -> list[nn.Module]:
        """What runs between the last layer and the pooling: CLIP's final LayerNorm."""
        return [self.encoder.final_layer_norm] if self.causal else []

    def _unlocked_modules(self) -> list[nn.Module]:
        stack = getattr(self.encoder, "encoder", None)
        if not (self.causal or (hasattr(self.encoder, "embeddings") and hasattr(stack, "layer"))):
            raise ConfigError(
                f"model.text.unlocked_layers={self.unlocked_layers} needs a BERT-style encoder "
                f"(embeddings + encoder.layer) or CLIP's text transformer, got "
                f"{type(self.encoder).__name__}; use unlocked_layers=0"
            )
        if not self.causal and (elsewhere := self._weights_the_split_skips()):
            raise ConfigError(
                f"model.text.unlocked_layers={self.unlocked_layers}: {type(self.encoder).__name__} has "
                f"weights outside its embeddings and layers ({elsewhere[0]}: a final LayerNorm, as "
                "pre-LayerNorm encoders have), which the split at a layer would skip; lock the tower "
                "whole (unlocked_layers=0) or leave it unlocked"
            )
        depth = len(self.layers)
        if self.unlocked_layers > depth:
            raise ConfigError(
                f"model.text.unlocked_layers={self.unlocked_layers} exceeds the encoder's {depth} layers"
            )
        return [*self.layers[depth - self.unlocked_layers :], *self._after_layers()]

    def _weights_the_split_skips(self) -> list[str]:
        """A BERT-style encoder's weights that the split (embeddings, ELECTRA's projection, layers) does
        not run; the pooler's output is never used."""
        split = ("embeddings.", "embeddings_project.", "encoder.layer.", "pooler.")
        return [name for name, _ in self.encoder.named_parameters() if not name.startswith(split)]

    def pool(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        if self.pooling == "cls":
            return hidden[:, 0]
        if self.pooling == "eot":  # open_clip's: the end token is the largest id of its BPE
            return hidden[torch.arange(hidden.shape[0], device=hidden.device), input_ids.argmax(dim=-1)]
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)

    def _encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden states. A causal encoder gets no padding mask, as in open_clip:
        no token up to the end token can see the padding after it."""
        mask = None if self.causal else _padding_mask(attention_mask)
        return self.encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state

    def _run_layers(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, layers: nn.ModuleList
    ) -> torch.Tensor:
        config = self.encoder.config
        if self.causal:
            mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None)
            options = {"is_causal": True}
        else:
            mask, options = _padding_mask(attention_mask), {}
        for layer in layers:
            out = layer(hidden, mask, **options)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def encode_frozen(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        device = self.device_anchor.device
        input_ids = input_ids.to(device, non_blocking=True)
        attention_mask = attention_mask.to(device, non_blocking=True)
        if not self.locked:
            return input_ids, attention_mask
        if not self.unlocked_layers:
            return (self.pool(self._encode(input_ids, attention_mask), input_ids, attention_mask),)
        hidden = self.encoder.embeddings(input_ids=input_ids)
        if (project := getattr(self.encoder, "embeddings_project", None)) is not None:
            hidden = project(hidden)  # ELECTRA's, from a smaller embedding size to the layers' width
        frozen = self.layers[: len(self.layers) - self.unlocked_layers]
        return self._run_layers(hidden, attention_mask, frozen), input_ids, attention_mask

    def encode_trainable(self, *hidden: torch.Tensor) -> torch.Tensor:
        if not self.locked:
            input_ids, attention_mask = hidden
            pooled = self.pool(self._encode(input_ids, attention_mask), input_ids, attention_mask)
        elif not self.unlocked_layers:
            (pooled,) = hidden
        else:
            states, input_ids, attention_mask = hidden
            unlocked = self.layers[len(self.layers) - self.unlocked_layers :]
            states = self._run_layers(states, attention_mask, unlocked)
            for module in self._after_layers():
                states = module(states)
            pooled = self.pool(states, input_ids, attention_mask)
        return F.normalize(self.proj(pooled), dim=-1)


def _padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """SDPA's (B, 1, L, L) mask, True where a token may attend a key: padding keys are masked. Built
    here because transformers, given the (B, L) mask, reads on the host whether any token is padding
    (a device sync in every forward); a 4D mask it takes as it is."""
    keys = attention_mask.bool()[:, None, None, :]
    return keys.expand(-1, -1, attention_mask.shape[1], -1)


def create_encoder(
    cfg: TextTowerConfig, vocab_size: int | None = None, *, load_pretrained: bool = True
) -> PreTrainedModel:
    """Random init from ``hf_config`` when given (``vocab_size`` fills a missing one), else pretrained.

    ``load_pretrained=False`` reads only the config of ``model.text.hf``: a checkpoint supplies the weights.
    """
    # fp32 master weights, whatever dtype the config records
    options = {"attn_implementation": "sdpa", "dtype": torch.float32}
    if cfg.hf_config:
        config = _config_from_keys(cfg.hf_config, vocab_size)
        try:
            encoder = AutoModel.from_config(config, **options)
        except (ValueError, AssertionError, ArithmeticError) as err:  # values the architecture refuses
            raise ConfigError(f"model.text.hf_config: {refusal(err)}") from None
    elif load_pretrained:
        encoder = load_hf(AutoModel, cfg.hf, "model.text.hf", **options)
    else:
        encoder = AutoModel.from_config(load_hf(AutoConfig, cfg.hf, "model.text.hf"), **options)
    kind = encoder.config.model_type
    key = f"model.text.hf_config.model_type={kind}" if cfg.hf_config else f"model.text.hf={cfg.hf}"
    if encoder.config.is_encoder_decoder:  # AutoModel built the whole seq2seq model: no text tower
        raise ConfigError(
            f"{key}: an encoder-decoder model; the text tower takes an encoder (BERT, RoBERTa, "
            "XLM-RoBERTa and the like)"
        )
    if getattr(encoder.config, "text_config", None) is not None:  # CLIPModel, SiglipModel, ...
        raise ConfigError(
            f"{key}: a whole image-text model ({type(encoder).__name__}), not a text encoder. To start "
            "from a released CLIP, use model.init_from=open_clip:... (docs/fine-tune-clip.md); for its "
            "text transformer alone, with a new projection, save CLIPTextModel.from_pretrained(DIR) "
            "to a folder and set model.text.hf to it"
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
        raise ConfigError(
            f"model.text.hf_config.model_type={model_type!r} is not a transformers model type"
        ) from None
    unknown = sorted(k for k in kwargs if not hasattr(default, k))
    if unknown:
        raise ConfigError(f"model.text.hf_config: unknown {model_type} config key(s) {', '.join(unknown)}")
    if vocab_size is not None:
        kwargs.setdefault("vocab_size", vocab_size)
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except StrictDataclassError as err:  # a value of the wrong type, e.g. YAML's string "1e-6" (write 1.0e-6)
        raise ConfigError(f"model.text.hf_config: {' '.join(str(err).split())}") from None


def build_text_tower(
    cfg: TextTowerConfig, embed_dim: int, vocab_size: int | None = None, *, load_pretrained: bool = True
) -> TextTower:
    return TextTower(create_encoder(cfg, vocab_size, load_pretrained=load_pretrained), embed_dim, cfg)
