"""On a CUDA GPU only (``make gpu-check``; the ``cuda`` marker keeps them out of ``make test``).

What the CPU suite cannot reach: the loss's tiles on cuBLAS with their compiled elementwise work
(every dtype and embedding width, both losses, 16k rows) and their host syncs, Gradient Cache's
GPU-only paths (pinned host batch, side-stream prefetch, dropout replayed on the CUDA generator),
the CUDA generator in a checkpoint's RNG state, training runs in bf16 and in fp16 with its
GradScaler, each against a reference, and a resumed run against an uninterrupted one (on one GPU,
and over NCCL where there are two).
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from processes import run_to_end
from small_runs import DEMO_CONFIG, run_overrides
from test_gradcache import (
    DROPOUT,
    NO_DROPOUT,
    assert_grads_close,
    gc_grads,
    make_batch,
    make_model,
    reference_grads,
)
from test_loss import clip_loss_formula
from test_loss_sigmoid import _reference as sigmoid_loss_formula
from test_trainer import EVERY, STEPS, finish, torchrun, weights
from test_trainer import overrides as fp64_run_overrides

from clip_train.checkpoint import complete_checkpoints
from clip_train.config import load_config
from clip_train.distributed import resolve_device
from clip_train.ema import WeightsEMA
from clip_train.engine import GradCache
from clip_train.engine.offload import to_host
from clip_train.engine.rng import ProcessRng
from clip_train.loss import contrastive_loss
from clip_train.model.compiling import compile_towers
from clip_train.optim import Update

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """IEEE fp32 matmuls and convolutions (cuDNN's TF32 patch embedding alone differs from the CPU
    by ~1e-3) unless a test asks for TF32, restored afterwards."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _features(rows: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=gen, dtype=torch.float64), dim=1)


def _loss_and_grads(fn, images, texts, scalars, dtype, device, **kwargs):
    """The loss and the gradients of the features and of each scalar (the scale, the sigmoid's
    bias), as fp64 on the CPU."""
    i = images.detach().to(device, dtype).requires_grad_()
    t = texts.detach().to(device, dtype).requires_grad_()
    scalar_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    s = [torch.tensor(x, device=device, dtype=scalar_dtype, requires_grad=True) for x in scalars]
    loss = fn(i, t, *s, **kwargs)
    loss.backward()
    return [x.detach().double().cpu() for x in (loss, i.grad, t.grad, *(x.grad for x in s))]


def _assert_close_to(actual, expected, tolerance) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, rtol=tolerance, atol=tolerance * e.abs().max() + 1e-5)


# Each feature dtype the loss takes (fp32 also with TF32 matmuls), and embedding widths from 64 to 1024.
EVERY_DTYPE = pytest.mark.parametrize(
    ("dtype", "tf32", "tolerance"),
    [
        (torch.float32, False, 1e-4),
        (torch.float32, True, 2e-2),
        (torch.bfloat16, False, 1e-2),
        (torch.float16, False, 2e-3),
    ],
)
EVERY_WIDTH = pytest.mark.parametrize("dim", [64, 200, 512, 768, 1024])


@EVERY_DTYPE
@EVERY_WIDTH
@pytest.mark.parametrize("hard_negatives", [False, True])
def test_tiled_loss_on_gpu_matches_fp64(dtype, tf32, tolerance, dim, hard_negatives) -> None:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    n, m = 1000, 1300 if hard_negatives else 1000
    images, texts = _features(n, dim, 0), _features(m, dim, 1)
    images, texts = images.to(dtype).double(), texts.to(dtype).double()  # the values the GPU sees
    labels = torch.randint(0, m, (n,), generator=torch.Generator().manual_seed(2)) if hard_negatives else None
    expected = _loss_and_grads(clip_loss_formula, images, texts, [50.0], torch.float64, "cpu", labels=labels)

    def tiled(i, t, s, labels):
        return contrastive_loss(i, t, s, labels=labels, tile_size=512)

    gpu_labels = None if labels is None else labels.to(CUDA)
    _assert_close_to(
        _loss_and_grads(tiled, images, texts, [50.0], dtype, CUDA, labels=gpu_labels), expected, tolerance
    )


