"""One logging setup: rank 0's status lines by default, rank-tagged on request, and progress that
is plain lines when stderr is not a terminal (a Slurm ``.out`` file)."""

from __future__ import annotations

import re
import sys

import pytest
from processes import run_to_end
from small_runs import DEMO_CONFIG, run_overrides

from clip_train.logs import Progress, get_logger, progress, setup_logging, timed


@pytest.fixture(autouse=True)
def restore_logging():
    yield
    setup_logging()


def test_rank_zero_logs_status_and_other_ranks_only_warnings(capsys):
    for rank in (0, 1):
        setup_logging(rank=rank, world_size=2)
        get_logger().info(f"status from {rank}")
        get_logger("data").warning(f"warning from {rank}")
    assert capsys.readouterr().err.splitlines() == [
        "clip-train: status from 0",
        "clip-train: warning from 0",
        "clip-train: warning from 1",
    ]


def test_all_ranks_tags_each_line_and_the_level_filters(capsys):
    setup_logging("WARNING", rank=1, world_size=2, all_ranks=True)
    get_logger().info("hidden by the level")
    get_logger().error("shown")
    setup_logging(rank=0, world_size=1, all_ranks=True)  # one process: nothing to tell apart
    get_logger().info("untagged")
    assert capsys.readouterr().err.splitlines() == ["clip-train: [rank 1] shown", "clip-train: untagged"]


def test_progress_off_a_terminal_is_plain_periodic_lines(capsys):
    setup_logging()
    assert list(progress(range(3), "encoding", total=3)) == [0, 1, 2]  # one line at the end
    shown = Progress("step", 10, initial=4, every_s=None)  # training: lines only when asked
    shown.move_to(5, {"loss": "2.3"})
    shown.move_to(6, {"loss": "2.1"})
    shown.plain_line()
    shown.plain_line()  # nothing new since the last line: not repeated
    shown.move_to(7)  # a stop before the next log step: its last line has no values of step 6
    shown.close()
    with timed("export: loading"):
        pass
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert re.fullmatch(r"clip-train: encoding: 3/3 \(\d+ s\)", lines[0])
    assert re.fullmatch(r"clip-train: step: 6/10, loss 2\.1 \(\d+ s\)", lines[1])
    assert re.fullmatch(r"clip-train: step: 7/10 \(\d+ s\)", lines[2])
    assert lines[3] == "clip-train: export: loading ..." and len(lines) == 5
    assert re.fullmatch(r"clip-train: export: loading: \d+\.\d s", lines[4])


def test_a_training_run_in_a_file_logs_a_line_per_log_step(digits, tmp_path):
    """What a Slurm .out file holds: the start-up lines and one plain line per log step, no bar. The
    demo's 20-step warmup spans these 20 steps, which start-up names."""
    overrides = run_overrides(digits, tmp_path / "run", 20, "log.every_steps=5")
    result = run_to_end([sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\r" not in result.stderr
    steps = re.findall(r"^clip-train: step: (\d+)/20, loss ", result.stderr, re.MULTILINE)
    assert steps == ["5", "10", "15", "20"]
    assert result.stderr.startswith(
        "clip-train: warning: optim.warmup_steps=20 >= train.max_steps=20: the rate rises to 100% of its "
        "peak at the last step, and optim.schedule=cosine never starts\n"
    ), result.stderr[:3000]
    assert all(line.startswith("clip-train: ") for line in result.stderr.splitlines()), result.stderr
