"""Gradient Cache step time and peak memory against batch size, next to the direct full-batch step.

Each (mode, batch size) runs in a fresh process, so its peak memory is its own: resident set size
on CPU, ``max_memory_allocated`` on CUDA. Modes: ``gc`` (Gradient Cache), ``direct`` (one forward
and backward of the whole batch, where it fits) and, with ``--lit``, ``gc-lit`` (Gradient Cache with
the image trunk locked). Peak memory is split into the baseline (runtime and model, measured before
the batch exists), the raw batch, the O(B·d) feature cache and the rest (activations, gradients):
Gradient Cache should keep "rest" flat in B. The step-time ratios come from one more process per
batch size in which the modes take turns step by step, so drift on a shared machine cancels out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clip_train.bench import positive_ints
from clip_train.bench.parallel_step import run_parallel
from clip_train.bench.plotting import pyplot
from clip_train.bench.runner import ProcessFailed, in_fresh_process
from clip_train.config import LOSS_IMPLS, PRECISIONS, ConfigError, load_config
from clip_train.distributed import resolve_device, wait_for_device
from clip_train.engine import GradCache
from clip_train.errors import UserError
from clip_train.loss import contrastive_loss
from clip_train.memory import MIB, format_bytes, peak_bytes, tensor_bytes, used_bytes
from clip_train.model import CLIP, build_model
from clip_train.precision import autocast
from clip_train.startup_time import process_started


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="configs/model/tiny.yaml", help="model YAML (a config with a model:)"
    )
    parser.add_argument("--batch", default="256,512,1024,2048", help="comma-separated per-rank batch sizes")
    parser.add_argument("--image-chunk", type=int, default=64, help="image chunk (0 = whole batch)")
    parser.add_argument("--text-chunk", type=int, default=128, help="text chunk (0 = whole batch)")
    parser.add_argument(
        "--lit", action="store_true", help="also time a locked image trunk (model.image.lock)"
    )
    parser.add_argument("--offload", action="store_true", help="keep the batch in host memory, stream chunks")
    parser.add_argument(
        "--keep-last-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="batch.keep_last_graph: each tower's last chunk keeps its graph instead of being replayed",
    )
    parser.add_argument("--no-direct", action="store_true", help="skip the direct full-batch baseline")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per point (after one warm-up)")
    parser.add_argument(  # fp64 is for exactness tests, not for timing
        "--precision", default="fp32", choices=[p for p in PRECISIONS if p != "fp64"]
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads per run (0 = torch's default); 1 is steadiest when shared",
    )
    parser.add_argument("--loss-impl", default="auto", choices=LOSS_IMPLS, help="contrastive_loss impl")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra model config overrides"
    )
    parser.add_argument(
        "--parallel",
        default="",
        help="ddp,fsdp: instead, one training step on --world gloo ranks with replicated or sharded towers",
    )
    parser.add_argument("--world", type=int, default=2, help="ranks for --parallel")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="save a time/memory plot here (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    sizes = positive_ints(args.batch, "--batch")
    if args.repeats <= 0 or min(args.image_chunk, args.text_chunk, args.threads) < 0:
        raise UserError("--repeats must be positive; chunks and --threads >= 0")
    try:  # fail here, with a one-line message, rather than in every worker
        load_config(args.model, args.set)
    except ConfigError as err:
        raise UserError(str(err)) from None
    if args.parallel:  # CPU gloo ranks
        results = run_parallel(args, sizes)
        if args.json:
            args.json.write_text(json.dumps({"parallel": results}, indent=2))
        return 0
    modes = ["gc", *(["gc-lit"] if args.lit else []), *([] if args.no_direct else ["direct"])]
    results, paired = [], []
    print(HEADER, flush=True)
    for batch in sizes:
        spec = batch_spec(args, batch, modes)
        for mode in modes:
            died = {"mode": mode, "batch": batch, "error": "worker died (out of memory?)"}
            results.append(_unless_killed(measure, {**spec, "mode": mode}, died))
            print(_row(results[-1]), flush=True)
        if len(modes) > 1:
            paired.append(_unless_killed(measure_paired, spec, {"batch": batch, "median_s": {}}))
    print(_summary(results, paired))
    if args.json:
        args.json.write_text(json.dumps({"points": results, "paired": paired}, indent=2))
    if args.plot:
        _plot(results, args.plot)
    return 0


def batch_spec(args: argparse.Namespace, batch: int, modes: list[str]) -> dict[str, Any]:
    """What :func:`measure` (with a ``mode`` added) and :func:`measure_paired` take for ``batch``:
    the command's options, JSON-able, and the device resolved."""
    options = {k: v for k, v in vars(args).items() if k not in ("run", "json", "plot")}
    return {**options, "batch": batch, "modes": modes, "device": resolve_device(args.device).type}


