import os
import sys
from pathlib import Path

import pytest

# Tests never touch a model hub or wandb's servers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    """The embedded digits set at 16 px, written once per test session by the real CLI."""
    from processes import run_to_end

    out = tmp_path_factory.mktemp("digits")
    command = [sys.executable, "-m", "clip_train", "make-shards", "digits", str(out), "--size", "16"]
    result = run_to_end(command)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="session")
def demo_run(digits, tmp_path_factory) -> Path:
    """A short real run of the demo recipe (tiny model, mean pooling) by the real CLI: checkpoints at
    steps 20 and 40, and a run config whose eval section is digits zero-shot on the val shards."""
    from processes import run_to_end
    from small_runs import DEMO_CONFIG, run_overrides

    out = tmp_path_factory.mktemp("demo_run")
    overrides = run_overrides(
        digits,
        out,
        40,
        "checkpoint.every_steps=20",
        f"eval.zeroshot={digits}/zeroshot.json",
        f"eval.zeroshot_data={digits}/val",
    )
    command = [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *overrides]
    result = run_to_end(command)
    assert result.returncode == 0, result.stderr[-3000:]
    return out
