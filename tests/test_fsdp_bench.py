"""``clip-train bench step --parallel ddp,fsdp`` on 2 gloo ranks (the tiny model): both modes side by side,
and the sharded towers' per-rank training state is half the replicated one's."""

from __future__ import annotations

import json
import sys

import pytest
from processes import run_to_end
from small_runs import TINY_MODEL_CONFIG


def test_bench_step_parallel_reports_ddp_and_fsdp_side_by_side(tmp_path):
    out = tmp_path / "parallel.json"
    command = [sys.executable, "-m", "clip_train", "bench", "step", "--parallel", "ddp,fsdp", "--world", "2"]
    command += ["--model", str(TINY_MODEL_CONFIG)]
    command += [
        "--batch",
        "4",
        "--image-chunk",
        "2",
        "--text-chunk",
        "4",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    result = run_to_end(command)
    assert result.returncode == 0, result.stderr[-3000:]
    ddp, fsdp = json.loads(out.read_text())["parallel"]
    assert (ddp["mode"], fsdp["mode"]) == ("ddp", "fsdp") and ddp["world"] == fsdp["world"] == 2
    for part in ("parameters", "gradients", "optimizer"):
        assert fsdp[part] / ddp[part] == pytest.approx(0.5, rel=0.15), part
    for point in (ddp, fsdp):
        assert len(point["ranks"]) == 2 and point["median_s"] > 0 and point["peak_bytes"] > 0
        assert 0 < point["built_other_bytes"] <= point["peak_bytes"]
        assert (
            point["built_main_bytes"] == point["ranks"][0]["built_bytes"] <= point["ranks"][0]["peak_bytes"]
        )
    rows = [line.split()[0] for line in result.stdout.splitlines()[1:]]
    assert rows == ["ddp", "fsdp"]


def test_an_unknown_parallel_mode_is_one_line():
    command = [sys.executable, "-m", "clip_train", "bench", "step", "--parallel", "ddp,zero"]
    result = run_to_end(command)
    assert result.returncode == 2 and "--parallel 'ddp,zero': unknown ['zero']" in result.stderr
    assert "Traceback" not in result.stderr
