"""``clip_train.load``: a trained model, its preprocessing and its tokenizer, offline, from nothing but
the checkpoint directory (weights, ``model.yaml``, ``text/``)."""

from __future__ import annotations

import os

import torch

from clip_train.checkpoint import checkpoint_model_config, find_weights, load_weights_file
from clip_train.data.transforms import ImageTransform, eval_transform
from clip_train.model import CLIP, Tokenizer, build_model


def load(
    path: str | os.PathLike, *, device: str | torch.device = "cpu"
) -> tuple[CLIP, ImageTransform, Tokenizer]:
    """``(model, preprocess, tokenizer)`` from a checkpoint, a run directory (its newest complete
    checkpoint) or a checkpoint's ``model.safetensors``; the model is in eval mode on ``device``.

    ``preprocess`` turns a PIL image into a uint8 (3, H, W) tensor, which the model normalises
    itself; ``tokenizer`` returns the keyword arguments of ``encode_text``::

        model, preprocess, tokenizer = clip_train.load("runs/demo-digits")
        image_features = model.encode_image(torch.stack([preprocess(image) for image in images]))
        text_features = model.encode_text(**tokenizer(["a photo of the digit 3", "a photo of the digit 5"]))
    """
    weights = find_weights(path, verify=True)
    model = build_model(checkpoint_model_config(weights.parent), load_pretrained=False)
    load_weights_file(weights, model)
    return model.to(device).eval(), eval_transform(model.image_size), model.tokenizer
