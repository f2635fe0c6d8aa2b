"""Differences between the torch releases clip_train runs on, detected by feature in one place.

Callers ask what to pass, never which version they run on: a version string says nothing about a
backport or a nightly, a signature does. The floor is torch 2.11; every other torch API the package
and its tests use exists unchanged from there on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel


def torchrun_waits_for_its_workers(agent_init: Callable[..., Any] | None = None) -> bool:
    """Whether torchrun waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (``--shutdown-timeout``) for its
    workers after passing a stop signal on. Before the release that added it (torch 2.11 has not) it
    kills them 30 s after, however long the step in progress and its checkpoint take."""
    if agent_init is None:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        agent_init = LocalElasticAgent.__init__
    return "shutdown_timeout" in inspect.signature(agent_init).parameters


def ddp_no_buffer_sync_kwargs(
    ddp_init: Callable[..., Any] = DistributedDataParallel.__init__,
) -> dict[str, bool]:
    """The ``DistributedDataParallel`` keyword that stops it broadcasting buffers before every forward.

    torch 2.13 added ``forward_sync_buffers`` and deprecated ``broadcast_buffers`` with a warning;
    torch < 2.13 rejects the new keyword. ``broadcast_buffers=False`` also skips the broadcast at
    construction, which ``forward_sync_buffers=False`` keeps. The towers' buffers (pixel mean and
    std, position ids) are constants built from the config on every rank, so both start equal.
    """
    if "forward_sync_buffers" in inspect.signature(ddp_init).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
