"""What the plan measures: the planning model (the config's architecture, random weights or on the
CPU fake tensors, no hub), each tower's chunk memory (the peak of the storages a pass creates) at
two chunk sizes, and (``--check-cpu``) the resident memory of real Gradient Cache steps to hold
the estimate against."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoConfig

from clip_train.config import ModelConfig, OptimConfig
from clip_train.ema import WeightsEMA
from clip_train.engine import GradCache, TrainableHead
from clip_train.errors import UserError
from clip_train.memory import format_bytes, peak_bytes, tensor_bytes, used_bytes
from clip_train.model import CLIP
from clip_train.model.freezing import tower_blocks
from clip_train.model.hub import load_hf
from clip_train.model.image import build_image_tower
from clip_train.model.text import build_text_tower
from clip_train.optim import build_optimizer
from clip_train.plan.architecture import find_text_architecture
from clip_train.plan.estimate import (
    Envelope,
    Line,
    ModelProfile,
    Setting,
    TowerProfile,
    adafactor_state_numel,
)
from clip_train.plan.peak import NewStoragePeak
from clip_train.plan.progress import Step, quiet
from clip_train.precision import autocast

# glibc's mallopt parameter numbers, and the values each measurement pins (whatever GLIBC_TUNABLES says)
_MALLOPT = {-1: 128 * 1024, -2: 128 * 1024, -3: 64 * 1024}  # trim threshold, top pad, mmap threshold


def build_planning_model(model_cfg: ModelConfig) -> tuple[nn.Module, list[str]]:
    """The config's architecture, random init, offline and without a tokenizer: memory depends on
    the shapes only, not on the weights."""
    notes = []
    text_cfg = model_cfg.text
    if not text_cfg.hf_config:
        found = find_text_architecture(text_cfg)
        text_cfg = dataclasses.replace(text_cfg, hf_config=_config_keys(found))
        source = found if isinstance(found, Path) else "plan's table of known models"
        notes.append(f"text tower {text_cfg.hf!r}: random weights, architecture from {source}")
    vocab = None if "vocab_size" in text_cfg.hf_config else 49408  # open_clip's BPE, as the tiny config
    text = build_text_tower(text_cfg, model_cfg.embed_dim, vocab_size=vocab)
    visual = build_image_tower(dataclasses.replace(model_cfg.image, pretrained=""), model_cfg.embed_dim)
    return CLIP(visual, text, None, model_cfg.init_logit_scale, model_cfg.init_logit_bias), notes


def _config_keys(found: dict[str, Any] | Path) -> dict[str, Any]:
    """``model.text.hf_config`` keys from a config.json on disk (transformers reads it), or as found."""
    if isinstance(found, dict):
        return found
    config = load_hf(AutoConfig, str(found.parent), "model.text.hf")
    return {"model_type": config.model_type, **config.to_diff_dict()}


def _random_inputs(
    model: nn.Module, tower: str, rows: int, context_length: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, ...]:
    """A batch as the data pipeline delivers it: uint8 NCHW pixels, or int64 ids and mask."""
    if tower == "image":
        size = model.image_size
        return (torch.randint(0, 256, (rows, 3, size, size), dtype=torch.uint8, device=device),)
    vocab = model.text.encoder.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (rows, context_length), device=device)
    return ids, torch.ones_like(ids)


def _measured_precision(precision: str, device_type: str) -> str:
    """CPU fp16 matmuls are emulated (~10x slower than bf16); bf16 has the same bytes per element."""
    return "bf16" if precision == "fp16" and device_type == "cpu" else precision


def measure_chunk(
    model: nn.Module, tower_name: str, rows: int, context_length: int, precision: str
) -> dict[str, float]:
    """Peaks of one chunk's stage-1 encode and stage-3 replay (forward, then forward + backward)."""
    tower = getattr(model, "visual" if tower_name == "image" else "text")
    device = model.logit_scale.device
    measured = _measured_precision(precision, device.type)

    inputs = _random_inputs(model, tower_name, rows, context_length, device)
    out: dict[str, float] = {}
    # Chunks are cloned inside the tracker so it counts them; they are then taken off again (they
    # are M_data or the trunk cache, not activations).
    with NewStoragePeak() as peak, torch.no_grad(), autocast(device, measured):
        chunk = tuple(t.clone() for t in inputs)
        tower(*chunk)
    out["encode"] = peak.bytes - tensor_bytes(chunk)
    with torch.no_grad(), autocast(device, measured):
        hidden = tower.encode_frozen(*inputs)
    out["trunk"] = tensor_bytes(hidden) / rows if tower.has_frozen_trunk else 0.0
    if tower.is_frozen:
        return out
    head = TrainableHead(tower)
    for p in tower.trainable_parameters():  # steady state: chunks accumulate into existing gradients
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    on_cuda = device.type == "cuda"
    if on_cuda:  # the caching allocator's own count, as a cross-check of the tracker's
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with NewStoragePeak() as peak:
        chunk = tuple(h.clone() for h in hidden)
        with autocast(device, measured):
            features = head(*chunk)
        out["forward"] = peak.bytes - tensor_bytes(chunk)
        features.backward(torch.randn_like(features))
        del features
    out["replay"] = peak.bytes - tensor_bytes(chunk)
    if on_cuda:
        out["allocator_replay"] = torch.cuda.max_memory_allocated(device) - before - tensor_bytes(chunk)
    return out


