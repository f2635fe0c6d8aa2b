"""``batch.image_chunk: auto`` and ``batch.text_chunk: auto``: a run's chunk sizes from a short
measurement of its own towers on its device and the plan's arithmetic (``estimate.py``). A per-rank
batch that fits the memory budget runs as one chunk per tower, which Gradient Cache trains as plain
backpropagation (no tower encoded twice); one that does not gets the largest chunks that fit."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch
from torch import nn

from clip_train.config import Config
from clip_train.engine.rng import preserved_rng
from clip_train.errors import UserError
from clip_train.loss.tiles_torch import default_tile
from clip_train.memory import format_bytes, tensor_bytes
from clip_train.parallel.fsdp import mixed_precision
from clip_train.plan.estimate import ModelProfile, Setting, breakdown, usable_bytes
from clip_train.plan.profile import profile_built_model, weight_dtype

MEASURED_CHUNKS = (2, 4)
CGROUP = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
NO_LIMIT = 2**62  # cgroup v1 writes "no limit" as the largest page multiple below 2**63


@dataclass(frozen=True)
class ChunkChoice:
    image: int
    text: int
    per_rank: int
    peak: float  # estimated bytes per rank
    usable: float  # the bytes it had to fit
    fits: bool
    keeps_graphs: bool  # every trained tower's last chunk keeps its graph (inf, batch.keep_last_graph)

    def describe(self) -> str:
        whole = "the whole per-rank batch fits: one chunk per tower"
        how = (
            (f"{whole}, no replay" if self.keeps_graphs else f"{whole}, each encoded twice: no graph kept")
            if (self.image, self.text) == (self.per_rank, self.per_rank)
            else "the largest chunks that fit"
        )
        return (
            f"auto chunks: image {self.image} / text {self.text} of {self.per_rank} per rank ({how}; "
            f"estimated peak {format_bytes(self.peak)} of {format_bytes(self.usable)} usable)"
        )


def run_setting(cfg: Config, world_size: int, device_type: str) -> Setting:
    """The run's own setting for the estimate, every ``auto`` chunk at the whole per-rank batch."""
    per_rank = cfg.batch.global_size // world_size
    image, text = (chunk if isinstance(chunk, int) else per_rank for chunk in cfg.batch.chunks)
    return Setting(
        batch=cfg.batch.global_size,
        gpus=world_size,
        image_chunk=image,
        text_chunk=text,
        offload=cfg.batch.offload,
        impl="inf" if cfg.loss.impl == "auto" else cfg.loss.impl,
        optimizer=cfg.optim.name,
        tile=cfg.loss.tile_size or default_tile(torch.device(device_type)),
        keep_last_graph=cfg.batch.keep_last_graph,
        kind=cfg.loss.kind,
        device=device_type,
        sharded=cfg.train.parallel == "fsdp",
        reshard_after_forward=cfg.fsdp.reshard_after_forward,
        sync_every_chunk=cfg.fsdp.sync_every_chunk,
        cpu_offload=cfg.fsdp.cpu_offload,
        **_fsdp_itemsizes(cfg),
        ema=cfg.train.ema_decay > 0,
    )


def _fsdp_itemsizes(cfg: Config) -> dict[str, int]:
    """Bytes of an all-gathered weight and of a gradient FSDP2 accumulates unsharded: its mixed
    precision policy's dtypes (a gradient without a reduce dtype stays in the gathered one), for
    the run's ``weight_dtype``."""
    weights = weight_dtype(cfg.train.precision)
    policy = mixed_precision(cfg.fsdp, cfg.train.precision, weights)
    gathered = policy.param_dtype or weights
    return {
        "gather_itemsize": gathered.itemsize,
        "accumulate_itemsize": (policy.reduce_dtype or gathered).itemsize,
    }


