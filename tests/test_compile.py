"""train.compile: each tower block compiled in place (``nn.Module.compile``) gives the eager steps in
every mode the step runs: Gradient Cache replay with dropout and drop-path, one chunk, a LiT trunk
under ``no_grad``, and FSDP2 on two gloo ranks; a second step compiles nothing new.

An inductor compile is the dearest thing a CPU test does, so the tests share their graphs: every
chunk has ``CHUNK`` rows, as the FSDP test's chunks do, and graphs compiled by one test serve the
next in this process and, through inductor's on-disk cache, the FSDP test's ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from dist_utils import run_distributed
from test_fsdp_gradcache import LIT_UNLOCKED, LR, STEPS, Case, full, rank_batch, reference
from test_gradcache import (
    DROPOUT,
    SEED,
    assert_grads_close,
    gc_grads,
    grads,
    make_batch,
    make_model,
    reference_grads,
    tiny_config,
)
from torch._dynamo.utils import counters

from clip_train.engine import GradCache
from clip_train.model import build_model
from clip_train.model.compiling import compile_towers, compiled_modules
from clip_train.model.freezing import tower_blocks
from clip_train.parallel import builds_on_meta, shard_towers
from clip_train.trainer import CudaGraphSkips

# In fp64 the compiled step equals the eager one to roundoff, unless torch 2.11's inductor, whose
# CPU attention backward mixes fp32 into fp64 graphs ("expected scalar type Double but found
# Float"), cannot compile that; then in fp32, the dtype runs train in, where roundoff is ~5e-5 and
# replaying other masks gives ~2.
INDUCTOR_COMPILES_FP64 = torch.__version__ >= "2.12"
DTYPE, PRECISION, RTOL = (
    (torch.float64, "fp64", 1e-10) if INDUCTOR_COMPILES_FP64 else (torch.float32, "fp32", 5e-4)
)
CHUNK = 2


@contextlib.contextmanager
def compiled_throughout() -> Iterator[None]:
    """Fails if a block breaks its graph or hits dynamo's recompile limit, past which it would run
    eager unnoticed."""
    breaks = sum(counters["graph_break"].values())
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    assert sum(counters["graph_break"].values()) == breaks


def two_steps(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], chunk: int) -> dict[str, torch.Tensor]:
    """The gradients of a step, after checking that the same step again compiles nothing new and
    gives them bitwise."""
    first = gc_grads(model, batch, image_chunk=chunk, text_chunk=chunk)
    with torch.compiler.set_stance("fail_on_recompile"):
        again = gc_grads(model, batch, image_chunk=chunk, text_chunk=chunk)
    assert all(torch.equal(again[name], grad) for name, grad in first.items())
    return first


def test_each_block_is_compiled_or_a_backbone_without_blocks_whole():
    model = make_model(*DROPOUT)
    for tower in (model.visual, model.text):
        assert compiled_modules(tower) == tower_blocks(tower) and len(tower_blocks(tower)) == 2
    resnet = build_model(tiny_config("model.image.timm=resnet18", "model.image.timm_kwargs={}").model)
    assert tower_blocks(resnet.visual) == [] and compiled_modules(resnet.visual) == [resnet.visual.trunk]


@pytest.mark.slow
def test_compiled_towers_replay_exactly_with_dropout():
    """Inductor-compiled blocks under Gradient Cache, dropout and drop-path on, give the eager
    full-batch gradients (two chunks a tower): the replay draws the same masks. Compiled in place:
    the state-dict keys stay, and inductor's fallback_random is set for the towers only."""
    batch = make_batch(2 * CHUNK)
    want = reference_grads(make_model(*DROPOUT, dtype=DTYPE), batch, CHUNK, CHUNK)
    model = make_model(*DROPOUT, dtype=DTYPE)
    keys = list(model.state_dict())
    compile_towers(model)
    with compiled_throughout():
        assert_grads_close(two_steps(model, batch, CHUNK), want, rtol=RTOL)
    assert list(model.state_dict()) == keys
    assert not torch._inductor.config.fallback_random


