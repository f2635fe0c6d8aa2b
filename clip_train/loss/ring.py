"""The ring of ranks: text blocks travel from rank to rank, so no rank ever holds the whole batch.

Forward, one pass: text block T_k starts at rank k and visits every rank; each rank computes its
tiles against the block in hand, and state that belongs to the block (the softmax's column LSE)
travels on with it, complete when it gets home. Backward, one more pass the other way round:
each rank starts with the block the forward ended on and T_k travels with a dT_k accumulator,
arriving home complete after the last hop, while dI accumulates locally. The next block's
transfer is posted before computing on the block in hand and waited for after, so
communication overlaps the matmuls. With one rank there is no communication.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from clip_train.loss.checks import Batch


class Ring:
    """Point-to-point exchange with this rank's ring neighbours (send to next, receive from previous)."""

    def __init__(self, batch: Batch) -> None:
        self.group, self.world = batch.group, batch.world
        if self.world > 1:
            self.next = dist.get_global_rank(self.group, (batch.rank + 1) % self.world)
            self.prev = dist.get_global_rank(self.group, (batch.rank - 1) % self.world)

    def start(self, send: list[torch.Tensor], recv: list[torch.Tensor], reverse: bool = False) -> list[Any]:
        """Post the transfers; ``reverse`` sends to the previous rank and receives from the next."""
        if self.world == 1 or not (send or recv):
            return []
        to, source = (self.prev, self.next) if reverse else (self.next, self.prev)
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, source, self.group) for t in recv]
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
    ring = Ring(batch)
    held = carried
    for step in range(batch.world):
        owner = (batch.rank - step) % batch.world
        last = step == batch.world - 1
        next_block = None if last else torch.empty_like(block)
        transfer = ring.start([] if last else [block], [] if last else [next_block])
        visit(owner, block, carried)
        if carried is not None and batch.world > 1:  # the state moves on once it is updated
            incoming = torch.empty_like(carried)
            transfer += ring.start([carried], [incoming])
        _wait(transfer)
        if carried is not None and batch.world > 1:
            held, carried = carried, incoming
        if not last:
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
    ring = Ring(batch)
    done = None  # the accumulator of the block visited in the previous step
    for step in range(batch.world):
        owner = (batch.rank + 1 + step) % batch.world
        last = step == batch.world - 1
        send, recv = ([], []) if last else (travelling, [torch.empty_like(t) for t in travelling])
        if done is not None:
            incoming = torch.empty_like(done)
            send, recv = [*send, done], [*recv, incoming]
        transfer = ring.start(send, recv, reverse=True)
        accumulator = visit(owner, travelling)
        _wait(transfer)
        if done is not None:
            accumulator += incoming
        done = accumulator
        if not last:
            travelling = recv[: len(travelling)]
    return done


def rank_coefficients(coef: float, batch: Batch, device: torch.device) -> list[float]:
    """Every rank's loss coefficient (its upstream gradient over its rows), indexed by rank."""
    if batch.world == 1:
        return [coef]
    mine = torch.tensor([coef], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(batch.world)]
    dist.all_gather(every, mine, group=batch.group)
    return [float(c) for c in every]


def without_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The tile kernels pick their own precision; autocast must not lower it under them."""

    @functools.wraps(fn)
    def run(ctx: Any, tensor: torch.Tensor, *args: Any) -> Any:
        with torch.autocast(tensor.device.type, enabled=False):
            return fn(ctx, tensor, *args)

    return run
