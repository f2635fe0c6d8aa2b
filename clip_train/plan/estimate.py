"""Per-GPU memory of one Gradient Cache step from a measured profile (Inf-CL eq. 10), and the
largest global batch that fits: arithmetic only, without torch or the loss's internals.

    M_peak ≈ static + M_data + M_cache + max(M_loss + M_kept, M_backbone)

``Breakdown`` defines the terms. Only M_backbone is measured (``profile.py``, at two small chunk
sizes, extrapolated linearly); the rest is counted from shapes. Under FSDP2 (``Setting.sharded``)
the static part is the rank's shards plus what sharding gathers or holds unsharded for a while:
``gathered_weights`` and ``accumulated_grads``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from clip_train.config import RESOLVED_LOSS_IMPLS
from clip_train.errors import UserError

GIB = 2**30
FP32 = 4
RESERVE = 0.10  # of the memory a run may use, for what the estimate leaves out (allocator slack, the runtime)
# Elements per strip of a tile that the PyTorch tiles work through at once on the CPU, where
# ``loss_workspace`` is measured (``loss/tiles_torch.py``'s STRIP_ELEMENTS; a test holds them equal).
STRIP_ELEMENTS = 1 << 20


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
    # FSDP2's units of the tower (``parallel.fsdp.shard_towers``), as parameter counts: the root's
    # own (every parameter outside a block), then each block's
    unit_numels: tuple[int, ...]
    trainable_numel: int  # parameters that get gradients


@dataclass(frozen=True)
class ModelProfile:
    image: TowerProfile
    text: TowerProfile
    embed_dim: int
    weight_bytes: int  # every parameter and buffer as stored (fp32; fp64 in an fp64 run)
    trainable_bytes: int
    adamw_bytes: int
    adafactor_bytes: int
    device: str
    precision: str
    measured_chunks: tuple[int, int]
    notes: tuple[str, ...] = ()
    itemsize: int = FP32  # bytes of a weight: 8 in an fp64 run, whose features and loss are fp64 too

    @property
    def towers(self) -> tuple[TowerProfile, TowerProfile]:
        return self.image, self.text


def adafactor_state_numel(shape: tuple[int, ...]) -> int:
    """torch's Adafactor: row and column second-moment factors for >= 2-D, a full vector otherwise."""
    if len(shape) < 2:
        return math.prod(shape)
    return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]


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
    tile: int = 4096  # loss.tile_size, or the tiled loss's default on the device
    keep_last_graph: bool = True  # batch.keep_last_graph
    kind: str = "softmax"  # loss.kind
    device: str = "cuda"  # where the loss's tiles run: the plan is for GPUs, --check-cpu runs here
    # train.parallel=fsdp, and the fsdp.* options that move memory
    sharded: bool = False
    reshard_after_forward: bool = True
    sync_every_chunk: bool = False
    cpu_offload: bool = False
    gather_itemsize: int = FP32  # bytes of an all-gathered weight (fsdp.param_dtype)
    accumulate_itemsize: int = FP32  # bytes of a gradient accumulated unsharded (fsdp.reduce_dtype)
    ema: bool = False  # train.ema_decay > 0: an average of the trainable weights (their dtype) beside them

    @property
    def per_rank(self) -> int:
        return self.batch // self.gpus

    def chunk(self, tower: str) -> int:
        chunk = self.image_chunk if tower == "image" else self.text_chunk
        return min(chunk, self.per_rank) if chunk else self.per_rank


@dataclass(frozen=True)
class Breakdown:
    """Per-GPU bytes of one setting; ``peak`` is eq. 10 plus the static part."""

    weights: float  # every parameter and buffer as stored; sharded, the rank's 1/W (none with cpu_offload)
    gathered: float  # sharded: the all-gathered weights in use (``gathered_weights``); DDP: 0
    grads: float  # trainable parameters only (LiT-frozen ones have none); DDP's buckets are views of them
    accumulated: float  # sharded: a tower's unsharded gradients between syncs (``accumulated_grads``)
    optimizer: float  # the trainable parameters' optimizer state (and their EMA, with one)
    data: float  # M_data: the raw per-rank batch; with offload, two chunks of the stream in use
    cache: float  # M_cache: fp32 (fp64) features and their gradients, and a LiT tower's frozen-trunk output
    loss: float  # M_loss: b×b (vanilla), n×b (local) or O(n·d) + tile² (inf) for n = b / gpus
    kept_graph: float  # M_kept: inf only, the graphs kept through the loss (see graph_keepers)
    backbone: float  # M_backbone: one chunk's graph-less encode or with-grad replay (beside a kept graph)
    optimizer_step: float  # foreach optimizers hold one parameter-sized temporary during step()

    @property
    def static(self) -> float:
        return self.weights + self.gathered + self.grads + self.accumulated + self.optimizer

    @property
    def transient(self) -> float:
        """Eq. 10's largest alternative: the loss beside the kept graphs, a chunk's encode or replay,
        or the optimizer step."""
        return max(self.loss + self.kept_graph, self.backbone, self.optimizer_step)

    @property
    def peak(self) -> float:
        return self.static + self.data + self.cache + self.transient


