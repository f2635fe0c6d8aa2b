"""Per-GPU memory of one Gradient Cache step, and the largest global batch that fits (Inf-CL eq. 10).

    M_peak ≈ static + M_data + M_cache + max(M_loss + M_kept, M_backbone)

* static — fp32 weights, gradients and optimizer state of the trainable parameters (LiT-frozen
  ones have neither). DDP's buckets add nothing: the gradients are views into them.
* M_data — the raw per-rank batch (uint8 images, int64 ids and mask); with offload only two
  chunks of the stream being consumed are on the device.
* M_cache — Gradient Cache's fp32 features and their gradients (2 towers × n × d each) and a LiT
  tower's cached frozen-trunk output (on the host with offload).
* M_loss — the loss implementation's workspace: b×b matrices for vanilla, n×b for local, O(n·d)
  plus tile² for inf (n = b / gpus).
* M_kept — the graph of the last chunk encoded, which Gradient Cache keeps through the loss
  instead of replaying that chunk (inf loss and ``batch.keep_last_graph`` only).
* M_backbone — the peak of one chunk's graph-less encode or with-grad replay, *measured* with
  torch's MemTracker at two small chunk sizes on the device at hand and extrapolated linearly.

A reserve of 5 % of the GPU plus 1 GiB (at most 10 % of the GPU, so toy budgets still plan) covers
the CUDA context and allocator fragmentation.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clip_train.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from clip_train.config import Config, ModelConfig

GIB = 2**30
FP32 = 4
IMPLS = ("vanilla", "local", "inf")
RESERVE_FIXED, RESERVE_FIXED_CAP, RESERVE_FRACTION = 1 * GIB, 0.10, 0.05
# BERT-base's published hyperparameters: what a hub name of that family builds when the hub is
# unreachable (the weights do not change the memory, only the shapes do).
KNOWN_TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    name: dict(
        model_type="bert",
        vocab_size=vocab,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
    )
    for name, vocab in (("bert-base-uncased", 30522), ("bert-base-cased", 28996))
}


# --------------------------------------------------------------------------------------------
# Measured activation memory
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """``fixed + per_sample · rows`` bytes, through two measurements."""

    fixed: float
    per_sample: float

    @classmethod
    def through(cls, rows: tuple[int, int], measured: tuple[float, float]) -> Line:
        slope = (measured[1] - measured[0]) / (rows[1] - rows[0])
        return cls(measured[0] - slope * rows[0], slope)

    def at(self, rows: int) -> float:
        return self.fixed + self.per_sample * rows


@dataclass(frozen=True)
class Envelope:
    """The maximum of several lines: a forward peak and a backward peak extrapolate separately."""

    lines: tuple[Line, ...]

    def at(self, rows: int) -> float:
        return max((line.at(rows) for line in self.lines), default=0.0)

    @property
    def per_sample(self) -> float:
        """The slope that dominates at large chunks."""
        return max((line.per_sample for line in self.lines), default=0.0)


@dataclass(frozen=True)
class TowerProfile:
    """One tower's measured chunk memory above the static part, raw chunk inputs excluded."""

    name: str
    encode: Envelope  # stage 1: graph-less forward of a chunk
    graph: Envelope  # with-grad forward of the trainable part: a kept chunk (empty: no replay)
    replay: Envelope  # stage 3: with-grad forward + backward of the trainable part (empty: no replay)
    trunk_per_sample: int  # bytes of the cached frozen-trunk output (0 unless LiT caches a trunk)
    input_per_sample: int  # raw bytes: uint8 pixels, or int64 ids + mask
    replays: bool


@dataclass(frozen=True)
class ModelProfile:
    image: TowerProfile
    text: TowerProfile
    embed_dim: int
    weight_bytes: int  # every parameter and buffer as stored (fp32)
    trainable_bytes: int
    adamw_bytes: int
    adafactor_bytes: int
    device: str
    precision: str
    measured_chunks: tuple[int, int]
    notes: tuple[str, ...] = ()

    @property
    def towers(self) -> tuple[TowerProfile, TowerProfile]:
        return self.image, self.text


