"""Every way a run ends ends the process: a data abort or a bad shard gives one line and an exit,
with 1 and 2 ranks, instead of a process waiting forever on data workers that ignore SIGTERM."""

from __future__ import annotations

import io
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest
from processes import Watched
from small_runs import DEMO_CONFIG, run_overrides

EXIT_AFTER_MESSAGE_S = 30  # the bound; a hang is forever, an exit takes about a second


def images_without_captions(folder: Path, digits: Path) -> Path:
    """A shard of real images whose captions were left out: every sample is skipped."""
    folder.mkdir()
    with (
        tarfile.open(next((digits / "train").glob("*.tar"))) as source,
        tarfile.open(folder / "no-captions.tar", "w") as shard,
    ):
        for member in source.getmembers():
            if not member.name.endswith(".txt"):
                shard.addfile(member, io.BytesIO(source.extractfile(member).read()))
    return folder


def empty_file(folder: Path, digits: Path) -> Path:
    folder.mkdir()
    (folder / "empty.tar").touch()
    return folder / "empty.tar"


def launcher(ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", "clip_train"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return [*torchrun, "-m", "clip_train"]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize(
    ("make_data", "message"),
    [
        (images_without_captions, "were skipped, more than data.max_skip_fraction"),
        (empty_file, "none of its 1 local shards is a readable tar, e.g. "),
    ],
    ids=["all-bad-samples", "0-byte-file"],
)
def test_a_failed_run_exits_soon_after_its_message(digits, tmp_path, ranks, make_data, message):
    data = make_data(tmp_path / "data", digits)
    overrides = run_overrides(digits, tmp_path / "run", 5, f"data.train={data}", "data.resampled=true")
    command = [*launcher(ranks), "train", str(DEMO_CONFIG), *overrides]
    run = Watched.start(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        run.wait_for(lambda: run.stderr.first_seen(message) is not None, "the error message")
        shown = run.stderr.first_seen(message)
        run.process.wait(timeout=max(1.0, shown + EXIT_AFTER_MESSAGE_S - time.monotonic()))
    finally:
        run.process.kill()
    result = run.wait()
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if message in line]
    assert len(errors) == ranks or (ranks == 2 and errors), result.stderr[-3000:]
    assert all(line.startswith("clip-train: ") for line in errors)
    if ranks == 1:  # one process: exactly one line, no traceback
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
