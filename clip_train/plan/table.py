"""The plan's table: one config's per-GPU memory terms and largest batch under each loss implementation,
with and without offload, and its text. ``clip-train plan`` (``commands/plan.py``) imports it only
once its inputs are checked, as it loads torch, transformers and timm."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from clip_train.config import RESOLVED_LOSS_IMPLS, Config
from clip_train.distributed import resolve_device
from clip_train.loss.tiles_torch import default_tile
from clip_train.memory import format_bytes
from clip_train.plan.auto_chunks import largest_fitting_chunks, run_setting
from clip_train.plan.estimate import (
    GIB,
    ModelProfile,
    Setting,
    breakdown,
    gpu_available,
    max_batch,
    usable_bytes,
)
from clip_train.plan.profile import profile_model
from clip_train.plan.progress import announce


def make_plan(
    cfg: Config, gpus: int, gpu_mem: float, device: str, chunks: tuple[int, int], title: str
) -> tuple[str, dict[str, Any]]:
    """The plan for ``cfg`` (its batch and world size already checked) on ``gpus`` GPUs of ``gpu_mem``
    GiB, activations measured on ``device`` at ``chunks``: its text under ``title``, and its record."""
    profile = profile_model(cfg.model, cfg.train.precision, chunks, resolve_device(device).type, announce)
    capacity = usable_bytes(gpu_available(gpu_mem), cfg.batch.memory_budget)
    rows = [_row(profile, setting, capacity, cfg.batch.auto_towers) for setting in _settings(cfg, gpus)]
    record = {
        "gpu_mem_gib": gpu_mem,
        "usable_bytes": capacity,
        "profile": dataclasses.asdict(profile),
        "rows": rows,
    }
    return _report(title, gpus, gpu_mem, cfg, profile, rows, capacity), record


def _settings(cfg: Config, gpus: int) -> list[Setting]:
    """The run's setting on GPUs (``auto_chunks.run_setting``) under each loss and offload choice."""
    run = run_setting(cfg, gpus, "cuda")
    return [
        dataclasses.replace(run, impl=impl, offload=offload)
        for impl in RESOLVED_LOSS_IMPLS
        if not (impl == "local" and cfg.loss.kind == "sigmoid")  # a softmax-only implementation
        for offload in (False, True)
    ]


def cpu_check_prediction(cfg: Config, chunks: tuple[int, int]) -> tuple[Setting, float]:
    """``--check-cpu``'s setting (inf loss, no offload, the CPU's tile) and its predicted peak without
    the weights (they precede the baseline of the measured RSS growth). One process has nothing to
    shard across (``shard_towers`` keeps its towers whole), so the setting is unsharded."""
    inf = next(s for s in _settings(cfg, 1) if s.impl == "inf" and not s.offload)
    tile = cfg.loss.tile_size or default_tile(torch.device("cpu"))
    setting = dataclasses.replace(inf, tile=tile, device="cpu", sharded=False)
    part = breakdown(profile_model(cfg.model, cfg.train.precision, chunks, "cpu", announce), setting)
    return setting, part.peak - part.weights


def cpu_check_report(cfg: Config, check: dict[str, float]) -> str:
    """``--check-cpu``'s lines: the prediction of ``cpu_check_prediction`` against the measurement."""
    return (
        f"\ncheck-cpu: inf loss, no offload, batch {cfg.batch.global_size}, 2 Gradient Cache + "
        f"{cfg.optim.name} steps in a fresh process\n  predicted {format_bytes(check['predicted'])} (peak "
        f"without weights, which precede the baseline)\n  measured  {format_bytes(check['measured'])} "
        f"(resident peak growth)\n  ratio measured/predicted {check['ratio']:.3f}"
    )


def _row(profile: ModelProfile, setting: Setting, capacity: float, auto: tuple[str, ...]) -> dict[str, Any]:
    """One setting's terms; ``auto`` chunks are the ones a run would choose with this capacity."""
    if auto:
        choice = largest_fitting_chunks(profile, setting, auto, capacity)
        setting = dataclasses.replace(setting, image_chunk=choice.image, text_chunk=choice.text)
    part = breakdown(profile, setting)
    return {
        **dataclasses.asdict(setting),
        **dataclasses.asdict(part),
        "static": part.static,
        "peak": part.peak,
        "fits": part.peak <= capacity,
        "max_batch": max_batch(profile, setting, capacity),
    }