def planning_model_config(model_cfg: ModelConfig) -> tuple[ModelConfig, list[str]]:
    """The same architecture with random init and no hub access: weights do not change memory."""
    notes = []
    image = dataclasses.replace(model_cfg.image, pretrained="")
    text = model_cfg.text
    if not text.hf_config:
        text = dataclasses.replace(text, hf_config=_text_hyperparameters(text.hf))
        notes.append(f"text tower {text.hf!r} built from its config with random weights")
    return dataclasses.replace(model_cfg, image=image, text=text), notes


def _text_hyperparameters(source: str) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError):
        if source in KNOWN_TEXT_CONFIGS:
            return dict(KNOWN_TEXT_CONFIGS[source])
        raise UserError(
            f"model.text.hf={source!r}: its config is neither local nor cached and its shape is not known "
            "here; pass model.text.hf_config={...} (hidden_size, num_hidden_layers, ...) to plan without it"
        ) from None
    return {"model_type": config.model_type, **config.to_diff_dict()}


def build_planning_model(model_cfg: ModelConfig) -> tuple[nn.Module, list[str]]:
    """The CLIP model without a tokenizer (planning needs shapes only), random init, offline."""
    from clip_train.model import CLIP
    from clip_train.model.image import build_image_tower
    from clip_train.model.text import build_text_tower

    cfg, notes = planning_model_config(model_cfg)
    vocab = None if "vocab_size" in cfg.text.hf_config else 49408  # open_clip's BPE, as the tiny config
    text = build_text_tower(cfg.text, cfg.embed_dim, vocab_size=vocab)
    visual = build_image_tower(cfg.image, cfg.embed_dim)
    return CLIP(visual, text, None, cfg.init_logit_scale, cfg.init_logit_bias), notes


def _random_inputs(
    model: nn.Module, tower: str, rows: int, context_length: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, ...]:
    """A batch as the data pipeline delivers it: uint8 NCHW pixels, or int64 ids and mask."""
    import torch

    if tower == "image":
        size = model.image_size
        return (torch.randint(0, 256, (rows, 3, size, size), dtype=torch.uint8, device=device),)
    vocab = model.text.encoder.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (rows, context_length), device=device)
    return ids, torch.ones_like(ids)


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _dynamic_peak(tracker: Any) -> int:
    """Peak bytes of activations and temporaries, i.e. without parameters, buffers and gradients."""
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    return sum(v for k, v in snapshot.items() if k in ("Activation", "Temp", "Other"))


