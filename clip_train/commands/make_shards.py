"""Write WebDataset shards for training and eval.

  clip-train make-shards folder SRC OUT --per-shard N   images with same-name .txt captions
  clip-train make-shards csv FILE OUT --per-shard N     a CSV/TSV of image paths and captions
  clip-train make-shards digits OUT [--size 32]         the built-in demo set (scikit-learn digits)

OUT gets shard-000000.tar, ... and sizes.json ({shard: samples}). Reruns on an unchanged source do
nothing. A table's header names its columns: filepath and title (OpenCLIP's), or path and caption,
unless --image-key and --caption-key name others; --separator defaults to tab for .tsv, else comma.
OpenCLIP's --csv-separator, --csv-img-key and --csv-caption-key work too. For LAION-scale sets use
img2dataset with --output_format webdataset; its shards and *_stats.json files work as they are.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from clip_train.data import writers
from clip_train.data.digits import write_digits
from clip_train.data.tables import TableFormat
from clip_train.logs import get_logger


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sources = parser.add_subparsers(dest="source", metavar="SOURCE", required=True)
    folder = sources.add_parser(
        "folder", help="images (jpg, png, webp, bmp, gif, tiff; searched recursively) with same-name .txt"
    )
    folder.add_argument("src", type=Path, help="folder of images and captions")
    folder.add_argument("out", type=Path, help="output shard directory")
    table = sources.add_parser("csv", help="a CSV/TSV of image paths (relative to it) and captions")
    table.add_argument("file", type=Path, help="the CSV or TSV file")
    table.add_argument("out", type=Path, help="output shard directory")
    table.add_argument(
        "--separator",
        "--csv-separator",
        default="",
        help="one character or \\t (default: tab for .tsv, else comma)",
    )
    table.add_argument(
        "--image-key", "--csv-img-key", default="", help="image column (default: filepath or path)"
    )
    table.add_argument(
        "--caption-key", "--csv-caption-key", default="", help="caption column (default: title or caption)"
    )
    for sub in (folder, table):
        sub.add_argument(
            "--per-shard", type=_positive, default=10000, help="samples per shard (default 10000)"
        )
    digits = sources.add_parser("digits", help="the demo set: OUT/train, OUT/val, OUT/zeroshot.json")
    digits.add_argument("out", type=Path, help="output directory")
    digits.add_argument("--size", type=_positive, default=32, help="image side in pixels (default 32)")
    digits.add_argument("--seed", type=int, default=0, help="train/val split and caption seed")
    for split, default in (("train", 8), ("val", 2)):
        digits.add_argument(
            f"--{split}-shards",
            type=_positive,
            default=default,
            help=f"at most this many {split} shards, all of one size but the last (default {default})",
        )


def _positive(text: str) -> int:
    """A count of at least 1, refused by argparse in one line that names the option."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def run(args: argparse.Namespace) -> int:
    if args.source == "digits":
        counts = write_digits(
            args.out,
            size=args.size,
            seed=args.seed,
            train_shards=args.train_shards,
            val_shards=args.val_shards,
        )
        print(f"digits: {counts['train']} train and {counts['val']} val samples in {args.out}")
        return 0
    if args.source == "folder":
        pairs, left_out = writers.folder_pairs(args.src)
        what = "the folder's images"
    else:
        table_format = TableFormat(args.separator, args.image_key, args.caption_key)
        pairs, left_out = writers.csv_pairs(args.file, table_format)
        what = "the table's rows"
    if left_out:
        get_logger().warning(_left_out_line(left_out, what))
    wrote = writers.write_pairs(pairs, args.out, per_shard=args.per_shard, desc=args.out.resolve().name)
    print(f"{len(pairs)} samples {'written to' if wrote else 'already up to date in'} {args.out}")
    return 0


def _left_out_line(left_out: list[tuple[str, str]], what: str) -> str:
    """One line: how many were left out, by reason, and the first of them."""
    reasons = Counter(reason for reason, _ in left_out)
    counts = ", ".join(f"{count} {reason}" for reason, count in reasons.most_common())
    return f"left out {len(left_out)} of {what} ({counts}), e.g. {left_out[0][1]}"