@EVERY_DTYPE
@EVERY_WIDTH
def test_sigmoid_tiles_on_gpu_match_fp64(dtype, tf32, tolerance, dim) -> None:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    images, texts = (_features(1000, dim, seed).to(dtype).double() for seed in (0, 1))
    scalars = [10.0, -10.0]  # SigLIP's initial scale and bias
    expected = _loss_and_grads(sigmoid_loss_formula, images, texts, scalars, torch.float64, "cpu")

    def tiled(i, t, s, b):
        return contrastive_loss(i, t, s, logit_bias=b, kind="sigmoid", tile_size=512)

    _assert_close_to(_loss_and_grads(tiled, images, texts, scalars, dtype, CUDA), expected, tolerance)


@pytest.mark.parametrize(
    ("formula", "kind", "scalars"),
    [(clip_loss_formula, "softmax", [50.0]), (sigmoid_loss_formula, "sigmoid", [10.0, -10.0])],
)
def test_both_losses_at_16k_rows_match_fp64(formula, kind, scalars) -> None:
    """Sixteen 1024-row tiles a side in fp32 (TF32 off), against the fp64 formula on the GPU."""
    images, texts = (_features(16384, 512, seed).float().double() for seed in (0, 1))
    expected = _loss_and_grads(formula, images, texts, scalars, torch.float64, CUDA)

    def tiled(i, t, s, b=None):
        return contrastive_loss(i, t, s, logit_bias=b, kind=kind, tile_size=1024)

    _assert_close_to(_loss_and_grads(tiled, images, texts, scalars, torch.float32, CUDA), expected, 1e-4)


