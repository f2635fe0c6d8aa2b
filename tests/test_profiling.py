"""``log.profile_steps``: a run traces the steps it was asked for and writes a Chrome trace and a
summary; the summary's split of a CUDA window, which only a GPU produces, is checked on events whose
shares and idle gaps are known."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from test_trainer import in_process_trainer

import clip_train.profiling
from clip_train.config import ConfigError
from clip_train.profiling import PHASES, PREFIX, SHARES, TRACED, StepProfiler, category, summarise


def _event(name, start, end, device="cuda", annotation=False, self_us=0.0):
    return {
        "name": name,
        "device": device,
        "start": start,
        "end": end,
        "self": self_us,
        "annotation": annotation,
    }


def _phase(name, start, end, device="cpu"):
    return _event(PREFIX + name, start, end, device, annotation=True)


# A 100 µs window. The host: data 0-10, encode 10-30, loss 30-50, replay 50-70, optimizer 70-80.
# The GPU: a copy 5-8, a GEMM 12-40 overlapping a fused LayerNorm 35-45 (busy 33 µs, kernel time
# 38, shared pro rata), flash attention 55-70, and the optimizer's kernel 78-90, inside the
# optimizer's span on the GPU (75-95). Busy 63 µs of 68 kernel-µs; the idle gaps 0-5, 8-12, 45-55,
# 70-78 and 90-100 fall while the host was in data (5 + 2), encode (2), loss (5), replay (5),
# optimizer (8) and after its phases (10).
WINDOW = [
    _event(TRACED, 0, 100, "cpu", annotation=True),
    _phase("data", 0, 10),
    _phase("encode", 10, 30),
    _phase("loss", 30, 50),
    _phase("replay", 50, 70),
    _phase("optimizer", 70, 80),
    _phase("optimizer", 75, 95, "cuda"),
    _event("Optimizer.step#AdamW.step", 78, 90, annotation=True),  # torch's own range: not a kernel
    _event("aten::mm", 12, 13, "cpu", self_us=1.0),  # CPU ops do not count in a CUDA window
    _event("Memcpy HtoD (Pinned -> Device)", 5, 8),
    _event("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_bias_TNN", 12, 40),
    _event("triton_per_fused__to_copy_add_native_layer_norm_7", 35, 45),
    _event("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", 55, 70),
    _event("multi_tensor_apply_kernel", 78, 90),
]


def test_a_cuda_window_counts_overlaps_once_and_charges_each_idle_gap_to_the_hosts_phase():
    summary = summarise(WINDOW, "cuda", steps=1)
    assert summary["step_s"] == pytest.approx(100e-6) and summary["busy_s"] == pytest.approx(63e-6)
    shares = summary["shares"]
    assert shares["idle"] == pytest.approx(0.37)
    expected = {"matmul": 28, "elementwise": 10, "attention": 15, "copies": 3, "optimizer": 12}
    for name, microseconds in expected.items():
        assert shares[name] == pytest.approx(0.63 * microseconds / 68)
    assert sum(shares.values()) == pytest.approx(1.0) and set(shares) == set(SHARES)
    idle = {"data": 7, "encode": 2, "loss": 5, "replay": 5, "optimizer": 8, "other": 10}
    assert summary["idle_s"] == pytest.approx({name: us * 1e-6 for name, us in idle.items()})
    host = {"data": 10, "encode": 20, "loss": 20, "replay": 20, "optimizer": 10}
    assert summary["host_s"] == pytest.approx({name: us * 1e-6 for name, us in host.items()})
    top = summary["top_kernels"]
    assert [k["name"][:6] for k in top] == ["nvjet_", "cudnn_", "multi_", "triton", "Memcpy"]
    assert top[0]["time_s"] == pytest.approx(28e-6) and top[0]["share"] == pytest.approx(0.28)


def test_collectives_are_timed_apart_from_the_shares_and_the_busy_time():
    """An all-gather on NCCL's stream (20-60 µs, over the GEMM and an idle gap): its time is mostly
    a wait for the other ranks, so the window's shares and idle stay what the compute made them."""
    alone = summarise(WINDOW, "cuda", steps=1)
    gathering = [*WINDOW, _event("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 20, 60)]
    summary = summarise(gathering, "cuda", steps=1)
    assert summary["shares"] == alone["shares"] and summary["busy_s"] == alone["busy_s"]
    assert summary["communication_s"] == pytest.approx(40e-6) and alone["communication_s"] == 0
    assert all("nccl" not in kernel["name"] for kernel in summary["top_kernels"])


def test_a_window_of_several_steps_reports_each_per_step():
    one, two = summarise(WINDOW, "cuda", steps=1), summarise(WINDOW, "cuda", steps=2)
    assert two["shares"] == one["shares"] and two["step_s"] == pytest.approx(one["step_s"] / 2)
    assert two["idle_s"] == pytest.approx({name: s / 2 for name, s in one["idle_s"].items()})
    assert (
        two["top_kernels"][0]["calls"] == 0.5
        and two["top_kernels"][0]["share"] == one["top_kernels"][0]["share"]
    )


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT", "matmul"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::addmm", "matmul"),
        ("Memset (Device)", "copies"),
        ("aten::copy_", "copies"),
        ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copies"),
        ("triton_per_fused_native_layer_norm_0", "elementwise"),
        ("triton_per_fused__to_copy_add_native_layer_norm_10", "elementwise"),  # inductor's fusion
    ],
)
def test_kernels_fall_into_their_shares_by_name(name, label):
    assert category(name, in_optimizer=False) == label
    assert category(name, in_optimizer=True) == "optimizer"


