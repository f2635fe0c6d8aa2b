"""The demo data set: scikit-learn's 1797 bundled 8x8 handwritten digits as WebDataset shards.

``write_digits(out)`` writes ``out/train`` and ``out/val`` (a seeded 80/20 split) and
``out/zeroshot.json``. Each sample is a ``{key}.png`` (dark ink on white, upscaled, RGB), a
``{key}.txt`` caption drawn from ``CAPTION_TEMPLATES`` and a ``{key}.json`` ``{"label": int}``.
``zeroshot.json`` holds ``{"classnames": [...], "templates": [...]}``: ``classnames[i]`` names label
i; each template has one ``{}`` for it and is phrased unlike the captions, to test generalisation.
"""

from __future__ import annotations

import io
import json
import math
import random
from pathlib import Path

import numpy as np
from PIL import Image

from clip_train.data.writers import Record, write_shards
from clip_train.files import replace_text

CLASSNAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CAPTION_TEMPLATES = (
    "a handwritten {word}",
    "the digit {digit}",
    "a photo of the number {word}",
    "a scanned handwritten digit {digit}",
    "the number {word}, written by hand",
    "a small blurry picture of a {word}",
    "a black and white drawing of the digit {word}",
    "handwritten number {digit} on white paper",
)
ZEROSHOT_TEMPLATES = ("a handwritten {}.", "a picture of the number {}.", "the digit {}, drawn by hand.")
VAL_FRACTION = 0.2


def _png(pixels: np.ndarray, size: int) -> bytes:
    ink = np.uint8(np.round(255.0 - pixels * (255.0 / 16.0)))  # sklearn's 0..16 ink to white paper
    image = Image.fromarray(ink).resize((size, size), Image.Resampling.BICUBIC).convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_digits(
    out: Path, *, size: int = 32, seed: int = 0, train_shards: int = 8, val_shards: int = 2
) -> dict[str, int]:
    """Write the demo set under ``out``; return {"train": n, "val": n}. Reruns skip finished parts."""
    from sklearn.datasets import load_digits  # an optional ("demo") dependency

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    n_val = round(len(order) * VAL_FRACTION)
    splits = {"train": (np.sort(order[n_val:]), train_shards), "val": (np.sort(order[:n_val]), val_shards)}
    for split, (indices, shards) in splits.items():
        records = (_record(digits.images[i], int(digits.target[i]), int(i), size, seed) for i in indices)
        source = {"digits": "sklearn.datasets.load_digits", "split": split, "size": size, "seed": seed}
        per_shard = math.ceil(len(indices) / shards)
        write_shards(records, out / split, per_shard=per_shard, total=len(indices), source=source, desc=split)
    zeroshot = {"classnames": list(CLASSNAMES), "templates": list(ZEROSHOT_TEMPLATES)}
    replace_text(out / "zeroshot.json", json.dumps(zeroshot, indent=1))
    return {split: len(indices) for split, (indices, _) in splits.items()}


def _record(pixels: np.ndarray, label: int, index: int, size: int, seed: int) -> Record:
    template = random.Random(f"digits/{seed}/{index}").choice(CAPTION_TEMPLATES)
    caption = template.format(word=CLASSNAMES[label], digit=label)
    return Record(
        key=f"digit{index:04d}",
        image=_png(pixels, size),
        image_ext="png",
        caption=caption,
        meta={"label": label},
    )
