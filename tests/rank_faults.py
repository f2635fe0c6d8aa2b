"""Faults injected into one rank of a real torchrun run: a ``sitecustomize.py`` on PYTHONPATH, which
every interpreter runs at start-up, patches the package in the process whose ``RANK`` matches and
does nothing anywhere else (torchrun itself, the other ranks). A rank forked from a ``forked_cli``
server runs it after the server's imports, so a fault rebinds what the code looks up when it calls
(a class's method, a module's global), never a name that another module imported."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path


def patched_in_rank(rank: int | tuple[int, ...], code: str, folder: Path) -> dict[str, str]:
    """The environment for a run in which rank ``rank`` (or each of several) first runs ``code``."""
    folder.mkdir(parents=True, exist_ok=True)
    body = textwrap.indent(textwrap.dedent(code).strip(), "    ")
    ranks = {str(r) for r in ((rank,) if isinstance(rank, int) else rank)}
    (folder / "sitecustomize.py").write_text(
        f"import os\n\nif os.environ.get('RANK') in {ranks!r}:\n{body}\n"
    )
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
