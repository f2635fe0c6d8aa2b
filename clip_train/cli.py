"""``clip-train``: one entry point, one module per subcommand.

Each subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int`` and keeps its
heavy imports (torch, webdataset, …) inside functions, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from clip_train.errors import UserError


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    help: str


COMMANDS = (
    Command("train", "clip_train.train", "train a CLIP model from a YAML config"),
    Command("eval", "clip_train.evaluate", "zero-shot and retrieval eval of a checkpoint"),
    Command("make-shards", "clip_train.make_shards", "write WebDataset shards (folder, csv, digits)"),
    Command("export", "clip_train.export", "export a checkpoint for open_clip (clip_benchmark, HF Hub)"),
    Command("plan", "clip_train.plan", "per-GPU memory plan and the largest batch that fits"),
    Command("config", "clip_train.commands.config", "print a resolved config, or every key (--keys)"),
)
BENCH_COMMANDS = (
    Command("loss", "clip_train.bench.loss", "contrastive loss time and memory vs batch size"),
    Command("step", "clip_train.bench.step", "Gradient Cache step time and memory vs batch size"),
    Command("data", "clip_train.bench.data", "data pipeline samples/s vs open_clip's loader"),
)


def _add_commands(subparsers: argparse._SubParsersAction, commands: Sequence[Command]) -> None:
    for command in commands:
        module = importlib.import_module(command.module)
        parser = subparsers.add_parser(command.name, help=command.help, description=module.__doc__)
        module.add_arguments(parser)
        parser.set_defaults(run=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clip-train",
        description="Train CLIP-style image-text models with contrastive batches of 100k to 1M+ pairs.",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_commands(subparsers, COMMANDS)
    bench = subparsers.add_parser(
        "bench", help="benchmarks (loss, step, data)", description="Measure time and memory; see README."
    )
    _add_commands(bench.add_subparsers(title="benchmarks", metavar="BENCH", required=True), BENCH_COMMANDS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except UserError as err:
        print(f"clip-train: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("clip-train: interrupted", file=sys.stderr)
        return 130
