"""``batch.image_chunk: auto`` / ``text_chunk: auto``: the choice against the plan's own estimate,
and real runs that log it, fit their budget, and keep it across a resume."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from processes import run_to_end
from small_runs import DEMO_CONFIG, TINY_MODEL_CONFIG

from clip_train.config import BatchConfig, ConfigError, load_config
from clip_train.model import build_model
from clip_train.plan import auto_chunks, breakdown, choose_chunks, largest_fitting_chunks, profile_model
from clip_train.plan.auto_chunks import cgroup_room, device_budget, run_setting
from clip_train.plan.estimate import GIB, gpu_available, usable_bytes
from clip_train.trainer import chunks_kept_from

SMALL = ("model.image.timm_kwargs.depth=2", "model.text.hf_config.num_hidden_layers=1")
PER_RANK = 64


@pytest.fixture(scope="module")
def profile():
    return profile_model(load_config(TINY_MODEL_CONFIG, SMALL).model, "fp32", (2, 4), "cpu")


def _setting(*overrides: str):
    cfg = load_config(TINY_MODEL_CONFIG, [*SMALL, f"batch.global_size={PER_RANK}", *overrides])
    return run_setting(cfg, 1, "cpu")


def _peak(profile, setting, image: int, text: int) -> float:
    return breakdown(profile, dataclasses.replace(setting, image_chunk=image, text_chunk=text)).peak


def test_a_batch_that_fits_is_one_chunk_per_tower(profile):
    setting = _setting()
    whole = _peak(profile, setting, PER_RANK, PER_RANK)
    choice = largest_fitting_chunks(profile, setting, ("image", "text"), whole)
    assert (choice.image, choice.text, choice.fits) == (PER_RANK, PER_RANK, True)
    assert choice.peak == whole and "no replay" in choice.describe()
    for override in ("batch.keep_last_graph=false", "loss.impl=local"):  # no graph kept: both replay
        setting = _setting(override)
        whole = _peak(profile, setting, PER_RANK, PER_RANK)
        choice = largest_fitting_chunks(profile, setting, ("image", "text"), whole)
        assert (choice.image, choice.text) == (PER_RANK, PER_RANK)
        assert "each encoded twice" in choice.describe() and "no replay" not in choice.describe()


@pytest.mark.parametrize("fraction", [0.9, 0.6, 0.45])
def test_a_batch_that_does_not_fit_gets_the_largest_chunks_that_do(profile, fraction):
    setting = _setting()
    smallest = _peak(profile, setting, 1, 1)
    usable = smallest + fraction * (_peak(profile, setting, PER_RANK, PER_RANK) - smallest)
    choice = largest_fitting_chunks(profile, setting, ("image", "text"), usable)
    assert choice.fits and choice.peak == _peak(profile, setting, choice.image, choice.text) <= usable
    assert (choice.image, choice.text) != (PER_RANK, PER_RANK)
    divisors = [d for d in range(1, PER_RANK + 1) if PER_RANK % d == 0]
    for tower in ("image", "text"):  # no auto chunk can grow alone and still fit
        chunks = {"image": choice.image, "text": choice.text}
        for larger in (d for d in divisors if d > chunks[tower]):
            assert _peak(profile, setting, **{**chunks, tower: larger}) > usable, (tower, larger)


def test_only_auto_chunks_move_and_a_hopeless_budget_says_so(profile):
    setting = _setting("batch.text_chunk=8")
    choice = largest_fitting_chunks(profile, setting, ("image",), _peak(profile, setting, 2, 8))
    assert choice.text == 8 and choice.image >= 2 and choice.fits
    hopeless = largest_fitting_chunks(profile, setting, ("image",), 1.0)
    assert (hopeless.image, hopeless.text, hopeless.fits) == (1, 8, False)


def test_choosing_leaves_the_rng_streams_and_gradients_as_they_were(tmp_path):
    cfg = load_config(TINY_MODEL_CONFIG, [*SMALL, "batch.global_size=32", "batch.memory_budget=64"])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    before = torch.get_rng_state()
    choice = choose_chunks(model, cfg, 1)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.grad is None for p in model.parameters())
    assert (choice.image, choice.text) == (32, 32) and choice.usable == pytest.approx(64 * GIB * 0.9)
    assert usable_bytes(gpu_available(65)) == pytest.approx(
        choice.usable
    )  # the plan's 65 GiB GPU: 64 beside its context


def test_what_the_estimate_counts_and_already_exists_is_room_for_it(monkeypatch):
    """Under DDP the chunks are chosen beside the EMA and a resumed optimizer's states, which the
    estimate counts: they are held, room for themselves, as the model's weights are (on a GPU they
    were neither free nor held: counted twice)."""
    cfg = load_config(TINY_MODEL_CONFIG, [*SMALL, "batch.global_size=32"])
    model = build_model(cfg.model)
    held = []
    monkeypatch.setattr(
        auto_chunks, "device_budget", lambda device, ranks, bytes_: held.append(bytes_) or GIB
    )
    states = {"exp_avg": torch.zeros(1000), "exp_avg_sq": torch.zeros(1000)}, {"w": torch.zeros(500)}
    choose_chunks(model, cfg, 1)
    choose_chunks(model, cfg, 1, states)
    weights = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    assert held == [weights, weights + 2500 * 4]


def test_an_ema_of_the_weights_is_counted_beside_the_optimizer_state(profile):
    without, with_ema = (breakdown(profile, _setting(*ema)) for ema in ([], ["train.ema_decay=0.999"]))
    assert with_ema.optimizer - without.optimizer == profile.trainable_bytes > 0
    assert with_ema.peak - without.peak == profile.trainable_bytes


def test_on_the_cpu_offload_leaves_the_whole_batch_in_the_memory_a_run_fits_into(profile):
    """The engine keeps the batch (and a LiT trunk's cache) in host memory: on a GPU that is not the
    device's, on the CPU it is."""
    offloaded, kept = (breakdown(profile, _setting(f"batch.offload={on}")) for on in ("true", "false"))
    assert (offloaded.data, offloaded.cache) == (kept.data, kept.cache)
    on_a_gpu = breakdown(profile, dataclasses.replace(_setting("batch.offload=true"), device="cuda"))
    assert on_a_gpu.data < kept.data


def cgroup_tree(root, membership: str, files: dict[str, str]):
    """A fake /sys/fs/cgroup under ``root`` and the /proc/self/cgroup that places the process in it."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    (root / "self_cgroup").write_text(membership + "\n")
    return root, root / "self_cgroup"


def test_a_gpus_budget_is_its_free_memory_and_the_models_not_a_teachers(monkeypatch):
    """Once the GPU's free memory plus all it held: a distillation teacher's weights, loaded first,
    counted as room the chunks could fill. The device is faked (no GPU here); what torch reports
    for it is the point."""
    free, model, teacher = 40 * GIB, 3 * GIB, 10 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: model + teacher)
    assert device_budget(torch.device("cuda", 0), 8, model) == free + model


def test_the_cpu_budget_takes_the_room_of_the_process_own_cgroups_v2_and_v1(tmp_path):
    """A Slurm job's or a systemd unit's limit sits below the mount's root, and cgroup v1 keeps it in
    memory.limit_in_bytes: the least room over the process's cgroup and those above it counts."""
    job = "system.slice/slurmstepd.scope/job_7"
    v2 = {
        "memory.max": "max",
        "system.slice/memory.max": str(64 * GIB),
        "system.slice/memory.current": str(40 * GIB),  # 24 GiB of room, shared with others
        f"{job}/memory.max": str(8 * GIB),
        f"{job}/memory.current": str(3 * GIB),  # 5 GiB of room: the least
    }
    assert cgroup_room(*cgroup_tree(tmp_path / "v2", f"0::/{job}", v2)) == 5 * GIB
    v1 = {
        "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
        f"memory/{job}/memory.limit_in_bytes": str(4 * GIB),
        f"memory/{job}/memory.usage_in_bytes": str(1 * GIB),
        "unified/cgroup.procs": "",
    }
    membership = f"5:memory:/{job}\n4:cpu,cpuacct:/{job}\nnot a cgroup line\n0::/{job}"
    assert cgroup_room(*cgroup_tree(tmp_path / "v1", membership, v1)) == 3 * GIB
    unlimited = {"memory/memory.limit_in_bytes": "9223372036854771712", "memory.max": "max"}
    assert cgroup_room(*cgroup_tree(tmp_path / "none", "5:memory:/\n0::/", unlimited)) is None


def test_choosing_leaves_a_batch_norms_running_statistics_as_they_were():
    """Rank 0 alone measures, in train mode on random images: a ResNet tower's running statistics
    would move there and nowhere else."""
    overrides = ["model.image.timm=resnet18", "model.image.timm_kwargs={}", "batch.global_size=8"]
    cfg = load_config(TINY_MODEL_CONFIG, [*SMALL, *overrides, "batch.memory_budget=64"])
    model = build_model(cfg.model).train()
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    assert any(name.endswith("running_mean") for name in before)
    choose_chunks(model, cfg, 1)
    assert all(torch.equal(buffer, before[name]) for name, buffer in model.named_buffers())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("batch.image_chunk=some", "batch.image_chunk='some'"),
        ("batch.text_chunk=-2", "batch.text_chunk=-2 must divide"),
        ("batch.memory_budget=-1", "batch.memory_budget=-1.0: must be >= 0"),
    ],
)
def test_bad_chunk_settings_name_their_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY_MODEL_CONFIG, [override]).validate(world_size=1)


