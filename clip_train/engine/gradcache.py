"""One optimizer step's gradients with Gradient Cache (Gao et al. 2021): activation memory set by the
chunk sizes, not the batch size, and exactly the full-batch gradients of the global contrastive loss.

1. encode every chunk without a graph, keeping the (B, d) features and the RNG state each chunk
   started from (with ``keep_last_graph``, each trained tower's last chunk keeps its graph instead,
   so a tower of one chunk is never encoded twice); a distillation teacher encodes every chunk
   too, never with a graph;
2. one loss call on detached leaf features (across ranks) gives the feature-gradient cache; with a
   teacher, it adds the distillation term towards the teacher's features (``clip_train.loss.distill``);
3. replay each chunk under its RNG state (same dropout and drop-path masks) and backprop its
   cached gradient into the tower; DDP syncs on each tower's last backward only, and so does a
   tower sharded with FSDP2 (``clip_train.parallel``), unless ``sync_every_chunk``;
4. average the gradients of the loss's own parameters (logit scale, sigmoid bias) across ranks.

LiT: a frozen trunk's output (``encode_frozen``) is cached in stage 1, on the device or in pinned host
memory with ``offload``, so replay runs only ``encode_trainable``; a frozen tower is never replayed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from clip_train.compat import ddp_no_buffer_sync_kwargs
from clip_train.config import PRECISIONS, Config, Precision
from clip_train.distributed import rank_and_world, wait_for_device
from clip_train.engine.offload import ChunkStream, Rows, chunk_bounds
from clip_train.engine.rng import RngState, preserved_rng
from clip_train.loss import contrastive_loss
from clip_train.loss.distill import contrastive_and_distillation_loss
from clip_train.loss.tiles_torch import tile_dtype
from clip_train.memory import tensor_bytes
from clip_train.parallel import GatherWaits, gradient_sync, is_sharded
from clip_train.precision import autocast
from clip_train.profiling import phase


@dataclass
class StepStats:
    """What one step cost. Times are wall-clock seconds with the device synchronised at each stage,
    in a ``timed`` step only (elsewhere they are 0: no synchronisation, nothing to report)."""

    loss: torch.Tensor  # 0-dim, on the device: reading it waits for the step, so the logger does
    encode_s: float  # stage 1, both towers
    loss_s: float  # stage 2
    replay_s: float  # stage 3 (+ the logit-scale all-reduce)
    gather_s: float  # FSDP: waiting for the blocks' all-gathers, taken out of encode_s and replay_s
    peak_mem: int  # bytes: CUDA's peak during the step (reserved under CUDA graphs); 0 on CPU (use RSS)
    cache_bytes: int  # features, their gradients and any frozen-trunk cache: O(B·d), wherever kept
    batch_bytes: int  # the raw batch (host memory with offload, else the device)
    max_live_chunks: int  # most input chunks alive at once in any run of the stream (<= 2 by construction)
    distill_loss: torch.Tensor | None = None  # the distillation term (unweighted, within ``loss``), 0-dim


class TrainableHead(nn.Module):
    """``tower.encode_trainable`` as ``forward``, the only call through which DDP reduces gradients."""

    def __init__(self, tower: nn.Module):
        super().__init__()
        self.tower = tower

    def forward(self, *hidden: torch.Tensor) -> torch.Tensor:
        return self.tower.encode_trainable(*hidden)


@dataclass(frozen=True)
class _Tower:
    module: nn.Module
    head: nn.Module  # DDP(TrainableHead) or the bare TrainableHead
    chunk: int
    replays: bool  # something in it trains
    caches_trunk: bool  # stage 1 keeps encode_frozen's output, replay starts from it
    sharded: bool = False  # FSDP2 units inside: they reduce-scatter as each backward ends
    sync_every_chunk: bool = False  # sharded: reduce-scatter every chunk, not only the last

    @functools.cached_property
    def stat_norms(self) -> list[nn.Module]:
        """Layers with running statistics (batch norm), found once rather than every replay."""
        return [m for m in self.module.modules() if getattr(m, "track_running_stats", False)]

    def sync_context(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a chunk's forward and backward: sync only if ``last``."""
        if isinstance(self.head, DistributedDataParallel) and not last:
            return self.head.no_sync()
        return self.backward_sync(last)

    def backward_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a backward alone: DDP decided at the forward, FSDP decides now."""
        if self.sharded:
            return gradient_sync(self.module, last or self.sync_every_chunk)
        return contextlib.nullcontext()


@dataclass
class _Encoded:
    """Stage 1's output for one tower."""

    bounds: list[Rows]
    features: torch.Tensor | None = None
    rng: list[RngState] = field(default_factory=list)
    trunk_cache: tuple[torch.Tensor, ...] = ()
    kept: torch.Tensor | None = None  # the last chunk's features, graph and all (see ``_encode``)


