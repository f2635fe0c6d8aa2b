"""Data pipeline throughput: decode + augment + tokenize samples/s, ours vs open_clip's WebDataset loader.

Both loaders read the same shards with the same workers, batch size, image size, tokenizer
(open_clip's BPE, 77 tokens) and augmentation (bicubic random resized crop, same scale), both
resampled. Ours hands out uint8 images (normalised later on the device); open_clip's hands out
normalised fp32, as each trainer expects. Each measurement runs in a fresh process, and timing
starts after a warm-up (worker start, shuffle buffers) of a few batches.

open_clip 3.3.0 with webdataset >= 1.0 crashes at the end of the first shard (KeyError 'fname'):
webdataset now ends every shard with an empty marker. The bench applies the minimal shim,
``tar_file_expander(eof_value=None)``, inside the open_clip measurement only, and says so.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import open_clip
import open_clip_train.data as open_clip_data
from open_clip.tokenizer import SimpleTokenizer
from PIL import Image
from webdataset.tariterators import tar_file_expander

from clip_train.bench.runner import in_fresh_process
from clip_train.config import DataConfig
from clip_train.data import build_train_loader, expand_urls
from clip_train.data.writers import Record, write_shards
from clip_train.errors import UserError
from clip_train.model.tokenizer import OpenCLIPTokenizer

CONTEXT_LENGTH = 77  # open_clip's, for both loaders
SHIM_NOTE = (
    "open_clip shim: open_clip_train.data.tar_file_expander = "
    "functools.partial(webdataset.tariterators.tar_file_expander, eof_value=None) "
    "(open_clip 3.3.0 + webdataset>=1.0 KeyError 'fname'; open_clip#935, webdataset#384)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "shards", nargs="?", default="", help="shard spec as for data.train (or --make-synthetic)"
    )
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1, 2], help="loader workers; several run in turn"
    )
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="timed seconds per measurement (default 20)"
    )
    parser.add_argument("--image-size", type=int, default=224, help="output image side (default 224)")
    parser.add_argument("--scale", type=float, nargs=2, default=[0.08, 1.0], help="random resized crop scale")
    parser.add_argument(
        "--make-synthetic",
        type=int,
        default=0,
        metavar="N",
        help="first write N synthetic LAION-like JPEGs (256-512 px) as shards in --synthetic-dir; bench them",
    )
    parser.add_argument("--synthetic-dir", type=Path, default=Path("runs/bench_data_shards"))


def run(args: argparse.Namespace) -> int:
    shards = args.shards
    if args.make_synthetic:
        shards = str(write_synthetic(args.synthetic_dir, args.make_synthetic))
    if not shards:
        raise UserError("give a shard spec, or --make-synthetic N to write synthetic shards first")
    print(
        f"shards {shards}: batch {args.batch}, {args.image_size}px, crop scale {tuple(args.scale)}, "
        f"{args.seconds:g} s per measurement"
    )
    print(SHIM_NOTE)
    print(f"{'workers':>7} {'clip_train':>14} {'open_clip':>14} {'ratio':>6}")
    for workers in args.workers:
        options = dict(
            shards=shards,
            workers=workers,
            batch=args.batch,
            seconds=args.seconds,
            size=args.image_size,
            scale=args.scale,
        )
        ours = in_fresh_process(measure, {**options, "loader": "clip_train"})
        theirs = in_fresh_process(measure, {**options, "loader": "open_clip"})
        print(f"{workers:>7} {ours:>10.1f} s/s {theirs:>10.1f} s/s {ours / theirs:>6.2f}", flush=True)
    return 0


def write_synthetic(out: Path, count: int) -> Path:
    """Random-ish JPEGs of LAION-like sizes and captions (smooth colour fields plus texture)."""
    words = ("a", "photo", "of", "the", "dog", "cat", "red", "blue", "small", "large", "house", "tree", "car")

    def record(index: int) -> Record:
        rng = np.random.default_rng(index)
        width, height = (int(v) for v in rng.integers(256, 513, 2))
        base = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize(
            (width, height), Image.BICUBIC
        )
        pixels = np.asarray(base, dtype=np.int16) + rng.integers(-24, 25, (height, width, 3), dtype=np.int16)
        buffer = io.BytesIO()
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
        text_rng = random.Random(index)
        caption = " ".join(text_rng.choices(words, k=text_rng.randint(5, 20)))
        return Record(key=f"{index:09d}", image=buffer.getvalue(), image_ext="jpg", caption=caption)

    source = {"synthetic_jpegs": count, "version": 1}
    # JPEG encoding and numpy release the GIL: threads make them in parallel, in order (23 s for
    # 4,096 on a 16-core GPU box in one thread).
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        records = pool.map(record, range(count))
        write_shards(records, out, per_shard=1000, total=count, source=source, desc="synthetic")
    return out


def measure(options: dict[str, Any]) -> float:
    """Samples/s of one loader, in a fresh process (its workers start as in a normal run)."""
    loader = _clip_train_batches if options["loader"] == "clip_train" else _open_clip_batches
    return _samples_per_second(loader(options), options["seconds"], warmup=2 * max(1, options["workers"]))


def _samples_per_second(batches: Iterator, seconds: float, warmup: int) -> float:
    for _ in range(warmup):
        next(batches)
    samples, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        samples += len(next(batches)[0])
    return samples / elapsed


def _clip_train_batches(options: dict[str, Any]) -> Iterator:
    cfg = DataConfig(
        train=options["shards"],
        resampled=True,
        num_samples=10**9,
        workers=options["workers"],
        rrc_scale=options["scale"],
    )
    loader = build_train_loader(
        cfg,
        global_batch=options["batch"],
        rank=0,
        world_size=1,
        seed=0,
        image_size=options["size"],
        tokenizer=OpenCLIPTokenizer(CONTEXT_LENGTH),
    )
    return ((batch.images, batch.input_ids) for batch in loader)


def _open_clip_batches(options: dict[str, Any]) -> Iterator:
    open_clip_data.tar_file_expander = functools.partial(tar_file_expander, eof_value=None)  # see SHIM_NOTE
    args = SimpleNamespace(
        train_data="::".join(expand_urls(options["shards"])),  # open_clip takes no directories
        dataset_resampled=True,
        train_num_samples=10**9,
        train_data_upsampling_factors=None,
        seed=0,
        batch_size=options["batch"],
        workers=options["workers"],
        world_size=1,
    )
    preprocess = open_clip.image_transform(
        options["size"], is_train=True, aug_cfg={"scale": tuple(options["scale"])}
    )
    tokenizer = SimpleTokenizer(context_length=CONTEXT_LENGTH)
    data = open_clip_data.get_wds_dataset(args, preprocess, is_train=True, epoch=0, tokenizer=tokenizer)
    return iter(data.dataloader)
