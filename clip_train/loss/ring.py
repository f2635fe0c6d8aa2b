"""The ring of ranks: text blocks travel from rank to rank, so no rank ever holds the whole batch.

Forward: block T_k starts at rank k and visits every rank, carrying its own state (the softmax's
column LSE), which is complete when it gets home. Backward: the other way round, T_k carries a
dT_k accumulator home while dI accumulates locally; the sigmoid's one pass carries its dT_k the
forward's way. Each hop's transfer is posted before the compute on the block in hand and waited
for after, so communication overlaps the matmuls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from clip_train.loss.checks import Batch


def _exchange(
    batch: Batch, send: list[torch.Tensor], recv: list[torch.Tensor], reverse: bool = False
) -> list[Any]:
    """Post the transfers to the next rank and from the previous one (``reverse``: the other way)."""
    if batch.world == 1 or not (send or recv):
        return []
    hop = -1 if reverse else 1
    to = dist.get_global_rank(batch.group, (batch.rank + hop) % batch.world)
    source = dist.get_global_rank(batch.group, (batch.rank - hop) % batch.world)
    ops = [dist.P2POp(dist.isend, t, to, batch.group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, source, batch.group) for t in recv]
    return dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def forward_pass(
    batch: Batch,
    block: torch.Tensor,
    carried: torch.Tensor | None,
    visit: Callable[[int, torch.Tensor, torch.Tensor | None], None],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Show every rank's text block to ``visit(owner, block, carried)``, which may update
    ``carried`` (the block's own state) in place. Returns the block in hand at the end, its
    carried state, and this rank's own block's carried state, home complete."""
    held = carried
    for step in range(batch.world):
        last = step == batch.world - 1
        next_block = block if last else torch.empty_like(block)
        transfer = [] if last else _exchange(batch, [block], [next_block])
        visit((batch.rank - step) % batch.world, block, carried)
        if carried is not None and batch.world > 1:  # the state moves on once it is updated
            held, carried = carried, torch.empty_like(carried)
            transfer += _exchange(batch, [held], [carried])
        _wait(transfer)
        block = next_block
    return block, held, carried


def backward_pass(
    batch: Batch,
    travelling: list[torch.Tensor],
    visit: Callable[[int, list[torch.Tensor]], torch.Tensor],
) -> torch.Tensor:
    """Starting from the block the forward ended on (``travelling``: the block and its state),
    call ``visit(owner, travelling)`` for every rank's block, the other way round; it returns
    that block's gradient accumulator, which follows the block home. Returns this rank's own."""
    return _accumulating(batch, travelling, visit, hop=-1, first_owner=batch.rank + 1)


def accumulating_pass(
    batch: Batch, block: torch.Tensor, visit: Callable[[int, list[torch.Tensor]], torch.Tensor]
) -> torch.Tensor:
    """Show every rank's text block to ``visit(owner, [block])``, starting from this rank's own, in
    the forward's direction; it returns that block's share of a sum (the sigmoid's text gradient),
    which follows the block home. Returns this rank's own block's sum."""
    return _accumulating(batch, [block], visit, hop=1, first_owner=batch.rank)


def _accumulating(
    batch: Batch,
    travelling: list[torch.Tensor],
    visit: Callable[[int, list[torch.Tensor]], torch.Tensor],
    hop: int,
    first_owner: int,
) -> torch.Tensor:
    """The blocks move ``hop`` ranks a step, ``first_owner``'s in hand at the start. Each block's
    sum follows it a hop behind: posted with the next block, so it crosses while the next block is
    computed, and added to that rank's share after. A sum that ends one rank short of its owner
    (the blocks started at home) takes one more hop, the only one nothing overlaps."""
    reverse, done = hop < 0, None  # the sum of the block visited in the previous step
    for step in range(batch.world):
        last = step == batch.world - 1
        send = ([] if last else travelling) + ([] if done is None else [done])
        recv = [torch.empty_like(t) for t in send]
        transfer = _exchange(batch, send, recv, reverse)
        accumulator = visit((first_owner - hop * step) % batch.world, travelling)
        _wait(transfer)
        if done is not None:
            accumulator += recv[-1]
        done = accumulator
        if not last:
            travelling = recv[: len(travelling)]
    if (first_owner - hop * (batch.world - 1)) % batch.world == batch.rank:
        return done
    home = torch.empty_like(done)
    _wait(_exchange(batch, [done], [home], reverse))
    return home


def rank_coefficients(coef: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Every rank's loss coefficients (its upstream gradients over its rows), rank-major: one
    all-gather, on the device, never read by the host."""
    mine = coef.reshape(-1)
    if batch.world == 1:
        return mine
    every = [torch.empty_like(mine) for _ in range(batch.world)]
    dist.all_gather(every, mine, group=batch.group)
    return torch.cat(every)


def without_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The tile kernels pick their own precision; autocast must not lower it under them."""

    @functools.wraps(fn)
    def run(ctx: Any, tensor: torch.Tensor, *args: Any) -> Any:
        with torch.autocast(tensor.device.type, enabled=False):
            return fn(ctx, tensor, *args)

    return run
