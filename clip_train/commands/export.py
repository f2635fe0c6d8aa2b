"""Export a checkpoint for open_clip: ``clip-train export CHECKPOINT OUT --format open_clip``.

``open_clip.create_model_and_transforms("local-dir:OUT")`` and ``open_clip.get_tokenizer("local-dir:OUT")``
then give the embeddings clip_train gives (checked before the command finishes), so clip_benchmark
and anything else built on open_clip can use the model; ``--push-to-hub REPO`` uploads it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clip_train.checkpoint import find_weights
from clip_train.errors import UserError
from clip_train.export import FORMATS, check_target, export_open_clip, push_to_hub
from clip_train.loading import load
from clip_train.logs import get_logger, timed
from clip_train.model import OpenCLIPTokenizer
from clip_train.wise_ft import parse_alpha, start_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        help="checkpoint directory, run directory (its newest checkpoint) or a .safetensors file",
    )
    parser.add_argument(
        "out", type=Path, help="output folder: new, empty, or an earlier export (which it replaces)"
    )
    parser.add_argument(
        "--format", choices=FORMATS, default="open_clip", help="export format (default open_clip)"
    )
    parser.add_argument(
        "--ema", action="store_true", help="export the checkpoint's EMA of the weights (train.ema_decay)"
    )
    parser.add_argument(
        "--wise-ft",
        metavar="ALPHA",
        type=parse_alpha,
        help="WiSE-FT: export (1 - ALPHA) * start + ALPHA * checkpoint; the start is the run's "
        "model.init_from",
    )
    parser.add_argument(
        "--wise-ft-from",
        metavar="SOURCE",
        default="",
        help="with --wise-ft: the start's weights, when not the run's model.init_from",
    )
    parser.add_argument("--push-to-hub", metavar="REPO", help="also upload to this Hugging Face Hub repo")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")


def run(args: argparse.Namespace) -> int:
    if args.wise_ft_from and args.wise_ft is None:
        raise UserError("--wise-ft-from names the start of a WiSE-FT mixture: give its alpha with --wise-ft")
    out = args.out.resolve()
    check_target(out)  # before the seconds that loading takes
    source = find_weights(args.checkpoint)
    log = get_logger()
    start = "" if args.wise_ft is None else start_of(source.parent, args.wise_ft_from)
    with timed(f"export: loading {source}"):
        model, _, _ = load(source, ema=args.ema, wise_ft=args.wise_ft, wise_ft_from=start)
    with timed(f"export: writing {out} and loading it back with open_clip"):
        image, text = export_open_clip(model, out)
    what = f"the EMA of {source}" if args.ema else str(source)
    if args.wise_ft is not None:
        what = f"the WiSE-FT mixture {1 - args.wise_ft:g} x {start} + {args.wise_ft:g} x {what}"
    log.info(f'exported {what} to {out}: open_clip.create_model_and_transforms("local-dir:{out}")')
    log.info(f"open_clip gives clip_train's embeddings: max |difference| image {image:.1e}, text {text:.1e}")
    if isinstance(model.tokenizer, OpenCLIPTokenizer) and not model.text.causal:  # which masks nothing
        log.info(
            'note: open_clip treats token id 0 as padding, which the bundled BPE also uses for "!" '
            'directly before some punctuation (e.g. "!("); such captions embed slightly differently'
        )
    if args.push_to_hub:
        with timed(f"export: uploading to {args.push_to_hub}"):
            url = push_to_hub(model, out, args.push_to_hub, private=args.private)
        log.info(f'pushed to {url}: open_clip.create_model_and_transforms("hf-hub:{url.repo_id}")')
    return 0
