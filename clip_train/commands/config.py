"""Show a config: ``clip-train config CONFIG [key=value ...]`` prints the resolved YAML that
``clip-train train`` would run with (includes and overrides applied, cross-field checks passed);
``clip-train config --keys`` lists every key with its type, default and meaning, and
``--readme README.md`` rewrites the README's config reference from the same rows.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path

from clip_train.config import ConfigKey, config_keys, config_yaml, load_config
from clip_train.errors import UserError

README_BEGIN, README_END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML run config, e.g. configs/demo-digits.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. batch.global_size=65536")
    parser.add_argument(
        "--keys", action="store_true", help="list every config key with its type, default and meaning"
    )
    parser.add_argument(
        "--readme", type=Path, metavar="README", help="rewrite the config reference between the markers"
    )


def run(args: argparse.Namespace) -> int:
    if args.readme:
        changed = update_readme(args.readme)
        print(f"{args.readme} {'updated' if changed else 'already current'}")
    elif args.keys:
        print(key_table())
    elif args.config is None:
        raise UserError("give a CONFIG to resolve, --keys to list every key, or --readme README.md")
    else:
        print(config_yaml(load_config(args.config, args.overrides).validate()), end="")
    return 0


def key_table() -> str:
    """One aligned row per key: name, type, default, and the comment that explains it."""
    table = [("key", "type", "default", "meaning"), *map(_cells, config_keys())]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
        for row in table
    )


def markdown_table() -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, type_name, default, meaning in map(_cells, config_keys()):
        type_cell = type_name.replace("|", r"\|")  # a bare | would end the table cell
        lines.append(f"| `{name}` | {type_cell} | `{default}` | {meaning} |")
    return "\n".join(lines)


def update_readme(readme: Path) -> bool:
    """Rewrite the marked section; True if the file changed."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise UserError(f"{readme} has no {README_BEGIN} ... {README_END} section")
    head, _, rest = text.partition(README_BEGIN)
    _, _, tail = rest.partition(README_END)
    new = f"{head}{README_BEGIN}\n{markdown_table()}\n{README_END}{tail}"
    if new == text:
        return False
    readme.write_text(new)
    return True


def _cells(key: ConfigKey) -> tuple[str, str, str, str]:
    return key.name, _type_name(key.hint), repr(key.default), key.meaning


def _type_name(hint: object) -> str:
    """``int | auto``, ``cls | mean``, ``float | None``: the values a key takes, as a user types them."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " | ".join(map(str, typing.get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(map(_type_name, typing.get_args(hint)))
    if hint is type(None):
        return "None"
    if origin is None:
        return getattr(hint, "__name__", str(hint))
    return str(hint).replace("typing.", "")
