"""Gradient Cache over FSDP2-sharded towers on real gloo ranks (W = 2 and 4), in fp64: two optimizer
steps equal the single-process steps on the concatenated global batch, with chunks and dropout and
drop-path replayed, with LiT locking and with the sigmoid loss; each sharded unit reduce-scatters
once per step (or once per replayed chunk with ``sync_every_chunk``)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable

import pytest
import torch
from dist_utils import run_distributed
from test_gradcache import (
    DROPOUT,
    SEED,
    assert_close_overall,
    assert_grads_close,
    grads,
    make_batch,
    make_model,
    tiny_config,
)
from torch.distributed.tensor import DTensor
from torch.profiler import profile

from clip_train.config import FsdpConfig
from clip_train.engine import GradCache
from clip_train.engine.offload import chunk_bounds
from clip_train.loss import contrastive_loss
from clip_train.model import build_model
from clip_train.model.freezing import tower_blocks
from clip_train.parallel import builds_on_meta, is_sharded, shard_towers

ROWS_PER_RANK, LR, STEPS = 4, 0.5, 2
SIGMOID = ("model.init_logit_bias=-4.0",)
LIT = ("model.image.lock=true",)
LIT_UNLOCKED = ("model.image.lock=true", "model.image.unlocked_layers=1")
FROZEN_TEXT = ("model.text.lock=true", "model.text.lock_head=true")


@dataclasses.dataclass(frozen=True)
class Case:
    chunks: tuple[int, int]
    extra: tuple[str, ...] = ()
    fsdp: FsdpConfig = dataclasses.field(default_factory=FsdpConfig)
    precision: str = "fp64"  # bf16: fp32 weights, bf16 gathers and autocast
    count_reductions: bool = False  # profile each step (slow) to count the reduce-scatters


def rank_batch(rank: int, world: int) -> tuple[torch.Tensor, ...]:
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return tuple(t[rows] for t in make_batch(world * ROWS_PER_RANK))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def fsdp_rank(rank: int, world: int, cases: list[Case]) -> list[dict]:
    return [fsdp_steps(rank, world, case) for case in cases]


def fsdp_steps(rank: int, world: int, case: Case) -> dict:
    weights = torch.float64 if case.precision == "fp64" else torch.float32
    model = make_model(*DROPOUT, *case.extra, dtype=weights)
    if builds_on_meta(case.fsdp):  # as the trainer builds: the other ranks' weights come from rank 0's
        model = model.to("meta")
    shard_towers(model, case.fsdp, case.precision, torch.device("cpu"))
    engine = GradCache(
        model,
        image_chunk=case.chunks[0],
        text_chunk=case.chunks[1],
        precision=case.precision,
        sync_every_chunk=case.fsdp.sync_every_chunk,
    )
    gathered = set()  # the dtypes a block's weights have inside its forward
    block = tower_blocks(model.visual)[0]
    block.register_forward_pre_hook(
        lambda module, args: gathered.update(p.dtype for p in module.parameters())
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    step_grads, losses, reductions = [], [], []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(SEED + rank)
        with profile() if case.count_reductions else contextlib.nullcontext() as prof:
            losses.append(engine.step(*rank_batch(rank, world)).loss.item())
        if case.count_reductions:
            events = collections.Counter(e.name.split(" ")[0] for e in prof.events())
            reductions.append(events["FSDP::post_backward_reduce"])
        step_grads.append({name: full(grad) for name, grad in grads(model).items()})
        optimizer.step()
    sharded = {name for name, p in model.named_parameters() if isinstance(p, DTensor)}
    units = {
        tower: 1 + len(tower_blocks(getattr(model, tower)))
        for tower in ("visual", "text")
        if is_sharded(getattr(model, tower))
    }
    return {
        "losses": losses,
        "grads": step_grads,
        "weights": {name: full(p.detach()) for name, p in model.named_parameters()},
        "local_numel": sum(p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor)),
        "sharded": sharded,
        "units": units,
        "reductions": reductions,
        "frozen": {name for name, p in model.named_parameters() if not p.requires_grad},
        "gathered": gathered,
        "grad_dtypes": {g.dtype for g in step_grads[-1].values()},
    }


def reference(world: int, case: Case) -> dict:
    """Plain autograd on the global batch, rank r's chunks encoded from rank r's seed, SGD as above."""
    return _reference(world, case.chunks, case.extra)


@functools.cache  # the FSDP settings and precision do not change the reference: cases share it
def _reference(world: int, chunks: tuple[int, int], extra: tuple[str, ...]) -> dict:
    model = make_model(*DROPOUT, *extra)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    kind = "sigmoid" if model.logit_bias is not None else "softmax"
    losses, step_grads = [], []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        image_features, text_features = [], []
        for rank in range(world):
            images, input_ids, attention_mask = rank_batch(rank, world)
            torch.manual_seed(SEED + rank)
            image_features += [model.visual(images[a:b]) for a, b in chunk_bounds(ROWS_PER_RANK, chunks[0])]
            text_features += [
                model.text(input_ids[a:b], attention_mask[a:b])
                for a, b in chunk_bounds(ROWS_PER_RANK, chunks[1])
            ]
        features = (torch.cat(image_features), torch.cat(text_features), model.logit_scale.exp())
        loss = contrastive_loss(*features, logit_bias=model.logit_bias, kind=kind)
        loss.backward()
        losses.append(loss.item())
        step_grads.append(grads(model))
        optimizer.step()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    total = sum(p.numel() for name, p in model.named_parameters() if "logit" not in name)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    return {"losses": losses, "grads": step_grads, "weights": weights, "numel": total, "frozen": frozen}


def check(results: list[dict], want: dict, world: int) -> None:
    for step in range(STEPS):
        mean_loss = sum(r["losses"][step] for r in results) / world
        assert mean_loss == pytest.approx(want["losses"][step], rel=1e-12)
        for result in results:
            assert_grads_close(result["grads"][step], want["grads"][step], rtol=1e-10)
    for result in results:
        assert result["weights"].keys() == want["weights"].keys()
        for name, expected in want["weights"].items():
            torch.testing.assert_close(result["weights"][name], expected, rtol=1e-10, atol=1e-12)
    # every tower parameter is sharded (locked ones too, and they stay locked), the shards add up
    # to the model once
    assert results[0]["frozen"] == want["frozen"]
    assert all(name.startswith(("visual.", "text.")) for name in results[0]["sharded"])
    assert len(results[0]["sharded"]) == len(want["weights"]) - sum("logit" in n for n in want["weights"])
    shard_total = sum(r["local_numel"] for r in results)
    assert want["numel"] <= shard_total < want["numel"] + world * len(results[0]["sharded"])


TWO_RANK_CASES = [
    Case((2, 4)),  # images in 2 chunks, text in 1: each tower's last chunk keeps its graph
    Case((1, 2), count_reductions=True),  # 4 and 2 chunks: all but each tower's last replayed
    Case((0, 0)),  # one chunk per tower: plain backpropagation
    Case((1, 2), SIGMOID),
    Case((1, 2), LIT, count_reductions=True),  # locked image trunk: only the projection trains
    Case((1, 2), LIT_UNLOCKED),  # the last block trains, the first stays frozen and sharded
    Case((1, 2), FROZEN_TEXT),  # a tower that never replays
    Case((1, 2), fsdp=FsdpConfig(sync_every_chunk=True), count_reductions=True),
    Case((1, 2), fsdp=FsdpConfig(reshard_after_forward=False)),
    Case((1, 2), fsdp=FsdpConfig(cpu_offload=True)),  # on CPU: the policy, not the copies
]
BF16 = Case((1, 2), precision="bf16")


def bf16_and_timing_session(rank: int, world: int) -> dict:
    """What the bf16 and timing tests check, on two gloo ranks of their own: `make test-floor` runs
    only the exact cases."""
    return {
        "bf16": fsdp_steps(rank, world, BF16),
        "bf16_inputs": trunk_inputs_in_bf16_steps(rank, world),
        "clocked": step_on_a_test_clock(rank, world),
    }


@pytest.fixture(scope="module")
def two_rank_steps() -> list[list[dict]]:
    """Every case of ``TWO_RANK_CASES`` on two ranks: ``[rank][case]``."""
    return run_distributed(fsdp_rank, 2, TWO_RANK_CASES, timeout_s=300)


@pytest.fixture(scope="module")
def bf16_and_timing_ranks() -> list[dict]:
    return run_distributed(bf16_and_timing_session, 2, timeout_s=300)


def test_two_ranks_fsdp_steps_equal_one_process_full_batch_steps(two_rank_steps):
    for index, case in enumerate(TWO_RANK_CASES):
        per_rank = [rank_results[index] for rank_results in two_rank_steps]
        check(per_rank, reference(2, case), world=2)


def test_bf16_gathers_bf16_weights_and_keeps_fp32_gradients_close_to_the_fp64_step(bf16_and_timing_ranks):
    """fsdp.param_dtype auto under bf16 training: each block computes with bf16 copies of its fp32
    shards; the gradients land in fp32 shards, within bf16's error of the fp64 step."""
    want = reference(2, Case(BF16.chunks))["grads"][0]
    for result in (rank["bf16"] for rank in bf16_and_timing_ranks):
        assert result["gathered"] == {torch.bfloat16} and result["grad_dtypes"] == {torch.float32}
        assert_close_overall(result["grads"][0], want, rtol=0.05)  # as without FSDP (seen: 0.016)