def _demo_overrides(digits, out, steps: int, *extra: str) -> list[str]:
    """The demo's model (activations outweigh its weights at this batch, unlike the tiny test model's)
    for a few steps at batch 128, no eval."""
    return [
        f"data.train={digits}/train", "data.val=", "eval.zeroshot=", "eval.zeroshot_data=",
        "data.workers=1", "batch.global_size=128", "batch.image_chunk=auto", "batch.text_chunk=auto",
        "batch.offload=false", f"train.max_steps={steps}", f"train.out_dir={out}", "log.wandb.mode=disabled",
        *extra,
    ]  # fmt: skip


def _train(digits, out, steps: int, *extra: str):
    command = [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG)]
    return run_to_end([*command, *_demo_overrides(digits, out, steps, *extra)])


@pytest.mark.slow
def test_runs_log_the_choice_fit_a_small_budget_and_keep_it_on_resume(digits, tmp_path):
    roomy = _train(digits, tmp_path / "roomy", 2)
    assert roomy.returncode == 0, roomy.stderr[-3000:]
    assert "auto chunks: image 128 / text 128 of 128 per rank (the whole per-rank batch fits" in roomy.stderr

    # A budget between the estimates for 1-row chunks and for the whole batch (the run's 10 %
    # reserve added back): smaller chunks, logged, and the run trains.
    cfg = load_config(DEMO_CONFIG, _demo_overrides(digits, tmp_path, 2))
    setting, measured = run_setting(cfg, 1, "cpu"), profile_model(cfg.model, "fp32", (2, 4), "cpu")
    smallest, whole = _peak(measured, setting, 1, 1), _peak(measured, setting, 128, 128)
    budget = f"batch.memory_budget={(smallest + whole) / 2 / 0.9 / 2**30}"
    tight = _train(digits, tmp_path / "tight", 2, budget, "checkpoint.every_steps=1")
    assert tight.returncode == 0, tight.stderr[-3000:]
    line = next(
        line.removeprefix("clip-train: ")
        for line in tight.stderr.splitlines()
        if line.startswith("clip-train: auto chunks:")
    )
    image, text = (int(word) for word in line.split(" of ")[0].replace("/ text", "").split()[-2:])
    assert (image, text) != (128, 128) and "the largest chunks that fit" in line

    # CUDA graphs take one chunk a step: auto's smaller ones stop the run at start-up, saying why.
    graphs = _train(
        digits, tmp_path / "graphs", 2, budget, "train.compile=true", "train.compile_mode=reduce-overhead"
    )
    assert graphs.returncode != 0 and not (tmp_path / "graphs" / "metrics.jsonl").exists()
    needs = f"reduce-overhead needs one chunk a step, and image/text chunks {image}/{text} (auto chunks:"
    assert needs in graphs.stderr, graphs.stderr[-3000:]

    # Resumed with a roomy budget at the same world size: the checkpoint's chunks stay.
    resumed = _train(digits, tmp_path / "tight", 3, "checkpoint.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"auto chunks: image {image} / text {text} per rank, as chosen before the resume" in resumed.stderr


@pytest.mark.parametrize(
    ("now", "kept"),
    [
        ({}, (64, 256)),  # the setting the choice was made for
        ({"text_chunk": 32}, None),  # a fixed chunk lowered at the resume (to fit memory) wins
        ({"global_size": 1024}, None),  # another per-rank batch: choose again
        ({"world_size": 4}, None),
        ({"memory_budget": 20.0}, None),  # a budget set after running out of memory: choose again
    ],
)
def test_a_resume_keeps_the_saved_chunks_only_for_the_setting_they_were_chosen_for(now, kept):
    saved = {
        "chunks": [64, 256],
        "world_size": 2,
        "asked": ["auto", 256],
        "global_size": 512,
        "memory_budget": 0.0,
    }
    settings = {"global_size": 512, "image_chunk": "auto", "text_chunk": 256} | now
    world = settings.pop("world_size", 2)
    assert chunks_kept_from(saved, BatchConfig(**settings), world) == kept
    budgeted = saved | {"memory_budget": 30.0}  # chosen under a budget that the resume leaves unset
    assert chunks_kept_from(budgeted, BatchConfig(**settings), world) == (
        kept if "memory_budget" not in now else None
    )
    old_checkpoint = {"chunks": [64, 256], "world_size": 2}  # saved before the settings were
    assert chunks_kept_from(old_checkpoint, BatchConfig(**settings), world) == (
        None if world != 2 else (64, 256)
    )
