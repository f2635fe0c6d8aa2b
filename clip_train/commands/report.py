"""A run's summary from its directory: ``clip-train report RUN_DIR [--prefix demo]``.

Reads ``metrics.jsonl`` and the checkpoints, so it works on any finished (or running) run. The
last line is always the zero-shot top-1, e.g. ``demo: zero-shot top-1 = 0.953``, for scripts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clip_train.monitor import summarize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="the run's train.out_dir")
    parser.add_argument("--prefix", default="run", help="printed before every line (default: run)")


def run(args: argparse.Namespace) -> int:
    print("\n".join(summarize(args.run_dir, args.prefix)))
    return 0