def profile_model(
    model_cfg: ModelConfig,
    precision: str = "fp32",
    chunks: tuple[int, int] = (2, 4),
    device: str = "cpu",
    step: Step = quiet,
) -> ModelProfile:
    """Build the model and measure each tower at two chunk sizes; the rest is counted from shapes."""
    if not 0 < chunks[0] < chunks[1]:
        raise UserError(f"--measure-chunks {chunks[0]} {chunks[1]}: need two sizes 0 < a < b")
    with _planning_model(model_cfg, precision, device, step) as (model, notes):
        return profile_built_model(model, model_cfg, precision, chunks, notes, step)


@contextlib.contextmanager
def _planning_model(
    model_cfg: ModelConfig, precision: str, device: str, step: Step
) -> Iterator[tuple[nn.Module, list[str]]]:
    """The planning model on ``device``, in the run's ``weight_dtype``. On the CPU its tensors are
    fake (shape, dtype and device, no data) while the context is open: a pass allocates exactly
    what a real one would, without the arithmetic, seconds where ViT-L's real passes take minutes.
    CUDA runs real passes quickly, and its allocator cross-checks the tracker's count."""
    towers = f"{model_cfg.image.timm} and {_text_label(model_cfg)}"
    if device == "cpu":
        with step(f"building {towers} as fake tensors (shapes only)"), torch.device("meta"):
            model, notes = build_planning_model(model_cfg)
            model = model.to(weight_dtype(precision))
        notes.append("cpu passes on fake tensors: the allocations of real ones, without the arithmetic")
        with FakeTensorMode(allow_non_fake_inputs=True):  # to_empty reads the meta tensors' shapes
            yield model.to_empty(device=device).train(), notes
    else:
        with step(f"building {towers} with random weights on {device}"):
            torch.manual_seed(0)
            model, notes = build_planning_model(model_cfg)
        yield model.to(device, weight_dtype(precision)).train(), notes


def weight_dtype(precision: str) -> torch.dtype:
    """The dtype a run keeps its weights in: fp64 runs train a double model (the trainer converts
    it), every other precision fp32 weights."""
    return torch.float64 if precision == "fp64" else torch.float32


def _text_label(model_cfg: ModelConfig) -> str:
    return (
        model_cfg.text.hf
        or f"a {model_cfg.text.hf_config.get('model_type', 'bert')} from model.text.hf_config"
    )


