"""Run a function in several real gloo processes and collect what each rank returns."""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    init_file: str,
    out_dir: str,
    timeout_s: float | None,
    args: tuple,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # The result is on disk. Skip interpreter teardown: there a C++ thread destructor sometimes
    # aborts ("terminate called without an active exception") after everything has succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float | None = None
) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; return their results.

    ``fn`` must be a module-level function (it is pickled by name). Results travel through
    ``torch.save`` files, so they may hold tensors. ``timeout_s`` bounds every collective, so a
    rank left waiting fails instead of hanging the test.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        spawn_args = (fn, world_size, init_file, tmp, timeout_s, args)
        mp.spawn(_worker, args=spawn_args, nprocs=world_size, join=True)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
