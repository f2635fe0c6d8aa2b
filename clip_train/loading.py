"""``clip_train.load``: a trained model, its preprocessing and its tokenizer, offline, from nothing but
the checkpoint directory (weights, ``model.yaml``, ``text/``), with open_clip's call shapes so code
written for an open_clip model runs on it unchanged."""

from __future__ import annotations

import os

import torch

from clip_train.checkpoint import checkpoint_model_config, find_weights, load_weights_file
from clip_train.data.transforms import ImageTransform, eval_transform
from clip_train.ema import load_ema_weights
from clip_train.model import CLIP, build_model
from clip_train.model.tokenizer import IdsTokenizer
from clip_train.wise_ft import mix_into, start_of


class LoadedCLIP(CLIP):
    """A CLIP called as an open_clip model is: ``encode_image(image, normalize=False)``,
    ``encode_text(text, normalize=False)`` without a mask, and ``model(image=None, text=None)``
    returning the logit bias too when there is one. A subclass, not a wrapper, so the weights,
    ``state_dict`` keys and towers are the trained model's own (eval and export take it as they take
    a CLIP, passing ``attention_mask=`` by name); training keeps the plain CLIP, whose callers unpack
    3 values."""

    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        """L2-normalised whatever ``normalize`` says: the image tower ends in the norm."""
        return super().encode_image(image)

    def encode_text(
        self,
        text: torch.Tensor | None = None,
        normalize: bool = False,
        attention_mask: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """L2-normalised whatever ``normalize`` says; without ``attention_mask``, the one the tokenizer's
        padding implies for these ids. The ids are open_clip's ``text``, or ``input_ids`` as
        ``model.tokenizer`` names them (``encode_text(**model.tokenizer(captions))``)."""
        if isinstance(normalize, torch.Tensor):  # a CLIP's encode_text(ids, mask): here it is by name
            raise TypeError("encode_text(text, normalize=False, attention_mask=None): pass the mask by name")
        if (text is None) == (input_ids is None):
            raise TypeError("encode_text() takes the ids once, as text or as input_ids")
        ids = text if input_ids is None else input_ids
        if attention_mask is None:
            attention_mask = self.tokenizer.attention_mask(ids)
        return super().encode_text(ids, attention_mask)

    def forward(
        self,
        image: torch.Tensor | None = None,
        text: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """open_clip's tuple: image features, text features (None for an input not given), the logit
        scale as a multiplier, and the logit bias when the model has one (sigmoid loss)."""
        image_features = None if image is None else self.encode_image(image)
        text_features = None if text is None else self.encode_text(text, attention_mask=attention_mask)
        outputs = (image_features, text_features, self.logit_scale.exp())
        return outputs if self.logit_bias is None else (*outputs, self.logit_bias)


def load(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    ema: bool = False,
    wise_ft: float | None = None,
    wise_ft_from: str = "",
) -> tuple[LoadedCLIP, ImageTransform, IdsTokenizer]:
    """``(model, preprocess, tokenizer)`` from a checkpoint, a run directory (its newest checkpoint;
    a damaged one is an error) or a checkpoint's ``model.safetensors``; the model is in eval mode on
    ``device``.
    ``ema=True``: the checkpoint's moving average of the weights (``train.ema_decay``) instead.
    ``wise_ft=alpha``: those weights mixed with the ones the run started from (WiSE-FT), its
    ``model.init_from`` or ``wise_ft_from``: ``(1 - alpha) * start + alpha * fine_tuned``.

    ``preprocess`` turns a PIL image into a uint8 (3, H, W) tensor, which the model normalises
    itself; ``tokenizer`` returns ids as open_clip's does, and ``encode_text`` derives their mask::

        model, preprocess, tokenizer = clip_train.load("runs/demo-digits")
        image_features = model.encode_image(torch.stack([preprocess(image) for image in images]))
        text_features = model.encode_text(tokenizer(["a photo of the digit 3", "a photo of the digit 5"]))
    """
    weights = find_weights(path, verify=True)
    cfg = checkpoint_model_config(weights.parent)
    model = _open_clip_shaped(build_model(cfg, load_pretrained=False))
    load_weights_file(weights, model)
    if ema:
        load_ema_weights(weights.parent, model)
    if wise_ft is not None:
        mix_into(model, cfg, wise_ft, start_of(weights.parent, wise_ft_from))
    return model.to(device).eval(), eval_transform(model.image_size), IdsTokenizer(model.tokenizer)


def _open_clip_shaped(model: CLIP) -> LoadedCLIP:
    """The same towers and tokenizer as a ``LoadedCLIP``; the checkpoint then sets every weight."""
    bias = None if model.logit_bias is None else model.logit_bias.item()
    return LoadedCLIP(model.visual, model.text, model.tokenizer, model.logit_scale.item(), bias)
