"""A run's summary from its directory: ``python -m clip_train.report RUN_DIR [--prefix demo]``.

Reads ``metrics.jsonl`` and the checkpoints, so it works on any finished (or running) run. The
last line is always the zero-shot top-1, e.g. ``demo: zero-shot top-1 = 0.953``, for scripts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from clip_train.checkpoint import complete_checkpoints


def summarize(run_dir: Path, prefix: str) -> list[str]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "zeroshot/top1" in r]
    if not train or not evals:
        raise SystemExit(f"{run_dir}: no training steps or no zero-shot eval in metrics.jsonl")
    checkpoints = complete_checkpoints(run_dir)
    final = evals[-1]
    wall_s = train[-1]["time"] - train[0]["time"] + train[0]["time/step_s"]  # periodic evals included
    lines = [
        f"run directory   {run_dir}",
        f"checkpoint      {checkpoints[-1] if checkpoints else 'none'}",
        f"training        {train[-1]['step']} steps in {wall_s:.0f} s, "
        f"median {statistics.median(r['train/samples_per_s'] for r in train):.0f} samples/s, "
        f"final loss {train[-1]['train/loss']:.3f}",
    ]
    if "retrieval/image_to_text_R@1" in final:
        lines.append(
            f"retrieval R@1   image->text {final['retrieval/image_to_text_R@1']:.3f}, "
            f"text->image {final['retrieval/text_to_image_R@1']:.3f}"
        )
    lines.append(f"zero-shot top-1 = {final['zeroshot/top1']:.3f}")
    return [f"{prefix}: {line}" for line in lines]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clip_train.report", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prefix", default="run")
    args = parser.parse_args(argv)
    print("\n".join(summarize(args.run_dir, args.prefix)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
