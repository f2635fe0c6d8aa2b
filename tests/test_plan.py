"""`clip-train plan`: the memory model's algebra, its loss terms against measured peaks, the
activation measurement, the largest-batch search, LiT accounting and the command line."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from processes import run_to_end
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoModel, BertConfig

from clip_train import load_config
from clip_train.cli import main
from clip_train.config import TextTowerConfig
from clip_train.errors import UserError
from clip_train.loss import contrastive_loss, tiles_torch
from clip_train.memory import tensor_bytes
from clip_train.model import build_model
from clip_train.optim import build_optimizer
from clip_train.plan import Setting, breakdown, loss_workspace, max_batch, profile_model, usable_bytes
from clip_train.plan.architecture import KNOWN_TEXT_ARCHITECTURES, find_text_architecture
from clip_train.plan.auto_chunks import run_setting
from clip_train.plan.estimate import FP32, STRIP_ELEMENTS, adafactor_state_numel, gpu_available
from clip_train.plan.profile import measure_chunk, profile_built_model

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "model" / "tiny.yaml"
# The LAION-400M recipes; the ViT-g/14 FSDP one (13 s to plan here, docs/fsdp.md) is left out for CI time.
LAION_RECIPES = sorted((ROOT / "configs").glob("laion400m*.yaml"))
PROGRESS_LINE = re.compile(r"clip-train: plan: .+( \.\.\.|: \d+\.\d s)")
SMALL = ("model.image.timm_kwargs.depth=2", "model.text.hf_config.num_hidden_layers=1")
LIT = ("model.image.lock=true",)


@pytest.fixture(scope="module")
def tiny_profile():
    return profile_model(load_config(TINY, SMALL).model, "fp32", (2, 4), "cpu")


@pytest.fixture(scope="module")
def lit_profile():
    return profile_model(load_config(TINY, (*SMALL, *LIT)).model, "fp32", (2, 4), "cpu")


def setting(**kw) -> Setting:
    base = dict(batch=4096, gpus=4, image_chunk=64, text_chunk=128, offload=False, impl="inf", tile=64)
    return Setting(**{**base, **kw})


def test_loss_workspace_inf_linear_vanilla_and_local_quadratic():
    dim, tile = 128, 64
    for impl in ("vanilla", "local"):  # one GPU: no all-gather, only the materialised matrices
        small, large = (loss_workspace(impl, b, 1, dim, tile) for b in (1024, 2048))
        assert large == 4 * small == 4 * 4 * 2048**2 * FP32 / 4
    # fixed GPUs: vanilla holds b×b (x4 per doubling), local n×b = b²/W (x4), inf is affine in b
    gpus = 8
    inf = [loss_workspace("inf", b, gpus, dim, tile) for b in (4096, 8192, 16384)]
    assert inf[2] - inf[1] == 2 * (inf[1] - inf[0]) > 0
    gather = [2 * b * dim * FP32 for b in (4096, 8192)]
    for impl in ("vanilla", "local"):
        quad = [
            loss_workspace(impl, b, gpus, dim, tile) - g for b, g in zip((4096, 8192), gather, strict=True)
        ]
        assert quad[1] == 4 * quad[0]
    # local is vanilla's b×b cut into W row blocks
    assert (
        loss_workspace("local", 8192, gpus, dim, tile) - gather[1]
        == (loss_workspace("vanilla", 8192, gpus, dim, tile) - gather[1]) / gpus
    )


@pytest.mark.parametrize(
    ("kind", "impl"),
    [
        ("softmax", "vanilla"),
        ("softmax", "local"),
        ("softmax", "inf"),
        ("sigmoid", "vanilla"),
        ("sigmoid", "inf"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_loss_workspace_matches_the_measured_peak_of_the_real_loss(kind, impl, dtype):
    """One process: MemTracker's peak of forward + backward, which includes the 2 n×d feature
    gradients. An fp64 run's features (``train.precision=fp64``) keep fp64 through the loss."""
    rows, dim, tile = 512, 64, 256
    torch.manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(rows, dim, dtype=dtype), dim=-1).requires_grad_()
    texts = torch.nn.functional.normalize(torch.randn(rows, dim, dtype=dtype), dim=-1).requires_grad_()
    scale = torch.tensor(2.0, dtype=dtype, requires_grad=True)
    bias = torch.tensor(-3.0, dtype=dtype, requires_grad=True)
    tracker = MemTracker()
    with tracker:
        loss = contrastive_loss(
            images, texts, scale.exp(), logit_bias=bias, kind=kind, impl=impl, tile_size=tile
        )
        grads = torch.autograd.grad(loss, (images, texts, scale, bias), allow_unused=True)
        del loss, grads
    (peak,) = (snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    itemsize = dtype.itemsize
    predicted = loss_workspace(impl, rows, 1, dim, tile, kind, itemsize=itemsize) + 2 * rows * dim * itemsize
    assert 0.85 < peak / predicted < 1.15


def test_the_estimate_strips_tiles_as_the_pytorch_tiles_do(tiny_profile):
    assert STRIP_ELEMENTS == tiles_torch.STRIP_ELEMENTS  # the estimate keeps its own copy: no torch
    # Beside the tile, CUDA's compiled kernels write its gradient G (a t×t), the CPU a 4 MiB strip.
    for kind in ("softmax", "sigmoid"):
        on_gpu, on_cpu = (
            loss_workspace("inf", 65536, 8, 512, 8192, kind, device) for device in ("cuda", "cpu")
        )
        assert on_gpu - on_cpu == (8192**2 - STRIP_ELEMENTS) * FP32
    planned = breakdown(tiny_profile, setting(tile=8192, batch=65536)).loss  # a plan is for CUDA
    assert planned == loss_workspace("inf", 65536, 4, tiny_profile.embed_dim, 8192, device="cuda")


def test_activation_slope_is_positive_and_linear():
    torch.manual_seed(0)
    model = build_model(load_config(TINY, SMALL).model).train()
    for tower in ("image", "text"):
        peaks = {rows: measure_chunk(model, tower, rows, 16, "fp32")["forward"] for rows in (2, 4, 8)}
        low, high = (peaks[4] - peaks[2]) / 2, (peaks[8] - peaks[4]) / 4
        assert low > 0 and abs(high / low - 1) < 0.10, (tower, peaks)


def test_offload_keeps_two_chunks_of_the_largest_stream(tiny_profile):
    image, text = tiny_profile.towers
    on_device = breakdown(tiny_profile, setting(offload=False))
    offloaded = breakdown(tiny_profile, setting(offload=True))
    n = 4096 // 4
    assert on_device.data == n * (image.input_per_sample + text.input_per_sample)
    assert offloaded.data == max(2 * 64 * image.input_per_sample, 2 * 128 * text.input_per_sample)
    assert offloaded.data < on_device.data
    # every other term is unchanged without a LiT trunk cache
    for field in ("cache", "loss", "backbone", "weights", "grads", "optimizer"):
        assert getattr(offloaded, field) == getattr(on_device, field)


def test_backbone_grows_with_the_chunk_not_the_batch(tiny_profile):
    a, b = (breakdown(tiny_profile, setting(batch=batch)).backbone for batch in (4096, 8192))
    assert a == b
    grown = breakdown(tiny_profile, setting(image_chunk=128, text_chunk=256)).backbone
    assert grown > a


@pytest.mark.parametrize("impl", ["vanilla", "local", "inf"])
@pytest.mark.parametrize("offload", [False, True])
def test_max_batch_fits_and_the_next_step_does_not(tiny_profile, impl, offload):
    cap = usable_bytes(gpu_available(0.5))
    s = setting(impl=impl, offload=offload)
    best = max_batch(tiny_profile, s, cap)
    step = 4 * 128  # gpus x lcm(64, 128)
    assert best > 0 and best % step == 0
    assert breakdown(tiny_profile, dataclasses.replace(s, batch=best)).peak <= cap
    assert breakdown(tiny_profile, dataclasses.replace(s, batch=best + step)).peak > cap


def test_max_batch_orders_the_implementations(tiny_profile):
    cap = usable_bytes(gpu_available(0.5))
    best = {
        impl: max_batch(tiny_profile, setting(impl=impl, offload=True), cap)
        for impl in ("vanilla", "local", "inf")
    }
    assert best["vanilla"] < best["local"] < best["inf"]


def test_an_fp64_plan_counts_the_double_model_a_run_trains(tiny_profile):
    """fp64 runs train a double model (the trainer converts it): the plan's fake model and a run's
    own (auto chunks) count its weights, gradients and AdamW states as a real step holds them, and
    the features and loss in fp64."""
    cfg = load_config(TINY, (*SMALL, "train.precision=fp64"))
    torch.manual_seed(0)
    model = build_model(cfg.model).double().train()
    opt = build_optimizer(cfg.optim, model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    states = sum(t.nbytes for state in opt.state.values() for k, t in state.items() if k != "step")
    planned = profile_model(cfg.model, "fp64", (2, 4), "cpu")
    run = profile_built_model(model, cfg.model, "fp64", (2, 4), [])
    for profile in (planned, run):
        assert profile.weight_bytes == tensor_bytes([*model.parameters(), *model.buffers()])
        assert profile.trainable_bytes == tensor_bytes([p.grad for p in trainable])
        assert profile.adamw_bytes == states
    fp64, fp32 = (breakdown(p, setting()) for p in (planned, tiny_profile))
    assert (fp64.cache, fp64.loss) == (2 * fp32.cache, 2 * fp32.loss)
    assert planned.image.replay.at(64) == pytest.approx(2 * tiny_profile.image.replay.at(64), rel=0.05)


def test_lit_drops_exactly_the_frozen_parameters_from_grads_and_optimizer(tiny_profile, lit_profile):
    model = build_model(load_config(TINY, (*SMALL, *LIT)).model)
    frozen = sum(p.numel() * FP32 for p in model.parameters() if not p.requires_grad)
    assert frozen > 0
    assert lit_profile.weight_bytes == tiny_profile.weight_bytes
    assert tiny_profile.trainable_bytes - lit_profile.trainable_bytes == frozen
    assert tiny_profile.adamw_bytes - lit_profile.adamw_bytes == 2 * frozen
    full, lit = (breakdown(p, setting()) for p in (tiny_profile, lit_profile))
    assert full.grads - lit.grads == frozen and full.optimizer - lit.optimizer == 2 * frozen
    # the locked trunk is cached as pooled fp32 (n, width) features and replays only the projection
    width = model.visual.trunk.num_features
    assert lit_profile.image.trunk_per_sample == width * FP32
    assert lit_profile.image.replay.per_sample < tiny_profile.image.replay.per_sample / 10


def test_kept_graphs_are_each_training_towers_last_chunk_beside_the_loss(tiny_profile):
    part = breakdown(tiny_profile, setting())
    image_graph, text_graph = tiny_profile.image.graph.at(64), tiny_profile.text.graph.at(128)
    assert image_graph > 0 and 0 < text_graph <= tiny_profile.text.replay.at(128)
    assert part.kept_graph == image_graph + text_graph
    assert breakdown(tiny_profile, setting(batch=8192)).kept_graph == part.kept_graph
    assert part.transient >= part.loss + part.kept_graph
    # the image tower's kept graph lives on while the text tower encodes and replays
    assert part.backbone >= image_graph + tiny_profile.text.replay.at(128)
    assert breakdown(tiny_profile, setting(impl="vanilla")).kept_graph == 0  # b×b loss: every chunk replays
    assert breakdown(tiny_profile, setting(keep_last_graph=False)).kept_graph == 0
    cap = usable_bytes(gpu_available(0.5))
    assert max_batch(tiny_profile, setting(keep_last_graph=False), cap) >= max_batch(
        tiny_profile, setting(), cap
    )
    frozen_text = ("model.text.lock=true", "model.text.lock_head=true")
    profile = profile_model(load_config(TINY, (*SMALL, *frozen_text)).model, "fp32", (2, 4), "cpu")
    assert not profile.text.replays
    frozen = breakdown(profile, setting())
    assert 0 < frozen.kept_graph == profile.image.graph.at(64)
    # the image tower's kept graph lives on through the frozen text tower's encode, encoded after it
    assert frozen.backbone >= frozen.kept_graph + profile.text.encode.at(128)


FSDP = {"sharded": True, "gather_itemsize": 2}  # train.precision=bf16's auto: bf16 gathers, fp32 sums
FOUR_BLOCKS = ("model.text.hf_config.num_hidden_layers=4",)  # and the tiny ViT's 4 blocks


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_fsdp_gathers_a_root_and_two_blocks_and_accumulates_one_towers_gradients():
    model_cfg = load_config(TINY, FOUR_BLOCKS).model
    profile = profile_model(model_cfg, "fp32", (2, 4), "cpu")
    model = build_model(model_cfg)
    image, text = _numel(model.visual), _numel(model.text)
    image_block, text_block = (
        _numel(model.visual.trunk.blocks[0]),
        _numel(model.text.encoder.encoder.layer[0]),
    )
    image_root, text_root = image - 4 * image_block, text - 4 * text_block
    assert profile.image.unit_numels == (image_root, *[image_block] * 4)
    assert profile.text.unit_numels == (text_root, *[text_block] * 4)

    part = breakdown(profile, setting(**FSDP))  # 4 GPUs; chunks 64 / 128 of 1,024 rows: both replay
    assert part.gathered == 2 * max(image_root + 2 * image_block, text_root + 2 * text_block) < 2 * text
    assert part.accumulated == 4 * max(image, text)
    assert (part.weights, part.grads, part.optimizer, part.optimizer_step) == (
        profile.weight_bytes / 4,
        profile.trainable_bytes / 4,
        profile.adamw_bytes / 4,
        profile.trainable_bytes / 4,
    )
    assert breakdown(profile, setting(**FSDP, reshard_after_forward=False)).gathered == 2 * (image + text)
    assert breakdown(profile, setting(**FSDP, sync_every_chunk=True)).accumulated == 0
    assert breakdown(profile, setting(**FSDP, text_chunk=0)).accumulated == 4 * image  # text: one chunk
    assert breakdown(profile, setting(**FSDP, image_chunk=0, text_chunk=0)).accumulated == 0
    host = breakdown(profile, setting(**FSDP, cpu_offload=True))
    assert host.weights == host.grads == host.optimizer == host.optimizer_step == 0
    assert (host.gathered, host.accumulated) == (part.gathered, part.accumulated)
    ddp = breakdown(profile, setting())
    assert ddp.gathered == ddp.accumulated == 0 and ddp.weights == profile.weight_bytes


def test_fsdp_accumulates_only_what_trains(lit_profile):
    lit = build_model(load_config(TINY, (*SMALL, *LIT)).model)
    head = sum(p.numel() for p in lit.visual.parameters() if p.requires_grad)
    assert 0 < head < _numel(lit.visual) / 10
    assert breakdown(lit_profile, setting(**FSDP, text_chunk=0)).accumulated == 4 * head


def test_the_run_setting_carries_the_fsdp_options():
    def run(*overrides: str) -> Setting:
        return run_setting(load_config(TINY, overrides), 2, "cpu")

    assert not run().sharded
    fsdp = ("train.parallel=fsdp",)
    fp32 = run(*fsdp)
    assert (fp32.gather_itemsize, fp32.accumulate_itemsize) == (4, 4)  # no casts
    fp64 = run(*fsdp, "train.precision=fp64")  # the trainer's double model: gathered and reduced as is
    assert (fp64.gather_itemsize, fp64.accumulate_itemsize) == (8, 8)
    bf16 = run(
        *fsdp, "train.precision=bf16", "fsdp.sync_every_chunk=true", "fsdp.reshard_after_forward=false"
    )
    assert bf16.sharded and bf16.sync_every_chunk and not bf16.reshard_after_forward
    assert (bf16.gather_itemsize, bf16.accumulate_itemsize) == (2, 4)
    assert run(*fsdp, "train.precision=bf16", "fsdp.reduce_dtype=bf16").accumulate_itemsize == 2
    assert run(*fsdp, "fsdp.cpu_offload=true").cpu_offload


def test_a_sharded_plan_says_what_it_shards(capsys):
    argv = ["plan", str(TINY), *SMALL, "train.parallel=fsdp", "--gpus", "2", "--gpu-mem", "1"]
    assert main([*argv, "--measure-chunks", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "sharded (fsdp): weights, grads and optimizer states 1/2 per GPU; all-gathered weights" in out
    assert "DDP's buckets" not in out


def test_adafactor_state_sizes_match_torch():
    module = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Conv2d(2, 3, 3), torch.nn.LayerNorm(7))
    opt = torch.optim.Adafactor(module.parameters())
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    states = sum(t.numel() for s in opt.state.values() for k, t in s.items() if k != "step")
    assert states == sum(adafactor_state_numel(tuple(p.shape)) for p in module.parameters())


def test_cli_prints_the_table_and_json(tmp_path):
    out = tmp_path / "plan.json"
    cmd = [
        sys.executable,
        "-m",
        "clip_train",
        "plan",
        str(TINY),
        *SMALL,
        "--gpus",
        "2",
        "--gpu-mem",
        "1",
        "--measure-chunks",
        "1",
        "2",
    ]
    proc = run_to_end([*cmd, "--json", str(out)], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("impl"))
    rows = [line.split() for line in lines[header + 1 : header + 7]]
    assert [(r[0], r[1]) for r in rows] == [
        (i, o) for i in ("vanilla", "local", "inf") for o in ("no", "yes")
    ]
    assert "measured on cpu" in proc.stdout
    plan = json.loads(out.read_text())
    for row in plan["rows"]:
        assert row["batch"] == 256 and row["gpus"] == 2
        transient = max(row["loss"] + row["kept_graph"], row["backbone"], row["optimizer_step"])
        assert row["peak"] == pytest.approx(row["static"] + row["data"] + row["cache"] + transient)
        assert row["fits"] == (row["peak"] <= plan["usable_bytes"])


def test_the_plan_fits_auto_chunks_into_the_memory_budget_a_run_takes(tmp_path):
    """``batch.memory_budget`` is what a run's auto chunks fit (less its reserve), whatever the GPU."""
    out = tmp_path / "plan.json"
    budget = "batch.memory_budget=0.15"
    argv = ["plan", str(TINY), *SMALL, budget, "--gpus", "2", "--gpu-mem", "8", "--json", str(out)]
    assert main([*argv, "--measure-chunks", "1", "2"]) == 0
    plan = json.loads(out.read_text())
    assert plan["usable_bytes"] == usable_bytes(gpu_available(8), 0.15) == pytest.approx(0.15 * 2**30 * 0.9)
    for row in plan["rows"]:  # the whole 128-row batch per GPU would not fit: smaller chunks do
        assert row["fits"] and row["peak"] <= plan["usable_bytes"]
        assert min(row["image_chunk"], row["text_chunk"]) < 128, row


def test_check_cpu_measures_the_ema_it_plans_for(tmp_path):
    """An EMA's fp32 averages are part of the prediction, so the real steps keep one too: without it
    the measured peak fell 13 % short of the plan (0.87), as against 5 % (0.95) without an EMA."""
    out = tmp_path / "plan.json"
    assert (
        main(["plan", str(TINY), "--gpus", "1", "--check-cpu", "--json", str(out), "train.ema_decay=0.999"])
        == 0
    )
    check = json.loads(out.read_text())["check_cpu"]
    assert 0.9 <= check["ratio"] <= 1.1, check


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "0"], "--gpus 0: must be >= 1"),
        (["--gpu-mem", "-1"], "--gpu-mem -1.0: must be > 0"),
        (["--batch", "1000", "--gpus", "3"], "batch.global_size=1000 must be a positive multiple"),
        (["--batch", "0"], "--batch 0: must be >= 1"),
        (["batch.global_size=0"], "batch.global_size=0: must be >= 1"),
        (["--check-cpu", "--gpus", "2"], "--check-cpu runs one process"),
        (["--json", "/no/such/dir/plan.json"], "--json /no/such/dir/plan.json: no folder /no/such/dir to"),
    ],
)
def test_cli_rejects_bad_arguments(capsys, argv, message):
    assert main(["plan", str(TINY), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "measuring" not in err  # in one line, before the measurements


@pytest.mark.parametrize("overrides", [SMALL, (*SMALL, *LIT)], ids=["trained", "lit"])
def test_fake_cpu_passes_count_what_real_passes_allocate(overrides):
    """plan measures on fake tensors on the CPU; a run's auto chunks measure its real model."""
    model_cfg = load_config(TINY, overrides).model
    fake = profile_model(model_cfg, "fp32", (2, 4), "cpu")
    torch.manual_seed(0)
    real = profile_built_model(build_model(model_cfg).train(), model_cfg, "fp32", (2, 4), [])
    assert (fake.weight_bytes, fake.trainable_bytes) == (real.weight_bytes, real.trainable_bytes)
    for ours, theirs in zip(fake.towers, real.towers, strict=True):
        assert ours.input_per_sample == theirs.input_per_sample
        assert ours.trunk_per_sample == theirs.trunk_per_sample
        for term in ("encode", "graph", "replay"):
            for chunk in (2, 4, 64):
                measured = getattr(theirs, term).at(chunk)
                assert getattr(ours, term).at(chunk) == pytest.approx(measured, rel=0.02), (term, chunk)


@pytest.mark.parametrize(
    ("name", "published"), [("bert-base-uncased", 109_482_240), ("bert-large-uncased", 335_141_888)]
)
def test_the_known_berts_have_their_published_parameter_counts(name, published):
    config = BertConfig(**{k: v for k, v in KNOWN_TEXT_ARCHITECTURES[name].items() if k != "model_type"})
    with torch.device("meta"):
        encoder = AutoModel.from_config(config)
    assert sum(p.numel() for p in encoder.parameters()) == published  # pooler included


def test_a_text_model_is_built_from_a_local_config_json(tmp_path):
    sizes = dict(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, vocab_size=99
    )
    BertConfig(**sizes).save_pretrained(tmp_path)
    image = "model.image.timm_kwargs.depth=2"
    from_dir = load_config(TINY, (image, f"model.text.hf={tmp_path}", "model.text.hf_config={}")).model
    from_keys = load_config(TINY, (image, f"model.text.hf_config={json.dumps(sizes)}")).model
    profile = profile_model(from_dir, "fp32", (2, 4), "cpu")
    assert f"architecture from {tmp_path / 'config.json'}" in " ".join(profile.notes)
    assert profile.weight_bytes == profile_model(from_keys, "fp32", (2, 4), "cpu").weight_bytes


def test_a_text_model_in_the_hub_cache_is_read_from_there(tmp_path, monkeypatch):
    repo = tmp_path / "models--acme--tiny-bert"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2).save_pretrained(snapshot)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert find_text_architecture(TextTowerConfig(hf="acme/tiny-bert")) == snapshot / "config.json"
    with pytest.raises(UserError, match="'acme/other-bert': plan needs this text model's architecture"):
        find_text_architecture(TextTowerConfig(hf="acme/other-bert"))


@pytest.fixture(scope="module")
def offline(tmp_path_factory) -> dict[str, str]:
    """No network and an empty hub cache: nothing downloaded before can help. One environment for
    the module, so its commands fork from one test server (a server imports torch for each)."""
    home = tmp_path_factory.mktemp("offline_hub")
    hub = {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_OFFLINE": "1"}
    return {**os.environ, **hub, "TRANSFORMERS_OFFLINE": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", LAION_RECIPES, ids=lambda path: path.stem)
def test_laion_recipes_plan_offline_and_say_what_they_measure(recipe, offline):
    command = [sys.executable, "-m", "clip_train", "plan", str(recipe), "--gpus", "8", "--gpu-mem", "80"]
    proc = run_to_end(command, cwd=ROOT, env=offline)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"plan: {recipe}")
    assert "architecture from plan's table of known models" in proc.stdout
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("impl"))
    rows = [line.split() for line in lines[header + 1 :]]
    assert [row[0] for row in rows] == ["vanilla"] * 2 + ["local"] * 2 + ["inf"] * 2
    assert [row[-2] for row in rows[4:]] == ["yes", "yes"]  # written for 8 x 80 GB with the ring loss
    steps = proc.stderr.splitlines()  # progress only: no hub retries, no warnings
    assert all(PROGRESS_LINE.fullmatch(step) for step in steps), proc.stderr
    assert steps[0] == "clip-train: plan: importing torch, transformers and timm ..."
    for tower in ("image", "text"):  # two chunk sizes, each announced before and timed after
        assert sum(f"measuring the {tower} tower" in step for step in steps) == 4


def test_an_unknown_text_model_fails_in_one_line_before_loading_torch(offline):
    recipe = LAION_RECIPES[0]
    command = [sys.executable, "-m", "clip_train", "plan", str(recipe), "model.text.hf=acme/unknown-bert"]
    proc = run_to_end(command, cwd=ROOT, env=offline)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()  # no "plan: importing torch ..." either: it failed before
    assert line.startswith("clip-train: error: model.text.hf='acme/unknown-bert': plan needs")
    assert "hf download acme/unknown-bert config.json" in line
