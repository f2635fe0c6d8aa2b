"""`clip-train bench loss`, `bench step` and `bench train` end to end at a toy size: every implementation or
trainer runs in its own fresh process, and the JSON records each (the figures themselves are
measurements for docs/benchmarks.md, never asserted here)."""

from __future__ import annotations

import json
import statistics
import sys
import tarfile

from processes import run_to_end
from small_runs import TINY_MODEL, TINY_MODEL_CONFIG

from clip_train.bench import loss as bench_loss
from clip_train.bench.data import write_synthetic
from clip_train.bench.train import SPLIT, _summarise
from clip_train.cli import main as cli_main


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


def test_bench_loss_has_its_json_whole_on_disk_after_each_point(tmp_path):
    """``bench gpu`` stops a ``bench loss`` that outlives its time: the JSON is rewritten whole after
    each point, so the points measured before a stop stay, and no temporary file is left."""
    out = tmp_path / "loss.json"
    results = bench_loss._Results(out)
    floor, point = (
        {"batch": 64, "impl": "floor", "time_s": 1e-4},
        {"batch": 64, "impl": "inf", "time_s": 1e-3},
    )
    results.add("points", floor)
    assert json.loads(out.read_text()) == {"points": [floor], "paired": [], "accuracy": []}
    results.add("points", point)
    results.add("paired", {"batch": 64, "median_s": {"inf": 1e-3}})
    assert json.loads(out.read_text()) == {
        "points": [floor, point],
        "paired": [{"batch": 64, "median_s": {"inf": 1e-3}}],
        "accuracy": [],
    }
    assert sorted(path.name for path in tmp_path.iterdir()) == ["loss.json"]


def test_bench_loss_distill_measures_ours_and_checks_it_against_open_clips_formula(tmp_path):
    """``--kind distill``: the loss plus the distillation term; its accuracy is measured against
    open_clip's ``DistillClipLoss`` in fp64 (the benchmark's own check, asserted here)."""
    out = tmp_path / "distill.json"
    command = ["bench", "loss", "--kind", "distill", "--batch", "64", "--dim", "16", "--impl", "inf"]
    assert cli_main([*command, "--repeats", "1", "--accuracy", "48", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(point["kind"], point["impl"]) for point in report["points"]] == [
        ("distill", "floor"),
        ("distill", "inf"),
    ]
    assert all(point["time_s"] > 0 for point in report["points"])
    (accuracy,) = report["accuracy"]
    assert accuracy["loss_rel_error"] < 1e-6 and accuracy["grad_rel_error"] < 1e-5, accuracy


def test_bench_loss_on_two_gloo_ranks_reports_the_slower_ranks_time(tmp_path):
    """``--world 2``: the ring loss on two gloo ranks, which the measurement's fresh process starts;
    the point's time is the slower rank's median. The floor is timed in one process."""
    out = tmp_path / "world.json"
    command = ["bench", "loss", "--batch", "64", "--dim", "16", "--impl", "inf", "--world", "2"]
    assert cli_main([*command, "--repeats", "3", "--json", str(out)]) == 0
    floor, ring = json.loads(out.read_text())["points"]
    assert (floor["impl"], floor["world"], ring["impl"], ring["world"]) == ("floor", 1, "inf", 2)
    assert len(ring["times_s"]) == 3 and ring["time_s"] >= statistics.median(ring["times_s"]) > 0
    assert ring["peak_mib"] >= 0


def test_bench_step_measures_each_mode_fresh_then_both_in_turn(tmp_path):
    """Gradient Cache and the direct step each in a fresh process (time, memory, the process's time
    to its warm-up step), then alternating in one process for their ratio."""
    out = tmp_path / "step.json"
    command = [sys.executable, "-m", "clip_train", "bench", "step", "--model", str(TINY_MODEL_CONFIG)]
    options = [
        "--batch",
        "8",
        "--image-chunk",
        "4",
        "--text-chunk",
        "4",
        "--repeats",
        "2",
        "--json",
        str(out),
    ]
    result = run_to_end([*command, *options])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(p["mode"], p["batch"], len(p["times_s"])) for p in report["points"]] == [
        ("gc", 8, 2),
        ("direct", 8, 2),
    ]
    for point in report["points"]:
        assert point["median_s"] > 0 and point["warmup_s"] > 0 and 0 < point["ready_s"] < 120
        assert point["peak_bytes"] >= point["batch_bytes"] > 0
    gc, direct = report["points"]
    assert gc["cache_bytes"] > 0 == direct["cache_bytes"]  # the feature cache is Gradient Cache's
    (paired,) = report["paired"]
    ratio = paired["median_s"]["gc"] / paired["median_s"]["direct"]
    assert f"B=8      gc / direct: {ratio:.3f} ({gc['median_s'] / direct['median_s']:.3f})" in result.stdout


def test_bench_train_runs_both_trainers_in_turn_on_one_architecture(tmp_path, digits):
    """A tiny run of each trainer, in turn: both runs parsed, the table row and the JSON written."""
    out = tmp_path / "train.json"
    command = [sys.executable, "-m", "clip_train", "bench", "train", "--batch", "32", "--procs", "1"]
    options = ["--steps", "3", "--warmup", "1", "--pairs", "1", "--shards", str(digits), "--json", str(out)]
    result = run_to_end([*command, *options, "--set", *TINY_MODEL, "data.num_samples=64"])
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    (pair,) = row["pairs"]
    assert (row["batch"], row["procs"]) == (32, 1)
    ours, theirs = pair["clip_train"]["samples_per_s"], pair["open_clip"]["samples_per_s"]
    assert ours > 0 and theirs > 0 and row["ratio"] == ours / theirs
    assert set(pair["clip_train"]["split_s"]) == set(SPLIT)
    assert f"| 32 | 1 | {theirs:.0f} | {ours:.0f} | {row['ratio']:.2f} |" in result.stdout


def test_bench_train_takes_the_ratio_pair_by_pair():
    """The ratio is the median of each pair's ratio, whose runs shared the machine's state, not the
    ratio of the two medians: here 1.0 against 3.0."""
    speeds = [(100.0, 100.0), (300.0, 300.0), (400.0, 100.0)]  # (clip_train, open_clip) samples/s
    split = dict.fromkeys(SPLIT, 0.1)
    pairs = [
        {"clip_train": {"samples_per_s": ours, "split_s": split}, "open_clip": {"samples_per_s": theirs}}
        for ours, theirs in speeds
    ]
    summary = _summarise({"batch": 32, "procs": 1, "pairs": pairs})
    assert summary["ratio"] == 1.0
    assert (summary["clip_train_samples_per_s"], summary["open_clip_samples_per_s"]) == (300.0, 100.0)
    assert summary["clip_train_split_s"] == split


def test_synthetic_shards_are_written_in_key_order_and_the_same_every_time(tmp_path):
    """Their records are made in parallel threads; the shards come out in order, byte for byte alike."""
    first, second = (write_synthetic(tmp_path / name, 24) for name in ("a", "b"))
    (shard,) = sorted(first.glob("*.tar"))
    assert shard.read_bytes() == (second / shard.name).read_bytes()
    with tarfile.open(shard) as tar:
        keys = [member.name.split(".")[0] for member in tar.getmembers()]
    assert keys == sorted(keys) and len(set(keys)) == 24 and keys[0] == f"{0:09d}"
