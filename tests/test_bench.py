"""`clip-train bench loss` end to end at a toy size: every implementation runs in its own fresh
process and once more in the paired process, and the JSON records both (the figures themselves
are measurements for the README, never asserted here)."""

from __future__ import annotations

import json
import sys

from processes import run_to_end


def test_bench_loss_sigmoid_runs_ours_and_open_clips_side_by_side(tmp_path):
    out = tmp_path / "loss.json"
    command = [sys.executable, "-m", "clip_train", "bench", "loss", "--kind", "sigmoid", "--batch", "256"]
    result = run_to_end([*command, "--dim", "32", "--repeats", "1", "--json", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    measured = {point["impl"]: point for point in report["points"]}
    assert set(measured) == {"floor", "vanilla", "inf", "open_clip"}
    assert all(point["time_s"] > 0 for point in measured.values())
    assert all(measured[impl]["peak_mib"] >= 0 for impl in ("vanilla", "inf", "open_clip"))
    (paired,) = report["paired"]
    assert set(paired["median_s"]) == {"vanilla", "inf", "open_clip"}
    assert "inf / open_clip" in result.stdout