def _unless_killed(fn: Callable[[Any], Any], spec: dict[str, Any], died: dict[str, Any]) -> dict[str, Any]:
    """``fn(spec)`` in a fresh process, or ``died`` if a signal (the OOM killer, say) ended it."""
    try:
        return in_fresh_process(fn, spec)
    except ProcessFailed as err:
        if not err.killed:
            raise
        return died


def _setup(spec: dict[str, Any]):
    """Threads and the device for a worker process."""
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    return torch.device(spec["device"])


def _model_and_step(spec: dict[str, Any], mode: str, device):
    """A fresh model for ``mode`` and its step function: Gradient Cache, or the direct baseline."""
    overrides = [*spec["set"], *(["model.image.lock=true"] if mode == "gc-lit" else [])]
    torch.manual_seed(0)
    model = build_model(load_config(spec["model"], overrides).model).to(device).train()
    if mode == "direct":
        return model, _direct_step(model, spec["precision"], spec["loss_impl"], device)
    engine = GradCache(
        model,
        image_chunk=spec["image_chunk"],
        text_chunk=spec["text_chunk"],
        precision=spec["precision"],
        offload=spec["offload"],
        keep_last_graph=spec["keep_last_graph"],
        loss_impl=spec["loss_impl"],
    )
    return model, engine.step