def loss_workspace(
    impl: str,
    batch: int,
    gpus: int,
    dim: int,
    tile: int,
    kind: str = "softmax",
    device: str = "cuda",
    itemsize: int = FP32,
) -> float:
    """Bytes the loss allocates beyond the cached features and their gradients (fp32, or fp64 at an
    ``itemsize`` of 8), fitted to MemTracker measurements of the real losses on the PyTorch path
    (``tests/test_plan.py``).

    Softmax vanilla: 4 b×b matrices (logits, both softmaxes, their gradient; measured 3.2-4.3 b²,
    and Inf-CL's 16.67 GB for CLIP at 32k); local: 4 n×b (measured 4.1-4.6 n·b; OpenCLIP's 8.63 GB
    at 64k on 8 GPUs); both plus the gathered features of both towers. Sigmoid vanilla: 5 n×b
    (logits, signs, their product, its log-sigmoid and gradient) plus the gathered texts.
    inf: n×d blocks (row temporaries and, across GPUs, the ring's blocks and gradient accumulators in
    hand and in flight): softmax 2 on one GPU and 9 on several (8 at W = 2), sigmoid 2 and 7 (6 at
    W = 2: no column state travels); plus one t×t tile, the elementwise work's room beside it (on
    the CPU a strip of ``STRIP_ELEMENTS``; on CUDA the compiled kernels' gradient tile G, counted in
    fp32) and, for softmax, O(n) log-sum-exp vectors.
    """
    n = batch // gpus
    if impl == "vanilla" and kind == "sigmoid":
        return (5 * n * batch + (batch * dim if gpus > 1 else 0)) * itemsize
    gathered = 2 * batch * dim if gpus > 1 else 0
    if impl == "vanilla":
        return (4 * batch * batch + gathered) * itemsize
    if impl == "local":
        return (4 * n * batch + gathered) * itemsize
    if impl == "inf":
        side = min(tile, n)
        beside = min(side * side, STRIP_ELEMENTS) if device == "cpu" else side * side
        if kind == "sigmoid":
            return ((7 if gpus > 1 else 2) * n * dim + side * side + beside) * itemsize
        return ((9 if gpus > 1 else 2) * n * dim + side * side + beside + 8 * n) * itemsize
    raise UserError(f"unknown loss impl {impl!r}; choose one of {', '.join(RESOLVED_LOSS_IMPLS)}")


def breakdown(profile: ModelProfile, setting: Setting) -> Breakdown:
    n, dim = setting.per_rank, profile.embed_dim
    share = resident_share(setting)
    trainable = profile.trainable_bytes
    optimizer = {"adamw": profile.adamw_bytes, "adafactor": profile.adafactor_bytes}[setting.optimizer]
    optimizer += trainable if setting.ema else 0
    # Raw input and cached-trunk streams: all on the device, or (offload) two chunks of the largest.
    streams = [(t.input_per_sample, setting.chunk(t.name)) for t in profile.towers]
    streams += [(t.trunk_per_sample, setting.chunk(t.name)) for t in profile.towers]
    offloaded = setting.offload and setting.device == "cuda"  # on the CPU, host memory is the device's
    if offloaded:  # the chunk in use and the one prefetched behind it
        data = max(size * min(2 * chunk, n) for size, chunk in streams)
    else:
        data = n * sum(t.input_per_sample for t in profile.towers)
    replaying = [t for t in profile.towers if t.replays]
    features = (2 + len(replaying)) * n * dim * profile.itemsize  # both towers', the replayed ones' gradients
    trunk = 0 if offloaded else n * sum(t.trunk_per_sample for t in profile.towers)
    backbone = max(
        max(t.encode.at(setting.chunk(t.name)), t.replay.at(setting.chunk(t.name))) for t in profile.towers
    )
    keepers = graph_keepers(replaying, setting)
    kept_graph = sum(t.graph.at(setting.chunk(t.name)) for t in keepers)
    backbone = max(backbone, _beside_kept_graphs(profile, setting, keepers))
    loss = loss_workspace(
        setting.impl,
        setting.batch,
        setting.gpus,
        dim,
        setting.tile,
        setting.kind,
        setting.device,
        profile.itemsize,
    )
    return Breakdown(
        weights=profile.weight_bytes * share,
        gathered=gathered_weights(profile, setting),
        grads=trainable * share,
        accumulated=accumulated_grads(profile, setting),
        optimizer=optimizer * share,
        data=data,
        cache=features + trunk,
        loss=loss,
        kept_graph=max(kept_graph, 0.0),
        backbone=max(backbone, 0.0),
        optimizer_step=trainable * share,
    )