class GradCache:
    """Gradient Cache for a ``clip_train.model.CLIP``: ``step`` adds full-batch gradients to ``.grad``.

    With fp16, pass ``scale_loss`` (a ``GradScaler``'s ``scale``): the loss is scaled before the cache
    is taken, so every ``.grad`` comes out scaled for ``scaler.unscale_``. fp32 and fp64 run the model
    in its own dtype; bf16 and fp16 encode under autocast. The loss runs in at least fp32.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        image_chunk: int = 0,
        text_chunk: int = 0,
        precision: Precision = "fp32",
        offload: bool = False,
        keep_last_graph: bool = True,
        loss_impl: str = "auto",
        tile_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        sync_every_chunk: bool = False,
        graph_pools: bool = False,
        teacher: nn.Module | None = None,
        distill_weight: float = 1.0,
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} must be one of {', '.join(PRECISIONS)}")
        self.model = model
        self.device = model.logit_scale.device
        self.precision = precision
        self.offload = offload
        # A model with a logit bias is trained with the sigmoid loss (Config.validate keeps them together).
        self.loss_kind = "sigmoid" if model.logit_bias is not None else "softmax"
        self.loss_impl = loss_impl
        # Beside a materialising loss the kept graph would share the peak with a b×b workspace.
        self.keep_last_graph = keep_last_graph and loss_impl in ("auto", "inf")
        self.tile_size = tile_size
        self.group = group
        self.world_size = rank_and_world(group)[1]
        self.sync_every_chunk = sync_every_chunk  # towers sharded with FSDP2 only
        # CUDA graphs' private pools hold their buffers outside the allocated count: the peak is then
        # the reserved one, which bounds them (and counts the allocator's cache).
        self._peak_of = torch.cuda.max_memory_reserved if graph_pools else torch.cuda.max_memory_allocated
        self.image = self._tower("image", model.visual, image_chunk)
        self.text = self._tower("text", model.text, text_chunk)
        # whether the step's gradients should be zeroed in place, not set to None (see ``_tower``)
        self.grads_in_buckets = any(
            isinstance(t.head, DistributedDataParallel) for t in (self.image, self.text)
        )
        sharded = self.image.sharded or self.text.sharded
        self.gather_waits = GatherWaits(model, self.device) if sharded else None
        self.chunk_stream = ChunkStream(self.device, offload)  # the engine's, with its CUDA side stream
        self.teacher, self.distill_weight = teacher, distill_weight  # a frozen CLIP, eval mode

    @classmethod
    def from_config(
        cls, model: nn.Module, config: Config, chunks: tuple[int, int], teacher: nn.Module | None = None
    ) -> GradCache:
        """Offload, precision, loss and distillation options from a run config (default process
        group), with the image and text ``chunks`` the run resolved (``auto`` is measured first) and
        the run's distillation ``teacher``, if any."""
        return cls(
            model,
            image_chunk=chunks[0],
            text_chunk=chunks[1],
            precision=config.train.precision,
            offload=config.batch.offload,
            keep_last_graph=config.batch.keep_last_graph,
            loss_impl=config.loss.impl,
            tile_size=config.loss.tile_size or None,
            sync_every_chunk=config.fsdp.sync_every_chunk,
            graph_pools=config.train.cuda_graphs,
            teacher=teacher,
            distill_weight=config.distill.weight,
        )

    def _tower(self, name: str, module: nn.Module, chunk: int) -> _Tower:
        if chunk < 0:
            raise ValueError(f"{name}_chunk={chunk} must be >= 0 (0 = the whole per-rank batch)")
        replays = not module.is_frozen
        head = TrainableHead(module)
        if is_sharded(module):  # FSDP2 reduces its own gradients; the towers' roots are its units
            return _Tower(
                module, head, chunk, replays, replays and module.has_frozen_trunk, True, self.sync_every_chunk
            )
        if replays and self.world_size > 1:
            # Gradients there before DDP wraps the head become views of its buckets, which every
            # replay chunk then accumulates into (``grads_in_buckets``: zero them in place). Made by
            # autograd at each step's first chunk instead, they held the unsynced chunks' sum beside
            # the buckets until the last chunk's sync: a second copy of the tower's gradients.
            for param in head.parameters():
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
            # One DDP per tower, so each syncs on its own last replay chunk. Buffers are not synced
            # per forward: they are constants (Gradient Cache cannot be exact with batch norm).
            head = DistributedDataParallel(
                head,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                process_group=self.group,
                **ddp_no_buffer_sync_kwargs(),
                gradient_as_bucket_view=True,  # .grad views DDP's buckets instead of a second copy
            )
        return _Tower(module, head, chunk, replays, replays and module.has_frozen_trunk)

    def step(
        self,
        images: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        timed: bool = True,
    ) -> StepStats:
        """Compute the step's gradients for a per-rank batch; see the class docstring for fp16.
        ``timed=False`` skips the stage times and with them the device synchronisations they need."""
        rows = images.shape[0]
        if rows == 0:
            raise ValueError("the batch is empty")
        if input_ids.shape[0] != rows or attention_mask.shape[0] != rows:
            raise ValueError(
                f"batch rows disagree: images {rows}, input_ids {input_ids.shape[0]}, "
                f"attention_mask {attention_mask.shape[0]}"
            )
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        clock = self._clock if timed else _untimed
        start = clock()  # the batch's copy to the device counts as the encode's, not the optimizer's
        batch = self.chunk_stream.place((images, input_ids, attention_mask))
        image_inputs, text_inputs = batch[:1], batch[1:]
        image_bounds, text_bounds = (chunk_bounds(rows, tower.chunk) for tower in (self.image, self.text))

        if self.gather_waits is not None:
            self.gather_waits.forget()  # waits outside timed steps (evaluation, untimed steps)
        image_keeps, text_keeps = self._graph_keepers()
        with phase("encode"):
            image = self._encode(self.image, image_inputs, image_bounds, keep_graph=image_keeps)
            text = self._encode(self.text, text_inputs, text_bounds, keep_graph=text_keeps)
            targets = self._encode_teacher((image_inputs, text_inputs), (image_bounds, text_bounds))
        encoded = clock()
        encode_gather_s = self._gather_s() if timed else 0.0
        with phase("loss"):
            loss, distill_loss, image_grad, text_grad = self._loss(
                image.features, text.features, scale_loss, targets
            )
        cache_bytes = tensor_bytes([image.features, text.features, image_grad, text_grad, *targets])
        cache_bytes += tensor_bytes(image.trunk_cache + text.trunk_cache)
        image.features = text.features = None  # replay needs only their gradients
        lossed = clock()
        with phase("replay"), preserved_rng(self.device):  # the step consumes the RNG like one forward pass
            self._replay(self.text, text, text_inputs, text_grad)
            self._replay(self.image, image, image_inputs, image_grad)
        replayed = clock()
        replay_gather_s = self._gather_s() if timed else 0.0

        return StepStats(
            loss=loss,
            encode_s=encoded - start - encode_gather_s,
            loss_s=lossed - encoded,
            replay_s=replayed - lossed - replay_gather_s,
            gather_s=encode_gather_s + replay_gather_s,
            peak_mem=self.peak_since_step_start(),
            cache_bytes=cache_bytes,
            batch_bytes=tensor_bytes(batch),
            max_live_chunks=self.chunk_stream.max_live,
            distill_loss=distill_loss,
        )

    def peak_since_step_start(self) -> int:
        """CUDA's peak memory since the last step began (read after the optimizer, it counts its
        update too); 0 on the CPU, whose peak is the process's resident one."""
        return self._peak_of(self.device) if self.device.type == "cuda" else 0

    def _graph_keepers(self) -> tuple[bool, bool]:
        """Whether the image and the text tower keep their last chunk's graph (see ``_encode``):
        every trained tower does with ``keep_last_graph``, so when each is one chunk the step is
        plain backpropagation, with no tower encoded twice."""
        return self.image.replays and self.keep_last_graph, self.text.replays and self.keep_last_graph

    def trains_and_replays(self, rows: int) -> tuple[tuple[bool, bool], tuple[float, float]]:
        """Whether the image and the text tower train, and the share of a ``rows``-sample batch each
        encodes a second time in replay (all but a kept last chunk): what the model FLOPs count."""
        bounds = [chunk_bounds(rows, tower.chunk) for tower in (self.image, self.text)]
        keeps = self._graph_keepers()
        shares = []
        for tower, keep, tower_bounds in zip((self.image, self.text), keeps, bounds, strict=True):
            kept = tower_bounds[-1][1] - tower_bounds[-1][0] if keep else 0
            shares.append((rows - kept) / rows if tower.replays else 0.0)
        return (self.image.replays, self.text.replays), (shares[0], shares[1])

    def _encode(
        self, tower: _Tower, inputs: Sequence[torch.Tensor], bounds: list[Rows], keep_graph: bool
    ) -> _Encoded:
        """Stage 1: graph-less features, each chunk's RNG state and the frozen-trunk cache for replay.

        With ``keep_graph`` the last chunk keeps its graph: replay backpropagates it first instead of
        encoding it again. The image tower's lives on while the text tower encodes (and keeps its own
        last chunk's graph), through the loss and the text tower's replay, so a step's peak holds one
        chunk graph of each tower beside the loss's workspace; at the largest batches that can cost
        more than the forward it saves: ``batch.keep_last_graph: false``.
        """
        out, rows = _Encoded(bounds), len(inputs[0])
        keep_trunk_on_host = self.offload and self.device.type == "cuda"
        kept_index = len(out.bounds) - 1 if keep_graph else None

        def encode(index: int, chunk: tuple[torch.Tensor, ...]) -> None:
            start, end = out.bounds[index]
            with torch.no_grad(), self._autocast():
                hidden = tower.module.encode_frozen(*chunk)
            if index == kept_index:
                # Its backward comes first in replay, so it syncs only when it is the only chunk.
                with tower.sync_context(last=index == 0), self._autocast():
                    out.kept = tower.head(*hidden)
                features = out.kept.detach()
            else:
                with torch.no_grad(), self._autocast():
                    if tower.replays:
                        out.rng.append(RngState.capture(self.device))
                    features = tower.module.encode_trainable(*hidden)
            if out.features is None:
                dtype = self._loss_dtype(features.dtype)
                out.features = _rows_like(features, rows, dtype=dtype)
            out.features[start:end] = features
            if tower.caches_trunk and index != kept_index:
                if not out.trunk_cache:
                    out.trunk_cache = tuple(_rows_like(h, rows, host=keep_trunk_on_host) for h in hidden)
                for cached, h in zip(out.trunk_cache, hidden, strict=True):
                    cached[start:end].copy_(h, non_blocking=True)

        self.chunk_stream.run(inputs, bounds, encode)
        return out

    def _encode_teacher(
        self, inputs: tuple[Sequence[torch.Tensor], ...], bounds: tuple[list[Rows], ...]
    ) -> tuple[torch.Tensor, ...]:
        """The teacher's image and text features for the whole batch, in the towers' chunks; none
        without a teacher."""
        if self.teacher is None:
            return ()
        encoders = (self.teacher.encode_image, self.teacher.encode_text)
        return tuple(
            self._teacher_features(encode, tower_inputs, tower_bounds)
            for encode, tower_inputs, tower_bounds in zip(encoders, inputs, bounds, strict=True)
        )

    def _teacher_features(
        self, encode: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], bounds: list[Rows]
    ) -> torch.Tensor:
        out: list[torch.Tensor] = []  # the (rows, d') buffer, once the first chunk gives d'

        def encode_chunk(index: int, chunk: tuple[torch.Tensor, ...]) -> None:
            with torch.no_grad(), self._autocast():
                features = encode(*chunk)
            if not out:
                out.append(_rows_like(features, bounds[-1][1], dtype=self._loss_dtype(features.dtype)))
            start, end = bounds[index]
            out[0][start:end] = features

        self.chunk_stream.run(inputs, bounds, encode_chunk)
        return out[0]

    def _loss_dtype(self, features: torch.dtype) -> torch.dtype:
        """The dtype the loss takes: in bf16 training on CUDA, bf16 for the tiles (``tile_dtype``:
        half the bytes; LSEs and gradient sums stay fp32), otherwise >= fp32."""
        if self.loss_impl in ("auto", "inf") and self.precision == "bf16":
            return tile_dtype(torch.bfloat16, self.device)
        return torch.promote_types(features, torch.float32)

    def _loss(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None,
        targets: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Stage 2: the loss on leaf features, plus the weighted distillation term towards the
        teacher's ``targets`` if any; their gradients are the cache. Returns the loss, the
        distillation term and the two gradients."""
        image_features.requires_grad_(self.image.replays)
        text_features.requires_grad_(self.text.replays)
        params = [p for p in (self.model.logit_scale, self.model.logit_bias) if p is not None]
        leaves = [p.detach().requires_grad_(p.requires_grad) for p in params]
        scale, bias = leaves[0].exp(), leaves[1] if len(leaves) > 1 else None
        distill_loss = None
        if targets:  # the CLIP loss and the distillation term in one pass over the tiles
            teacher_scale = self.teacher.logit_scale.detach().exp()
            loss, distill_loss = contrastive_and_distillation_loss(
                image_features,
                text_features,
                scale,
                *targets,
                teacher_scale,
                group=self.group,
                tile_size=self.tile_size,
            )
            loss = loss + self.distill_weight * distill_loss
        else:
            loss = contrastive_loss(
                image_features,
                text_features,
                scale,
                logit_bias=bias,
                kind=self.loss_kind,
                impl=self.loss_impl,
                group=self.group,
                tile_size=self.tile_size,
                same_upstream=True,  # 1, or the loss scale, on every rank (backward just below)
            )
        if loss.requires_grad:
            (scale_loss(loss) if scale_loss is not None else loss).backward()
        trained = [(p, leaf.grad) for p, leaf in zip(params, leaves, strict=True) if leaf.grad is not None]
        if trained:
            self._accumulate_rank_average(trained)
        distill_loss = None if distill_loss is None else distill_loss.detach()
        return loss.detach(), distill_loss, image_features.grad, text_features.grad

    def _accumulate_rank_average(self, trained: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """The loss's parameters (scale, bias) are not DDP's: each rank's loss is its share of the
        global mean, so their global gradient is the rank average."""
        grads = torch.stack([grad for _, grad in trained])
        if self.world_size > 1:
            dist.all_reduce(grads, group=self.group)
            grads = grads / self.world_size
        for (param, _), grad in zip(trained, grads, strict=True):
            grad = grad.to(param.dtype)
            param.grad = grad if param.grad is None else param.grad + grad

    def _replay(
        self,
        tower: _Tower,
        cache: _Encoded,
        inputs: Sequence[torch.Tensor],
        grad: torch.Tensor | None,
    ) -> None:
        """Stage 3: re-encode each chunk with grad under its stage-1 RNG state, backprop the cache."""
        if grad is None:  # nothing in the tower trains
            return
        bounds = cache.bounds
        if cache.kept is not None:
            start, end = bounds[-1]
            with tower.backward_sync(last=len(bounds) == 1):
                cache.kept.backward(grad[start:end].to(cache.kept.dtype))
            cache.kept, bounds = None, bounds[:-1]
        if not bounds:
            return
        last = len(bounds) - 1

        def replay(index: int, chunk: tuple[torch.Tensor, ...]) -> None:
            start, end = cache.bounds[index]
            with tower.sync_context(last=index == last):
                if not tower.caches_trunk:
                    with torch.no_grad(), self._autocast():
                        chunk = tower.module.encode_frozen(*chunk)
                cache.rng[index].restore()
                with self._autocast():
                    features = tower.head(*chunk)
                features.backward(grad[start:end].to(features.dtype))

        with _running_stats_kept(tower.stat_norms):
            self.chunk_stream.run(cache.trunk_cache or inputs, bounds, replay)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.precision)

    def _gather_s(self) -> float:
        return self.gather_waits.take_seconds() if self.gather_waits is not None else 0.0

    def _clock(self) -> float:
        wait_for_device(self.device)
        return time.perf_counter()


@contextlib.contextmanager
def _running_stats_kept(stat_norms: list[nn.Module]) -> Iterator[None]:
    """Batch norm's running statistics as stage 1 left them: a replay is the same forward again,
    and would move them a second time (twice the momentum, twice ``num_batches_tracked``)."""
    norms = [m for m in stat_norms if m.training]
    kept = [[b.clone() for b in m.buffers(recurse=False)] for m in norms]
    try:
        yield
    finally:
        for norm, buffers in zip(norms, kept, strict=True):
            for live, before in zip(norm.buffers(recurse=False), buffers, strict=True):
                live.copy_(before)


def _untimed() -> float:
    return 0.0


def _rows_like(
    like: torch.Tensor, rows: int, *, dtype: torch.dtype | None = None, host: bool = False
) -> torch.Tensor:
    """An empty (rows, *like.shape[1:]) buffer; pinned host memory when it should stream back fast."""
    device = "cpu" if host else like.device
    return torch.empty((rows, *like.shape[1:]), dtype=dtype or like.dtype, device=device, pin_memory=host)
