"""Argument checks and process-group plumbing shared by every loss implementation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from clip_train.distributed import rank_and_world


@dataclass(frozen=True)
class Batch:
    """Where this rank's rows sit in the global batch.

    ``labels`` always holds global text-column indices: in symmetric (CLIP) mode they are the
    implied diagonal ``rank * n + arange(n)``, in hard-negative mode the caller's labels.
    """

    group: dist.ProcessGroup | None
    rank: int
    world: int
    labels: torch.Tensor
    symmetric: bool


def resolve_group(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    """``group`` or the default group when torch.distributed is up, with this rank and the world size."""
    rank, world = rank_and_world(group)
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    return group, rank, world


def check_inputs(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    labels: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> Batch:
    """Validate shapes (across ranks too) and return this rank's place in the global batch."""
    if image_features.dim() != 2 or text_features.dim() != 2:
        raise ValueError(
            "contrastive_loss: features must be 2-D (rows, dim); got image "
            f"{tuple(image_features.shape)} and text {tuple(text_features.shape)}"
        )
    (n, d), (m, d_text) = image_features.shape, text_features.shape
    if d != d_text:
        raise ValueError(f"contrastive_loss: image dim {d} != text dim {d_text}")
    if n == 0:
        raise ValueError("contrastive_loss: no rows (image_features has 0 rows)")
    if image_features.dtype != text_features.dtype or image_features.device != text_features.device:
        raise ValueError(
            "contrastive_loss: image and text features must share dtype and device; got "
            f"{image_features.dtype}/{image_features.device} and {text_features.dtype}/{text_features.device}"
        )
    if not image_features.is_floating_point():
        raise ValueError(f"contrastive_loss: features must be floating point, got {image_features.dtype}")
    if logit_scale.numel() != 1:
        raise ValueError(
            f"contrastive_loss: logit_scale must be a scalar, got shape {tuple(logit_scale.shape)}"
        )
    group, rank, world = resolve_group(group)
    if world > 1:
        _check_same_shapes(n, m, d, image_features.device, group, world)
    if labels is None:
        if m != n:
            raise ValueError(
                "contrastive_loss: symmetric CLIP loss needs as many text rows as image rows, "
                f"got {n} and {m}"
                " (pass labels= for hard negatives)"
            )
        diagonal = torch.arange(n, device=image_features.device) + rank * n
        return Batch(group, rank, world, diagonal, symmetric=True)
    if labels.shape != (n,) or labels.dtype != torch.long:
        raise ValueError(
            f"contrastive_loss: labels must be a LongTensor of shape ({n},), "
            f"got {labels.dtype} of shape {tuple(labels.shape)}"
        )
    if m < n:
        raise ValueError(
            f"contrastive_loss: hard-negative mode needs text rows m >= image rows n, got {m} < {n}"
        )
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= world * m:
        raise ValueError(
            f"contrastive_loss: labels must lie in [0, {world * m}) (global text columns), "
            f"got [{low}, {high}]"
        )
    return Batch(group, rank, world, labels.to(image_features.device), symmetric=False)


def _check_same_shapes(
    n: int, m: int, d: int, device: torch.device, group: dist.ProcessGroup, world: int
) -> None:
    mine = torch.tensor([n, m, d], dtype=torch.long, device=device)
    shapes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(shapes, mine, group=group)
    shapes_list = [tuple(s.tolist()) for s in shapes]
    if len(set(shapes_list)) > 1:
        described = ", ".join(f"rank {r}: n={s[0]} m={s[1]} d={s[2]}" for r, s in enumerate(shapes_list))
        raise ValueError(
            f"contrastive_loss: every rank must hold the same number of rows and dim, got {described}"
        )


def gather_with_grad(tensor: torch.Tensor, batch: Batch) -> torch.Tensor:
    """All ranks' rows, rank-major; backward sums every rank's gradient into the owner's rows."""
    if batch.world == 1:
        return tensor
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(tensor, group=batch.group), dim=0)