def _report(
    title: str,
    gpus: int,
    gpu_mem: float,
    cfg: Config,
    profile: ModelProfile,
    rows: list[dict],
    capacity: float,
) -> str:
    first = rows[0]
    chunks = " / ".join(
        f"{tower} {'auto' if chunk == 'auto' else chunk or 'all'}"
        for tower, chunk in zip(("image", "text"), cfg.batch.chunks, strict=True)
    )
    lines = [
        title,
        f"  {gpus} GPU(s) x {gpu_mem:g} GiB; usable {format_bytes(capacity)} per GPU "
        + _usable_source(cfg, gpu_mem, capacity),
        f"  precision {profile.precision}, optimizer {cfg.optim.name}, embed_dim {profile.embed_dim}, "
        f"chunks {chunks}, inf tile {first['tile']}",
        f"  activations measured on {profile.device} as new storages' peak (fwd+bwd at chunks "
        f"{profile.measured_chunks[0]} and {profile.measured_chunks[1]}), scaled linearly in the chunk",
    ]
    lines += [f"  note: {note}" for note in profile.notes]
    for tower in profile.towers:
        replay = (
            f"replay {format_bytes(tower.replay.per_sample)}/sample" if tower.replays else "frozen: no replay"
        )
        trunk = (
            f", cached trunk {format_bytes(tower.trunk_per_sample)}/sample" if tower.trunk_per_sample else ""
        )
        lines.append(
            f"  {tower.name:5s}: input {format_bytes(tower.input_per_sample)}/sample, encode "
            f"{format_bytes(tower.encode.per_sample)}/sample, {replay}{trunk}"
        )
    lines += _static_lines(first)
    lines.append(
        f"\nglobal batch {first['batch']:,} ({first['batch'] // gpus:,} per GPU); "
        "peak = static + data + cache + max(loss + kept graph, backbone, optim step)"
    )
    header = (
        "impl",
        "offload",
        "chunks",
        "data",
        "cache",
        "loss",
        "kept",
        "backbone",
        "optim",
        "static",
        "peak",
    )
    money = ("data", "cache", "loss", "kept_graph", "backbone", "optimizer_step", "static", "peak")
    per_gpu = first["batch"] // gpus
    table = [(*header, "fits", "max batch")] + [
        (
            row["impl"],
            "yes" if row["offload"] else "no",
            f"{row['image_chunk'] or per_gpu}/{row['text_chunk'] or per_gpu}",
            *(format_bytes(row[key]) for key in money),
            "yes" if row["fits"] else "NO",
            f"{row['max_batch']:,}",
        )
        for row in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines += [
        "  ".join(
            cell.rjust(w) if i > 2 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in table
    ]
    return "\n".join(lines)


def _usable_source(cfg: Config, gpu_mem: float, capacity: float) -> str:
    """Where the usable bytes come from: ``batch.memory_budget`` as a run takes it, or the GPU."""
    if cfg.batch.memory_budget:
        return f"(batch.memory_budget={cfg.batch.memory_budget:g} GiB less the run's 10 % reserve)"
    return f"after a {format_bytes(gpu_mem * GIB - capacity)} reserve (CUDA context, allocator fragmentation)"


def _static_lines(row: dict[str, Any]) -> list[str]:
    """The static terms; sharded, also where the shards live and what FSDP2 gathers or accumulates
    beside them (``estimate.gathered_weights`` and ``accumulated_grads``)."""
    size = {
        key: format_bytes(row[key]) for key in ("weights", "gathered", "grads", "accumulated", "optimizer")
    }
    if not row["sharded"]:
        return [
            f"  static per GPU: weights {size['weights']}, grads {size['grads']} (DDP's buckets hold them), "
            f"optimizer {size['optimizer']}"
        ]
    where = "in host memory (fsdp.cpu_offload)" if row["cpu_offload"] else f"1/{row['gpus']} per GPU"
    gathered = (
        "a tower's root unit + 2 blocks: the one in use, the one prefetched"
        if row["reshard_after_forward"]
        else "both whole towers: fsdp.reshard_after_forward=false"
    )
    accumulated = (
        "none: fsdp.sync_every_chunk"
        if row["sync_every_chunk"]
        else "a tower's, from its first replay chunk until its last reduce-scatters"
    )
    return [
        f"  sharded (fsdp): weights, grads and optimizer states {where}; all-gathered weights "
        f"{size['gathered']} ({gathered}; {row['gather_itemsize']} bytes each); unsharded grads "
        f"{size['accumulated']} ({accumulated}; {row['accumulate_itemsize']} bytes each)",
        f"  static per GPU: weights {size['weights']} + gathered {size['gathered']}, grads {size['grads']} "
        f"+ unsharded {size['accumulated']}, optimizer {size['optimizer']}",
    ]
