"""Train a CLIP model: ``clip-train train CONFIG [key=value ...]`` (single process or torchrun)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML run config, e.g. configs/demo-digits.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. batch.global_size=65536")


def run(args: argparse.Namespace) -> int:
    from clip_train.config import load_config

    load_config(args.config, args.overrides).validate()
    print("clip-train: the trainer is not available in this version yet")
    return 2
