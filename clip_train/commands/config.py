"""Show a config: ``clip-train config CONFIG [key=value ...]`` prints the resolved YAML that
``clip-train train`` would run with (includes and overrides applied, cross-field checks passed);
``clip-train config --keys`` lists every key with its type, default and meaning.
"""

from __future__ import annotations

import argparse

from clip_train.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML run config, e.g. configs/demo-digits.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. batch.global_size=65536")
    parser.add_argument(
        "--keys", action="store_true", help="list every config key with its type, default and meaning"
    )


def run(args: argparse.Namespace) -> int:
    if args.keys:
        print(key_table())
        return 0
    if args.config is None:
        raise UserError("give a CONFIG to resolve, or --keys to list every key")
    from clip_train.config import config_yaml, load_config

    print(config_yaml(load_config(args.config, args.overrides).validate()), end="")
    return 0


def key_table() -> str:
    """One aligned row per key: name, type, default, and the comment that explains it."""
    from clip_train.config_reference import rows

    table = [("key", "type", "default", "meaning"), *rows()]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
        for row in table
    )