@contextlib.contextmanager
def _trackable(tower: nn.Module) -> Iterator[None]:
    """Let MemTracker hook every parameter: it refuses frozen ones (``requires_grad=False``).

    Harmless for the measurement: frozen parameters only run under ``no_grad`` (the graph-less
    encode) or not at all (the replay of a LiT tower's trainable head), so no graph or gradient
    changes while the flag is flipped.
    """
    frozen = [p for p in tower.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def _measured_precision(precision: str, device_type: str) -> str:
    """CPU fp16 matmuls are emulated (~10x slower than bf16); bf16 has the same bytes per element."""
    return "bf16" if precision == "fp16" and device_type == "cpu" else precision


def _measure_chunk(
    model: nn.Module, tower_name: str, rows: int, context_length: int, precision: str
) -> dict[str, float]:
    """Peaks of one chunk's stage-1 encode and stage-3 replay (forward, then forward + backward)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from clip_train.engine import TrainableHead
    from clip_train.precision import autocast

    tower = getattr(model, "visual" if tower_name == "image" else "text")
    device = model.logit_scale.device
    measured = _measured_precision(precision, device.type)

    inputs = _random_inputs(model, tower_name, rows, context_length, device)
    out: dict[str, float] = {}
    tracker = MemTracker()
    # Chunks are cloned inside the tracker so it counts them; they are then taken off again (they
    # are M_data or the trunk cache, not activations).
    with _trackable(tower), tracker, torch.no_grad(), autocast(device, measured):
        chunk = tuple(t.clone() for t in inputs)
        tower(*chunk)
    out["encode"] = _dynamic_peak(tracker) - _nbytes(chunk)
    with torch.no_grad(), autocast(device, measured):
        hidden = tower.encode_frozen(*inputs)
    out["trunk"] = _nbytes(hidden) / rows if tower.has_frozen_trunk else 0.0
    if tower.is_frozen:
        return out
    head = TrainableHead(tower)
    for p in tower.trainable_parameters():  # steady state: chunks accumulate into existing gradients
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    tracker = MemTracker()
    on_cuda = device.type == "cuda"
    if on_cuda:  # the caching allocator's own count, as a cross-check of the tracker's
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with _trackable(tower), tracker:
        chunk = tuple(h.clone() for h in hidden)
        with autocast(device, measured):
            features = head(*chunk)
        out["forward"] = _dynamic_peak(tracker) - _nbytes(chunk)
        features.backward(torch.randn_like(features))
        del features
    out["replay"] = _dynamic_peak(tracker) - _nbytes(chunk)
    if on_cuda:
        out["allocator_replay"] = torch.cuda.max_memory_allocated(device) - before - _nbytes(chunk)
    return out


def profile_model(
    model_cfg: ModelConfig,
    precision: str = "fp32",
    chunks: tuple[int, int] = (2, 4),
    device: str = "cpu",
) -> ModelProfile:
    """Build the model and measure each tower at two chunk sizes; the rest is counted from shapes."""
    import torch

    if not 0 < chunks[0] < chunks[1]:
        raise UserError(f"--measure-chunks {chunks[0]} {chunks[1]}: need two sizes 0 < a < b")
    torch.manual_seed(0)
    model, notes = build_planning_model(model_cfg)
    model.to(device).train()
    if _measured_precision(precision, torch.device(device).type) != precision:
        notes.append(f"{precision} autocast measured as bf16 on {device} (same bytes per element)")
    length = model_cfg.text.context_length
    towers = []
    for name in ("image", "text"):
        measured = [_measure_chunk(model, name, rows, length, precision) for rows in chunks]

        def line(key: str, runs: list[dict[str, float]] = measured) -> Line:
            return Line.through(chunks, (runs[0][key], runs[1][key]))

        tower = getattr(model, "visual" if name == "image" else "text")
        replays = not tower.is_frozen
        sample = _random_inputs(model, name, 1, length)
        if replays and "allocator_replay" in measured[1]:
            notes.append(
                f"{name} replay at chunk {chunks[1]}: CUDA max_memory_allocated "
                f"{_fmt(measured[1]['allocator_replay'])} vs MemTracker {_fmt(measured[1]['replay'])}"
            )
        towers.append(
            TowerProfile(
                name=name,
                encode=Envelope((line("encode"),)),
                graph=Envelope((line("forward"),) if replays else ()),
                replay=Envelope((line("forward"), line("replay")) if replays else ()),
                trunk_per_sample=round(measured[1]["trunk"]) if replays else 0,
                input_per_sample=_nbytes(sample),
                replays=replays,
            )
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ModelProfile(
        image=towers[0],
        text=towers[1],
        embed_dim=model_cfg.embed_dim,
        weight_bytes=sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())),
        trainable_bytes=sum(p.numel() * FP32 for p in trainable),
        adamw_bytes=sum(2 * p.numel() * FP32 for p in trainable),
        adafactor_bytes=sum(adafactor_state_numel(tuple(p.shape)) * FP32 for p in trainable),
        device=_describe_device(torch.device(device)),
        precision=precision,
        measured_chunks=chunks,
        notes=tuple(notes),
    )


def adafactor_state_numel(shape: tuple[int, ...]) -> int:
    """torch's Adafactor: row and column second-moment factors for >= 2-D, a full vector otherwise."""
    if len(shape) < 2:
        return math.prod(shape)
    return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]


