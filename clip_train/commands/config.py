"""Show a config: ``clip-train config CONFIG [key=value ...]`` prints the resolved YAML that
``clip-train train`` would run with (includes and overrides applied, cross-field checks passed, the
keys that other settings leave without effect warned about on stderr); ``clip-train config --keys``
lists every key with its type, default and meaning (with a CONFIG, its value there instead of the
default), and ``--reference docs/config.md`` rewrites the config reference page from the same rows.
"""

from __future__ import annotations

import argparse
import operator
import types
import typing
from pathlib import Path

from clip_train.config import Config, ConfigKey, config_keys, config_yaml, load_config
from clip_train.config.unused import warn_unused_settings
from clip_train.errors import UserError

REFERENCE_BEGIN, REFERENCE_END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
MAX_COLUMN = 40  # a longer cell (a config's dict value) overflows its column rather than widen every row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML run config, e.g. configs/demo-digits.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. batch.global_size=65536")
    parser.add_argument(
        "--keys",
        action="store_true",
        help="list every config key with its type, default and meaning; with CONFIG, its value there",
    )
    parser.add_argument(
        "--reference",
        type=Path,
        metavar="FILE",
        help="rewrite the config reference between the markers (docs/config.md)",
    )


def run(args: argparse.Namespace) -> int:
    if args.reference:
        changed = update_reference(args.reference)
        print(f"{args.reference} {'updated' if changed else 'already current'}")
    elif args.keys:
        print(key_table(None if args.config is None else _resolved(args)))
    elif args.config is None:
        raise UserError("give a CONFIG to resolve, --keys to list every key, or --reference docs/config.md")
    else:
        print(config_yaml(_resolved(args)), end="")
    return 0


def _resolved(args: argparse.Namespace) -> Config:
    """The config ``clip-train train`` would run with: includes and overrides applied, checks passed;
    the keys it would warn about, on stderr."""
    cfg = load_config(args.config, args.overrides).validate()
    warn_unused_settings(cfg)
    return cfg


def key_table(config: Config | None = None) -> str:
    """One aligned row per key: name, type, default (or ``config``'s value), and the comment that
    explains it."""
    header = ("key", "type", "default" if config is None else "value", "meaning")
    table = [header, *(_cells(key, config) for key in config_keys())]
    widths = [min(MAX_COLUMN, max(len(row[i]) for row in table)) for i in range(3)]
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


def update_reference(page: Path) -> bool:
    """Rewrite the marked section; True if the file changed."""
    try:
        text = page.read_text()
    except OSError as err:
        raise UserError(f"--reference {page}: {err.strerror or err}") from None
    if REFERENCE_BEGIN not in text or REFERENCE_END not in text:
        raise UserError(f"{page} has no {REFERENCE_BEGIN} ... {REFERENCE_END} section")
    head, _, rest = text.partition(REFERENCE_BEGIN)
    _, _, tail = rest.partition(REFERENCE_END)
    new = f"{head}{REFERENCE_BEGIN}\n{markdown_table()}\n{REFERENCE_END}{tail}"
    if new == text:
        return False
    page.write_text(new)
    return True


def _cells(key: ConfigKey, config: Config | None = None) -> tuple[str, str, str, str]:
    """The key's row; its value in ``config`` when given, else its default."""
    value = key.default if config is None else operator.attrgetter(key.name)(config)
    return key.name, _type_name(key.hint), repr(value), key.meaning


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
