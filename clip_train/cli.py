"""``clip-train``: one entry point; each command is a module with ``add_arguments(parser)`` and
``run(args) -> int``.

Only the chosen command's module is imported (it imports the library, torch included), so
``clip-train --help`` lists every command without loading torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from clip_train.errors import UserError
from clip_train.launcher import torchrun_env_from_slurm
from clip_train.logs import get_logger
from clip_train.preemption import stop_worker_processes


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    help: str


COMMANDS = (
    Command("train", "clip_train.commands.train", "train a CLIP model from a YAML config"),
    Command("eval", "clip_train.commands.eval", "zero-shot and retrieval eval of a checkpoint"),
    Command(
        "export", "clip_train.commands.export", "export a checkpoint for open_clip (clip_benchmark, HF Hub)"
    ),
    Command(
        "make-shards", "clip_train.commands.make_shards", "write WebDataset shards (folder, csv, digits)"
    ),
    Command("plan", "clip_train.commands.plan", "per-GPU memory plan and the largest batch that fits"),
    Command("config", "clip_train.commands.config", "print a resolved config, or every key (--keys)"),
    Command("report", "clip_train.commands.report", "a run's summary: steps, speed, loss, eval"),
)
BENCH_COMMANDS = (
    Command("loss", "clip_train.bench.loss", "contrastive loss time and memory vs batch size"),
    Command("step", "clip_train.bench.step", "Gradient Cache step time and memory vs batch size"),
    Command("data", "clip_train.bench.data", "data pipeline samples/s vs open_clip's loader"),
    Command("train", "clip_train.bench.train", "whole training steps vs OpenCLIP's own trainer"),
    Command("gpu", "clip_train.bench.gpu", "one GPU session's figures in one folder (make gpu-bench)"),
)


def _add_commands(
    subparsers: argparse._SubParsersAction, commands: Sequence[Command], chosen: str | None
) -> None:
    """Every command is listed; only the chosen one's module is imported to add its arguments."""
    for command in commands:
        parser = subparsers.add_parser(command.name, help=command.help)
        if command.name == chosen:
            module = importlib.import_module(command.module)
            parser.description = module.__doc__
            parser.formatter_class = argparse.RawDescriptionHelpFormatter
            module.add_arguments(parser)
            parser.set_defaults(run=module.run)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser for ``argv``: its command (and benchmark) fully, the others by name and help."""
    chosen = [*argv, None, None]
    parser = argparse.ArgumentParser(
        prog="clip-train",
        description="Train CLIP-style image-text models with contrastive batches of 100k to 1M+ pairs.",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_commands(subparsers, COMMANDS, chosen[0])
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks (loss, step, data, train, gpu)",
        description="Measure time and memory; see docs/benchmarks.md.",
    )
    benchmarks = bench.add_subparsers(title="benchmarks", metavar="BENCH", required=True)
    _add_commands(benchmarks, BENCH_COMMANDS, chosen[1] if chosen[0] == "bench" else None)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argparse's parse, except that ``key=value`` overrides may also follow a command's options
    (``clip-train plan CONFIG --gpus 8 batch.global_size=65536``): argparse alone takes a command's
    positionals in one run and refuses those after an option."""
    args, unparsed = parser.parse_known_args(argv)
    if unparsed and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in unparsed):
        args.overrides = [*args.overrides, *unparsed]
    elif unparsed:
        parser.error(f"unrecognized arguments: {' '.join(unparsed)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(build_parser(argv), argv)
    try:
        os.environ.update(torchrun_env_from_slurm(os.environ))
        return args.run(args)
    except UserError as err:
        get_logger().error(f"error: {err}")
        return 2
    except KeyboardInterrupt:
        get_logger().error("interrupted")
        return 130
    finally:
        stop_worker_processes()  # on every path: no exit waits on a data worker