def _describe_device(device: torch.device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# --------------------------------------------------------------------------------------------
# The analytic model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """What the plan varies: global batch, GPUs, chunking, offload, loss implementation."""

    batch: int
    gpus: int
    image_chunk: int  # 0 = the whole per-rank batch
    text_chunk: int
    offload: bool
    impl: str
    optimizer: str = "adamw"
    tile: int = 4096  # loss.tile_size, or the CUDA default of the tiled loss
    keep_last_graph: bool = True  # batch.keep_last_graph
    kind: str = "softmax"  # loss.kind

    @property
    def per_rank(self) -> int:
        return self.batch // self.gpus

    def chunk(self, tower: str) -> int:
        chunk = self.image_chunk if tower == "image" else self.text_chunk
        return min(chunk, self.per_rank) if chunk else self.per_rank


@dataclass(frozen=True)
class Breakdown:
    """Per-GPU bytes of one setting; ``peak`` is eq. 10 plus the static part."""

    weights: float
    grads: float
    optimizer: float
    data: float
    cache: float
    loss: float
    kept_graph: float  # alive through the loss: the last chunk encoded keeps its graph
    backbone: float
    optimizer_step: float  # foreach optimizers hold one parameter-sized temporary during step()

    @property
    def static(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def transient(self) -> float:
        """The largest of eq. 10's alternatives: the loss (beside the kept chunk graph), one chunk's
        encode/replay, the optimizer step."""
        return max(self.loss + self.kept_graph, self.backbone, self.optimizer_step)

    @property
    def peak(self) -> float:
        return self.static + self.data + self.cache + self.transient


def loss_workspace(impl: str, batch: int, gpus: int, dim: int, tile: int, kind: str = "softmax") -> float:
    """Bytes the loss allocates beyond the cached features and their gradients (fp32), from
    MemTracker measurements of the real losses on the PyTorch path (``tests/test_plan.py``).

    Softmax. vanilla: 4 b×b matrices (logits, both softmaxes, their gradient: Inf-CL measures CLIP
    at 16.67 GB for 32k), local: 4 n×b (OpenCLIP's 8.63 GB at 64k on 8 GPUs), both plus
    all-gathered features of both towers; inf: n×d blocks (row dot-product temporaries and,
    across GPUs, the ring's text blocks and gradient accumulators in hand and in flight: 2 on one
    GPU, 9 on several, measured at W = 1, 3 and 4; 8 at W = 2), one t×t tile and a strip of it,
    and O(n) log-sum-exp vectors. The reference losses measure 3.2-4.3 b² (vanilla) and 4.1-4.6
    n·b (local) on CPU, gradients included.

    Sigmoid. vanilla: 5 n×b matrices (logits, signs, their product, its log-sigmoid and gradient)
    and the gathered texts; inf: n×d blocks (2 on one GPU, 7 on several; 6 at W = 2, no column
    state travels), one tile and a strip.
    """
    n = batch // gpus
    if impl == "vanilla" and kind == "sigmoid":
        return 5 * n * batch * FP32 + (batch * dim * FP32 if gpus > 1 else 0)
    gathered = 2 * batch * dim * FP32 if gpus > 1 else 0
    if impl == "vanilla":
        return 4 * batch * batch * FP32 + gathered
    if impl == "local":
        return 4 * n * batch * FP32 + gathered
    if impl == "inf":
        from clip_train.loss.tiles_torch import STRIP_ELEMENTS

        side = min(tile, n)
        strip = min(side * side, STRIP_ELEMENTS)
        if kind == "sigmoid":
            return ((7 if gpus > 1 else 2) * n * dim + side * side + strip) * FP32
        return ((9 if gpus > 1 else 2) * n * dim + side * side + strip + 8 * n) * FP32
    raise UserError(f"unknown loss impl {impl!r}; choose one of {', '.join(IMPLS)}")


def breakdown(profile: ModelProfile, setting: Setting) -> Breakdown:
    n = setting.per_rank
    trainable = profile.trainable_bytes
    optimizer = {"adamw": profile.adamw_bytes, "adafactor": profile.adafactor_bytes}[setting.optimizer]
    # Raw input and cached-trunk streams: all on the device, or (offload) two chunks of the largest.
    streams = [(t.input_per_sample, setting.chunk(t.name)) for t in profile.towers]
    streams += [(t.trunk_per_sample, setting.chunk(t.name)) for t in profile.towers]
    if setting.offload:  # the chunk in use and the one prefetched behind it
        data = max(size * min(2 * chunk, n) for size, chunk in streams)
    else:
        data = n * sum(t.input_per_sample for t in profile.towers)
    features = 2 * n * profile.embed_dim * FP32
    feature_grads = sum(n * profile.embed_dim * FP32 for t in profile.towers if t.replays)
    trunk = 0 if setting.offload else n * sum(t.trunk_per_sample for t in profile.towers)
    backbone = max(
        max(t.encode.at(setting.chunk(t.name)), t.replay.at(setting.chunk(t.name))) for t in profile.towers
    )
    replaying = [t for t in profile.towers if t.replays]  # the last of them keeps a chunk's graph
    keeps = replaying and setting.impl == "inf" and setting.keep_last_graph
    kept_graph = replaying[-1].graph.at(setting.chunk(replaying[-1].name)) if keeps else 0.0
    return Breakdown(
        weights=profile.weight_bytes,
        grads=trainable,
        optimizer=optimizer,
        data=data,
        cache=features + feature_grads + trunk,
        loss=loss_workspace(
            setting.impl, setting.batch, setting.gpus, profile.embed_dim, setting.tile, setting.kind
        ),
        kept_graph=max(kept_graph, 0.0),
        backbone=max(backbone, 0.0),
        optimizer_step=trainable,
    )


def usable_bytes(gpu_mem_gib: float) -> float:
    """GPU memory minus the reserve for the CUDA context and allocator fragmentation."""
    total = gpu_mem_gib * GIB
    return total * (1 - RESERVE_FRACTION) - min(RESERVE_FIXED, RESERVE_FIXED_CAP * total)


def batch_step(setting: Setting) -> int:
    """Global batches must be multiples of gpus × every chunk size (config validation's rule)."""
    return setting.gpus * math.lcm(setting.image_chunk or 1, setting.text_chunk or 1)


def max_batch(profile: ModelProfile, setting: Setting, capacity: float, limit: int = 2**40) -> int:
    """The largest multiple of ``batch_step`` whose peak fits ``capacity`` bytes (0 if none does)."""
    step = batch_step(setting)

    def fits(k: int) -> bool:
        return breakdown(profile, dataclasses.replace(setting, batch=k * step)).peak <= capacity

    if not fits(1):
        return 0
    high = 2
    while fits(high) and high * step < limit:
        high *= 2
    low = high // 2  # fits(low) holds; fits(high) does not (or the limit is reached)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low * step


# --------------------------------------------------------------------------------------------
# The CPU anchor: plan vs a real Gradient Cache step's resident memory
# --------------------------------------------------------------------------------------------


def measure_cpu_step(
    model_cfg: ModelConfig, setting: Setting, precision: str, optimizer: str, steps: int = 2
) -> int:
    """Peak RSS growth (bytes) of ``steps`` Gradient Cache + optimizer steps over the model's baseline.

    Run it in a fresh process (``check_cpu`` does): ru_maxrss is a process-wide high-water mark.
    The baseline is taken after the model is built and has run one graph-less 1-sample forward
    (so lazily loaded kernels are not counted as training memory). glibc's mmap threshold is pinned
    at 64 KiB first: its default threshold rises after every large free, after which freed tensor
    memory stays in the heap and RSS counts memory no tensor holds (measured: ~1.6x the live peak).
    """
    import ctypes

    import torch

    from clip_train.memory import peak_bytes, used_bytes

    ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 64 * 1024)

    from clip_train.config import OptimConfig
    from clip_train.engine import GradCache
    from clip_train.optim import build_optimizer

    torch.manual_seed(0)
    model, _ = build_planning_model(model_cfg)
    model.train()
    length = model_cfg.text.context_length
    with torch.no_grad():
        model(*_random_inputs(model, "image", 1, length), *_random_inputs(model, "text", 1, length))
    opt = build_optimizer(OptimConfig(name=optimizer), model)
    engine = GradCache(
        model,
        image_chunk=setting.image_chunk,
        text_chunk=setting.text_chunk,
        precision=precision,
        offload=setting.offload,
        loss_impl=setting.impl,
        tile_size=setting.tile,
    )
    cpu = torch.device("cpu")
    baseline = used_bytes(cpu)
    images = _random_inputs(model, "image", setting.batch, length)
    text = _random_inputs(model, "text", setting.batch, length)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        engine.step(*images, *text)
        opt.step()
    return peak_bytes(cpu) - baseline


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def check_cpu(cfg: Config, setting: Setting, chunks: tuple[int, int]) -> dict[str, float]:
    """Predicted peak (weights excluded: they precede the baseline) vs measured RSS growth."""
    import concurrent.futures
    import multiprocessing

    profile = profile_model(cfg.model, cfg.train.precision, chunks, "cpu")
    part = breakdown(profile, setting)
    predicted = part.peak - part.weights
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        measured = pool.submit(
            measure_cpu_step, cfg.model, setting, cfg.train.precision, setting.optimizer
        ).result()
    return {"predicted": predicted, "measured": measured, "ratio": measured / predicted}


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config (e.g. configs/model/vit-b16-bert-base.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument("--gpus", type=int, default=8, help="data-parallel GPUs (default 8)")
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU (default 80)")
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: batch.global_size)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the plan as JSON")
    parser.add_argument(
        "--measure-chunks",
        type=int,
        nargs=2,
        default=(2, 4),
        metavar=("A", "B"),
        help="chunk sizes of the activation measurement (default 2 4)",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="measure on")
    parser.add_argument(
        "--check-cpu",
        action="store_true",
        help="also run 2 real Gradient Cache steps on the CPU and compare their RSS growth with the plan",
    )


def _settings(cfg: Config, args: argparse.Namespace, batch: int, tile: int) -> list[Setting]:
    return [
        Setting(
            batch=batch,
            gpus=args.gpus,
            image_chunk=cfg.batch.image_chunk,
            text_chunk=cfg.batch.text_chunk,
            offload=offload,
            impl=impl,
            optimizer=cfg.optim.name,
            tile=tile,
            keep_last_graph=cfg.batch.keep_last_graph,
            kind=cfg.loss.kind,
        )
        for impl in IMPLS
        if not (impl == "local" and cfg.loss.kind == "sigmoid")  # a softmax-only implementation
        for offload in (False, True)
    ]


def _fmt(num_bytes: float) -> str:
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.2f}G"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.1f}M"
    return f"{num_bytes / 2**10:.1f}K"


