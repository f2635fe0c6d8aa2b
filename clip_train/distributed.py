"""Process-group setup from torchrun's environment, and the few collectives training and evaluation need."""

from __future__ import annotations

import datetime
import itertools
import os
import pickle
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from clip_train.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(requested: str) -> torch.device:
    """``auto`` is CUDA when there is a GPU, else the CPU; ``cuda`` without a GPU is a user error."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda: no CUDA device is available here")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


def wait_for_device(device: torch.device) -> None:
    """Wait until the device has run every kernel queued so far (CUDA queues them; the CPU runs each
    at once), so that a clock read next times the work, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def local_gpu(local_rank: int, visible: int) -> torch.device:
    """This rank's GPU, ``cuda:LOCAL_RANK``, or ``cuda:0`` where the process sees one GPU alone: a
    per-task binding (srun's ``--gpus-per-task=1``, ``--gpu-bind=single:1``) gives each process its
    own, as its ``cuda:0``. One line, not "invalid device ordinal", when the node started more ranks
    than CUDA_VISIBLE_DEVICES leaves GPUs."""
    if visible == 1:
        return torch.device("cuda", 0)
    if local_rank >= visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise UserError(
            f"local rank {local_rank} has no GPU: {visible} visible (CUDA_VISIBLE_DEVICES={shown}); "
            "start one process per visible GPU"
        )
    return torch.device("cuda", local_rank)


