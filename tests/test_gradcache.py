"""Gradient Cache engine: exact full-batch gradients (fp64), LiT caching, offload, mixed precision.

The reference for "full-batch gradient" is plain autograd: every chunk encoded with grad in the
order the engine's stage 1 uses (image chunks, then text chunks) from the same seed, hence the
same dropout and drop-path masks, then one loss over the whole batch and one backward. Without
dropout the reference is a single forward of the whole batch.
"""

from __future__ import annotations

import copy
import functools
import random
from pathlib import Path

import pytest
import torch

from clip_train.config import Config, load_config
from clip_train.engine import GradCache
from clip_train.engine.offload import ChunkStream, chunk_bounds, to_host
from clip_train.engine.rng import ProcessRng, saved_cuda_state
from clip_train.loss import contrastive_loss
from clip_train.model import build_model

TINY = Path(__file__).resolve().parents[1] / "configs" / "model" / "tiny.yaml"
DROPOUT = (
    "model.image.timm_kwargs.depth=2",
    "model.image.timm_kwargs.drop_path_rate=0.1",
    "model.text.hf_config.hidden_dropout_prob=0.1",
    "model.text.hf_config.attention_probs_dropout_prob=0.1",
)
NO_DROPOUT = (
    "model.image.timm_kwargs.depth=2",
    "model.image.timm_kwargs.drop_path_rate=0.0",
    "model.text.hf_config.hidden_dropout_prob=0.0",
    "model.text.hf_config.attention_probs_dropout_prob=0.0",
)
ROWS, SEED = 10, 1234
# A 1,024-token WordPiece vocabulary instead of open_clip's 49,408 BPE tokens: the token embedding is
# then 1/48 of its size, and with it the gradients, weights and shards that each fp64 comparison
# gathers, saves and loads (a test worker held 5 GB of them for the FSDP cases). What these tests
# check does not depend on the tokenizer: their token ids are random draws below VOCAB, its size.
WORDPIECE_1K = Path(__file__).with_name("wordpiece-1k")
VOCAB = len((WORDPIECE_1K / "vocab.txt").read_text().splitlines())


def tiny_config(*overrides: str) -> Config:
    """The tiny recipe's model on the small vocabulary, with ``overrides``."""
    return load_config(TINY, (f"model.text.tokenizer={WORDPIECE_1K}", *overrides))