def test_a_run_traces_the_steps_it_was_asked_for(digits, tmp_path):
    """Steps 3-4 of 5 on the CPU: every phase shows in the trace and in the summary."""
    profile = ["log.profile_after=2", "log.profile_steps=2", "log.every_steps=5", "train.max_steps=5"]
    in_process_trainer(digits, tmp_path, *profile).run()
    folder = tmp_path / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["summary-rank0.json", "trace-rank0.json.gz"]
    summary = json.loads((folder / "summary-rank0.json").read_text())
    assert summary["steps_traced"] == [3, 4] and summary["steps"] == 2 and summary["device"] == "cpu"
    assert sum(summary["shares"].values()) == pytest.approx(1.0) and summary["shares"]["matmul"] > 0
    assert all(summary["host_s"][name] > 0 for name in PHASES)
    assert 0 < summary["busy_s"] <= summary["step_s"]
    with gzip.open(folder / "trace-rank0.json.gz") as trace:
        names = {event.get("name") for event in json.load(trace)["traceEvents"]}
    assert {PREFIX + name for name in PHASES} | {TRACED} <= names
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [5]  # the run went on after the trace


def test_a_window_past_the_runs_end_is_refused_at_start_up(digits, tmp_path):
    """Such a run traced steps 3-4 and then wrote nothing, saying nothing."""
    with pytest.raises(
        ConfigError, match=r"^log\.profile_after=2 \+ log\.profile_steps=5 pass train\.max_steps=4"
    ):
        in_process_trainer(
            digits, tmp_path, "log.profile_after=2", "log.profile_steps=5", "train.max_steps=4"
        )


def test_no_profile_steps_starts_no_profiler(digits, tmp_path, monkeypatch):
    """The default (log.profile_steps=0) past log.profile_after: no profiler ever runs."""
    started = []
    real = clip_train.profiling.profile
    monkeypatch.setattr(clip_train.profiling, "profile", lambda *a, **k: started.append(1) or real(*a, **k))
    in_process_trainer(digits, tmp_path, "log.profile_after=1", "train.max_steps=3").run()
    assert started == [] and not (tmp_path / "profile").exists()


def test_a_run_resumed_past_the_traces_start_says_it_traces_nothing(digits, tmp_path, capsys):
    """Saved at step 2 unprofiled, resumed with the trace from step 2 (log.profile_after=1): nothing is
    traced, and rank 0 says so (the advice's cases are below)."""
    schedule = ["train.max_steps=4", "checkpoint.every_steps=2", "log.profile_steps=2"]
    in_process_trainer(digits, tmp_path, *schedule, "log.profile_steps=0", "train.max_steps=2").run()
    in_process_trainer(digits, tmp_path, *schedule, "log.profile_after=1", "checkpoint.resume=auto").run()
    warning = (
        "warning: nothing is traced: log.profile_after=1 starts the trace at step 2, and this run resumed "
        "at step 2; log.profile_after=2 traces the steps it runs"
    )
    assert warning in capsys.readouterr().err and not (tmp_path / "profile").exists()


@pytest.mark.parametrize(
    ("resumed", "written", "advice"),
    [
        (10, None, None),  # before step 11: traced
        (11, None, "log.profile_after=11 to 95"),
        (95, None, "log.profile_after=95"),
        (97, None, "log.profile_after=97 with log.profile_steps=3 or fewer"),
        (100, None, None),  # a finished run started again only evaluates
        (50, [11, 15], None),  # the run traced its window before it stopped
        (50, [21, 25], "log.profile_after=50 to 95"),  # another window's trace
    ],
)
def test_a_resumed_run_is_told_which_profile_after_traces_it(tmp_path, resumed, written, advice):
    """Steps 11-15 of 100 (log.profile_after=10, log.profile_steps=5)."""
    profiler = StepProfiler(11, 5, tmp_path, torch.device("cpu"), rank=0)
    if written is not None:
        (tmp_path / "profile").mkdir()
        (tmp_path / "profile" / "summary-rank0.json").write_text(json.dumps({"steps_traced": written}))
    said = profiler.missed_by(resumed, max_steps=100)
    assert said == (
        advice
        and "warning: nothing is traced: log.profile_after=10 starts the trace at step 11, and this run "
        f"resumed at step {resumed}; {advice} traces the steps it runs"
    )