def _syncs(fn) -> list[str]:
    """Where ``fn()`` waits for the device (file:line of each synchronising call, so that a failing
    assertion names them): CUDA's sync debug mode warns on each."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]


def test_tiled_loss_syncs_once_over_64_tiles_and_never_over_one() -> None:
    """A forward and backward of the PyTorch tiles never waits for the device over one tile (the
    scale, the upstream gradient and the column LSEs stay there) and once over 8×8 tiles (the
    grid's underflowed columns), so no tile waits for the host."""
    images, texts = (_features(1024, 64, seed).float().to(CUDA) for seed in (0, 1))

    def syncs(tile: int) -> int:
        i, t = images.clone().requires_grad_(), texts.clone().requires_grad_()
        s = torch.tensor(20.0, device=CUDA, requires_grad=True)
        return len(_syncs(lambda: contrastive_loss(i, t, s, tile_size=tile).backward()))

    for tile in (128, 1024):  # warm-up: first calls may sync to set up cuBLAS and the allocator
        syncs(tile)
    assert (syncs(128), syncs(1024)) == (1, 0)


def test_an_untimed_gradcache_step_never_syncs() -> None:
    """The trainer's unlogged steps: with the batch on the device, a Gradient Cache step in chunks
    (replay included) never waits for the device, nor does the loss alone: the towers (BERT's
    padding mask too), the chunking, the feature cache and the loss over one tile stay there."""
    model = make_model(*NO_DROPOUT, dtype=torch.float32).to(CUDA)
    batch = [t.to(CUDA) for t in make_batch(rows=24)]
    engine = GradCache(model, image_chunk=8, text_chunk=12)
    with torch.no_grad():
        features = model.text.encode_trainable(*model.text.encode_frozen(*batch[1:]))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        engine.step(*batch, timed=False)

    scale = torch.full((), 2.0, device=CUDA, requires_grad=True)  # torch.tensor would copy from the host

    def loss_alone() -> None:
        images, texts = features.flip(0).clone().requires_grad_(), features.clone().requires_grad_()
        contrastive_loss(images, texts, scale.exp()).backward()

    for _ in range(2):  # warm-up: the compiled tiles, cuBLAS and the allocator
        step()
        loss_alone()
    assert (_syncs(step), _syncs(loss_alone)) == ([], [])


def test_the_guarded_update_and_the_ema_never_sync_and_a_non_finite_step_is_skipped_on_the_device(
    tmp_path,
) -> None:
    """Fused AdamW skips on the device (the all-reduced flag as ``found_inf``): neither a good step
    nor a non-finite one, nor the EMA after them, hands anything to the host; the ledger, read at a
    logged step, finds the skipped step, and the weights and the averages are as before it."""
    model = make_model(*NO_DROPOUT, dtype=torch.float32).to(CUDA)
    cfg = load_config(DEMO_CONFIG, [f"train.out_dir={tmp_path}", "train.ema_decay=0.9"])
    update, ema = Update(model, cfg, CUDA), WeightsEMA.from_config(model, cfg.train)
    assert update.skips_on_device
    batch = [t.to(CUDA) for t in make_batch(rows=8)]
    engine = GradCache(model, image_chunk=8, text_chunk=8)
    syncs = []

    def step(number: int, poisoned: bool = False) -> None:
        update.optimizer.zero_grad(set_to_none=True)
        loss = engine.step(*batch, timed=False).loss
        loss = loss * float("nan") if poisoned else loss

        def guarded() -> None:
            update(loss, number)
            ema.update(number, update.stepped)

        syncs.append(_syncs(guarded))

    step(1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    averages = {name: average.clone() for name, average in ema.averages.items()}
    step(2, poisoned=True)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert all(torch.equal(average, averages[name]) for name, average in ema.averages.items())
    step(3)
    assert syncs == [[], [], []]
    update.skipped_steps.settle(3)
    assert (update.skipped_steps.total, update.skipped_steps.in_a_row) == (1, 0)
    assert int(update.optimizer.state[model.visual.proj.weight]["step"]) == 2


def test_a_resume_that_turns_on_the_fused_optimizer_steps_it_on_the_device(tmp_path) -> None:
    """Unfused AdamW keeps its step counts on the host and torch loads them where the saved groups
    said; the fused kernel takes them on the parameters' device."""
    model = make_model(*NO_DROPOUT, dtype=torch.float32).to(CUDA)
    batch = [t.to(CUDA) for t in make_batch(rows=8)]
    engine = GradCache(model, image_chunk=8, text_chunk=8)

    def update_with(fused: str) -> Update:
        return Update(model, load_config(DEMO_CONFIG, [f"train.out_dir={tmp_path}", fused]), CUDA)

    unfused = update_with("optim.fused=false")
    engine.step(*batch, timed=False)
    unfused(torch.ones((), device=CUDA), 1)
    resumed = update_with("optim.fused=true")
    resumed.load_state_dict(unfused.state_dict())
    resumed.optimizer.zero_grad(set_to_none=True)
    engine.step(*batch, timed=False)
    resumed(torch.ones((), device=CUDA), 2)
    state = resumed.optimizer.state[model.visual.proj.weight]
    assert state["step"].device.type == "cuda" and int(state["step"]) == 2


def test_process_rng_restores_the_current_device_from_either_format(monkeypatch) -> None:
    """The state holds the current device's generator; an older checkpoint's list with more devices
    than this process sees restores its entry 0 (LOCAL_RANK unset) onto the current device."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    rng = ProcessRng()
    state = rng.state_dict()
    assert isinstance(state["cuda"], torch.Tensor)
    first = torch.rand(4, device=CUDA)
    after = torch.cuda.get_rng_state()
    rng.load_state_dict(state)
    assert torch.equal(torch.rand(4, device=CUDA), first)
    rng.load_state_dict({**state, "cuda": [state["cuda"], *[after] * torch.cuda.device_count()]})
    assert torch.equal(torch.rand(4, device=CUDA), first)


def test_the_logged_peak_counts_the_optimizer_step() -> None:
    """The engine's own peak ends with its replay; the trainer reads the step's after the optimizer,
    so what the update allocates (a foreach AdamW's temporaries; 512 MiB of stand-ins here) counts."""
    model = make_model(*NO_DROPOUT, dtype=torch.float32).to(CUDA)
    engine = GradCache(model, image_chunk=8, text_chunk=12)
    stats = engine.step(*make_batch(rows=24))
    assert engine.peak_since_step_start() == stats.peak_mem > 0
    held = torch.cuda.memory_allocated(CUDA)  # the step's peak is more: its activations are freed
    grown = [torch.zeros(1 << 26, device=CUDA) for _ in range(2)]  # 512 MiB
    del grown
    assert engine.peak_since_step_start() >= max(stats.peak_mem, held + (1 << 29))


def test_auto_device_is_the_gpu_and_an_offloaded_batch_is_pinned() -> None:
    assert resolve_device("auto").type == "cuda" and resolve_device("cuda").type == "cuda"
    batch = make_batch()
    pinned = to_host(batch, CUDA)
    assert all(t.is_pinned() and torch.equal(t, b) for t, b in zip(pinned, batch, strict=True))


@pytest.mark.parametrize("offload", [False, True])
def test_gradcache_step_on_gpu_equals_cpu(offload) -> None:
    """Same weights and batch: the CUDA step (offload: pinned host batch, side-stream prefetch)
    gives the CPU step's gradients, with at most two input chunks on the device."""
    batch = make_batch(rows=24)
    grads = []
    for device, streamed in ((torch.device("cpu"), False), (CUDA, offload)):
        model = make_model(*NO_DROPOUT, dtype=torch.float32).to(device)
        stats = GradCache(model, image_chunk=8, text_chunk=12, offload=streamed).step(*batch)
        grads.append({k: p.grad.double().cpu() for k, p in model.named_parameters() if p.grad is not None})
    assert stats.max_live_chunks <= 2 and stats.peak_mem > 0
    assert grads[0].keys() == grads[1].keys()
    for key, expected in grads[0].items():
        torch.testing.assert_close(grads[1][key], expected, rtol=1e-3, atol=1e-5, msg=key)


def test_offload_prefetches_on_one_side_stream_for_the_engines_life(monkeypatch) -> None:
    """Four prefetch runs a step, two steps, one side stream: a new stream per run would come from the
    pool that ProcessGroupNCCL's stream comes from, and every 32nd or so would be NCCL's."""
    created, make_stream = [], torch.cuda.Stream

    def counted_stream(*args, **kwargs) -> torch.cuda.Stream:
        stream = make_stream(*args, **kwargs)
        if "stream_id" not in kwargs:  # a new stream; current_stream() wraps an existing one
            created.append(stream)
        return stream

    monkeypatch.setattr(torch.cuda, "Stream", counted_stream)
    engine = GradCache(
        make_model(*NO_DROPOUT, dtype=torch.float32).to(CUDA), image_chunk=8, text_chunk=6, offload=True
    )
    batch = make_batch(rows=24)
    assert engine.step(*batch).max_live_chunks <= 2
    side = engine.chunk_stream.side_stream
    assert engine.step(*batch).max_live_chunks <= 2
    assert len(created) == 1 and created[0] is side is engine.chunk_stream.side_stream
    assert side != torch.cuda.current_stream(CUDA)


@pytest.mark.parametrize("image_chunk", [3, 0])
def test_dropout_and_drop_path_replay_on_the_cuda_generator_is_exact(image_chunk) -> None:
    """fp64 on the GPU: the chunked step's replay draws the CUDA generator's masks again, so its
    gradients are the full-batch step's (the CPU suite checks the CPU generator the same way)."""
    model, batch = make_model(*DROPOUT).to(CUDA), make_batch()
    got = gc_grads(model, batch, image_chunk=image_chunk, text_chunk=4, precision="fp64")
    want = reference_grads(model, [x.to(CUDA) for x in batch], image_chunk, 4)
    assert len(want) == sum(1 for p in model.parameters() if p.requires_grad)
    assert_grads_close(got, want, rtol=1e-10)


def test_cuda_graphs_train_as_the_compiled_blocks_do_and_their_pools_count_in_the_peak() -> None:
    """``train.compile_mode=reduce-overhead``: three SGD steps of one chunk through blocks replayed
    as CUDA graphs give the plainly compiled blocks' losses and weights (the same kernels), and the
    step's peak counts the graphs' private pools, which the allocated count misses (an H200 run
    logged 3.1 GiB against 23.6 without graphs)."""
    batch = [x.to(CUDA) for x in make_batch(rows=16)]
    runs = []
    for cuda_graphs in (False, True):
        torch.cuda.empty_cache()  # each run's reserved peak its own
        model = make_model(*NO_DROPOUT, dtype=torch.float32).to(CUDA)
        compile_towers(model, cuda_graphs=cuda_graphs)
        engine, optimizer = (
            GradCache(model, graph_pools=cuda_graphs),
            torch.optim.SGD(model.parameters(), lr=0.1),
        )
        losses = []
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            stats = engine.step(*batch)
            losses.append(stats.loss.item())
            optimizer.step()
        runs.append(
            (losses, {name: p.detach().clone() for name, p in model.named_parameters()}, stats.peak_mem)
        )
        del model, engine, optimizer, stats
    (plain_losses, plain_weights, plain_peak), (graph_losses, graph_weights, graph_peak) = runs
    torch.testing.assert_close(graph_losses, plain_losses, rtol=1e-6, atol=0)
    for name, weight in plain_weights.items():
        torch.testing.assert_close(graph_weights[name], weight, rtol=1e-6, atol=1e-7, msg=name)
    assert graph_peak >= plain_peak


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_training_run_on_gpu_learns(digits, tmp_path, precision) -> None:
    """60 steps of the demo's model at batch 64 (fp16: with its GradScaler): every loss finite,
    and the last ten average clearly below the first ten (from ~4.2 to ~4.0 on the CPU in fp32)."""
    command = [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG)]
    overrides = run_overrides(
        digits, tmp_path, 60, "train.device=cuda", f"train.precision={precision}",
        "batch.global_size=64", "batch.image_chunk=32", "batch.text_chunk=32", "log.every_steps=1",
        "optim.warmup_steps=5", "optim.lr=3e-3", "checkpoint.every_steps=60",
    )  # fmt: skip
    result = run_to_end([*command, *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000060"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = torch.tensor([r["train/loss"] for r in records if "train/loss" in r])
    assert len(losses) == 60 and torch.isfinite(losses).all()
    assert losses[-10:].mean() < losses[:10].mean() - 0.1, losses.tolist()
    assert records[-1]["train/skipped_steps"] <= 5  # fp16: overflows above a scale of 1 are no bad steps


def test_clip_train_eval_scores_a_checkpoint_as_its_run_did(digits, tmp_path) -> None:
    """fp32 on a GPU: the run's matmuls are TF32, and `clip-train eval` ran them in full fp32, so a
    checkpoint scored otherwise than in its run's final evaluation."""
    overrides = run_overrides(
        digits, tmp_path, 2, "train.device=cuda", "train.precision=fp32", f"data.val={digits}/val",
        "checkpoint.every_steps=2",
    )  # fmt: skip
    result = run_to_end([sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG), *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    in_run = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])  # the final evaluation
    checkpoint = tmp_path / "checkpoints" / "step_00000002"
    evaluated = run_to_end([sys.executable, "-m", "clip_train", "eval", str(checkpoint)])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    alone = json.loads(evaluated.stdout.splitlines()[-1])
    for key in ("val/loss", "retrieval/image_to_text_R@1", "retrieval/text_to_image_R@5"):
        assert alone[key] == pytest.approx(in_run[key], rel=1e-6), key


def resumed_against_uninterrupted(digits, tmp_path, device: str, processes: int) -> dict[str, float]:
    """The largest difference per tensor between the final weights of an fp64 run and of a fresh
    run resumed from its mid-run checkpoint, both under torchrun with ``processes`` ranks."""
    reference = tmp_path / "reference"
    finish(torchrun(*fp64_run_overrides(digits, reference, f"train.device={device}"), nproc=processes))
    halfway = reference / "checkpoints" / f"step_{STEPS // 2 - STEPS // 2 % EVERY:08d}"
    copy = tmp_path / "from" / halfway.name
    shutil.copytree(halfway, copy)
    resumed = tmp_path / "resumed"
    args = fp64_run_overrides(digits, resumed, f"train.device={device}", f"checkpoint.resume={copy}")
    assert f"resumed from {copy}" in finish(torchrun(*args, nproc=processes))
    want, got = weights(reference), weights(resumed)
    assert got.keys() == want.keys()
    return {name: (got[name] - want[name]).abs().max().item() for name in want}


@pytest.mark.parametrize("gpus", [1, 2])
def test_resumed_run_on_gpus_ends_where_the_uninterrupted_one_does(digits, tmp_path, gpus) -> None:
    """Within fp64 rounding, not bit for bit as on the CPU with gloo (tests/test_trainer.py): NCCL
    chooses its reduction algorithm and channels per run, and cuDNN's weight gradients may sum
    through atomics, so the order of a sum is not promised to repeat. A resume that lost the data
    position, an RNG stream or an optimizer state differs by orders of magnitude more."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, {torch.cuda.device_count()} visible")
    differences = resumed_against_uninterrupted(digits, tmp_path, "cuda", gpus)
    worst = max(differences, key=differences.get)
    assert differences[worst] <= 1e-9, (worst, differences[worst])
