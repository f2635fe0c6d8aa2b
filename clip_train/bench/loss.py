"""`clip-train bench loss`: forward+backward time and peak extra memory of the loss vs batch size.

On CPU every (impl, batch) runs in a fresh subprocess, so peak RSS growth over the inputs is
that configuration's own; ``--world W`` runs W gloo ranks with b/W rows each. On CUDA the peak
is ``max_memory_allocated`` above the inputs. A configuration whose estimated memory exceeds
what is available is reported as OOM without running. The compute floor is one plain b×b×d
matmul (computed in row chunks, so it needs no b×b output), timed in the same run.

``--kind sigmoid`` benchmarks the SigLIP loss; impl ``open_clip`` is open_clip's own
``SigLipLoss`` (its neighbour exchange across ranks), run side by side in the same way. For the
softmax loss ``open_clip`` is its ``ClipLoss`` (``local_loss`` and ``gather_with_grad`` across
ranks), and ``inf_cl`` is Inf-CL's ``cal_inf_loss`` (both directions; CUDA, when installed).

``--kind distill`` benchmarks the softmax loss plus the distillation term towards a teacher's
features (d as the student's): ``inf`` is clip_train's (both at once, tiled and ringed),
``open_clip`` its ``DistillClipLoss``, which builds the student's and the teacher's logits.

``--accuracy ROWS`` also compares each implementation's loss and gradients, in ``--dtype``, with the
same inputs' loss and gradients in fp64 (the materialised formula) at ROWS rows.

``--json`` is rewritten (whole, atomically) after each measured point, so a run stopped part-way
(``bench gpu``'s time limits) keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from clip_train.bench import positive_ints
from clip_train.bench.plotting import pyplot
from clip_train.bench.runner import ProcessFailed, in_fresh_process
from clip_train.config import RESOLVED_LOSS_IMPLS
from clip_train.distributed import resolve_device, wait_for_device
from clip_train.files import replace_text
from clip_train.loss import contrastive_loss
from clip_train.loss.distill import contrastive_and_distillation_loss
from clip_train.memory import MIB, format_bytes, peak_bytes, used_bytes

# local is softmax-only; open_clip's SigLipLoss runs beside the sigmoid loss.
IMPLS = {
    "softmax": (*RESOLVED_LOSS_IMPLS, "open_clip", "inf_cl"),
    "sigmoid": (*(i for i in RESOLVED_LOSS_IMPLS if i != "local"), "open_clip"),
    "distill": ("inf", "open_clip"),
}
TEACHER_SCALE = 50.0  # the teacher's logit scale in --kind distill
# Estimated peak extra bytes per rank, per element of the similarity matrix it materialises
# (logits, log-softmaxes or log-sigmoids, labels and gradients), measured at small sizes with headroom.
MATRIX_COPIES = {"vanilla": 7, "local": 8, "open_clip": 8, "inf_cl": 0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", default="4096,8192,16384,32768", help="comma-separated global batch sizes")
    parser.add_argument("--dim", type=int, default=512, help="embedding dimension")
    parser.add_argument(
        "--kind", default="softmax", choices=tuple(IMPLS), help="the loss; distill: softmax + distillation"
    )
    parser.add_argument(
        "--impl",
        default="",
        help="comma-separated: "
        + "; ".join(f"{', '.join(impls)} ({kind})" for kind, impls in IMPLS.items())
        + "; default all",
    )
    parser.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA fp32: TF32 matmuls, as training sets them (default on)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed forward+backward runs (median reported)"
    )
    parser.add_argument("--world", type=int, default=1, help="ranks (gloo processes on CPU), b/W rows each")
    parser.add_argument("--tile", type=int, default=0, help="tile size for inf (0: the device default)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--scale", type=float, default=30.0, help="logit scale s")
    parser.add_argument("--bias", type=float, default=-10.0, help="sigmoid: logit bias b")
    parser.add_argument(
        "--accuracy", type=int, default=0, metavar="ROWS", help="also: error against fp64 at ROWS rows"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write memory- and time-vs-batch figures here (PNG)")


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device).type
    batches = positive_ints(args.batch, "--batch")
    choices = IMPLS[args.kind]
    impls = [i.strip() for i in args.impl.split(",")] if args.impl else list(choices)
    for impl in impls:
        if impl not in choices:
            raise SystemExit(
                f"bench loss: unknown {args.kind} impl {impl!r}; choose from {', '.join(choices)}"
            )
    if device == "cuda" and args.world > 1:
        raise SystemExit("bench loss: --world runs gloo ranks on CPU; use torchrun for multi-GPU")
    if any(b % args.world for b in batches):
        raise SystemExit(f"bench loss: every batch must be divisible by --world {args.world}")

    results = _Results(args.json)
    points = results.parts["points"]
    tf32 = ", TF32" if device == "cuda" and args.dtype == "float32" and args.tf32 else ""
    print(
        f"{args.kind} loss, dim={args.dim}, {args.dtype}{tf32}, device={device}, world={args.world}, "
        f"repeats={args.repeats}"
    )
    header = f"{'batch':>7} {'impl':>12} {'time_s':>8} {'x_floor':>8} {'peak':>9}  note"
    print(header)
    for batch in batches:
        floor = _measure(_spec(args, "floor", batch, device, world=1), device)
        results.add("points", floor)
        print(
            f"{batch:>7} {'matmul':>12} {floor['time_s']:>8.3f} {1.0:>8.2f} {'':>9}  one b×b×d matmul (floor)"
        )
        for impl in impls:
            spec = _spec(args, impl, batch, device, args.world)
            need, have = _estimate_bytes(spec), _available_bytes(device)
            if device == "cpu" and need > 0.85 * have:  # CUDA tries: its out-of-memory error is caught
                result = {**_public(spec), "time_s": None, "peak_mib": None, "oom": True}
                result["note"] = f"OOM: needs ~{format_bytes(need)}, {format_bytes(have)} available; skipped"
            else:
                result = _measure(spec, device)
            results.add("points", result)
            time_s, peak = result["time_s"], result["peak_mib"]
            cells = (
                f"{time_s:>8.3f} {time_s / floor['time_s']:>8.2f} {format_bytes(peak * MIB):>9}"
                if time_s is not None
                else f"{'-':>8} {'-':>8} {'-':>9}"
            )
            print(f"{batch:>7} {impl:>12} {cells}  {result.get('note', '')}", flush=True)
        ran = [r for r in points if r["batch"] == batch and r["impl"] != "floor" and r["time_s"] is not None]
        if args.world == 1 and len(ran) > 1:
            runs_spec = [_spec(args, r["impl"], batch, device, 1) for r in ran]
            measured = _measure({**runs_spec[0], "impl": "paired", "runs": runs_spec}, device)
            if "median_s" not in measured:  # all of them at once ran out of memory
                print(f"{'':>7} {'same process':>12}  {measured.get('note', '')}", flush=True)
                continue
            results.add("paired", {"batch": batch, "median_s": measured["median_s"]})
            print(f"{'':>7} {'same process':>12}  {_ratios(measured['median_s'])}", flush=True)
    if args.accuracy:
        for impl in impls:
            point = _accuracy(args, impl, device)
            results.add("accuracy", point)
            print(f"{args.accuracy:>7} {point['impl']:>12}  {_accuracy_note(point)}", flush=True)
    if args.plot:
        _plot(points, args.plot)
    return 0


class _Results:
    """The points, paired timings and accuracy so far, rewritten whole to ``--json`` after each one:
    a run stopped part-way (``bench gpu``'s budget, a hung configuration) keeps what it measured."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.parts: dict[str, list[dict[str, Any]]] = {"points": [], "paired": [], "accuracy": []}

    def add(self, part: str, entry: dict[str, Any]) -> None:
        self.parts[part].append(entry)
        if self.path:
            replace_text(self.path, json.dumps(self.parts, indent=2))


def _spec(args: argparse.Namespace, impl: str, batch: int, device: str, world: int) -> dict[str, Any]:
    """Everything a measuring subprocess needs, as plain JSON-able values."""
    return {
        "impl": impl,
        "batch": batch,
        "device": device,
        "world": world,
        **{
            key: getattr(args, key)
            for key in ("kind", "dim", "repeats", "tile", "dtype", "scale", "bias", "tf32")
        },
    }


def _public(spec: dict[str, Any]) -> dict[str, Any]:
    keys = ("kind", "impl", "batch", "dim", "world", "dtype", "device", "tile", "repeats", "tf32")
    return {key: spec[key] for key in keys}


def _ratios(times: dict[str, float]) -> str:
    """Each implementation's time over the baseline's (open_clip's SigLipLoss, else vanilla),
    from the impls taking turns in one process."""
    base = "open_clip" if "open_clip" in times else next(iter(times))
    return ", ".join(f"{label} / {base} {t / times[base]:.3f}" for label, t in times.items() if label != base)


def _estimate_bytes(spec: dict[str, Any]) -> float:
    """Per-rank peak extra memory of one configuration (generous; used only to skip OOMs)."""
    b, w, d = spec["batch"], spec["world"], spec["dim"]
    itemsize = 8 if spec["dtype"] == "float64" else 4
    features = 16 * (b // w) * d * itemsize
    if spec["impl"] == "inf":
        tile = spec["tile"] or 4096
        buffers = 12 if spec["kind"] == "distill" else 4  # distill: two logit tiles and their exponentials
        return features + buffers * tile * tile * itemsize
    # Rows of the matrix each rank builds: all of them for the softmax vanilla loss, its own otherwise.
    rows = b if (spec["kind"], spec["impl"]) == ("softmax", "vanilla") else b // w
    matrices = 2 if spec["kind"] == "distill" else 1  # the student's logits and the teacher's
    return features + matrices * MATRIX_COPIES[spec["impl"]] * rows * b * itemsize


def _available_bytes(device: str) -> float:
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return float(free)
    return float(psutil.virtual_memory().available)


def _accuracy(args: argparse.Namespace, impl: str, device: str) -> dict[str, Any]:
    """``impl``'s loss and gradients at ``--accuracy`` rows in ``--dtype`` against fp64, in this
    process (no memory is measured); an implementation that fails has its error as its result."""
    spec = {**_spec(args, impl, args.accuracy, device, world=1), "of": impl}
    point = {"impl": impl, "rows": args.accuracy, "dtype": args.dtype}
    try:
        return {**point, **_errors_against_fp64(spec)}
    except Exception as err:
        return {**point, "note": f"failed: {type(err).__name__}: {err}"}


def _accuracy_note(point: dict[str, Any]) -> str:
    if "loss_rel_error" not in point:
        return point.get("note", "")
    return (
        f"vs fp64: loss {point['loss_rel_error']:.1e} relative, "
        f"gradients {point['grad_rel_error']:.1e} of their largest"
    )


def _errors_against_fp64(spec: dict[str, Any]) -> dict[str, Any]:
    """Relative error of the loss, and largest gradient error over the largest gradient, of one
    implementation in the benchmark's dtype against the fp64 formula on the same inputs."""
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    gen = torch.Generator().manual_seed(0)
    inputs = [F.normalize(torch.randn(spec["batch"], spec["dim"], generator=gen, dtype=torch.float64), dim=1)]
    inputs.append(F.normalize(inputs[0] + torch.randn(inputs[0].shape, generator=gen, dtype=torch.float64)))
    inputs += [
        torch.tensor(spec["scale"], dtype=torch.float64),
        torch.tensor(spec["bias"], dtype=torch.float64),
    ]
    exact = [t.to(device).clone().requires_grad_() for t in inputs]
    low = [t.to(device, dtype if t.ndim else torch.float32).clone().requires_grad_() for t in inputs]
    if spec["kind"] == "distill":  # open_clip's formula, which builds both matrices, in fp64
        reference = _loss_fn({**spec, "impl": "open_clip", "dtype": "float64"}, 0, 1)(*exact)
    else:
        bias = exact[3] if spec["kind"] == "sigmoid" else None
        reference = contrastive_loss(*exact[:3], logit_bias=bias, kind=spec["kind"], impl="vanilla")
    reference.backward()
    loss = _loss_fn({**spec, "impl": spec["of"]}, 0, 1)(*low)
    loss.backward()
    grad_error = max(
        float((b.grad.double() - a.grad).abs().max() / a.grad.abs().max())
        for a, b in zip(exact[:2], low[:2], strict=True)
    )
    return {
        "loss_rel_error": abs(float(loss.detach()) / float(reference.detach()) - 1),
        "grad_rel_error": grad_error,
    }


def _measure(spec: dict[str, Any], device: str) -> dict[str, Any]:
    """One configuration: in-process on CUDA (an out-of-memory error is its result), in a fresh
    process (and its ranks) on CPU."""
    if device == "cuda":
        try:
            return {**_public(spec), **_run(spec)}
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return {**_public(spec), "time_s": None, "peak_mib": None, "oom": True, "note": "OOM"}
        except Exception as err:  # an optional implementation's own failure, reported as its result
            return {**_public(spec), "time_s": None, "peak_mib": None, "note": f"failed: {err}"}
    try:
        return {**_public(spec), **in_fresh_process(_run, spec)}
    except ProcessFailed as err:
        return {**_public(spec), "time_s": None, "peak_mib": None, "note": f"failed: {err.last_line}"}


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration's results: paired timings, or time and memory on 1 or W ranks."""
    if spec["impl"] == "paired":
        return {"median_s": _paired_times(spec["runs"])}
    world = spec["world"] if spec["impl"] != "floor" else 1
    if world == 1:
        return _time_and_memory(spec, rank=0, world=1)
    # On the CPU this is a measurement's own process, which has only imported: its ranks are forked
    # from it. On CUDA it is the command's, which holds the device: they start fresh.
    start_method = "fork" if spec["device"] == "cpu" else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, (world, spec, tmp), nprocs=world, start_method=start_method)
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    return {
        "time_s": max(r["time_s"] for r in per_rank),
        "times_s": per_rank[0]["times_s"],
        "peak_mib": max(r["peak_mib"] for r in per_rank),
    }


def _rank_main(rank: int, world: int, spec: dict[str, Any], tmp: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        result = _time_and_memory(spec, rank, world)
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _make_step(spec: dict[str, Any], rank: int, world: int) -> Any:
    """One timed unit of work on fresh inputs: forward + backward of the loss, or the floor matmul."""
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = spec["tf32"]
    rows = spec["batch"] // world
    gen = torch.Generator().manual_seed(rank)
    images = F.normalize(torch.randn(rows, spec["dim"], generator=gen), dim=1).to(device, dtype)
    texts = F.normalize(torch.randn(rows, spec["dim"], generator=gen), dim=1).to(device, dtype)
    if spec["impl"] == "floor":
        return _matmul_floor(images, texts)
    leaves = [images.requires_grad_(), texts.requires_grad_()]
    leaves += [torch.tensor(spec[key], device=device, requires_grad=True) for key in ("scale", "bias")]
    loss_fn = _loss_fn(spec, rank, world)

    def step() -> None:
        loss_fn(*leaves).backward()
        for leaf in leaves:
            leaf.grad = None

    return step


def _synchronizer(device: Any, world: int) -> Any:
    def sync() -> None:
        wait_for_device(device)
        if world > 1:
            dist.barrier()

    return sync


def _time_and_memory(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    device = torch.device(spec["device"])
    sync = _synchronizer(device, world)
    step = _make_step(spec, rank, world)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = used_bytes(device)
    times = []
    step()  # warm-up (lazy initialisation, first-touch page faults); its memory still counts
    for _ in range(max(1, spec["repeats"])):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    peak = peak_bytes(device) - base
    return {"time_s": statistics.median(times), "times_s": times, "peak_mib": max(peak, 0) / MIB}


def _paired_times(specs: list[dict[str, Any]]) -> dict[str, float]:
    """Median step time of each configuration, all in one process taking turns step by step, so a
    shared machine's drift slows them alike and their ratios hold (the memory needs fresh processes)."""
    sync = _synchronizer(torch.device(specs[0]["device"]), 1)
    steps = {spec["impl"]: _make_step(spec, 0, 1) for spec in specs}
    times: dict[str, list[float]] = {label: [] for label in steps}
    for repeat in range(max(1, specs[0]["repeats"]) + 1):
        for label, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            if repeat:  # the first round warms up
                times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


def _loss_fn(spec: dict[str, Any], rank: int, world: int) -> Any:
    """``(images, texts, scale, bias) -> loss`` for the benchmarked implementation."""
    if spec["kind"] == "distill":
        return _distill_loss_fn(spec, rank, world)
    if spec["impl"] == "open_clip":  # imported here: importing open_clip costs every fresh process ~3 s
        from open_clip.loss import ClipLoss, SigLipLoss

        if spec["kind"] == "sigmoid":
            return SigLipLoss(rank=rank, world_size=world)
        clip_loss = ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
        return lambda images, texts, scale, bias: clip_loss(images, texts, scale)
    if spec["impl"] == "inf_cl":
        from inf_cl import cal_inf_loss

        return lambda images, texts, scale, bias: (
            (cal_inf_loss(images, texts, scale=scale) + cal_inf_loss(texts, images, scale=scale)) / 2
        )
    # same_upstream: every rank backpropagates 1, as the trainer's ranks do (no host read in the backward)
    options = {
        "kind": spec["kind"],
        "impl": spec["impl"],
        "tile_size": spec["tile"] or None,
        "same_upstream": True,
    }

    def loss(images: Any, texts: Any, scale: Any, bias: Any) -> Any:
        return contrastive_loss(
            images, texts, scale, logit_bias=bias if spec["kind"] == "sigmoid" else None, **options
        )

    return loss


def _distill_loss_fn(spec: dict[str, Any], rank: int, world: int) -> Any:
    """The softmax loss plus the distillation term towards fixed teacher features of this rank's rows."""
    gen = torch.Generator().manual_seed(1000 + rank)
    rows, device, dtype = spec["batch"] // world, torch.device(spec["device"]), getattr(torch, spec["dtype"])
    exact = [torch.randn(rows, spec["dim"], generator=gen, dtype=torch.float64) for _ in range(2)]
    teacher = [F.normalize(features, dim=1).to(device, dtype) for features in exact]
    teacher_scale = torch.tensor(TEACHER_SCALE, device=device)
    if spec["impl"] == "open_clip":
        from open_clip.loss import DistillClipLoss

        distill = DistillClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
        return lambda images, texts, scale, bias: sum(distill(images, texts, scale, *teacher, teacher_scale))
    tile = spec["tile"] or None

    def loss(images: Any, texts: Any, scale: Any, bias: Any) -> Any:
        return sum(
            contrastive_and_distillation_loss(images, texts, scale, *teacher, teacher_scale, tile_size=tile)
        )

    return loss


def _matmul_floor(images: Any, texts: Any) -> Any:
    """A b×b×d matmul in row chunks into one reused buffer: the FLOPs without the b×b memory."""
    chunk = min(2048, images.shape[0])
    out = images.new_empty(chunk, texts.shape[0])

    def step() -> None:
        for start in range(0, images.shape[0], chunk):
            part = images[start : start + chunk]
            torch.mm(part, texts.t(), out=out[: len(part)])

    return step


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for color, impl in enumerate(dict.fromkeys(r["impl"] for r in results)):
        done = [r for r in results if r["impl"] == impl and r["time_s"] is not None]
        if not done:
            continue
        batches = [r["batch"] for r in done]
        label = "b×b×d matmul" if impl == "floor" else impl
        if impl != "floor":
            mem_ax.plot(batches, [r["peak_mib"] for r in done], "o-", color=f"C{color}", label=impl)
        style = "o--" if impl == "floor" else "o-"
        time_ax.plot(batches, [r["time_s"] for r in done], style, color=f"C{color}", label=label)
    for ax, ylabel in ((mem_ax, "peak extra memory per rank (MiB)"), (time_ax, "forward+backward time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    world, kind = (results[0]["world"], results[0]["kind"]) if results else (1, "softmax")
    fig.suptitle(f"{kind} loss, world={world} (OOM-skipped configurations omitted)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
