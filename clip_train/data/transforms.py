"""Image transforms in the loader workers: PIL in, uint8 (3, H, W) tensor out.

Images stay uint8 until the device normalises them (4x smaller than fp32 in pinned memory and in
the Gradient Cache offload).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from PIL import Image
from torchvision.transforms import v2

ImageTransform = Callable[[Image.Image], torch.Tensor]


def train_transform(
    image_size: int,
    scale: Sequence[float],
    ratio: Sequence[float],
    *,
    color_jitter: Sequence[float] = (),
    color_jitter_prob: float = 1.0,
    grayscale_prob: float = 0.0,
) -> ImageTransform:
    """CLIP's training augmentation, a random resized crop; optionally, as OpenCLIP's ``--aug-cfg``
    offers, colour jitter (brightness, contrast, saturation, hue) on a share of the images, then
    grayscale on another."""
    crop = v2.RandomResizedCrop(
        image_size,
        scale=(scale[0], scale[1]),
        ratio=(ratio[0], ratio[1]),
        interpolation=v2.InterpolationMode.BICUBIC,
        antialias=True,
    )
    colour = []
    if color_jitter and color_jitter_prob > 0:
        colour.append(v2.RandomApply([v2.ColorJitter(*color_jitter)], p=color_jitter_prob))
    if grayscale_prob > 0:
        colour.append(v2.RandomGrayscale(p=grayscale_prob))
    return v2.Compose([crop, *colour, v2.PILToTensor()])


def eight_bit(image: Image.Image) -> Image.Image:
    """16-bit grey (PNG, TIFF: modes ``I;16*``) as 8-bit grey by its top 8 bits; other modes as they
    are. PIL's own conversion clips at 255, which turns all but the darkest pixels white."""
    if image.mode.startswith("I;16"):
        return image.convert("I").point(lambda value: value / 256).convert("L")
    return image


def eval_transform(image_size: int) -> ImageTransform:
    """Resize the short side, take the centre square, convert to RGB (any PIL mode in).

    The steps, their order and PIL's bicubic resize are open_clip's, so both give the same pixels
    for an image handed to ``clip_train.load``'s transform (resizing before the conversion matters
    for RGBA, which PIL resizes with premultiplied alpha). The data loaders decode to RGB first, as
    open_clip's webdataset and image-folder loaders do; only its CSV loader resizes RGBA as RGBA.
    A 16-bit grey image, which open_clip's transform turns near-white, keeps its top 8 bits.
    """
    return v2.Compose(
        [
            eight_bit,
            v2.Resize(image_size, interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
            v2.CenterCrop(image_size),
            v2.RGB(),
            v2.PILToTensor(),
        ]
    )


def apply_seeded(transform: ImageTransform, image: Image.Image, seed: int) -> torch.Tensor:
    """Run a random transform with its own seed, leaving the caller's torch RNG untouched (with
    ``data.workers=0`` it is the trainer's), so a resumed run crops as the uninterrupted one.

    Only the CPU generator is seeded (the transforms draw from it): ``torch.manual_seed`` would also
    queue a CUDA seeding, formatting a stack trace each time, which cost 40 % of the loader's time."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return transform(image)