def profile_built_model(
    model: nn.Module,
    model_cfg: ModelConfig,
    precision: str,
    chunks: tuple[int, int],
    notes: list[str],
    step: Step = quiet,
) -> ModelProfile:
    """Measure a model already on its device (the planning model, or a run's own for auto chunks)."""
    device = model.logit_scale.device
    if _measured_precision(precision, device.type) != precision:
        notes.append(f"{precision} autocast measured as bf16 on {device.type} (same bytes per element)")
    image, text = (
        _profile_tower(model, model_cfg, name, chunks, precision, notes, step) for name in ("image", "text")
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_bytes = tensor_bytes(trainable)  # in the parameters' dtype, as their gradients and states
    itemsize = model.logit_scale.element_size()
    return ModelProfile(
        image=image,
        text=text,
        embed_dim=model_cfg.embed_dim,
        weight_bytes=tensor_bytes((*model.parameters(), *model.buffers())),
        trainable_bytes=trainable_bytes,
        adamw_bytes=2 * trainable_bytes,
        adafactor_bytes=sum(adafactor_state_numel(tuple(p.shape)) * itemsize for p in trainable),
        itemsize=itemsize,
        device=_describe_device(device),
        precision=precision,
        measured_chunks=chunks,
        notes=tuple(notes),
    )


def _profile_tower(
    model: nn.Module,
    model_cfg: ModelConfig,
    name: str,
    chunks: tuple[int, int],
    precision: str,
    notes: list[str],
    step: Step,
) -> TowerProfile:
    """Each peak of ``measure_chunk`` as a line through the two chunk sizes."""
    length = model_cfg.text.context_length
    label = model_cfg.image.timm if name == "image" else _text_label(model_cfg)

    def measure(rows: int) -> dict[str, float]:
        with step(f"measuring the {name} tower ({label}) at chunk {rows}: encode, then replay"):
            return measure_chunk(model, name, rows, length, precision)

    small, large = (measure(rows) for rows in chunks)

    def line(key: str) -> Line:
        return Line.through(chunks, (small[key], large[key]))

    tower = getattr(model, "visual" if name == "image" else "text")
    replays = not tower.is_frozen
    if replays and "allocator_replay" in large:
        notes.append(
            f"{name} replay at chunk {chunks[1]}: CUDA max_memory_allocated "
            f"{format_bytes(large['allocator_replay'])} vs tracked {format_bytes(large['replay'])}"
        )
    return TowerProfile(
        name=name,
        encode=Envelope((line("encode"),)),
        graph=Envelope((line("forward"),) if replays else ()),
        replay=Envelope((line("forward"), line("replay")) if replays else ()),
        trunk_per_sample=round(large["trunk"]) if replays else 0,
        input_per_sample=tensor_bytes(_random_inputs(model, name, 1, length)),
        replays=replays,
        unit_numels=_unit_numels(tower),
        trainable_numel=sum(p.numel() for p in tower.parameters() if p.requires_grad),
    )


def _unit_numels(tower: nn.Module) -> tuple[int, ...]:
    """The parameter counts of the tower's FSDP2 units, as ``shard_towers`` wraps them: the root's
    own (every parameter no block holds), then each block's."""
    blocks = [sum(p.numel() for p in block.parameters()) for block in tower_blocks(tower)]
    return (sum(p.numel() for p in tower.parameters()) - sum(blocks), *blocks)


def _describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def measure_cpu_step(model_cfg: ModelConfig, setting: Setting, precision: str, steps: int = 2) -> int:
    """Peak RSS growth (bytes) of ``steps`` Gradient Cache + optimizer (+ EMA) steps over the model's
    baseline.

    Run it in a fresh process: the resident peak is a process-wide high-water mark. The baseline follows a
    graph-less 1-sample forward, so lazily loaded kernels are not counted. glibc's mmap threshold is
    pinned at 64 KiB: by default it rises after each large free, and freed tensors then stay in the
    heap, counted by RSS (measured: ~1.6x the live peak). Its trim threshold and top pad are pinned
    at their defaults, which a GLIBC_TUNABLES may have raised (``make test``'s: 1.37x).
    """
    libc = ctypes.CDLL(None)
    for parameter, value in _MALLOPT.items():
        libc.mallopt(parameter, value)
    torch.manual_seed(0)
    model, _ = build_planning_model(model_cfg)
    model = model.to(weight_dtype(precision)).train()
    length = model_cfg.text.context_length
    with torch.no_grad():
        model(*_random_inputs(model, "image", 1, length), *_random_inputs(model, "text", 1, length))
    opt = build_optimizer(OptimConfig(name=setting.optimizer), model)
    engine = GradCache(
        model,
        image_chunk=setting.image_chunk,
        text_chunk=setting.text_chunk,
        precision=precision,
        offload=setting.offload,
        loss_impl=setting.impl,
        tile_size=setting.tile,
        keep_last_graph=setting.keep_last_graph,
    )
    cpu = torch.device("cpu")
    baseline = used_bytes(cpu)
    ema = WeightsEMA(model, decay=0.999) if setting.ema else None  # its averages count, as planned
    images = _random_inputs(model, "image", setting.batch, length)
    text = _random_inputs(model, "text", setting.batch, length)
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        engine.step(*images, *text)
        opt.step()
        if ema is not None:
            ema.update(step, torch.ones((), dtype=torch.bool))
    return peak_bytes(cpu) - baseline
