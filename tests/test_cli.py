import subprocess
import sys

import pytest

from clip_train.cli import BENCH_COMMANDS, COMMANDS


def clip_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clip_train", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "argv",
    [[], *[[c.name] for c in COMMANDS], ["bench"], *[["bench", c.name] for c in BENCH_COMMANDS]],
    ids=lambda argv: " ".join(argv) or "top",
)
def test_every_command_has_help(argv):
    result = clip_train(*argv, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: clip-train")


def test_console_script_matches_module():
    from clip_train.cli import build_parser

    assert build_parser().prog == "clip-train"


def test_bad_config_is_one_readable_line(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("batch:\n  global_sise: 64\n")
    result = clip_train("train", str(config))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        "clip-train: error: unknown config key batch.global_sise: did you mean batch.global_size"
    )


def test_bad_override_and_missing_file(tmp_path):
    result = clip_train("train", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "config file not found" in result.stderr and "Traceback" not in result.stderr
    config = tmp_path / "ok.yaml"
    config.write_text("batch:\n  global_size: 6\n")
    result = clip_train("train", str(config), "batch.image_chunk=4")
    assert result.returncode == 2
    assert "batch.image_chunk=4 must divide" in result.stderr and "Traceback" not in result.stderr