def device_budget(device: torch.device, local_ranks: int, held: int) -> float:
    """Bytes this rank may use: its GPU's free memory, or on the CPU its share of the node's
    available memory (and of its cgroups' room, if less), plus ``held``: what the estimate counts
    and the process holds already (the model, the EMA, a resumed optimizer's states). What else it
    holds is no room: on the CPU the interpreter's and torch's own memory, on either a distillation
    teacher's weights (which a budget of the GPU's allocated memory took for room)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free + held)
    available = psutil.virtual_memory().available
    room = cgroup_room()
    if room is not None:
        available = min(available, room)
    return available / local_ranks + held


def cgroup_room(root: Path = CGROUP, membership: Path = PROC_CGROUP) -> int | None:
    """Bytes this process's memory cgroups leave it: the least room (limit less usage) over its own
    cgroup and those above it, cgroup v2 (``memory.max``) or v1 (``memory.limit_in_bytes``); None
    without a limit. Its own cgroup, not the mount's root: a Slurm job's or a systemd unit's limit
    sits below the root."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        if line.count(":") < 2:  # not a hierarchy:controllers:path line
            continue
        _, controllers, path = line.split(":", 2)
        if not controllers:  # the v2 hierarchy (under unified/ where v1 holds the memory controller)
            base = root / "unified" if (root / "unified").is_dir() else root
            limit_file, usage_file = "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        level = base / path.strip("/")
        for folder in (level, *level.parents[: len(level.parents) - len(base.parents)]):
            limit = _read_int(folder / limit_file)  # v2 "max" reads as None
            if limit is not None and limit < NO_LIMIT:
                rooms.append(limit - (_read_int(folder / usage_file) or 0))
    return min(rooms) if rooms else None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def choose_chunks(model: nn.Module, cfg: Config, world_size: int, also_held: object = ()) -> ChunkChoice:
    """Measure the towers (without touching the RNG streams, leaving gradients behind or moving a
    batch norm's running statistics toward the probe's random images: rank 0 alone measures) and
    pick the chunks: each ``auto`` one as large as the budget allows, the whole batch first.
    ``also_held``: tensors besides the model's that the estimate counts and that exist already (the
    EMA's averages, a resumed optimizer's states), which are room for them, not for the chunks."""
    device = model.logit_scale.device
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with preserved_rng(device):
        profile = profile_built_model(model, cfg.model, cfg.train.precision, MEASURED_CHUNKS, [])
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    held = tensor_bytes((*model.parameters(), *model.buffers())) + tensor_bytes(also_held)
    usable = usable_bytes(device_budget(device, local_ranks, held), cfg.batch.memory_budget)
    setting = run_setting(cfg, world_size, device.type)
    choice = largest_fitting_chunks(profile, setting, cfg.batch.auto_towers, usable)
    if not choice.fits:
        raise UserError(
            f"batch.global_size={cfg.batch.global_size}: even 1-row auto chunks need an estimated "
            f"{format_bytes(choice.peak)} per rank, more than {format_bytes(choice.usable)} (the budget, "
            "batch.memory_budget or what the device has, less 10 %); use more ranks, "
            "batch.offload=true or a smaller batch (clip-train plan shows the terms)"
        )
    return choice


def largest_fitting_chunks(
    profile: ModelProfile, setting: Setting, auto: tuple[str, ...], usable: float
) -> ChunkChoice:
    """From ``setting``'s chunks, shrink the ``auto`` tower with the larger transient peak through
    the divisors of the per-rank batch until the estimated peak fits ``usable`` bytes, then grow
    each back as far as it still fits. ``fits`` is False when even 1-row chunks do not."""
    per_rank = setting.per_rank
    sizes = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    chunks = {"image": setting.chunk("image"), "text": setting.chunk("text")}

    def peak(**changed: int) -> float:
        trial = {**chunks, **changed}
        return breakdown(profile, replace(setting, image_chunk=trial["image"], text_chunk=trial["text"])).peak

    while peak() > usable and (shrinkable := [t for t in auto if chunks[t] > 1]):
        tower = max(shrinkable, key=lambda t: _transient(profile, t, chunks[t]))
        chunks[tower] = sizes[sizes.index(chunks[tower]) - 1]
    for tower in auto:
        larger = [size for size in sizes if size > chunks[tower] and peak(**{tower: size}) <= usable]
        chunks[tower] = max(larger, default=chunks[tower])
    estimate = peak()
    keeps_graphs = setting.impl == "inf" and setting.keep_last_graph  # every trained tower's (graph_keepers)
    return ChunkChoice(
        chunks["image"], chunks["text"], per_rank, estimate, usable, estimate <= usable, keeps_graphs
    )


def _transient(profile: ModelProfile, tower: str, chunk: int) -> float:
    measured = profile.image if tower == "image" else profile.text
    return max(measured.encode.at(chunk), measured.replay.at(chunk))