@pytest.mark.slow
def test_compiled_blocks_train_in_one_chunk_and_under_a_locked_trunk():
    """One chunk a tower (plain backpropagation through the compiled blocks), and a LiT image tower
    whose first block is frozen: in eval mode under no_grad it gets graphs of its own, compiled in
    the first step and not again. The one-chunk towers ask for CUDA graphs (reduce-overhead), which
    inductor skips on the CPU: the step is the same, and the skips show that the option arrived."""
    one_chunk, lit = make_model(*DROPOUT, dtype=DTYPE), make_model(*DROPOUT, *LIT_UNLOCKED, dtype=DTYPE)
    frozen = tower_blocks(lit.visual)[0]
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    batches = make_batch(CHUNK), make_batch(2 * CHUNK)
    wants = [
        reference_grads(model, batch, CHUNK, CHUNK)
        for model, batch in zip((one_chunk, lit), batches, strict=True)
    ]
    graphs, skipped_cuda_graphs = [], []
    for model, batch, want in zip((one_chunk, lit), batches, wants, strict=True):
        compile_towers(model, cuda_graphs=model is one_chunk)  # the one mode CUDA graphs take
        skips = counters["inductor"]["cudagraph_skips"]
        with compiled_throughout():
            graphs.append(counters["stats"]["unique_graphs"])
            assert_grads_close(two_steps(model, batch, CHUNK), want, rtol=RTOL)
        skipped_cuda_graphs.append(counters["inductor"]["cudagraph_skips"] > skips)
    assert counters["stats"]["unique_graphs"] > graphs[-1]  # LiT's own, the frozen block's in eval mode
    assert skipped_cuda_graphs == [True, False]  # inductor had the option where asked (off CUDA: skipped)


def test_graphs_run_without_cuda_graphs_are_counted_and_told_once(caplog):
    """What a reduce-overhead run logs (``compile/cudagraph_skips``): inductor's count of graphs run
    without the CUDA graphs asked for (here the CPU's, of a block compiled with the option), and the
    first skip's one warning, which inductor itself keeps in its perf_hints log."""
    block = torch.nn.Linear(4, 4)
    block.compile(options={"triton.cudagraphs": True})
    skips, before = CudaGraphSkips(), counters["inductor"]["cudagraph_skips"]
    block(torch.randn(2, 4)).sum().backward()
    assert skips.count() == counters["inductor"]["cudagraph_skips"] > before
    skips.count()  # the count again: no second warning
    told = [r.getMessage() for r in caplog.records if "without CUDA graphs" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith("warning: train.compile_mode=reduce-overhead"), told


FSDP_CASES = [
    Case((CHUNK, CHUNK), precision=PRECISION),
    Case((CHUNK, CHUNK), LIT_UNLOCKED, precision=PRECISION),
]


def compiled_fsdp_steps(rank: int, world: int) -> dict:
    """Per case of ``FSDP_CASES``, two SGD steps over towers compiled and then sharded, as the
    trainer does (the other ranks build on the meta device); the second compiles nothing new."""
    results = []
    for case in FSDP_CASES:
        model = make_model(*DROPOUT, *case.extra, dtype=DTYPE)
        if builds_on_meta(case.fsdp):
            model = model.to("meta")
        compile_towers(model)
        shard_towers(model, case.fsdp, case.precision, torch.device("cpu"))
        engine = GradCache(
            model, image_chunk=case.chunks[0], text_chunk=case.chunks[1], precision=case.precision
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        losses, step_grads = [], []
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(SEED + rank)
            with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
                losses.append(engine.step(*rank_batch(rank, world)).loss.item())
            step_grads.append({name: full(grad) for name, grad in grads(model).items()})
            optimizer.step()
        weights = {name: full(p.detach()) for name, p in model.named_parameters()}
        results.append({"losses": losses, "grads": step_grads, "weights": weights})
    return {"results": results, "graph_breaks": sum(counters["graph_break"].values())}


@pytest.mark.slow
def test_compiled_sharded_towers_step_as_one_eager_process_on_the_full_batch():
    """Blocks compiled, then sharded with FSDP2 (each one unit), on 2 ranks: two steps equal the
    eager single-process steps on the global batch, with replayed dropout and with a LiT trunk."""
    ranks = run_distributed(compiled_fsdp_steps, 2, timeout_s=300)
    assert [r["graph_breaks"] for r in ranks] == [0, 0]
    for index, case in enumerate(FSDP_CASES):
        want = reference(2, case)
        for step in range(STEPS):
            mean_loss = sum(r["results"][index]["losses"][step] for r in ranks) / 2
            assert mean_loss == pytest.approx(want["losses"][step], rel=RTOL)
            for r in ranks:
                assert_grads_close(r["results"][index]["grads"][step], want["grads"][step], rtol=RTOL)
        for r in ranks:
            assert_grads_close(r["results"][index]["weights"], want["weights"], rtol=RTOL)
