"""Run one measurement in a fresh Python process, so that its memory peak is its own (``ru_maxrss``
is process-wide) and nothing it loads or leaks reaches the next one.

The function is named by module and name, its spec and result travel as JSON: the child starts
from a clean interpreter, not a copy of the parent (fork) or an unpickled one (spawn).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ProcessFailed(RuntimeError):
    """The process ended without a result: ``killed`` by a signal (the OOM killer, typically) or an error."""

    def __init__(self, target: str, returncode: int, stderr: str) -> None:
        super().__init__(f"{target} failed in a fresh process (exit code {returncode}):\n{stderr.strip()}")
        self.killed = returncode < 0
        self.last_line = (stderr.strip().splitlines() or ["no output"])[-1]


def in_fresh_process(fn: Callable[[Any], Any], spec: Any) -> Any:
    """``fn(spec)`` in a new interpreter; ``fn`` is a module-level function. Its stdout passes through;
    its stderr is replayed after it ends, or carried by :class:`ProcessFailed`."""
    target = f"{fn.__module__}:{fn.__qualname__}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        command = [sys.executable, "-m", __name__, target, str(out)]
        proc = subprocess.run(command, input=json.dumps(spec), stderr=subprocess.PIPE, text=True, check=False)
        if proc.returncode != 0:
            raise ProcessFailed(target, proc.returncode, proc.stderr)
        sys.stderr.write(proc.stderr)
        return json.loads(out.read_text())


def _main() -> None:
    target, out = sys.argv[1:]
    module, name = target.split(":")
    result = getattr(importlib.import_module(module), name)(json.load(sys.stdin))
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _main()
