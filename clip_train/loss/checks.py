"""Argument checks, process-group plumbing and small helpers shared by every loss implementation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from clip_train.distributed import host_values_device, rank_and_world


@dataclass(frozen=True)
class Batch:
    """Where this rank's rows sit in the global batch. ``labels`` holds global text columns: the
    diagonal ``rank * n + arange(n)`` in symmetric (CLIP) mode, else the caller's hard-negative labels."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    labels: torch.Tensor
    symmetric: bool


def check_inputs(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    labels: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> Batch:
    """Validate shapes (across ranks too) and return this rank's place in the global batch.

    Every rank joins one agreement collective before anything can raise, so a problem on one rank
    fails every rank with the same message instead of leaving the others hanging until the timeout.
    """
    rank, world = rank_and_world(group)
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    problem = _local_problem(image_features, text_features, logit_scale, labels, world)
    if world > 1:
        problem = _agree(problem, image_features, text_features, group, world)
    if problem:
        raise ValueError(f"contrastive_loss: {problem}")
    n = image_features.shape[0]
    if labels is None:
        diagonal = torch.arange(n, device=image_features.device) + rank * n
        return Batch(group, rank, world, diagonal, symmetric=True)
    return Batch(group, rank, world, labels.to(image_features.device), symmetric=False)


def _local_problem(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    labels: torch.Tensor | None,
    world: int,
) -> str:
    """What is wrong with this rank's inputs ("" if nothing)."""
    if image_features.dim() != 2 or text_features.dim() != 2:
        return (
            "features must be 2-D (rows, dim); got image "
            f"{tuple(image_features.shape)} and text {tuple(text_features.shape)}"
        )
    (n, d), (m, d_text) = image_features.shape, text_features.shape
    if d != d_text:
        return f"image dim {d} != text dim {d_text}"
    if n == 0:
        return "no rows (image_features has 0 rows)"
    if image_features.dtype != text_features.dtype or image_features.device != text_features.device:
        return (
            "image and text features must share dtype and device; got "
            f"{image_features.dtype}/{image_features.device} and {text_features.dtype}/{text_features.device}"
        )
    if not image_features.is_floating_point():
        return f"features must be floating point, got {image_features.dtype}"
    if logit_scale.numel() != 1:
        return f"logit_scale must be a scalar, got shape {tuple(logit_scale.shape)}"
    if labels is None:
        if m != n:
            return (
                f"symmetric CLIP loss needs as many text rows as image rows, got {n} and {m} "
                "(pass labels= for hard negatives)"
            )
        return ""
    if labels.shape != (n,) or labels.dtype != torch.long:
        return (
            f"labels must be a LongTensor of shape ({n},), got {labels.dtype} of shape {tuple(labels.shape)}"
        )
    if m < n:
        return f"hard-negative mode needs text rows m >= image rows n, got {m} < {n}"
    low, high = torch.stack(labels.aminmax()).tolist()  # one read of the device
    if low < 0 or high >= world * m:
        return f"labels must lie in [0, {world * m}) (global text columns), got [{low}, {high}]"
    return ""


def _agree(
    problem: str,
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    group: dist.ProcessGroup,
    world: int,
) -> str:
    """The first rank's problem, or a disagreement about shapes, the same on every rank ("" if none)."""
    shape = (0, 0, 0) if problem else (*image_features.shape, text_features.shape[0])
    mine = torch.tensor([bool(problem), *shape], device=host_values_device(group, image_features.device))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    every = torch.stack(gathered).tolist()  # one read, whatever the world size
    if any(row[0] for row in every):
        problems: list[str] = [""] * world
        dist.all_gather_object(problems, problem, group=group)
        rank, first = next((r, p) for r, p in enumerate(problems) if p)
        return f"rank {rank}: {first}"
    shapes = [tuple(row[1:]) for row in every]  # (n, d, m)
    if len(set(shapes)) > 1:
        described = ", ".join(f"rank {r}: n={s[0]} m={s[2]} d={s[1]}" for r, s in enumerate(shapes))
        return f"every rank must hold the same number of rows and dim, got {described}"
    return ""


class _GatherRows(torch.autograd.Function):
    """All ranks' rows, rank-major; backward sums every rank's gradient into the owner's rows
    (as the deprecated ``torch.distributed.nn.functional.all_gather`` does)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, batch: Batch) -> torch.Tensor:  # type: ignore[override]
        ctx.batch = batch
        parts = [torch.empty_like(tensor) for _ in range(batch.world)]
        dist.all_gather(parts, tensor.contiguous(), group=batch.group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.batch.group)
        return grad.chunk(ctx.batch.world)[ctx.batch.rank], None


def gather_with_grad(tensor: torch.Tensor, batch: Batch) -> torch.Tensor:
    """All ranks' rows, rank-major, differentiably (the identity on one rank)."""
    return tensor if batch.world == 1 else _GatherRows.apply(tensor, batch)


def grads_like(
    grads: tuple[torch.Tensor, ...], inputs: list[tuple[torch.dtype, torch.Size]]
) -> tuple[torch.Tensor, ...]:
    """Each gradient in its input's (dtype, shape): the kernels accumulate in their own precision."""
    return tuple(g.to(dtype).reshape(shape) for g, (dtype, shape) in zip(grads, inputs, strict=True))


def row_dots(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Row-wise dot products, accumulated in ``dtype``."""
    return (a.to(dtype) * b.to(dtype)).sum(dim=1)
