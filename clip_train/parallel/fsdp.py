"""FSDP2 (``fully_shard``) over the two towers: each transformer block and each tower's root is one
unit, so a rank keeps 1/W of every parameter, gradient and optimizer state and gathers one block's
weights at a time.

The towers are separate FSDP roots because Gradient Cache encodes and replays each on its own; the
loss's logit scale and bias stay plain replicated parameters, which the engine averages over ranks
as it does under DDP. Gradient Cache calls ``encode_trainable`` (and, for a locked trunk,
``encode_frozen``) instead of ``forward``, so those are registered as FSDP forward methods: the
tower root's weights are gathered around them. Locked parameters are sharded like the rest; they
never get a gradient, so they are never reduce-scattered and the optimizer holds no state for them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.utils._pytree import tree_leaves

from clip_train.config import FsdpConfig, FsdpDtype, Precision
from clip_train.model.freezing import tower_blocks

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mixed_precision(cfg: FsdpConfig, precision: Precision, weights: torch.dtype) -> MixedPrecisionPolicy:
    """``auto`` gathers bf16 weights under bf16 training (half the all-gather bytes) and reduces
    gradients in the weights' own dtype, so that summing W ranks' gradients loses nothing."""
    param = _dtype(cfg.param_dtype, torch.bfloat16 if precision == "bf16" else None)
    reduce = _dtype(cfg.reduce_dtype, weights if param is not None else None)
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def _dtype(choice: FsdpDtype, auto: torch.dtype | None) -> torch.dtype | None:
    return auto if choice == "auto" else _DTYPES[choice]


def builds_on_meta(cfg: FsdpConfig) -> bool:
    """Whether this rank builds a model to shard on the meta device: only rank 0 builds (and loads)
    the weights, so that a rank's host and device never hold a whole model that only rank 0 needs.
    Not with ``cpu_offload``, whose shards live on the host, where NCCL cannot broadcast to them:
    there every rank builds the same seeded weights."""
    return dist.is_initialized() and dist.get_rank() != 0 and not cfg.cpu_offload


def shard_towers(model: nn.Module, cfg: FsdpConfig, precision: Precision, device: torch.device) -> None:
    """Shard both towers of a ``CLIP`` in place across the default process group. Unless
    ``cpu_offload``, every rank takes its shards of rank 0's weights and a copy of its buffers, on
    ``device``: the other ranks may have built theirs on the meta device (``builds_on_meta``).
    One process without a group keeps its towers whole."""
    if not dist.is_initialized():
        return
    weights = model.logit_scale.dtype
    from_main = not cfg.cpu_offload  # the same on every rank
    whole = model.state_dict() if from_main and dist.get_rank() == 0 else {}
    policy = mixed_precision(cfg, precision, weights)
    options = {
        "reshard_after_forward": cfg.reshard_after_forward,
        "mp_policy": policy,
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if cfg.cpu_offload
        else OffloadPolicy(),
    }
    for tower in (model.visual, model.text):
        for block in tower_blocks(tower):
            fully_shard(block, **options)
        fully_shard(tower, **options)
        tower.input_dtype = policy.param_dtype  # what a frozen trunk's first layer computes in
        register_fsdp_forward_method(tower, "encode_trainable")
        if tower.has_frozen_trunk:  # an unlocked tower's encode_frozen only moves its inputs
            register_fsdp_forward_method(tower, "encode_frozen")
    if not from_main:
        return
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model.to_empty(device=device)
    set_model_state_dict(
        model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    for buffer in model.buffers():  # non-persistent ones (pixel statistics, position ids) included
        dist.broadcast(buffer, src=0)


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def gradient_sync(tower: nn.Module, sync: bool) -> Iterator[None]:
    """Reduce-scatter the gradients of backward passes run inside (``sync``) or keep accumulating
    them unsharded until a later one does; syncing is restored on the way out."""
    tower.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        tower.set_requires_gradient_sync(True)


@contextlib.contextmanager
def gathered_for_eval(model: nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    """Every sharded unit's full weights on every rank while inside: evaluation splits its data
    unevenly across ranks, so its forwards must not need collectives. Costs one replica of the
    parameters (no gradients, no optimizer states) for the duration. A collective on entry.
    ``reshard_after_forward`` is the run's setting, restored on the way out (the tower roots keep
    FSDP's own choice for roots: no resharding after forward)."""
    roots = {id(model.visual), id(model.text)}
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward and id(unit) not in roots, recurse=False)


class GatherWaits:
    """How long compute waits for FSDP's all-gathers, so the step's time split can show it.

    A block's pre-forward hook, and in backward its outputs' gradient hook, is where FSDP waits for
    (or issues) the block's gather; each is bracketed by hooks placed before and after FSDP's own.
    On CUDA the brackets are events on the compute stream, which FSDP makes wait for its all-gather
    stream; with gloo the wait blocks the host and the host clock measures it. A tower root gathers
    inside its registered forward method, not in hooks: its few weights (embeddings, final norm,
    projection) stay in encode and replay time.
    """

    def __init__(self, model: nn.Module, device: torch.device):
        self._cuda = device.type == "cuda"
        self._spans: list[tuple[Any, Any]] = []
        self._opened: Any = None
        for tower in (model.visual, model.text):
            for block in tower_blocks(tower) if is_sharded(tower) else ():
                block.register_forward_pre_hook(self._open, prepend=True)
                block.register_forward_pre_hook(self._close)
                block.register_forward_hook(self._before_backward, prepend=True)
                block.register_forward_hook(self._after_backward)

    def take_seconds(self) -> float:
        """Seconds waited since the last call (on CUDA, once the device has been synchronised)."""
        spans, self._spans = self._spans, []
        if self._cuda:
            return sum(start.elapsed_time(end) for start, end in spans) / 1000
        return sum(end - start for start, end in spans)

    def forget(self) -> None:
        """Drop the waits recorded so far, unread (their CUDA events may still be pending)."""
        self._spans = []

    def _stamp(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @torch.compiler.disable
    def _open(self, *_: Any) -> None:
        self._opened = self._stamp()

    @torch.compiler.disable
    def _close(self, *_: Any) -> None:
        self._spans.append((self._opened, self._stamp()))

    @torch.compiler.disable
    def _before_backward(self, module: nn.Module, args: Any, output: Any) -> None:
        for tensor in _grad_outputs(output):
            tensor.register_hook(self._open)

    @torch.compiler.disable
    def _after_backward(self, module: nn.Module, args: Any, output: Any) -> None:
        for tensor in _grad_outputs(output):
            tensor.register_hook(self._close)


def _grad_outputs(output: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