BF16_INPUT_CASES = [
    Case((1, 2), precision="bf16"),
    Case((1, 2), fsdp=FsdpConfig(reshard_after_forward=False), precision="bf16"),
    # bf16 weights without autocast: a frozen trunk's first layer must get bf16 inputs
    Case((1, 2), LIT, FsdpConfig(param_dtype="bf16"), precision="fp32"),
]


def trunk_inputs_in_bf16_steps(rank: int, world: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """One step over sharded towers per case of ``BF16_INPUT_CASES``: what the image trunk gets in
    stage 1 and in replay, chunk by chunk (1-row chunks: stage 1 is the first ``ROWS_PER_RANK``)."""
    steps = []
    for case in BF16_INPUT_CASES:
        model = make_model(*DROPOUT, *case.extra, dtype=torch.float32)
        shard_towers(model, case.fsdp, case.precision, torch.device("cpu"))
        engine = GradCache(
            model, image_chunk=case.chunks[0], text_chunk=case.chunks[1], precision=case.precision
        )
        seen: list[torch.Tensor] = []
        model.visual.trunk.register_forward_pre_hook(
            lambda module, args, seen=seen: seen.append(args[0].detach().clone())
        )
        torch.manual_seed(SEED + rank)
        engine.step(*rank_batch(rank, world))
        steps.append((seen[:ROWS_PER_RANK], seen[ROWS_PER_RANK:]))
    return steps


def test_bf16_replay_gets_the_inputs_stage_one_encoded(bf16_and_timing_ranks):
    """Gradient Cache is exact only if a replayed chunk is the chunk that was encoded. A sharded
    tower root's weights are fp32 shards or, gathered (kept so with reshard_after_forward=false),
    bf16 copies: inputs prepared in the weights' dtype would differ between stage 1 and replay.
    They are prepared in fp32 and handed on in the gathered weights' dtype, also to a frozen trunk
    (encoded once, never replayed). The last chunk keeps its graph: it is not replayed."""
    for steps in (rank["bf16_inputs"] for rank in bf16_and_timing_ranks):
        (encoded, replayed), (encoded_kept, replayed_kept), (encoded_lit, replayed_lit) = steps
        assert all(x.dtype == torch.bfloat16 for x in [*encoded, *encoded_kept])
        pairs = zip([*encoded[:-1], *encoded_kept[:-1]], [*replayed, *replayed_kept], strict=True)
        for stage_one, replay in pairs:
            assert stage_one.dtype == replay.dtype == torch.bfloat16
            assert torch.equal(stage_one, replay)
        assert len(encoded) == len(encoded_kept) == len(encoded_lit) == ROWS_PER_RANK and not replayed_lit
        assert all(x.dtype == torch.bfloat16 for x in encoded_lit)
        # the same images, prepared the same way in each case
        assert all(torch.equal(a, b) for a, b in zip(encoded, encoded_lit, strict=True))


def test_each_unit_reduce_scatters_once_per_step_or_once_per_chunk(two_rank_steps):
    plain = TWO_RANK_CASES[1]  # then LiT (4) and sync_every_chunk (7), counted on rank 0
    results = [two_rank_steps[0][i] for i in (1, 4, 7)]
    image_units, text_units = results[0]["units"]["visual"], results[0]["units"]["text"]
    assert (image_units, text_units) == (3, 3)  # two blocks and the root of each tower
    assert results[0]["reductions"] == [image_units + text_units] * STEPS
    # LiT: of the image tower only the root holds a trainable weight (the projection)
    assert results[1]["reductions"] == [1 + text_units] * STEPS
    # every chunk: each tower's kept last chunk, then 3 image and 1 text replays
    image_chunks, text_chunks = ROWS_PER_RANK // plain.chunks[0], ROWS_PER_RANK // plain.chunks[1]
    assert results[2]["reductions"] == [image_units * image_chunks + text_units * text_chunks] * STEPS


def test_four_ranks_fsdp_step_equals_one_process_full_batch_step():
    cases = [Case((1, 2)), Case((2, 0), (*SIGMOID, *LIT))]
    results = run_distributed(fsdp_rank, 4, cases, timeout_s=300)
    for index, case in enumerate(cases):
        check([rank_results[index] for rank_results in results], reference(4, case), world=4)


def sharded_from_meta(rank: int, world: int) -> dict:
    """Rank 0 builds the weights, the others on the meta device (``builds_on_meta``), as the
    trainer does; every rank's full tensors after sharding."""
    on_meta = builds_on_meta(FsdpConfig())
    offloaded_on_meta = builds_on_meta(FsdpConfig(cpu_offload=True))  # host shards: never
    if on_meta:
        model = build_model(tiny_config(*DROPOUT).model, on_meta=True).double()
    else:
        model = make_model(*DROPOUT)
    built_on_meta = all(p.is_meta for p in model.parameters())
    shard_towers(model, FsdpConfig(), "fp64", torch.device("cpu"))
    sharded = {name for name, p in model.named_parameters() if isinstance(p, DTensor)}
    state = {name: full(t).clone() for name, t in model.state_dict().items()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    return {
        "offloaded_on_meta": offloaded_on_meta,
        "on_meta": on_meta,
        "built_on_meta": built_on_meta,
        "sharded": sharded,
        "state": state,
        "buffers": buffers,
    }


def test_ranks_that_build_on_meta_get_rank_zeros_weights_and_buffers():
    built = make_model(*DROPOUT)
    for rank, result in enumerate(run_distributed(sharded_from_meta, 3, timeout_s=300)):
        assert result["on_meta"] == result["built_on_meta"] == (rank != 0) and not result["offloaded_on_meta"]
        assert result["sharded"] and all(name.startswith(("visual.", "text.")) for name in result["sharded"])
        assert result["state"].keys() == built.state_dict().keys()
        assert all(torch.equal(t, built.state_dict()[name]) for name, t in result["state"].items())
        # the non-persistent buffers too: pixel statistics and position ids are not in the state dict
        assert {name: b.dtype for name, b in result["buffers"].items()} == {
            n: b.dtype for n, b in built.named_buffers()
        }
        assert all(torch.equal(b, dict(built.named_buffers())[name]) for name, b in result["buffers"].items())


WAIT_S, WORK_S = 7.0, 3.0  # seconds on the test's own clock


def step_on_a_test_clock(rank: int, world: int) -> tuple[float, float, float, float]:
    """One step whose clock (``time.perf_counter``, which the engine and ``GatherWaits`` read) moves
    only where this test moves it: ``WAIT_S`` inside the first image block's all-gather bracket, as a
    late peer would make this rank wait, once in a forward (encode) and once in a backward (replay);
    ``WORK_S`` of compute right after each. Returns (gather_s, encode_s, loss_s, replay_s)."""
    model = make_model(*DROPOUT)
    shard_towers(model, FsdpConfig(), "fp64", torch.device("cpu"))
    block = tower_blocks(model.visual)[0]
    now = [0.0]
    moves = {"wait forward", "wait backward", "work forward", "work backward"}

    def move_once(what: str, seconds: float) -> None:
        if what in moves:
            moves.remove(what)
            now[0] += seconds

    def in_backward(what: str, seconds: float) -> Callable[..., None]:
        def hook(module, args, output: torch.Tensor) -> None:
            if output.requires_grad:
                output.register_hook(lambda grad: move_once(what, seconds))

        return hook

    # Registered before GradCache brackets FSDP's hooks (its own go first and last): inside them.
    block.register_forward_pre_hook(lambda *_: move_once("wait forward", WAIT_S))
    block.register_forward_hook(in_backward("wait backward", WAIT_S))
    engine = GradCache(model, image_chunk=2, text_chunk=2, precision="fp64")
    block.register_forward_hook(lambda *_: move_once("work forward", WORK_S))  # after the brackets
    block.register_forward_hook(in_backward("work backward", WORK_S))
    torch.manual_seed(SEED + rank)
    real_clock = time.perf_counter
    time.perf_counter = lambda: now[0]
    try:
        stats = engine.step(*rank_batch(rank, world))
    finally:
        time.perf_counter = real_clock
    assert not moves, moves
    return stats.gather_s, stats.encode_s, stats.loss_s, stats.replay_s


def test_a_wait_for_all_gathers_shows_as_gather_time_not_encode_or_replay_time(bf16_and_timing_ranks):
    """What a rank waits inside a block's all-gather bracket, in a forward and in a backward, is
    booked as gather_s and taken out of encode_s and replay_s, which keep the compute around it."""
    for rank in bf16_and_timing_ranks:
        assert rank["clocked"] == (2 * WAIT_S, WORK_S, 0.0, WORK_S)
