"""Small files replaced whole, so that a reader, an upload or a kill part-way never sees half of one."""

from __future__ import annotations

import os
from pathlib import Path


def replace_text(path: Path, text: str) -> None:
    """``path`` holds ``text``, written beside it under a hidden name and renamed over it."""
    written = path.with_name(f".{path.name}.tmp")
    written.write_text(text)
    os.replace(written, path)