def make_model(*overrides: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    return copy.deepcopy(_built_model(overrides, dtype))


@functools.cache
def _built_model(overrides: tuple[str, ...], dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(tiny_config(*overrides).model).to(dtype).train()
    with torch.no_grad():  # a non-default scale so its gradient is not a special case
        model.logit_scale.fill_(2.0)
    return model


def make_batch(rows: int = ROWS, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (rows, 3, 32, 32), dtype=torch.uint8, generator=gen)
    input_ids = torch.randint(1, VOCAB, (rows, 16), generator=gen)
    lengths = torch.randint(3, 17, (rows,), generator=gen)
    attention_mask = (torch.arange(16) < lengths[:, None]).long()
    return images, input_ids, attention_mask


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def gc_grads(model, batch, seed: int = SEED, scaler=None, **engine_kwargs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    engine = GradCache(model, **{"loss_impl": "inf", **engine_kwargs})  # the default path
    torch.manual_seed(seed)
    engine.step(*batch, scale_loss=scaler.scale if scaler is not None else None)
    return grads(model)


def reference_grads(
    model, batch, image_chunk: int, text_chunk: int, seed: int = SEED
) -> dict[str, torch.Tensor]:
    """Plain autograd over the whole batch, chunks encoded in stage-1 order so masks match."""
    model.zero_grad(set_to_none=True)
    images, input_ids, attention_mask = batch
    torch.manual_seed(seed)
    image_features = torch.cat([model.visual(images[a:b]) for a, b in chunk_bounds(len(images), image_chunk)])
    text_features = torch.cat(
        [model.text(input_ids[a:b], attention_mask[a:b]) for a, b in chunk_bounds(len(images), text_chunk)]
    )
    kind = "sigmoid" if model.logit_bias is not None else "softmax"
    scale, bias = model.logit_scale.exp(), model.logit_bias
    contrastive_loss(
        image_features, text_features, scale, logit_bias=bias, kind=kind, impl="vanilla"
    ).backward()
    return grads(model)


def assert_close_overall(actual: dict, expected: dict, rtol: float) -> None:
    """Relative error of the whole gradient vector, the measure for low precision; and of each
    one-number gradient (the logit scale's, a bias's) on its own, which the vector would swamp."""
    assert actual.keys() == expected.keys()
    got, want = (
        torch.cat([grads[name].double().flatten() for name in expected]) for grads in (actual, expected)
    )
    err = ((got - want).norm() / want.norm()).item()
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"
    for name in (name for name, grad in expected.items() if grad.numel() == 1):
        want_one, got_one = expected[name].double(), actual[name].double()
        err = ((got_one - want_one).abs() / want_one.abs().clamp_min(1e-12)).item()
        assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol}"


def assert_grads_close(actual: dict, expected: dict, rtol: float) -> None:
    """Per-parameter max error relative to that gradient's max magnitude.

    Gradients that are zero in exact arithmetic (attention key biases: softmax ignores a shift)
    are pure roundoff, so the scale is floored at 1e-6 of the largest gradient anywhere.
    """
    assert actual.keys() == expected.keys()
    floor = 1e-6 * max(want.abs().max() for want in expected.values())
    for name, want in expected.items():
        scale = torch.maximum(want.abs().max(), floor)
        err = ((actual[name].to(want.dtype) - want).abs().max() / scale).item()
        assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol}"


@pytest.mark.parametrize(("image_chunk", "text_chunk"), [(2, 5), (3, 4), (0, 3)])
def test_exact_full_batch_gradients_with_dropout(image_chunk, text_chunk):
    model, batch = make_model(*DROPOUT), make_batch()
    for encode, inputs in ((model.encode_image, batch[:1]), (model.encode_text, batch[1:])):
        assert not torch.equal(seeded(encode, inputs, 0), seeded(encode, inputs, 1)), "dropout is off"
    got = gc_grads(model, batch, image_chunk=image_chunk, text_chunk=text_chunk, precision="fp64")
    want = reference_grads(model, batch, image_chunk, text_chunk)
    assert len(want) == sum(1 for p in model.parameters() if p.requires_grad)
    assert_grads_close(got, want, rtol=1e-10)


def test_patch_dropout_replays_the_patches_it_kept():
    """FLIP's patch dropout (timm's, ``timm_kwargs.patch_drop_rate``) draws the patches it keeps from
    the RNG stream that each chunk's replay restores: the blocks see the class token and half the
    patches in both passes, and the gradients are the whole batch's."""
    model, batch = make_model(*DROPOUT, "model.image.timm_kwargs.patch_drop_rate=0.5"), make_batch()
    tokens = []  # the sequence length each pass hands the first block
    model.visual.trunk.blocks[0].register_forward_pre_hook(lambda _, args: tokens.append(args[0].shape[1]))
    got = gc_grads(model, batch, image_chunk=3, text_chunk=5, precision="fp64")
    assert tokens == [1 + 16 // 2] * 7  # 4 chunks encoded, then all but the kept last one replayed
    want = reference_grads(model, batch, 3, 5)
    assert_grads_close(got, want, rtol=1e-10)


@pytest.mark.parametrize(("offload", "lock"), [(False, False), (True, False), (False, True)])
def test_sigmoid_loss_exact_with_offload_and_lit(offload, lock):
    """A model with a logit bias trains with the sigmoid loss; bias and scale gradients included."""
    overrides = (*DROPOUT, "model.init_logit_bias=-4.0", *(["model.image.lock=true"] if lock else []))
    model, batch = make_model(*overrides), make_batch()
    got = gc_grads(model, batch, image_chunk=3, text_chunk=4, precision="fp64", offload=offload)
    want = reference_grads(model, batch, 3, 4)
    assert {"logit_scale", "logit_bias"} <= want.keys()
    assert_grads_close(got, want, rtol=1e-10)


def test_step_leaves_the_rng_as_one_forward_pass_would():
    model, batch = make_model(*DROPOUT), make_batch()
    gc_grads(model, batch, image_chunk=3, text_chunk=4)
    after_step = torch.get_rng_state()
    reference_grads(model, batch, 3, 4)
    assert torch.equal(after_step, torch.get_rng_state())


def _generator_states(count: int) -> list[torch.Tensor]:
    """``count`` distinct generator states, standing in for one per CUDA device."""
    return [torch.Generator().manual_seed(seed).get_state() for seed in range(count)]


def _draws() -> tuple[float, torch.Tensor]:
    return random.random(), torch.rand(3)


def test_process_rng_restores_a_checkpoint_that_listed_every_device(monkeypatch):
    """An older checkpoint holds ``torch.cuda.get_rng_state_all()``: it loads in a process without
    a GPU (as on a GPU-less machine; the entries are stand-ins), and the Python and CPU streams
    resume exactly."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rng = ProcessRng()
    state = {**rng.state_dict(), "cuda": _generator_states(8)}
    first = _draws()
    rng.load_state_dict(state)
    again = _draws()
    assert first[0] == again[0] and torch.equal(first[1], again[1])


@pytest.mark.parametrize(("local_rank", "devices", "entry"), [(None, 4, 0), ("2", 4, 2), ("3", 1, 0)])
def test_an_old_device_list_gives_the_entry_of_the_device_the_rank_drew_on(
    monkeypatch, local_rank, devices, entry
):
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    states = _generator_states(devices)
    assert saved_cuda_state(states) is states[entry]


def test_process_rng_saves_and_restores_the_current_device_only(monkeypatch):
    """torch.cuda's generator calls replaced by stand-ins: the state holds one device's generator
    (not a list), and an old list restores its LOCAL_RANK entry onto the current device."""
    current, restored = _generator_states(2)[1], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    rng = ProcessRng()
    state = rng.state_dict()
    assert state["cuda"] is current
    rng.load_state_dict(state)
    old = _generator_states(3)
    rng.load_state_dict({**state, "cuda": old})
    assert len(restored) == 2 and restored[0] is current and restored[1] is old[1]


def test_without_dropout_chunking_matches_one_whole_batch_forward():
    model, batch = make_model(*NO_DROPOUT), make_batch()
    got = gc_grads(model, batch, image_chunk=3, text_chunk=4, precision="fp64")
    model.zero_grad(set_to_none=True)
    image_features, text_features, scale = model(*batch)
    loss = contrastive_loss(image_features, text_features, scale, impl="vanilla")
    loss.backward()
    assert_grads_close(got, grads(model), rtol=1e-10)
    engine = GradCache(model, image_chunk=3, text_chunk=4, loss_impl="vanilla")
    assert engine.step(*batch).loss == pytest.approx(loss.item(), rel=1e-12)


def seeded(encode, inputs, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return encode(*inputs)


def count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_lit_runs_the_frozen_trunk_once_per_chunk_and_stays_exact():
    model, batch = make_model(*DROPOUT, "model.image.lock=true"), make_batch()
    assert model.visual.has_frozen_trunk and not model.visual.is_frozen
    trunk_calls, head_calls = count_calls(model.visual.trunk), count_calls(model.visual.proj)
    got = gc_grads(model, batch, image_chunk=3, text_chunk=4)
    assert trunk_calls[0] == 4  # stage 1 only: ceil(10 / 3) chunks
    assert head_calls[0] == 7  # stage 1, and replay of all but the last chunk, which kept its graph
    want = reference_grads(model, batch, 3, 4)
    assert not any(name.startswith("visual.trunk") for name in want)
    assert_grads_close(got, want, rtol=1e-10)


@pytest.mark.parametrize(
    ("frozen_text", "impl", "keep"),
    [(False, "inf", True), (True, "inf", True), (False, "vanilla", True), (False, "inf", False)],
)
def test_each_trained_towers_last_chunk_keeps_its_graph_instead_of_replaying(frozen_text, impl, keep):
    """With the tiled loss, the last chunk of each tower that trains is encoded once, with its graph
    (the image tower's lives on while the text tower encodes and replays); every other chunk is
    encoded twice, under its stage-1 dropout masks. Beside the materialising vanilla loss, or with
    ``keep_last_graph=False``, every chunk is replayed."""
    frozen = ("model.text.lock=true", "model.text.lock_head=true") if frozen_text else ()
    model, batch = make_model(*DROPOUT, *frozen), make_batch()
    image_calls, text_calls = count_calls(model.visual.proj), count_calls(model.text.proj)
    got = gc_grads(model, batch, image_chunk=3, text_chunk=4, loss_impl=impl, keep_last_graph=keep)
    image_chunks, text_chunks = 4, 3  # ceil(10 / 3), ceil(10 / 4)
    if impl == "vanilla" or not keep:
        assert (image_calls[0], text_calls[0]) == (2 * image_chunks, 2 * text_chunks)
    elif frozen_text:
        assert (image_calls[0], text_calls[0]) == (2 * image_chunks - 1, text_chunks)
    else:
        assert (image_calls[0], text_calls[0]) == (2 * image_chunks - 1, 2 * text_chunks - 1)
    assert_grads_close(got, reference_grads(model, batch, 3, 4), rtol=1e-10)


@pytest.mark.parametrize(
    ("image_chunk", "text_chunk", "calls"), [(0, 0, (1, 1)), (10, 0, (1, 1)), (0, 4, (1, 5))]
)
@pytest.mark.parametrize("offload", [False, True])
def test_one_chunk_per_tower_is_plain_backprop_with_no_tower_encoded_twice(
    image_chunk, text_chunk, calls, offload
):
    """When each trained tower is one chunk, both keep their graph: one forward each, as without
    Gradient Cache. A one-chunk tower is encoded once whatever the other's chunks (text in 3 here)."""
    model, batch = make_model(*DROPOUT), make_batch()
    image_calls, text_calls = count_calls(model.visual.proj), count_calls(model.text.proj)
    got = gc_grads(model, batch, image_chunk=image_chunk, text_chunk=text_chunk, offload=offload)
    assert (image_calls[0], text_calls[0]) == calls
    assert_grads_close(got, reference_grads(model, batch, image_chunk, text_chunk), rtol=1e-10)


def test_lit_with_unlocked_blocks_caches_the_token_sequence():
    model, batch = (
        make_model(*DROPOUT, "model.image.lock=true", "model.image.unlocked_layers=1"),
        make_batch(),
    )
    frozen_calls = count_calls(model.visual.trunk.blocks[0])
    unlocked_calls = count_calls(model.visual.trunk.blocks[1])
    got = gc_grads(model, batch, image_chunk=4, text_chunk=5, offload=True)
    assert (frozen_calls[0], unlocked_calls[0]) == (3, 5)
    want = reference_grads(model, batch, 4, 5)
    assert any(name.startswith("visual.trunk.blocks.1.") for name in want)
    assert_grads_close(got, want, rtol=1e-10)


def test_fully_frozen_tower_is_never_replayed():
    model = make_model(*DROPOUT, "model.image.lock=true", "model.image.lock_head=true")
    batch = make_batch()
    assert model.visual.is_frozen
    proj_calls = count_calls(model.visual.proj)
    got = gc_grads(model, batch, image_chunk=3, text_chunk=4)
    assert proj_calls[0] == 4
    assert not any(name.startswith("visual.") for name in got)
    assert_grads_close(got, reference_grads(model, batch, 3, 4), rtol=1e-10)


@pytest.mark.parametrize("keep", [True, False])
def test_replay_leaves_batch_norm_statistics_as_one_forward_a_chunk(keep):
    model = make_model("model.image.timm=resnet10t", "model.image.timm_kwargs={}", *NO_DROPOUT[2:])
    batch = make_batch(rows=8)
    reference = copy.deepcopy(model)
    for start, end in chunk_bounds(8, 4):
        reference.visual(batch[0][start:end])
    GradCache(model, image_chunk=4, text_chunk=0, keep_last_graph=keep, loss_impl="inf").step(*batch)
    expected = dict(reference.visual.named_buffers())
    assert any(name.endswith("num_batches_tracked") for name in expected)
    for name, buffer in model.visual.named_buffers():
        assert torch.equal(buffer, expected[name]), name


def test_offload_keeps_the_batch_on_the_host_untouched_and_stays_exact():
    model, batch = make_model(*DROPOUT), make_batch()
    before = [t.clone() for t in batch]
    engine = GradCache(model, image_chunk=3, text_chunk=4, offload=True, loss_impl="inf")
    torch.manual_seed(SEED)
    stats = engine.step(*batch)
    assert all(torch.equal(a, b) for a, b in zip(batch, before, strict=True))
    assert stats.max_live_chunks <= 2
    assert stats.batch_bytes == sum(t.numel() * t.element_size() for t in batch)
    assert stats.cache_bytes == 4 * ROWS * 128 * 8  # image + text features and their gradients, fp64
    assert_grads_close(grads(model), reference_grads(model, batch, 3, 4), rtol=1e-10)


def test_to_host_pins_only_for_cuda():
    batch = make_batch()
    assert all(a is b for a, b in zip(to_host(batch, torch.device("cpu")), batch, strict=True))
    assert not any(t.is_pinned() for t in to_host(batch, torch.device("cpu")))  # CUDA: test_cuda.py


def test_chunk_stream_yields_the_right_slices_and_counts_live_chunks():
    data = torch.arange(20).view(10, 2)
    bounds = chunk_bounds(10, 4)
    assert bounds == [(0, 4), (4, 8), (8, 10)]
    seen, kept = [], []
    stream = ChunkStream(torch.device("cpu"))
    stream.run(
        (data, data * 10), bounds, lambda index, chunk: seen.append((index, *map(torch.Tensor.tolist, chunk)))
    )
    assert seen == [(i, data[a:b].tolist(), (data[a:b] * 10).tolist()) for i, (a, b) in enumerate(bounds)]
    assert stream.max_live == 1
    stream.run((data,), bounds, lambda index, chunk: kept.append(chunk))  # a consumer that leaks every chunk
    assert stream.max_live == 3
    stream.place((data,))  # a new step: its count starts again
    stream.run((data,), bounds[:2], lambda index, chunk: None)  # the leaked chunks are the last run's
    assert stream.max_live == 1 and len(kept) == 3
    with pytest.raises(ValueError, match="chunk size"):
        chunk_bounds(10, -1)


def test_an_engine_streams_every_step_through_its_one_chunk_stream():
    model, batch = make_model(*NO_DROPOUT), make_batch()
    engine = GradCache(model, image_chunk=3, text_chunk=4, offload=True)
    stream = engine.chunk_stream
    steps = [engine.step(*batch) for _ in range(2)]
    assert engine.chunk_stream is stream and [s.max_live_chunks for s in steps] == [1, 1]  # no prefetch here
    assert stream.side_stream is None  # made on the first CUDA prefetch only (tests/test_cuda.py)


def test_fp16_with_grad_scaler_and_bf16_are_close_to_fp32():
    batch = make_batch()
    model = make_model(*NO_DROPOUT, dtype=torch.float32)
    want = gc_grads(model, batch, image_chunk=5, text_chunk=5)

    bf16 = gc_grads(model, batch, image_chunk=5, text_chunk=5, precision="bf16")
    assert_close_overall(bf16, want, rtol=0.05)  # bf16 keeps 8 mantissa bits (seen: 0.016)

    scale = 2.0**12
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaled = gc_grads(model, batch, scaler=scaler, image_chunk=5, text_chunk=5, precision="fp16")
    assert_close_overall({k: v / scale for k, v in scaled.items()}, want, rtol=0.01)  # 11 bits (seen: 0.002)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(optimizer)
    assert_close_overall(grads(model), want, rtol=0.01)
    before = model.logit_scale.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert model.logit_scale.item() == pytest.approx((before - 0.1 * want["logit_scale"]).item(), rel=1e-4)

    overflowing = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # fp16 backward overflows: step skipped
    gc_grads(model, batch, scaler=overflowing, image_chunk=5, text_chunk=5, precision="fp16")
    weights = [p.detach().clone() for p in model.parameters()]
    overflowing.step(optimizer)
    overflowing.update()
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    assert overflowing.get_scale() < 2.0**40


def test_bad_input_is_named():
    model, (images, input_ids, attention_mask) = make_model(*NO_DROPOUT), make_batch()
    with pytest.raises(ValueError, match="batch rows disagree"):
        GradCache(model).step(images[:4], input_ids, attention_mask)
    with pytest.raises(ValueError, match="empty"):
        GradCache(model).step(images[:0], input_ids[:0], attention_mask[:0])
    with pytest.raises(ValueError, match="precision"):
        GradCache(model, precision="fp8")
    with pytest.raises(ValueError, match="image_chunk"):
        GradCache(model, image_chunk=-1)


def test_from_config_reads_batch_train_and_loss_sections():
    config = load_config(
        TINY,
        [
            "batch.offload=true",
            "train.precision=bf16",
            "loss.impl=inf",
            "batch.keep_last_graph=false",
        ],
    )
    engine = GradCache.from_config(make_model(*NO_DROPOUT), config, (3, 4))
    assert (engine.image.chunk, engine.text.chunk, engine.offload) == (3, 4, True)
    assert (engine.precision, engine.loss_impl, engine.tile_size) == ("bf16", "inf", None)
    assert not engine.keep_last_graph
    assert GradCache.from_config(
        make_model(*NO_DROPOUT), load_config(TINY, ["loss.impl=inf"]), (0, 0)
    ).keep_last_graph