def process_group_backend(device: torch.device) -> str:
    """gloo on the CPU; on CUDA, NCCL for device tensors and gloo for host ones. NCCL has no host
    collectives, and some run on host tensors: with ``fsdp.cpu_offload`` the gradient norm of the
    offloaded shards, for one. Both backends are created at start-up, as torch does by default."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def init_distributed(device: str = "auto", timeout_s: int = 600) -> DistEnv:
    """Join the torchrun group (``process_group_backend``) if there is one, else run as one process;
    ranks that srun started have torchrun's variables from ``clip_train.launcher``.
    The timeout bounds every collective, so a rank that dies cannot leave the others waiting forever."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = resolve_device(device).type == "cuda"
    torch_device = local_gpu(local_rank, torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(torch_device)
    if world_size > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        # After a torchrun restart the store may still hold the dead group's addresses: a prefix
        # per attempt keeps the new group from connecting to them.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            process_group_backend(torch_device),
            store=dist.PrefixStore(f"clip_train/attempt_{attempt}", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=torch_device if use_cuda else None,
        )
    return DistEnv(rank, world_size, local_rank, torch_device)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_ranks_true(flags: Sequence[bool] | torch.Tensor) -> list[bool]:
    """Each flag ANDed over the ranks, in one all-reduce, so all ranks take the same branches.
    Flags computed on the device come as a bool tensor: nothing waits for them until the one read.
    Host flags stay host tensors (gloo, ``process_group_backend``): on a GPU, an all-reduce through
    NCCL would queue behind the step's kernels, and reading it would wait for all of them."""
    if not isinstance(flags, torch.Tensor):
        if not dist.is_initialized():
            return list(flags)
        flags = torch.tensor(list(flags), dtype=torch.bool, device="cpu")
    return and_over_ranks(flags).tolist()


def and_over_ranks(flags: torch.Tensor) -> torch.Tensor:
    """Each flag ANDed over the ranks, where it lies: on a GPU, an all-reduce queued on the stream,
    which nothing on the host waits for."""
    values = flags.to(dtype=torch.long)
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return values.bool()


@contextmanager
def failing_together(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """A ``UserError`` that the block raises on some ranks is raised on every rank of ``group``, with
    the lowest failing rank's message (naming it): a check that only some ranks fail must not leave
    the others waiting in their next collective. A collective on the host (one all-reduce while no
    rank fails), which waits for no GPU work; the block itself must not hold one."""
    error: UserError | None = None
    try:
        yield
    except UserError as err:
        error = err
    world = rank_and_world(group)[1]
    if world == 1:
        if error is not None:
            raise error
        return
    failed = torch.tensor([0 if error is None else 1], device="cpu")
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return
    messages: list[str | None] = [None] * world
    dist.all_gather_object(messages, None if error is None else str(error), group=group)
    rank, message = next((rank, message) for rank, message in enumerate(messages) if message is not None)
    raise UserError(f"on rank {rank}: {message}") from None


def gather_to_main(obj: object) -> list[object] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere); just ``[obj]`` without a group."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """This process's place in ``group`` (the default group), or (0, 1) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def require_host_collectives(group: dist.ProcessGroup | None = None) -> None:
    """Refuse a group without a backend for host tensors (NCCL alone, made by code that calls the
    library): the trainer and the evaluation agree on host values (stop votes, skip counts, a rank's
    error) through it, which would fail at the first step or evaluation instead of here."""
    if not dist.is_initialized() or "cpu:" in (backends := dist.get_backend_config(group)):
        return
    raise UserError(
        f"the process group's backends ({backends}) take no host tensors, which clip_train exchanges "
        "through it: add gloo for them, init_process_group('cuda:nccl,cpu:gloo') (or no backend: torch's "
        "default makes both)"
    )


def host_values_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where ranks exchange host values (shapes, counts) about tensors on ``device``: the host when
    the group serves host tensors (a CUDA run's ``cuda:nccl,cpu:gloo``), since reading an NCCL
    result waits for every kernel queued before it; ``device`` in a group that does not (NCCL alone)."""
    return torch.device("cpu") if "cpu:" in dist.get_backend_config(group) else device


def gather_rows(rows: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, list[int]]:
    """Every rank's 2-D ``rows`` concatenated in rank order, and each rank's row count.

    ``all_gather`` needs equal shapes, so blocks are padded to the largest; a rank with no rows may
    pass a (0, 0) tensor.
    """
    _, world = rank_and_world(group)
    if world == 1:
        return rows, [rows.shape[0]]
    shape = torch.tensor(rows.shape, dtype=torch.long, device=host_values_device(group, rows.device))
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    counts, widths = torch.stack(shapes).t().tolist()
    width = max(widths)
    padded = rows.new_zeros((max(counts), width))
    padded[: rows.shape[0], : rows.shape[1]] = rows
    blocks = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(blocks, padded, group=group)
    return torch.cat([block[:n] for block, n in zip(blocks, counts, strict=True)]), counts


def sum_over_ranks(counts: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``counts`` summed in place over the ranks of ``group``."""
    if rank_and_world(group)[1] > 1:
        dist.all_reduce(counts, group=group)
    return counts


def sum_counts_over_ranks(
    counts: Mapping[str, int], keys: Sequence[str], group: dist.ProcessGroup | None = None
) -> dict[str, int]:
    """``counts[key]`` (0 where missing) summed over the ranks of ``group``, for every key; a
    collective on the host, which waits for no GPU work."""
    values = torch.tensor([counts.get(key, 0) for key in keys], dtype=torch.long, device="cpu")
    return dict(zip(keys, sum_over_ranks(values, group).tolist(), strict=True))


def decided_by_main(decide: Callable[[], T]) -> T:
    """``decide()`` run on rank 0 only; its result returned, or its ``UserError`` raised, on every
    rank, so that the ranks act on one decision and fail together. The other ranks wait for it
    through the store, up to ``train.io_timeout_s``: rank 0 may pull, verify or finish a checkpoint
    for minutes, longer than a collective may wait (``train.dist_timeout_s``)."""
    rank, world = rank_and_world()
    key = f"clip_train/decided/{next(_decisions)}"  # every rank makes the same calls in the same order
    outcome: tuple[Any, str | None] = (None, None)
    if rank == 0:
        try:
            outcome = (decide(), None)
        except UserError as err:
            outcome = (None, str(err))
        if world > 1:
            _default_store().set(key, pickle.dumps(outcome))
    elif world > 1:
        outcome = pickle.loads(_wait_for_key(key))
    if outcome[1] is not None:
        raise UserError(outcome[1])
    return outcome[0]


# -- waiting without a collective, and ending together ----------------------------------------------

_decisions = itertools.count()
_main_only_timeout_s = [3600.0]  # train.io_timeout_s, set by set_main_only_timeout
_store_polls = [0]  # grows while this rank polls the store: it is waiting, not stalled
ENDING_KEY = "clip_train/ending"


class PeerEnded(Exception):
    """Another rank ended the run (its ``Ending`` is in the store) while this one waited for it."""


def main_done() -> None:
    """Every rank waits here until rank 0 gets here, through the store (``train.io_timeout_s``)."""
    decided_by_main(lambda: None)


def set_main_only_timeout(seconds: float) -> None:
    """How long the other ranks wait for a phase rank 0 runs alone, and the collectives of the groups
    ``new_io_group`` makes from now on for the slowest rank's files (``train.io_timeout_s``)."""
    _main_only_timeout_s[0] = float(seconds)


def store_polls() -> int:
    """How often this rank polled the store for rank 0 so far: a rank that polls is not stalled."""
    return _store_polls[0]


def _wait_for_key(key: str) -> bytes:
    """The value rank 0 sets under ``key``, polled in Python, so that signals are handled meanwhile;
    ``PeerEnded`` once another rank has ended the run, ``UserError`` after ``train.io_timeout_s``."""
    store, timeout_s = _default_store(), _main_only_timeout_s[0]
    deadline, pause = time.monotonic() + timeout_s, 0.002
    while not store.check([key]):
        if store.check([ENDING_KEY]):
            raise PeerEnded(key)
        if time.monotonic() > deadline:
            raise UserError(
                f"train.io_timeout_s={timeout_s:.0f}: rank 0 did not finish its part (a checkpoint's pull, "
                "verification or save, or init_from) in time; raise it if that can take longer"
            )
        _store_polls[0] += 1
        time.sleep(pause)
        pause = min(2 * pause, 0.5)
    return store.get(key)


def announce_ending(ending: bytes) -> bytes:
    """Record ``ending`` as how the run ends unless a rank recorded one before; returns the first."""
    return _default_store().compare_set(ENDING_KEY, "", ending)


def announced_ending() -> bytes | None:
    """The ending a rank recorded, or None (also when the store cannot be reached)."""
    try:
        store = _default_store()
        return store.get(ENDING_KEY) if store.check([ENDING_KEY]) else None
    except (RuntimeError, ValueError):  # the group is gone, or the store's host with it
        return None


def raise_store_flag(key: str) -> None:
    """Set the flag ``key`` in the group's store, for every rank to see."""
    _default_store().set(key, b"1")


def store_flag(key: str) -> bool:
    """Whether a rank set the flag ``key`` (False also when the store cannot be reached)."""
    try:
        return _default_store().check([key])
    except (RuntimeError, ValueError):
        return False


def new_group_of_all(timeout_s: float, backend: str | None = None) -> dist.ProcessGroup | None:
    """A process group of every rank beside the default one (None without torch.distributed), its
    collectives bounded by ``timeout_s`` as the default group's are: a new group does not inherit
    that bound but takes torch's default (30 minutes). ``backend`` as the default group's unless
    named. A collective."""
    if rank_and_world()[1] == 1:
        return None
    return dist.new_group(timeout=datetime.timedelta(seconds=timeout_s), backend=backend)


def new_io_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank whose collectives wait up to ``train.io_timeout_s``, for ranks that
    wait while the slowest writes or reads its own files (a sharded checkpoint's): storage may take
    longer than a collective may wait (``train.dist_timeout_s``). Host collectives only, so no NCCL
    communicator is made for it. A collective."""
    return new_group_of_all(_main_only_timeout_s[0], backend="gloo")


def abort_distributed() -> None:
    """End this rank's process group without waiting for its peers: after an error, a destroy could
    wait on a collective a stalled peer never joins."""
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()


def abort_collectives(group: dist.ProcessGroup | None = None) -> None:
    """Make the collectives in flight in ``group`` (the default group) return with an error, from any
    thread (NCCL; a gloo collective returns once its peer's group is gone)."""
    with suppress(RuntimeError, ValueError):  # no group (any more): nothing in flight
        (group or dist.distributed_c10d._get_default_group()).abort()


def _default_store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()
