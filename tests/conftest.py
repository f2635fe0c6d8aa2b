import os
import subprocess
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
    out = tmp_path_factory.mktemp("digits")
    command = [sys.executable, "-m", "clip_train", "make-shards", "digits", str(out), "--size", "16"]
    subprocess.run(command, check=True, capture_output=True)
    return out
