"""``clip-train bench step --parallel ddp,fsdp``: one Gradient Cache training step (the towers'
gradients and the AdamW update) on W gloo ranks with the towers replicated (DDP) or sharded
(FSDP2), side by side: the median step time, each rank's peak resident memory (once the model is
built and sharded, and overall), and the bytes of parameters, gradients and optimizer states a
rank holds. Each (mode, batch) point runs in fresh processes, so every peak is its own."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from clip_train.bench.runner import in_fresh_process
from clip_train.config import FsdpConfig, load_config
from clip_train.engine import GradCache
from clip_train.errors import UserError
from clip_train.memory import format_bytes, peak_bytes
from clip_train.model import build_model
from clip_train.optim import build_optimizer
from clip_train.parallel import builds_on_meta, shard_towers
from clip_train.parallel.memory import state_bytes

PARALLEL_MODES = ("ddp", "fsdp")
COLUMNS = ("params", "grads", "optim")
HEADER = (
    f"{'mode':<5} {'B/rank':>6} {'step s':>8} | {'built RSS r0/others':>19} | {'peak RSS/rank':>13} | "
    + " ".join(f"{c:>8}" for c in COLUMNS)
)


def run_parallel(args: Any, sizes: list[int]) -> list[dict[str, Any]]:
    """Every mode of ``args.parallel`` at every per-rank batch size; prints a row per point."""
    modes = [m.strip() for m in args.parallel.split(",")]
    if unknown := [m for m in modes if m not in PARALLEL_MODES]:
        raise UserError(
            f"--parallel {args.parallel!r}: unknown {unknown}; choose from {', '.join(PARALLEL_MODES)}"
        )
    print(HEADER, flush=True)
    results = []
    for batch in sizes:
        for mode in modes:
            spec = {
                "mode": mode,
                "batch": batch,
                "world": args.world,
                "model": args.model,
                "set": args.set,
                "image_chunk": args.image_chunk,
                "text_chunk": args.text_chunk,
                "repeats": args.repeats,
                "threads": args.threads or 1,
            }
            results.append(in_fresh_process(measure_ranks, spec))
            print(_row(results[-1]), flush=True)
    return results


def measure_ranks(spec: dict[str, Any]) -> dict[str, Any]:
    """One point: ``spec['world']`` gloo ranks, each reporting; summarised over the ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        # forked: the measurement's own process (in_fresh_process), which has only imported
        mp.start_processes(_rank, (spec, tmp), nprocs=spec["world"], start_method="fork")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(spec["world"])]
    return {
        "mode": spec["mode"],
        "batch": spec["batch"],
        "world": spec["world"],
        "median_s": max(r["median_s"] for r in ranks),
        "peak_bytes": max(r["peak_bytes"] for r in ranks),
        # rank 0 builds the weights; under FSDP the others build on the meta device
        "built_main_bytes": ranks[0]["built_bytes"],
        "built_other_bytes": max(r["built_bytes"] for r in ranks[1:]),
        **{k: max(r[k] for r in ranks) for k in ("parameters", "gradients", "optimizer")},
        "ranks": ranks,
    }


def _rank(rank: int, spec: dict[str, Any], tmp: str) -> None:
    torch.set_num_threads(spec["threads"])
    timeout = datetime.timedelta(seconds=600)
    init = f"file://{os.path.join(tmp, 'init')}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=spec["world"], timeout=timeout)
    try:
        cfg = load_config(spec["model"], spec["set"])
        torch.manual_seed(0)
        on_meta = spec["mode"] == "fsdp" and builds_on_meta(FsdpConfig())  # as the trainer builds
        model = build_model(cfg.model, on_meta=on_meta).train()
        if spec["mode"] == "fsdp":
            shard_towers(model, FsdpConfig(), "fp32", torch.device("cpu"))
        built = peak_bytes(torch.device("cpu"))
        optimizer = build_optimizer(cfg.optim, model)
        engine = GradCache(model, image_chunk=spec["image_chunk"], text_chunk=spec["text_chunk"])
        batch = _batch(model, spec["batch"], rank)
        times = []
        for _ in range(spec["repeats"] + 1):
            optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as in training
            start = time.perf_counter()
            engine.step(*batch)
            optimizer.step()
            dist.barrier()
            times.append(time.perf_counter() - start)
        result = {
            "median_s": statistics.median(times[1:]),
            "peak_bytes": peak_bytes(torch.device("cpu")),
            "built_bytes": built,
            **state_bytes(model, optimizer),
        }
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _batch(model, rows: int, rank: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(rank)
    size, context = model.image_size, model.tokenizer.context_length
    images = torch.randint(0, 256, (rows, 3, size, size), dtype=torch.uint8, generator=gen)
    input_ids = torch.randint(1, model.tokenizer.vocab_size, (rows, context), generator=gen)
    return images, input_ids, torch.ones_like(input_ids)


def _row(r: dict[str, Any]) -> str:
    parts = ("built_main_bytes", "built_other_bytes", "peak_bytes", "parameters", "gradients", "optimizer")
    size = {k: format_bytes(r[k]) for k in parts}
    built = f"{size['built_main_bytes']}/{size['built_other_bytes']}"
    return (
        f"{r['mode']:<5} {r['batch']:>6} {r['median_s']:8.3f} | {built:>19} | {size['peak_bytes']:>13} | "
        f"{size['parameters']:>8} {size['gradients']:>8} {size['optimizer']:>8}"
    )