def resident_share(setting: Setting) -> float:
    """The part of the weights, gradients and optimizer states (and of the step's temporary) a GPU
    holds: all under DDP, a 1/W shard under FSDP, none with fsdp.cpu_offload (the shards live, and
    the optimizer steps, in host memory). Buffers and the loss's scale and bias stay replicated:
    a few KiB, counted as sharded."""
    if not setting.sharded:
        return 1
    return 0 if setting.cpu_offload else 1 / setting.gpus


def gathered_weights(profile: ModelProfile, setting: Setting) -> float:
    """Sharded: the all-gathered weights (fsdp.param_dtype) at their most. One tower computes at a
    time; resharding after forward, it holds its root unit (what no block holds) gathered beside
    the block in use and the next one, prefetched: the larger tower's root and two largest blocks.
    Without resharding, a graph-less stage-1 encode leaves every block gathered until the tower's
    own backward reshards it (a frozen tower's never), so through the loss both towers are whole."""
    if not setting.sharded:
        return 0.0
    units = [t.unit_numels for t in profile.towers]
    if setting.reshard_after_forward:
        numel = max(root + sum(sorted(blocks)[-2:]) for root, *blocks in units)
    else:
        numel = sum(map(sum, units))
    return numel * setting.gather_itemsize


def accumulated_grads(profile: ModelProfile, setting: Setting) -> float:
    """Sharded: gradients held unsharded between syncs. Gradient Cache turns a tower's gradient sync
    off for its earlier replay chunks, so FSDP2 adds their gradients up unsharded (in the reduce
    dtype) until the last chunk reduce-scatters them; the towers replay one after the other, so
    the larger one's. None with fsdp.sync_every_chunk or in a one-chunk tower (each block's
    gradients are reduce-scattered as its backward ends). Counted as static, which over-counts the
    encode and the loss (no gradients yet) and the first tower's replay (the other's shards not
    yet there), to the safe side."""
    if not setting.sharded or setting.sync_every_chunk:
        return 0.0
    chunked = [
        t.trainable_numel for t in profile.towers if t.replays and setting.chunk(t.name) < setting.per_rank
    ]
    return max(chunked, default=0) * setting.accumulate_itemsize


def _beside_kept_graphs(profile: ModelProfile, setting: Setting, keepers: list[TowerProfile]) -> float:
    """A kept graph lives from its tower's encode until that tower's replay begins. The step encodes
    the image tower first and replays it last, so the text tower encodes and replays (a frozen one
    only encodes) beside the image tower's kept graph: the two add up."""
    kept, peak = 0.0, 0.0
    for tower in profile.towers:  # in the order the step encodes them
        chunk = setting.chunk(tower.name)
        if kept:
            peak = max(peak, kept + tower.encode.at(chunk), kept + tower.replay.at(chunk))
        if any(tower is keeper for keeper in keepers):
            kept += tower.graph.at(chunk)
    return peak


def graph_keepers(replaying: list[TowerProfile], setting: Setting) -> list[TowerProfile]:
    """The towers whose last chunk keeps its graph through the loss (``GradCache._graph_keepers``):
    every trained one, with the inf loss and ``batch.keep_last_graph``."""
    return replaying if setting.impl == "inf" and setting.keep_last_graph else []


def usable_bytes(available: float, memory_budget_gib: float = 0.0) -> float:
    """What a run's ``auto`` chunks fit into: ``batch.memory_budget`` GiB per rank when set, else the
    ``available`` bytes of its device, less the ``RESERVE``. A run (``auto_chunks.choose_chunks``)
    and the plan both count it here, so the plan shows the chunks a run would choose."""
    return (memory_budget_gib * GIB or available) * (1 - RESERVE)


def gpu_available(gpu_mem_gib: float) -> float:
    """What a run finds free on a GPU of ``gpu_mem_gib``: the memory beside the CUDA context (1 GiB,
    capped at 10 % so toy GPUs still plan)."""
    total = gpu_mem_gib * GIB
    return total - min(GIB, 0.10 * total)


def max_batch(profile: ModelProfile, setting: Setting, capacity: float, limit: int = 2**40) -> int:
    """The largest global batch whose peak fits ``capacity`` bytes (0 if none does), a multiple of
    gpus × every chunk size as config validation requires."""
    step = setting.gpus * math.lcm(setting.image_chunk or 1, setting.text_chunk or 1)

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
