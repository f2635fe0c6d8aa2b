"""`clip-train bench gpu` (`make gpu-bench`): its dry run on the CPU runs every section the GPU
session runs and writes the same files, so the command cannot rot between GPU sessions; a failing
section is recorded and the others still run; what finished is on disk before the next section
starts; and the profile's split of a CUDA step, which only a GPU produces, is checked on events
whose shares are known."""

from __future__ import annotations

import json
import sys

import pytest
from processes import Watched, run_to_end

from clip_train.bench.gpu import FILES, OPTIMIZER, SECTIONS, SHARES, STEP, category, summarise_profile
from clip_train.bench.train import SPLIT


def _bench(out, *options: str):
    result = run_to_end([sys.executable, "-m", "clip_train", "bench", "gpu", "--out", str(out), *options])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads((out / "gpu-bench.json").read_text())


@pytest.mark.slow
def test_the_dry_run_runs_every_section_and_prints_the_summary_last(tmp_path):
    out = tmp_path / "bench"
    result, report = _bench(out)
    assert result.stdout.splitlines()[0].startswith("gpu-bench: DRY RUN on the CPU")
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)  # at most 8 files: no venv, no shards
    summary = (out / "gpu-bench.md").read_text()
    assert summary.startswith("# gpu-bench: DRY RUN") and result.stdout.rstrip().endswith(summary.rstrip())
    assert report["dry_run"] and all("error" not in report[name] for name in SECTIONS), summary

    loss = report["loss"]
    assert {p["impl"] for p in loss["points"]} == {"inf", "open_clip"} and loss["inf_cl"] == "not installed"
    for point in loss["points"]:  # 4 matmuls at the measured rate (the best 1-matmul floor)
        assert point["x_floor"] == pytest.approx(point["time_s"] / point["four_matmul_floor_s"])
    assert loss["matmul_tflops"] == max(loss["matmul_tflops_by_batch"].values()) > 0
    for accuracy in loss["accuracy"]:  # bf16 against fp64: a few parts in a thousand, never exact
        assert 0 < accuracy["loss_rel_error"] < 2e-2 and 0 < accuracy["grad_rel_error"] < 5e-2

    trainer = report["trainer"]  # log windows from the first after the warm-up: steps 3-4, not 2-4
    assert (trainer["warmup"], trainer["log_every"], trainer["steps"]) == (1, 2, 4)
    assert "medians over steps 3-4:" in summary
    runs = trainer["runs"]
    assert [(r["batch"], r["compile"]) for r in runs] == [(16, False), (32, True)]
    for run in runs:  # the CPU's peak is the measured matmul rate: MFU is the share of it
        assert run["samples_per_s"] > 0 and set(run["split_s"]) == set(SPLIT)
        assert run["mfu"] == pytest.approx(run["tflops"] / loss["matmul_tflops"], rel=1e-9)
        assert run["of_matmul_rate"] == pytest.approx(run["mfu"], rel=1e-9)

    (point,) = report["step"]["points"]  # the eager trainer's batch and chunks, beside its samples/s
    assert (point["batch"], point["chunks"]) == (16, [0, 0])
    assert point["samples_per_s"] == 16 / point["step_s"]
    share = runs[0]["samples_per_s"] / point["samples_per_s"]
    assert f"| 16 | 0/0 | {point['step_s']:.4f} |" in summary and f"| {share:.1%} |" in summary

    assert report["open_clip"]["ratio"] > 0 and report["open_clip"]["batch"] == 16
    profile = report["profile"]
    assert "one step at batch 16 with train.compile" in summary  # eager here (TORCHDYNAMO_DISABLE)
    assert sum(profile["shares"].values()) == pytest.approx(1.0)
    assert profile["shares"]["matmul"] > 0 and profile["shares"]["optimizer"] > 0
    assert 0 < len(profile["top_kernels"]) <= 15
    assert any(k["name"] in ("aten::mm", "aten::addmm") for k in profile["top_kernels"])
    for heading in ("## loss", "## trainer", "## step", "## open_clip", "## profile"):
        assert heading in summary


@pytest.mark.slow
def test_a_failing_section_is_recorded_at_once_and_the_next_one_runs(tmp_path):
    """A value that the trainer's start-up check refuses: OpenCLIP's section fails with its message,
    which is on disk before the next section starts (a GPU session whose time runs out keeps what
    finished), and the profile (which builds the model without the run's checks) still runs."""
    out = tmp_path / "bench"
    bench = Watched.start([sys.executable, "-m", "clip_train", "bench", "gpu", "--out", str(out),
                           "--sections", "open_clip,profile", "--set", "log.peak_tflops=-1"])  # fmt: skip
    bench.wait_for(lambda: "gpu-bench: profile ..." in bench.stdout.text, "the second section started")
    so_far = json.loads((out / "gpu-bench.json").read_text())
    assert "log.peak_tflops=-1.0 must be >= 0" in so_far["open_clip"]["error"] and "profile" not in so_far
    assert "**failed**" in (out / "gpu-bench.md").read_text()

    result = bench.wait()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "gpu-bench.json").read_text())
    assert report["open_clip"] == so_far["open_clip"]
    assert "error" not in report["profile"] and report["profile"]["shares"]["matmul"] > 0
    assert "gpu-bench: open_clip: FAILED" in result.stdout and "gpu-bench: profile: done" in result.stdout
    assert "## profile" in (out / "gpu-bench.md").read_text()


def _event(name, start, end, device="cuda", self_us=0.0):
    return {"name": name, "device": device, "start": start, "end": end, "self": self_us}


def test_a_cuda_steps_split_counts_overlaps_once_and_the_rest_as_idle():
    """A 100 µs step: a GEMM 0-30 overlapping an elementwise kernel 20-40 (busy 40 µs, kernel time
    50, shared pro rata), flash attention 50-60, a copy 60-65, then the optimizer's annotation at
    70 and an un-named kernel 75-85 after it (the optimizer's). Busy 65 µs of 75 kernel-µs; idle 35."""
    events = [
        _event(STEP, 0, 100, "cpu"),
        _event(OPTIMIZER, 70, 72, "cpu"),
        _event("aten::mm", 1, 2, "cpu", 1.0),  # CPU ops do not count on a CUDA step
        _event("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 30),
        _event("vectorized_elementwise_kernel", 20, 40),
        _event("pytorch_flash::flash_fwd_kernel", 50, 60),
        _event("Memcpy HtoD (Pinned -> Device)", 60, 65),
        _event("multi_tensor_apply_kernel", 75, 85),
    ]
    summary = summarise_profile(events, "cuda")
    assert summary["step_s"] == pytest.approx(100e-6) and summary["busy_s"] == pytest.approx(65e-6)
    shares = summary["shares"]
    assert shares["idle"] == pytest.approx(0.35)
    expected = {"matmul": 30, "elementwise": 20, "attention": 10, "copies": 5, "optimizer": 10}
    for name, microseconds in expected.items():
        assert shares[name] == pytest.approx(0.65 * microseconds / 75)
    assert sum(shares.values()) == pytest.approx(1.0) and set(shares) == set(SHARES)
    assert summary["top_kernels"][0]["name"].startswith("sm90_xmma_gemm")


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT", "matmul"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::addmm", "matmul"),
        ("Memset (Device)", "copies"),
        ("aten::copy_", "copies"),
        ("triton_per_fused_native_layer_norm_0", "elementwise"),
    ],
)
def test_kernels_fall_into_their_shares_by_name(name, label):
    assert category(name, in_optimizer=False) == label
    assert category(name, in_optimizer=True) == "optimizer"
