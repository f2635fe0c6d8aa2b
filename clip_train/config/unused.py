"""Settings that a run's other choices leave without effect. A recipe may keep them on purpose (one
key switches between modes and the others wait for it) or by mistake (``fsdp.cpu_offload`` on a
DDP run reads as if it offloaded), so ``clip-train train`` and ``clip-train config`` name them at
start-up as warnings; a contradiction, by contrast, is a ``ConfigError`` in ``Config.validate``."""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clip_train.config.schema import Config, FsdpConfig
from clip_train.logs import get_logger


@dataclass(frozen=True)
class _Needs:
    """``keys`` take effect only where ``applies(cfg)`` holds, which ``setting`` says in words."""

    keys: tuple[str, ...]
    applies: Callable[[Config], bool]
    setting: str


_NEEDS = (
    _Needs(
        tuple(f"fsdp.{f.name}" for f in dataclasses.fields(FsdpConfig)),
        lambda cfg: cfg.train.parallel == "fsdp",
        "train.parallel=fsdp",
    ),
    _Needs(
        ("optim.betas", "optim.eps", "optim.fused"), lambda cfg: cfg.optim.name == "adamw", "optim.name=adamw"
    ),
    _Needs(
        ("loss.tile_size", "batch.keep_last_graph"),
        lambda cfg: cfg.loss.impl in ("auto", "inf"),
        "loss.impl=inf (or auto)",
    ),
    _Needs(
        ("batch.memory_budget",),
        lambda cfg: bool(cfg.batch.auto_towers),
        "batch.image_chunk=auto or batch.text_chunk=auto",
    ),
    _Needs(
        ("optim.cooldown_power",),
        lambda cfg: cfg.optim.schedule == "const-cooldown",
        "optim.schedule=const-cooldown",
    ),
    _Needs(("distill.weight",), lambda cfg: bool(cfg.distill.teacher), "distill.teacher"),
    _Needs(("data.color_jitter_prob",), lambda cfg: bool(cfg.data.color_jitter), "data.color_jitter"),
    _Needs(("log.profile_after",), lambda cfg: cfg.log.profile_steps > 0, "log.profile_steps"),
)


def unused_settings(cfg: Config) -> list[str]:
    """A line for each key set away from its default that ``cfg``'s other choices ignore, and one for
    a warmup that lasts the whole run (under cosine or const: const-cooldown refuses it)."""
    defaults, lines = Config(), []
    for needs in _NEEDS:
        if needs.applies(cfg):
            continue
        for key in needs.keys:
            if (value := operator.attrgetter(key)(cfg)) != operator.attrgetter(key)(defaults):
                lines.append(f"{key}={_shown(value)} has no effect without {needs.setting}")
    warmup, steps = cfg.optim.warmup_steps, cfg.train.max_steps
    if warmup >= steps:
        lines.append(
            f"optim.warmup_steps={warmup} >= train.max_steps={steps}: the rate rises to "
            f"{math.floor(100 * steps / warmup)}% of its peak at the last step, and "
            f"optim.schedule={cfg.optim.schedule} never starts"
        )
    return lines


def warn_unused_settings(cfg: Config) -> None:
    """Each of ``unused_settings`` as a warning line, marked to stand out among the start-up's."""
    for line in unused_settings(cfg):
        get_logger().warning(f"warning: {line}")


def _shown(value: Any) -> str:
    """As a config file or an override writes it: ``false``, ``[0.9, 0.95]``, ``bf16``."""
    return value if isinstance(value, str) else json.dumps(value)