def _timed(model, step, batch, device):
    """Wall and process-CPU seconds of one step, and what it returned."""
    model.zero_grad(set_to_none=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    out = step(*batch)
    wait_for_device(device)
    return time.perf_counter() - start, time.process_time() - cpu_start, out


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One (mode, batch) point, in a fresh process: median step time and the memory breakdown."""
    device = _setup(spec)
    model, step = _model_and_step(spec, spec["mode"], device)
    base = used_bytes(device)
    batch = synthetic_batch(model, spec["batch"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ready_s = time.time() - process_started()  # imports (on a GPU), model and batch
    times, cpu_times, stats = [], [], None
    try:
        for _ in range(spec["repeats"] + 1):
            wall, cpu, stats = _timed(model, step, batch, device)
            times.append(wall)
            cpu_times.append(cpu)
    except torch.OutOfMemoryError:
        return {"mode": spec["mode"], "batch": spec["batch"], "error": "out of memory"}
    # Offloaded to a GPU, the batch stays in host memory and its chunks count as activations.
    in_peak = not (spec["offload"] and device.type == "cuda")
    batch_bytes = tensor_bytes(batch) if in_peak else 0
    cache_bytes = stats.cache_bytes if spec["mode"] != "direct" else 0
    peak = peak_bytes(device)
    return {
        "mode": spec["mode"],
        "batch": spec["batch"],
        "device": str(device),
        "median_s": statistics.median(times[1:]),
        "times_s": times[1:],
        "ready_s": ready_s,
        "warmup_s": times[0],
        "cpu_s": statistics.median(cpu_times[1:]),  # process CPU time: less sensitive to a shared machine
        "peak_bytes": peak,
        "base_bytes": base,
        "batch_bytes": batch_bytes,
        "cache_bytes": cache_bytes,
        "rest_bytes": peak - batch_bytes - cache_bytes,  # what must stay flat in B under Gradient Cache
        "activation_bytes": peak - base - batch_bytes - cache_bytes,
    }


def measure_paired(spec: dict[str, Any]) -> dict[str, Any]:
    """Median step time of every mode at one batch size, the modes taking turns step by step in one
    process: a shared machine's drift then slows them alike, so their ratios are steadier than
    those of the separate fresh processes (which the memory figures need)."""
    device = _setup(spec)
    runners = {mode: _model_and_step(spec, mode, device) for mode in spec["modes"]}
    batch = synthetic_batch(next(iter(runners.values()))[0], spec["batch"])
    times: dict[str, list[float]] = {mode: [] for mode in runners}
    for _ in range(spec["repeats"] + 1):
        for mode in list(runners):
            try:
                times[mode].append(_timed(*runners[mode], batch, device)[0])
            except torch.OutOfMemoryError:  # the direct step where it does not fit
                del runners[mode], times[mode]
    return {"batch": spec["batch"], "median_s": {mode: statistics.median(t[1:]) for mode, t in times.items()}}


def _direct_step(model, precision: str, loss_impl: str, device):
    """The no-cache baseline: the whole batch through both towers with one graph, one backward."""

    def step(images, input_ids, attention_mask):
        batch = (t.to(device, non_blocking=True) for t in (images, input_ids, attention_mask))
        with autocast(device, precision):
            image_features, text_features, scale = model(*batch)
        loss = contrastive_loss(image_features.float(), text_features.float(), scale, impl=loss_impl)
        loss.backward()
        return loss

    return step


def synthetic_batch(model: CLIP, rows: int) -> tuple[torch.Tensor, ...]:
    """Random uint8 images and token ids shaped for ``model``, in host memory as a loader delivers them."""
    gen = torch.Generator().manual_seed(rows)
    size, context = model.image_size, model.tokenizer.context_length
    images = torch.randint(0, 256, (rows, 3, size, size), dtype=torch.uint8, generator=gen)
    input_ids = torch.randint(1, model.tokenizer.vocab_size, (rows, context), generator=gen)
    lengths = torch.randint(2, context + 1, (rows,), generator=gen)
    attention_mask = (torch.arange(context) < lengths[:, None]).long()
    if torch.cuda.is_available():
        return tuple(t.pin_memory() for t in (images, input_ids, attention_mask))
    return images, input_ids, attention_mask


HEADER = (
    f"{'mode':<7} {'B':>6} {'step s':>8} {'cpu s':>8} | {'peak':>8} = {'base':>8} + {'batch':>8} + "
    f"{'cache':>8} + {'activ.':>8} | {'peak-batch-cache':>16}"
)


def _row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['mode']:<7} {r['batch']:>6} {r['error']}"
    size = {k.removesuffix("_bytes"): format_bytes(v) for k, v in r.items() if k.endswith("_bytes")}
    return (
        f"{r['mode']:<7} {r['batch']:>6} {r['median_s']:8.3f} {r['cpu_s']:8.3f} | {size['peak']:>8} = "
        f"{size['base']:>8} + {size['batch']:>8} + {size['cache']:>8} + {size['activation']:>8} | "
        f"{size['rest']:>16}"
    )


def _summary(results: list[dict[str, Any]], paired: list[dict[str, Any]]) -> str:
    ok = {(r["mode"], r["batch"]): r for r in results if "error" not in r}
    lines = ["", "summary:"]
    gc = sorted(b for m, b in ok if m == "gc")
    if len(gc) > 1:
        low, high = ok["gc", gc[0]], ok["gc", gc[-1]]
        lines.append(
            f"  gc memory, peak - batch - feature cache: B={gc[-1]} / B={gc[0]} = "
            f"{high['rest_bytes'] / low['rest_bytes']:.3f} (activations alone: "
            f"{format_bytes(high['activation_bytes'])} vs {format_bytes(low['activation_bytes'])})"
        )
    lines.append("  step-time ratios: modes alternating in one process (separate fresh processes)")
    for point in paired:
        batch, times = point["batch"], point["median_s"]
        for a, b in (("gc", "direct"), ("gc-lit", "gc")):
            if a in times and b in times and (a, batch) in ok and (b, batch) in ok:
                separate = ok[a, batch]["median_s"] / ok[b, batch]["median_s"]
                lines.append(f"  B={batch:<6} {a} / {b}: {times[a] / times[b]:.3f} ({separate:.3f})")
    return "\n".join(lines)


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in results):
        points = sorted((r["batch"], r) for r in results if r["mode"] == mode and "error" not in r)
        batches = [b for b, _ in points]
        (line,) = ax_time.plot(batches, [r["median_s"] for _, r in points], "o-", label=mode)
        color = line.get_color()
        ax_mem.plot(
            batches, [r["peak_bytes"] / MIB for _, r in points], "o-", color=color, label=f"{mode} peak"
        )
        rest = [r["rest_bytes"] / MIB for _, r in points]
        ax_mem.plot(batches, rest, "x--", color=color, label=f"{mode} peak-batch-cache")
    for ax, label in ((ax_time, "median step time (s)"), (ax_mem, "memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("per-rank batch size")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
