"""The package's layers, read from its imports (every ``import`` statement, function-level ones too):
a lower layer never imports a higher one, so each layer can be read, tested and reused without
the ones above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "clip_train"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved against its package."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def importers_of(target: str, outside: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules of ``clip_train``, except those under ``outside``, that import ``target``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if any(within(name, allowed) for allowed in outside):
            continue
        hits = sorted(m for m in imported_modules(path) if within(m, target))
        if hits:
            found[name] = hits
    return found


def test_the_import_reader_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The rules below are only as good as the reader: it must see what a lazy import hides."""
    package = tmp_path / "clip_train" / "plan"
    package.mkdir(parents=True)
    module = package / "lazy.py"
    module.write_text(
        "def run():\n    from clip_train.bench.runner import in_fresh_process\n"
        "from ..bench import step\nfrom . import estimate\nimport clip_train.model.text as text\n"
    )
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path / "clip_train")
    assert {
        "clip_train.bench.runner",
        "clip_train.bench.step",
        "clip_train.plan.estimate",
        "clip_train.model.text",
    } <= imported_modules(module)
    assert importers_of("clip_train.bench", outside=("clip_train.commands",)) == {
        "clip_train.plan.lazy": [
            "clip_train.bench",
            "clip_train.bench.runner",
            "clip_train.bench.runner.in_fresh_process",
            "clip_train.bench.step",
        ]
    }


@pytest.mark.parametrize("top", ["clip_train.bench", "clip_train.commands"])
def test_only_commands_and_benchmarks_import_benchmarks_and_commands(top):
    """Commands and benchmarks sit on top of the library: ``clip_train.cli`` finds them by name."""
    assert importers_of(top, outside=("clip_train.bench", "clip_train.commands")) == {}


def test_the_model_imports_only_lower_layers():
    """The towers need the config and the errors, nothing that trains, exports or plans with them."""
    lower = ("clip_train.model", "clip_train.config", "clip_train.errors")
    found = {
        name: [m for m in modules if within(m, "clip_train") and not any(within(m, ok) for ok in lower)]
        for name, modules in importers_of("clip_train", outside=()).items()
        if within(name, "clip_train.model")
    }
    assert {name: modules for name, modules in found.items() if modules} == {}
