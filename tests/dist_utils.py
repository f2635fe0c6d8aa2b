"""Run a function in several real gloo processes and collect what each rank returns."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks are forked from a server process that imported torch and the library once (multiprocessing's
# forkserver, one per test worker), not started as fresh interpreters: a fresh one spends 3-8 s of
# CPU importing torch, timm and transformers, most of a small test's time on a 2-core machine. The
# server never runs torch, so each rank still starts from a clean state.
multiprocessing.set_forkserver_preload(["dist_utils", "clip_train.trainer"])

# Gloo's TCP mesh set-up between two processes on one busy machine fails now and then ("Gloo
# connectFullMesh failed ... Connection closed by peer", once in CI's floor run) before the code
# under test has run. A rank whose set-up failed exits with this code and the group is started
# again, up to SETUP_TRIES times; a failure of the tested function itself is never retried.
SETUP_FAILED_EXIT = 86  # none of the trainer's own exit codes (1, 2, 75, 130)
SETUP_TRIES = 3


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    init_file: str,
    out_dir: str,
    timeout_s: float | None,
    env: dict[str, str],
    args: tuple,
    retry_setup: bool,
) -> None:
    os.environ.clear()  # the caller's, not the server's (which is the first caller's)
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
        )
    except RuntimeError as err:
        if not retry_setup:
            raise
        print(
            f"rank {rank}: process group set-up failed, the group will be started again: {err}",
            file=sys.stderr,
        )
        os._exit(SETUP_FAILED_EXIT)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        if dist.is_initialized():  # a function that ends its run (``StopWatch.ended_by``) aborts it itself
            dist.destroy_process_group()
    # The result is on disk. Skip interpreter teardown: there a C++ thread destructor sometimes
    # aborts ("terminate called without an active exception") after everything has succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float | None = None
) -> list[Any]:
    """Start ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; return their results.

    ``fn`` must be a module-level function (it is pickled by name). Results travel through
    ``torch.save`` files, so they may hold tensors. ``timeout_s`` bounds every collective, so a
    rank left waiting fails instead of hanging the test.
    """
    for _ in range(SETUP_TRIES - 1):
        try:
            return _run_group(fn, world_size, args, timeout_s, retry_setup=True)
        except mp.ProcessExitedException as err:
            if err.exit_code != SETUP_FAILED_EXIT:
                raise
    return _run_group(fn, world_size, args, timeout_s, retry_setup=False)


def _run_group(
    fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float | None, retry_setup: bool
) -> list[Any]:
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        spawn_args = (fn, world_size, init_file, tmp, timeout_s, dict(os.environ), args, retry_setup)
        mp.start_processes(_worker, args=spawn_args, nprocs=world_size, join=True, start_method="forkserver")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
