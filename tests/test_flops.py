"""Model FLOPs per sample and MFU: the start-up count against FlopCounterMode over whole training
steps, the peak table, and the ``mfu`` a real run logs against figures recomputed from its log."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from dist_utils import run_distributed
from processes import run_to_end
from small_runs import TINY_MODEL, TINY_MODEL_CONFIG, run_overrides

import clip_train.trainer
from clip_train.config import load_config
from clip_train.distributed import DistEnv
from clip_train.engine import GradCache
from clip_train.flops import (
    PEAK_TFLOPS,
    device_peak_tflops,
    flop_counter_mode,
    tower_flops,
    training_flops_per_sample,
)
from clip_train.model import build_model
from clip_train.trainer import Trainer

ROWS = 8


def _tiny_model(*overrides: str):
    torch.manual_seed(0)
    return build_model(load_config(TINY_MODEL_CONFIG, [*TINY_MODEL, *overrides]).model).train()


def _batch(model, rows: int = ROWS):
    gen = torch.Generator().manual_seed(0)
    size, context = model.image_size, model.tokenizer.context_length
    images = torch.randint(0, 256, (rows, 3, size, size), dtype=torch.uint8, generator=gen)
    input_ids = torch.randint(1, model.tokenizer.vocab_size, (rows, context), generator=gen)
    return images, input_ids, torch.ones_like(input_ids)


def _step_flops(model, **chunks) -> tuple[float, float]:
    """FLOPs of one whole Gradient Cache step counted op by op, per sample, and the start-up count."""
    engine = GradCache(model, loss_impl="inf", **chunks)
    with flop_counter_mode() as counter:
        engine.step(*_batch(model))
    model.zero_grad(set_to_none=True)
    counted = training_flops_per_sample(tower_flops(model), *engine.trains_and_replays(ROWS))
    return counter.get_total_flops() / ROWS, counted


def test_one_sample_forward_scales_to_the_whole_batch():
    """Per-sample attention and matmuls: one sample's count is the batch's over its size, exactly."""
    model = _tiny_model()
    image, text = tower_flops(model)
    images, input_ids, attention_mask = _batch(model)
    with torch.no_grad(), flop_counter_mode() as counter:
        model(images, input_ids, attention_mask)
    assert counter.get_total_flops() == ROWS * (image.frozen + image.trainable + text.frozen + text.trainable)
    attention = counter.get_flop_counts()["Global"]
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in attention  # counted on the CPU too


@pytest.mark.parametrize("overrides", [(), ("model.image.timm_kwargs.patch_drop_rate=0.5",)])
def test_the_start_up_count_matches_a_counted_step_with_and_without_replay(overrides):
    """One chunk: forward + backward of the whole batch, which the count puts at 3 x forward (the
    patch embedding's input gradient, never computed, and the loss make the difference: 3 % here,
    where 8-px patches are a large share of a tiny tower). Image chunks of 2: the image tower
    replays the 3 chunks before its last (which keeps its graph), and the step grows by exactly
    their forward. With patch dropout (FLIP) the blocks see half the patches, and so does the count."""
    model = _tiny_model(*overrides)
    one_chunk, counted_one = _step_flops(model)
    chunked, counted_chunked = _step_flops(model, image_chunk=2, text_chunk=0)
    assert counted_one == pytest.approx(one_chunk, rel=0.05)
    image, _ = tower_flops(model)
    assert counted_chunked - counted_one == pytest.approx(image.trainable * 3 / 4, rel=1e-12)
    assert chunked - one_chunk == pytest.approx(image.trainable * 3 / 4, rel=1e-12)


def test_a_locked_trunk_counts_its_forward_once():
    model = _tiny_model("model.image.lock=true", "model.image.unlocked_layers=1")
    modes = [m.training for m in model.modules()]
    image, text = tower_flops(model)
    assert [m.training for m in model.modules()] == modes and not all(modes)  # the frozen trunk stays eval
    assert image.frozen > 0 and image.trainable > 0  # the trunk and the unlocked block with the head
    one_chunk, counted = _step_flops(model)
    assert counted == image.frozen + 3 * image.trainable + 3 * (text.frozen + text.trainable)
    assert counted == pytest.approx(one_chunk, rel=0.05)


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 156.0),  # fp32 runs TF32 matmuls on CUDA
        ("NVIDIA H200", "fp16", 989.4),
        ("NVIDIA L40S", "bf16", 362.1),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA GB200", "bf16", 2500.0),  # a word of its own, not a B200
        ("NVIDIA GH200 480GB", "bf16", 989.4),
        ("NVIDIA RTX A1000", "bf16", None),  # not an A100
        ("NVIDIA H100 80GB HBM3", "fp64", None),
        ("Tesla T4", "bf16", None),
    ],
)
def test_the_peak_comes_from_the_table_by_device_name_and_matmul_dtype(monkeypatch, name, precision, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_tflops(torch.device("cuda", 0), precision) == peak
    assert device_peak_tflops(torch.device("cuda", 0), precision, override=123.0) == 123.0


def test_the_cpu_has_no_peak_unless_one_is_given():
    assert device_peak_tflops(torch.device("cpu"), "fp32") is None
    assert device_peak_tflops(torch.device("cpu"), "fp32", override=0.5) == 0.5
    assert set(PEAK_TFLOPS) >= {"A100", "A800", "H100", "H200", "L40S", "B200"}


def _records(run_dir) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "train/samples_per_s" in r]


def test_a_run_logs_samples_per_second_over_each_log_window_and_mfu_only_with_a_peak(tmp_path, digits):
    """samples/s covers every step since the last log (5 steps logged every 2: windows of 1, 2 and 1
    steps; the process's first step, which the start-up metrics time, in none), not the logged step
    alone, whose stage timing waits for the device. MFU: whole per-rank
    batches (no replay), 3 x the forward FLOPs that FlopCounterMode counts on a batch of the run's
    model, times the logged samples/s, over log.peak_tflops."""
    peak, one_chunk = 0.5, ["batch.image_chunk=0", "batch.text_chunk=0"]
    with_peak, without = tmp_path / "with_peak", tmp_path / "without"
    command = [sys.executable, "-m", "clip_train", "train", str(TINY_MODEL_CONFIG)]
    every_2 = [*one_chunk, "log.every_steps=2", f"log.peak_tflops={peak}"]
    ran = run_to_end([*command, *run_overrides(digits, with_peak, 5, *every_2)])
    assert ran.returncode == 0, ran.stderr[-3000:]
    model = _tiny_model()
    with torch.no_grad(), flop_counter_mode() as counter:
        model(*_batch(model))
    flops_per_sample = 3 * counter.get_total_flops() / ROWS
    records = _records(with_peak)
    assert [r["step"] for r in records] == [2, 4, 5]
    for record, steps in zip(records, (1, 2, 1), strict=True):
        window_s = record["time/window_s"]
        assert record["train/samples_per_s"] * window_s == pytest.approx(16 * steps, rel=1e-9)
        assert window_s >= record["time/step_s"]  # the logged step is the window's last
        tflops = flops_per_sample * record["train/samples_per_s"] / 1e12
        assert record["train/tflops"] == pytest.approx(tflops, rel=1e-9)
        assert record["train/mfu"] == pytest.approx(tflops / peak, rel=1e-9)
    assert "mfu against 0.5 TFLOP/s" in ran.stderr and ", mfu " in ran.stderr

    ran = run_to_end([*command, *run_overrides(digits, without, 1, *one_chunk, "log.every_steps=1")])
    assert ran.returncode == 0, ran.stderr[-3000:]
    (record,) = _records(without)
    assert "train/mfu" not in record and "train/tflops" not in record and "mfu" not in ran.stderr


def peak_and_count_of_each_rank(rank: int, world: int, overrides: list[str], peaks: list) -> tuple:
    """Two ranks whose GPUs differ: each device's peak as the table would give it, one of them an
    unlisted GPU (None). The run trains its steps, and each rank reports what it counts against."""
    clip_train.trainer.device_peak_tflops = lambda *_: peaks[rank]
    cfg = load_config(TINY_MODEL_CONFIG, overrides).validate(world_size=world)
    trainer = Trainer(cfg, DistEnv(rank=rank, world_size=world, local_rank=0, device=torch.device("cpu")))
    trainer.run()
    return trainer.step, trainer.peak_tflops, trainer.flops_per_sample


@pytest.mark.parametrize("peaks", [[0.5, None], [None, 0.5]], ids=["listed-unlisted", "unlisted-listed"])
def test_ranks_on_different_gpus_count_against_rank_zeros_peak(tmp_path, digits, peaks):
    """Each rank asked its own device and made a store decision only where it had a peak: the ranks'
    decisions then fell out of step. Rank 0 logs the MFU; its device's peak decides for all."""
    overrides = run_overrides(digits, tmp_path, 2, "data.workers=0", "train.io_timeout_s=60")
    ranks = run_distributed(peak_and_count_of_each_rank, 2, overrides, peaks, timeout_s=120)
    assert ranks[0] == ranks[1]
    step, peak, flops_per_sample = ranks[0]
    assert step == 2 and peak == peaks[0] and (flops_per_sample is None) == (peaks[0] is None)