def _validate_args(args: argparse.Namespace, batch: int) -> None:
    if args.gpus <= 0:
        raise UserError(f"--gpus {args.gpus}: must be >= 1")
    if not args.gpu_mem > 0:
        raise UserError(f"--gpu-mem {args.gpu_mem}: must be > 0 GiB")
    if batch <= 0:
        raise UserError(f"--batch {batch}: must be >= 1")
    if args.check_cpu and args.gpus != 1:
        raise UserError(f"--check-cpu runs one process on this machine: use --gpus 1, not {args.gpus}")


def run(args: argparse.Namespace) -> int:
    import torch

    from clip_train.config import load_config
    from clip_train.distributed import resolve_device
    from clip_train.loss.tiles_torch import default_tile

    cfg = load_config(args.config, args.overrides)
    batch = args.batch if args.batch is not None else cfg.batch.global_size
    _validate_args(args, batch)
    cfg.batch.global_size = batch
    cfg.validate(world_size=args.gpus)
    chunks = tuple(args.measure_chunks)
    profile = profile_model(cfg.model, cfg.train.precision, chunks, resolve_device(args.device).type)
    capacity = usable_bytes(args.gpu_mem)
    tile = cfg.loss.tile_size or default_tile(torch.device("cuda"))
    rows = [_row(profile, setting, capacity) for setting in _settings(cfg, args, batch, tile)]
    print(_report(args, cfg, profile, rows, capacity))
    result: dict[str, Any] = {
        "config": str(args.config),
        "overrides": list(args.overrides),
        "gpu_mem_gib": args.gpu_mem,
        "usable_bytes": capacity,
        "profile": dataclasses.asdict(profile),
        "rows": rows,
    }
    if args.check_cpu:
        inf = next(s for s in _settings(cfg, args, batch, tile) if s.impl == "inf" and not s.offload)
        cpu_setting = dataclasses.replace(inf, tile=cfg.loss.tile_size or default_tile(torch.device("cpu")))
        result["check_cpu"] = check = check_cpu(cfg, cpu_setting, chunks)
        print(
            f"\ncheck-cpu: inf loss, no offload, batch {batch}, 2 Gradient Cache + {cfg.optim.name} steps "
            f"in a fresh process\n  predicted {_fmt(check['predicted'])} (peak without weights, which "
            f"precede the baseline)\n  measured  {_fmt(check['measured'])} (ru_maxrss growth)\n"
            f"  ratio measured/predicted {check['ratio']:.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def _row(profile: ModelProfile, setting: Setting, capacity: float) -> dict[str, Any]:
    part = breakdown(profile, setting)
    return {
        **dataclasses.asdict(setting),
        **dataclasses.asdict(part),
        "static": part.static,
        "peak": part.peak,
        "fits": part.peak <= capacity,
        "max_batch": max_batch(profile, setting, capacity),
    }


def _report(
    args: argparse.Namespace, cfg: Config, profile: ModelProfile, rows: list[dict], capacity: float
) -> str:
    first = rows[0]
    chunks = f"image {first['image_chunk'] or 'all'} / text {first['text_chunk'] or 'all'} per GPU"
    lines = [
        f"plan: {args.config} {' '.join(args.overrides)}".rstrip(),
        f"  {args.gpus} GPU(s) x {args.gpu_mem:g} GiB; usable {_fmt(capacity)} per GPU after a "
        f"{_fmt(args.gpu_mem * GIB - capacity)} reserve (CUDA context, allocator fragmentation)",
        f"  precision {profile.precision}, optimizer {cfg.optim.name}, embed_dim {profile.embed_dim}, "
        f"chunks {chunks}, inf tile {first['tile']}",
        f"  activations measured on {profile.device} with torch MemTracker (fwd+bwd at chunks "
        f"{profile.measured_chunks[0]} and {profile.measured_chunks[1]}), scaled linearly in the chunk",
    ]
    lines += [f"  note: {note}" for note in profile.notes]
    for tower in profile.towers:
        replay = f"replay {_fmt(tower.replay.per_sample)}/sample" if tower.replays else "frozen: no replay"
        trunk = f", cached trunk {_fmt(tower.trunk_per_sample)}/sample" if tower.trunk_per_sample else ""
        lines.append(
            f"  {tower.name:5s}: input {_fmt(tower.input_per_sample)}/sample, encode "
            f"{_fmt(tower.encode.per_sample)}/sample, {replay}{trunk}"
        )
    lines.append(
        f"  static per GPU: weights {_fmt(first['weights'])}, grads {_fmt(first['grads'])} (DDP's buckets "
        f"hold them), optimizer {_fmt(first['optimizer'])}"
    )
    lines.append(
        f"\nglobal batch {first['batch']:,} ({first['batch'] // args.gpus:,} per GPU); "
        "peak = static + data + cache + max(loss + kept graph, backbone, optim step)"
    )
    header = (
        "impl",
        "offload",
        "data",
        "cache",
        "loss",
        "kept",
        "backbone",
        "optim",
        "static",
        "peak",
        "fits",
        "max batch",
    )
    money = ("data", "cache", "loss", "kept_graph", "backbone", "optimizer_step", "static", "peak")
    table = [header] + [
        (
            row["impl"],
            "yes" if row["offload"] else "no",
            *(_fmt(row[key]) for key in money),
            "yes" if row["fits"] else "NO",
            f"{row['max_batch']:,}",
        )
        for row in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines += [
        "  ".join(
            cell.rjust(w) if i > 1 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in table
    ]
    return "\n".join(lines)
