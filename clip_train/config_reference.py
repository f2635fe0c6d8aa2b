"""The README's config reference, generated from the dataclasses in ``clip_train.config``.

A key's description is the inline comment on its field. ``python -m clip_train.config_reference``
rewrites the README section between the markers; a test fails when the README is stale.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

from clip_train import config as config_module

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
_FIELD_COMMENT = re.compile(r"^\s+(\w+):[^#]*#\s*(.+)$")


def _comments(cls: type) -> dict[str, str]:
    """Inline field comments of ``cls`` and the dataclasses it inherits from."""
    comments: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        for line in inspect.getsource(klass).splitlines():
            if m := _FIELD_COMMENT.match(line):
                comments[m.group(1)] = m.group(2)
    return comments


def rows(cls: type = config_module.Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """Every key as (dotted name, type, default as Python writes it, description), in declaration order."""
    found = []
    hints, comments = typing.get_type_hints(cls), _comments(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            found += rows(hint, f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        found.append((prefix + f.name, _type_name(hint), repr(default), comments.get(f.name, "")))
    return found


def _type_name(hint: object) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) is None:
        return getattr(hint, "__name__", str(hint))
    return str(hint).replace("typing.", "")


def render() -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, type_name, default, comment in rows():
        type_cell = type_name.replace("|", r"\|")  # a bare | would end the table cell
        lines.append(f"| `{key}` | {type_cell} | `{default}` | {comment} |")
    return "\n".join(lines)


def update_readme(readme: Path) -> bool:
    """Rewrite the marked section; True if the file changed."""
    text = readme.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    new = f"{head}{BEGIN}\n{render()}\n{END}{tail}"
    readme.write_text(new)
    return new != text


if __name__ == "__main__":
    changed = update_readme(Path(sys.argv[1] if len(sys.argv) > 1 else "README.md"))
    print("README.md updated" if changed else "README.md already current")
