"""What a run can set, and which combinations start: the dataclasses are the single reference
(docs/config.md is generated from their field comments); ``Config.validate`` checks across fields at
start-up, once the world size is known."""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from clip_train.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem, with a message that names the key and says what to change."""


# The choices a run makes, declared once: the loss, the engine, plan and the benchmarks derive theirs.
Precision = Literal["fp32", "bf16", "fp16", "fp64"]
LossKind = Literal["softmax", "sigmoid"]
LossImpl = Literal["vanilla", "local", "inf", "auto"]
PRECISIONS, LOSS_KINDS, LOSS_IMPLS = (typing.get_args(choice) for choice in (Precision, LossKind, LossImpl))
RESOLVED_LOSS_IMPLS = tuple(impl for impl in LOSS_IMPLS if impl != "auto")  # what auto resolves among
Parallel = Literal["ddp", "fsdp"]
Schedule = Literal["cosine", "const", "const-cooldown"]
FsdpDtype = Literal["auto", "fp32", "bf16"]
CompileMode = Literal["default", "reduce-overhead"]
MAX_LOGIT_SCALE = math.log(100.0)  # CLIP's clamp: logits at most 100 x the cosine similarity
MAX_TIMEOUT_S = 10**7  # 116 days: past it torch's timeouts overflow (a hang at 9e9 s, an error at 1e10)
SOURCE_SEPARATOR = "::"  # joins the sources of data.train (webdataset's, which ``expand_urls`` splits on too)
JSON_PREFIX = "json:"  # a data.caption_key naming a field of the sample's json


@dataclass
class TowerConfig:
    """What both towers share: LiT locking and activation checkpointing."""

    lock: bool = False  # LiT: freeze the tower except its last unlocked_layers blocks and the head
    unlocked_layers: int = 0  # with lock: how many final blocks (layers) keep training
    lock_head: bool = False  # with lock: freeze the projection too (all frozen if unlocked_layers=0)
    freeze_norms: bool = False  # with lock: unlocked blocks keep their norm layers frozen (and BN stats)
    grad_checkpointing: bool = False  # recompute activations in backward (less memory, more time)


@dataclass
class ImageTowerConfig(TowerConfig):
    """A timm image tower; ``timm_kwargs`` sizes small models (img_size, depth, embed_dim, …)."""

    timm: str = "vit_base_patch16_224"  # timm model name (any timm architecture)
    timm_kwargs: dict[str, Any] = field(default_factory=dict)  # timm.create_model keyword arguments
    pretrained: str = ""  # "" (random init), a local file or dir, or "hub" for timm's own lookup


@dataclass
class TextTowerConfig(TowerConfig):
    """A transformers encoder: pretrained from ``hf``, or random-init from ``hf_config`` (one of them)."""

    hf: str = ""  # pretrained encoder: hub name or local directory (model and tokenizer); or hf_config
    hf_config: dict[str, Any] = field(default_factory=dict)  # random init from these config keys; or hf
    tokenizer: str = ""  # open_clip, a hub name or a local dir; "" means the same as `hf`
    pooling: Literal["cls", "mean", "eot"] = "cls"  # first token, masked mean, or end token (clip_text_model)
    context_length: int = 64  # tokens per caption (padded or truncated)


@dataclass
class ModelConfig:
    embed_dim: int = 512  # width of the shared image-text embedding
    init_logit_scale: float | None = None  # None: ln(1/0.07) for softmax (CLIP), ln 10 for sigmoid (SigLIP)
    init_logit_bias: float | None = None  # sigmoid only, learnable; None: -10 (SigLIP) for sigmoid
    image: ImageTowerConfig = field(default_factory=ImageTowerConfig)
    text: TextTowerConfig = field(default_factory=TextTowerConfig)
    init_from: str = ""  # fine-tune from: a checkpoint, run dir or open_clip:SPEC (docs/fine-tune-clip.md)


@dataclass
class DataConfig:
    train: str = ""  # brace-expanded shard URLs, a directory or a .csv/.tsv table; "::" joins sources
    train_weights: list[float] = field(default_factory=list)  # one per "::" source: a weighted mixture
    val: str = ""  # validation shards or a .csv/.tsv table (retrieval; zero-shot when shards carry labels)
    resampled: bool = True  # draw shards with replacement (multi-node); false: shuffle and split
    num_samples: int = 0  # samples per epoch across all ranks; 0 = sized to one pass over the shards
    workers: int = 2  # DataLoader worker processes per rank (decode, augment, tokenize)
    shuffle_buffer: int = 1000  # samples in each worker's shuffle buffer
    max_skip_fraction: float = 0.1  # abort above this share of bad samples, from max(1000, batch) on
    rrc_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])  # RandomResizedCrop area range
    rrc_ratio: list[float] = field(default_factory=lambda: [0.75, 4.0 / 3.0])  # its aspect-ratio range
    color_jitter: list[float] = field(default_factory=list)  # brightness, contrast, saturation, hue; []: off
    color_jitter_prob: float = 1.0  # with color_jitter: the share of images jittered
    grayscale_prob: float = 0.0  # the share of images made gray (after any jitter)
    csv_separator: str = ""  # tables (train and val): one character or \t; "" = tab for .tsv, else comma
    csv_image_key: str = ""  # tables: image-path column (relative to its folder); "" = filepath or path
    csv_caption_key: str = ""  # tables: caption column; "" = title (OpenCLIP's) or caption
    csv_shard_rows: int = 1000  # tables: rows per piece, the unit shuffled and split like a shard
    caption_key: str | list[str] = "txt"  # shards: member (txt, caption) or json:FIELD; list: one per sample

    @property
    def caption_keys(self) -> tuple[str, ...]:
        """``caption_key`` as a tuple: member extensions lower-cased (as shards' members are read),
        ``json:FIELD`` fields as written."""
        keys = [self.caption_key] if isinstance(self.caption_key, str) else self.caption_key
        return tuple(
            JSON_PREFIX + key[len(JSON_PREFIX) :] if key.lower().startswith(JSON_PREFIX) else key.lower()
            for key in (key.strip() for key in keys)
        )


@dataclass
class LossConfig:
    kind: LossKind = "softmax"  # CLIP's softmax or SigLIP's sigmoid loss
    impl: LossImpl = "auto"  # auto = inf (tiles and a ring of ranks)
    tile_size: int = 0  # 0 picks a size for the device


@dataclass
class DistillConfig:
    teacher: str = ""  # frozen CLIP to match (--distill-model): checkpoint, run dir or open_clip:ARCH/TAG
    teacher_model: str = ""  # an open_clip: teacher's architecture, a model YAML (configs/model/*.yaml)
    weight: float = 1.0  # loss = contrastive + weight x distillation (OpenCLIP's: 1)


@dataclass
class BatchConfig:
    global_size: int = 256  # contrastive batch across all ranks
    image_chunk: int | Literal["auto"] = "auto"  # per-rank sub-batch; 0 = all; auto: fitted to memory_budget
    text_chunk: int | Literal["auto"] = "auto"  # the same for the text tower (text chunks can be much larger)
    memory_budget: float = 0.0  # GiB per rank that auto chunks plan for; 0 = what the device has free
    offload: bool = False  # keep the raw batch in pinned host memory, one chunk on device
    keep_last_graph: bool = True  # inf: each tower's last chunk keeps its graph, no replay; off for max batch

    @property
    def chunks(self) -> tuple[int | str, int | str]:
        return self.image_chunk, self.text_chunk

    @property
    def auto_towers(self) -> tuple[str, ...]:
        """The towers (``image``, ``text``) whose chunk is ``auto``."""
        towers = zip(("image", "text"), self.chunks, strict=True)
        return tuple(tower for tower, chunk in towers if chunk == "auto")


@dataclass
class OptimConfig:
    name: Literal["adamw", "adafactor"] = "adamw"  # adafactor is torch.optim.Adafactor (DDP only)
    lr: float = 5e-4  # peak learning rate, after warmup
    image_lr: float | None = None  # the image tower's peak rate; None: optim.lr (docs/fine-tune-optim.md)
    text_lr: float | None = None  # the text tower's peak rate; None: optim.lr
    layer_decay: float = 1.0  # block k of L at its tower's rate x decay^(L-k), embeddings decay^L; 1: off
    min_lr: float = 0.0  # where the cosine schedule ends
    weight_decay: float = 0.2  # on weight matrices only (not norms, biases, embeddings, scale)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # AdamW only
    eps: float = 1e-6  # AdamW only
    fused: bool = True  # AdamW: torch's fused kernel where the device has one (CUDA, CPU); false: foreach
    warmup_steps: int = 0  # linear warmup, then the schedule
    schedule: Schedule = "cosine"  # after warmup, as OpenCLIP's --lr-scheduler
    cooldown_steps: int = 0  # const-cooldown: the last steps, decaying from lr to min_lr
    cooldown_power: float = 1.0  # const-cooldown: 1 = linear (OpenCLIP's --lr-cooldown-power)
    grad_clip: float = 1.0  # global-norm clip; 0 disables


@dataclass
class TrainConfig:
    max_steps: int = 1000  # optimizer steps in the whole run
    seed: int = 0  # initial weights, data order, augmentation and dropout streams
    precision: Precision = "fp32"  # bf16/fp16 autocast; fp16 adds GradScaler
    out_dir: str = "runs/default"  # run directory: config, metrics, checkpoints, wandb
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA (NCCL) if present, else CPU (gloo)
    dist_timeout_s: int = 600  # process-group init and collective timeout
    io_timeout_s: int = 3600  # wait on one rank's I/O: rank 0's pull/verify/save/upload, the slowest's shards
    max_bad_steps: int = 5  # consecutive skipped (non-finite) steps that stop the run, at a log or save step
    compile: bool = False  # torch.compile each tower block, FSDP too (random ops as eager: exact replay)
    compile_mode: CompileMode = "default"  # reduce-overhead: + CUDA graphs; one chunk, DDP, no lock
    parallel: Parallel = "ddp"  # ddp: a full replica per rank; fsdp: FSDP2-sharded towers (see fsdp.*)
    ema_decay: float = 0.0  # EMA of the trainable weights, ema = d*ema + (1-d)*w after each step; 0: off
    ema_warmup_power: float = 0.0  # > 0: the decay at step t is min(ema_decay, 1 - (1+t)^-power) (timm's)

    @property
    def cuda_graphs(self) -> bool:
        """Whether the compiled blocks replay as CUDA graphs (``compile_mode=reduce-overhead``)."""
        return self.compile_mode == "reduce-overhead"


@dataclass
class FsdpConfig:
    reshard_after_forward: bool = True  # true: ZeRO-3 (free each block after use); false: ZeRO-2
    sync_every_chunk: bool = False  # reduce-scatter every replay chunk: less gradient memory, more traffic
    param_dtype: FsdpDtype = "auto"  # all-gathered weights; auto: bf16 under train.precision=bf16, else own
    reduce_dtype: FsdpDtype = "auto"  # reduce-scattered gradients; auto: the weights' own dtype
    cpu_offload: bool = False  # sharded parameters, gradients and optimizer states in host memory


@dataclass
class CheckpointConfig:
    every_steps: int = 1000  # also at the end of the run; 0: no checkpoints at all (benchmarks, smoke tests)
    keep: int = 3  # newest complete checkpoints kept
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this (milestones); 0: none
    resume: str = ""  # "" (fresh run), "auto" (newest checkpoint that verifies) or a checkpoint path
    check_free_space: bool = True  # refuse a save up front if the disk has less room than its tensors
    remote: str = ""  # fsspec URL (s3://, gs://, a mount) mirroring the kept checkpoints; resume=auto pulls


@dataclass
class WandbConfig:
    project: str = "clip_train"  # wandb project
    name: str = ""  # wandb run name; "" = the run directory's name
    tags: list[str] = field(default_factory=list)  # wandb tags
    mode: Literal["offline", "online", "disabled"] = "offline"  # online only when asked


@dataclass
class LogConfig:
    every_steps: int = 10  # metrics.jsonl and wandb cadence; a plain progress line when not on a terminal
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"  # status lines on stderr
    peak_tflops: float = 0.0  # a device's dense peak TFLOP/s for mfu; 0: NVIDIA's table (A100-B200; no CPU)
    all_ranks: bool = False  # every rank's status lines, tagged [rank N]; false: rank 0 (others warn only)
    profile_steps: int = 0  # trace this many steps with torch.profiler into profile/ of the run; 0: none
    profile_after: int = 10  # steps run before the trace starts (compiling, warming up)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class EvalConfig:
    every_steps: int = 0  # 0 = only at the end of training
    zeroshot: str = ""  # class names + templates: a JSON file, or imagenet / imagenet-simple
    zeroshot_data: str = ""  # labelled shards or an ImageFolder directory; "" means data.val
    zeroshot_sets: dict[str, str] = field(default_factory=dict)  # more sets by name: zeroshot/NAME/top1, ...
    retrieval: bool = True  # image<->text recall@k on data.val
    batch_size: int = 256  # eval batch per rank
    use_ema: bool = False  # evaluate the EMA weights (train.ema_decay > 0, or a checkpoint's ema.safetensors)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self, world_size: int | None = None) -> Config:
        """Cross-field checks; ``world_size`` defaults to ``$WORLD_SIZE`` (1 without a launcher)."""
        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        _check_finite(self)
        _check_batch(self.batch, world)
        for name in ("image", "text"):
            check_lock(getattr(self.model, name), f"model.{name}")
        for key in (
            "model.embed_dim",
            "model.text.context_length",
            "train.max_steps",
            "train.dist_timeout_s",
            "train.io_timeout_s",
            "train.max_bad_steps",
            "checkpoint.keep",
            "log.every_steps",
            "optim.lr",
            "optim.eps",  # 0: a parameter whose gradient stays 0 (an unseen token's row) turns NaN
            "data.csv_shard_rows",
        ):
            if (value := operator.attrgetter(key)(self)) <= 0:
                raise ConfigError(f"{key}={value} must be > 0")
        for key in (
            "optim.warmup_steps",
            "optim.weight_decay",
            "optim.grad_clip",
            "data.num_samples",
            "data.workers",
            "data.shuffle_buffer",
            "eval.every_steps",
            "checkpoint.every_steps",
            "log.profile_steps",
            "log.profile_after",
        ):
            if (value := operator.attrgetter(key)(self)) < 0:
                raise ConfigError(f"{key}={value} must be >= 0")
        for key in ("train.dist_timeout_s", "train.io_timeout_s"):
            if (value := operator.attrgetter(key)(self)) > MAX_TIMEOUT_S:
                raise ConfigError(f"{key}={value} must be at most {MAX_TIMEOUT_S} (116 days)")
        scale = self.model.init_logit_scale
        if scale is not None and not 0.0 <= scale <= MAX_LOGIT_SCALE:  # the update clamps it there
            raise ConfigError(
                f"model.init_logit_scale={scale} must lie in [0, ln 100 = {MAX_LOGIT_SCALE:.3f}]: it is the "
                "log of the logits' scale (CLIP's ln(1/0.07) = 2.659)"
            )
        profiled = self.log.profile_after + self.log.profile_steps
        if self.log.profile_steps and profiled > self.train.max_steps:
            raise ConfigError(
                f"log.profile_after={self.log.profile_after} + log.profile_steps={self.log.profile_steps} "
                f"pass train.max_steps={self.train.max_steps}: the trace would never be written"
            )
        if self.checkpoint.remote and not self.checkpoint.every_steps:
            raise ConfigError(
                f"checkpoint.remote={self.checkpoint.remote} mirrors checkpoints, and "
                "checkpoint.every_steps=0 saves none"
            )
        if self.eval.every_steps and not evaluates_anything(self.eval, self.data):
            raise ConfigError(
                f"eval.every_steps={self.eval.every_steps} has nothing to evaluate: set eval.zeroshot "
                "and/or data.val (with eval.retrieval)"
            )
        if not 0 <= self.train.seed < 2**32:  # numpy's range; a rank's streams add to it
            raise ConfigError(f"train.seed={self.train.seed} must lie in [0, 2**32)")
        if not self.train.out_dir.strip():
            raise ConfigError("train.out_dir is empty: name the run's directory")
        if self.train.out_dir.startswith("~"):  # it would be a folder named ~ in the working directory
            raise ConfigError(
                f"train.out_dir={self.train.out_dir}: ~ is not expanded here (nor by a shell, in key=value); "
                "give the path from / or with $HOME"
            )
        if self.log.peak_tflops < 0:
            raise ConfigError(f"log.peak_tflops={self.log.peak_tflops} must be >= 0 (0: the table)")
        if not 0.0 <= self.optim.min_lr <= self.optim.lr:
            raise ConfigError(f"optim.min_lr={self.optim.min_lr} must lie in [0, optim.lr={self.optim.lr}]")
        _check_schedule(self.optim, self.train.max_steps)
        _check_rates(self.optim)
        _check_ema(self.train, self.eval)
        if len(self.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.optim.betas):
            raise ConfigError(f"optim.betas={self.optim.betas} must be two numbers in [0, 1)")
        for key in ("rrc_scale", "rrc_ratio"):  # torchvision would take the first two and ignore the rest
            low_high = getattr(self.data, key)
            if len(low_high) != 2 or not 0.0 < low_high[0] <= low_high[1]:
                raise ConfigError(f"data.{key}={low_high} must be two numbers 0 < low <= high")
        for key in ("max_skip_fraction", "color_jitter_prob", "grayscale_prob"):
            if not 0.0 <= (value := getattr(self.data, key)) <= 1.0:
                raise ConfigError(f"data.{key}={value} must lie in [0, 1]")
        _check_color_jitter(self.data.color_jitter)
        check_evaluation(self.eval, self.data)
        if len(self.data.csv_separator) > 1 and self.data.csv_separator != "\\t":
            raise ConfigError(
                f"data.csv_separator={self.data.csv_separator!r} must be one character, \\t for a tab, "
                "or empty (tab for .tsv, comma otherwise)"
            )
        if (self.loss.kind == "sigmoid") != (self.model.init_logit_bias is not None):
            raise ConfigError(
                f"model.init_logit_bias={self.model.init_logit_bias} with loss.kind={self.loss.kind}: the "
                "bias belongs to the sigmoid loss (the softmax loss is blind to it); set both or neither"
            )
        if self.loss.kind == "sigmoid" and self.loss.impl == "local":
            raise ConfigError("loss.impl=local is a softmax option; the sigmoid loss takes vanilla or inf")
        if self.loss.tile_size < 0:
            raise ConfigError(f"loss.tile_size={self.loss.tile_size} must be >= 0 (0 picks a size)")
        every, keep_every = self.checkpoint.every_steps, self.checkpoint.keep_every
        if keep_every < 0 or (keep_every and (not every or keep_every % every)):
            raise ConfigError(
                f"checkpoint.keep_every={self.checkpoint.keep_every} must be 0 or a multiple of "
                f"checkpoint.every_steps={self.checkpoint.every_steps}: only saved steps can be kept"
            )
        _check_distill(self.distill, self.loss)
        _check_text_source(self.model.text)
        _check_data_sources(self.data)
        _check_fsdp(self.train, self.optim)
        _check_compile_mode(self, world)
        return self


def check_lock(tower: TowerConfig, key: str) -> None:
    """LiT's refinements only beside the lock they refine (``key``: model.image or model.text)."""
    if tower.unlocked_layers < 0:
        raise ConfigError(f"{key}.unlocked_layers={tower.unlocked_layers}: must be >= 0")
    if tower.unlocked_layers and not tower.lock:
        raise ConfigError(
            f"{key}.unlocked_layers={tower.unlocked_layers} has no effect without {key}.lock=true; set "
            "the lock or drop unlocked_layers"
        )
    for option in ("lock_head", "freeze_norms"):
        if getattr(tower, option) and not tower.lock:
            raise ConfigError(f"{key}.{option}=true needs {key}.lock=true")


def _check_text_source(text: TextTowerConfig) -> None:
    """Exactly one of ``hf`` and ``hf_config``: with both, one would be silently ignored."""
    if text.hf and text.hf_config:
        raise ConfigError(
            f"model.text.hf={text.hf!r} and model.text.hf_config are both set: hf loads a pretrained "
            "encoder, hf_config builds a random-init one; drop one (model.text.hf_config={} or "
            "model.text.hf=)"
        )
    if not (text.hf or text.hf_config):
        raise ConfigError(
            "model.text.hf and model.text.hf_config are both empty: set hf to a pretrained encoder "
            "(hub name or directory) or hf_config to a random-init architecture"
        )
    if text.hf_config and not text.tokenizer:
        raise ConfigError(
            "model.text.tokenizer is empty and model.text.hf_config has no vocabulary to take it from: "
            "set model.text.tokenizer=open_clip, a hub name or a directory"
        )
    if text.pooling == "eot" and text.tokenizer != "open_clip":
        raise ConfigError(
            "model.text.pooling=eot pools at the largest token id, the end token of open_clip's BPE: set "
            f"model.text.tokenizer=open_clip (got {text.tokenizer or text.hf!r})"
        )


def _check_distill(distill: DistillConfig, loss: LossConfig) -> None:
    """The teacher's term is a softmax cross-entropy, beside the tiled softmax loss only."""
    if not distill.teacher:
        if distill.teacher_model:
            raise ConfigError(
                f"distill.teacher_model={distill.teacher_model!r} has no distill.teacher to build"
            )
        return
    if loss.kind != "softmax":
        raise ConfigError(
            f"distill.teacher with loss.kind={loss.kind}: distillation matches the teacher's softmax, "
            "beside the softmax loss only"
        )
    if loss.impl not in ("auto", "inf"):
        raise ConfigError(
            f"distill.teacher with loss.impl={loss.impl}: the loss and the distillation term are computed "
            "together in tiles (loss.impl=inf); drop loss.impl"
        )
    if distill.weight <= 0:
        raise ConfigError(f"distill.weight={distill.weight} must be > 0")
    if distill.teacher.startswith("open_clip:") and not distill.teacher_model:
        raise ConfigError(
            f"distill.teacher={distill.teacher} needs its architecture: set distill.teacher_model to a model "
            "YAML, e.g. configs/model/ViT-L-14.yaml"
        )


def _check_data_sources(data: DataConfig) -> None:
    """One positive weight per ``::`` source, drawn with replacement (docs/data-mixtures.md)."""
    weights, sources = data.train_weights, len(data.train.split(SOURCE_SEPARATOR))
    if weights and len(weights) != sources:
        raise ConfigError(
            f"data.train_weights={weights} has {len(weights)} weights, but data.train has {sources} "
            "sources joined with '::': give one weight per source"
        )
    if not all(math.isfinite(weight) and weight > 0 for weight in weights):
        raise ConfigError(f"data.train_weights={weights}: every weight must be a positive number")
    if weights and not data.resampled:
        raise ConfigError(
            "data.train_weights needs data.resampled=true: a weighted mixture draws each source's shards "
            "with replacement (one pass over every shard has no proportions to keep)"
        )


def _check_finite(section: Any, prefix: str = "") -> None:
    """Every number in the config is finite. NaN compares false with every bound, so it would pass
    the range checks unseen (``min(decay, nan)`` is ``decay``); an infinite rate or clip is a typo."""
    for f in dataclasses.fields(section):
        key, value = prefix + f.name, getattr(section, f.name)
        numbers = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, float)]
        if dataclasses.is_dataclass(value):
            _check_finite(value, key + ".")
        elif not all(math.isfinite(v) for v in numbers):
            raise ConfigError(f"{key}={value} must be a finite number")


def _check_color_jitter(strengths: list[float]) -> None:
    """torchvision's ColorJitter takes each strength s as the range [max(0, 1 - s), 1 + s] (hue:
    [-s, s] of the colour wheel, at most half of it)."""
    if strengths and (len(strengths) != 4 or min(strengths) < 0 or strengths[3] > 0.5):
        raise ConfigError(
            f"data.color_jitter={strengths} must be four strengths >= 0 (brightness, contrast, saturation, "
            "hue <= 0.5), e.g. [0.4, 0.4, 0.4, 0.1], or [] for none"
        )


def evaluates_anything(eval_cfg: EvalConfig, data_cfg: DataConfig) -> bool:
    """Whether evaluation has a metric to compute: zero-shot, or retrieval on ``data.val``."""
    return bool(eval_cfg.zeroshot) or (eval_cfg.retrieval and bool(data_cfg.val))


def check_evaluation(eval_cfg: EvalConfig, data: DataConfig) -> None:
    """What evaluation reads, checked alike by ``clip-train train`` and ``clip-train eval`` (which
    takes a training run's config, but not its batch layout's checks)."""
    if eval_cfg.batch_size <= 0:
        raise ConfigError(f"eval.batch_size={eval_cfg.batch_size} must be > 0")
    if eval_cfg.zeroshot_data and not eval_cfg.zeroshot:
        raise ConfigError(
            "eval.zeroshot_data needs eval.zeroshot: the class names and templates to score it with"
        )
    _check_zeroshot_sets(eval_cfg)
    if not data.caption_keys or any(key in ("", "json", JSON_PREFIX) for key in data.caption_keys):
        raise ConfigError(
            f"data.caption_key={data.caption_key!r}: each key is a member of the samples (txt, caption) "
            "or json:FIELD, a field of their json"
        )


def _check_zeroshot_sets(eval_cfg: EvalConfig) -> None:
    """Each name becomes a metric prefix (zeroshot/NAME/top1): one path segment, not a metric's name,
    and one key segment: an override ``eval.zeroshot_sets.NAME=DIR`` splits its key at each '.'."""
    for name, source in eval_cfg.zeroshot_sets.items():
        if not re.fullmatch(r"[A-Za-z0-9_-]+", str(name)) or name in ("top1", "top5", "n", "skipped"):
            raise ConfigError(
                f"eval.zeroshot_sets: the name {name!r} must be letters, digits, '_' or '-' and not "
                "top1, top5, n or skipped (it names the metrics zeroshot/NAME/top1, ...)"
            )
        if isinstance(source, dict) and source:  # eval.zeroshot_sets.imagenet.v2=DIR, split at the '.'
            rest = next(iter(source))
            raise ConfigError(
                f"eval.zeroshot_sets.{name}.{rest}: a set's name takes no '.' (an override's key splits "
                f"at each one); name it {name}_{rest}, say"
            )
        if not isinstance(source, str) or not source:
            raise ConfigError(
                f"eval.zeroshot_sets.{name}={source!r} must name shards or a folder of class folders"
            )
    if eval_cfg.zeroshot_sets and not eval_cfg.zeroshot:
        raise ConfigError(
            "eval.zeroshot_sets needs eval.zeroshot: the class names and templates to score them with"
        )


def _check_schedule(optim: OptimConfig, max_steps: int) -> None:
    """A cooldown only under const-cooldown, and one that fits after the warmup."""
    room = max_steps - optim.warmup_steps
    if optim.schedule == "const-cooldown" and room < 1:
        raise ConfigError(
            f"optim.warmup_steps={optim.warmup_steps} leaves no step of train.max_steps={max_steps} for "
            "the cooldown of optim.schedule=const-cooldown; shorten the warmup or raise train.max_steps"
        )
    if optim.schedule == "const-cooldown" and not 0 < optim.cooldown_steps <= room:
        raise ConfigError(
            f"optim.cooldown_steps={optim.cooldown_steps}: optim.schedule=const-cooldown needs 1 to {room} "
            f"cooldown steps (train.max_steps={max_steps} minus optim.warmup_steps={optim.warmup_steps})"
        )
    if optim.schedule == "const" and optim.min_lr:
        raise ConfigError(f"optim.min_lr={optim.min_lr} has no effect with optim.schedule=const; drop it")
    if optim.schedule != "const-cooldown" and optim.cooldown_steps:
        raise ConfigError(
            f"optim.cooldown_steps={optim.cooldown_steps} has no effect with "
            f"optim.schedule={optim.schedule}; use const-cooldown or drop it"
        )
    if optim.cooldown_power <= 0:
        raise ConfigError(f"optim.cooldown_power={optim.cooldown_power} must be > 0")


def _check_rates(optim: OptimConfig) -> None:
    """Per-tower rates, when set, are positive; layer decay shrinks the rate toward the input."""
    for key in ("image_lr", "text_lr"):
        if (rate := getattr(optim, key)) is not None and rate <= 0:
            raise ConfigError(f"optim.{key}={rate} must be > 0 (or null for optim.lr)")
    if not 0.0 < optim.layer_decay <= 1.0:
        raise ConfigError(f"optim.layer_decay={optim.layer_decay} must lie in (0, 1] (1: no layer decay)")


def _check_ema(train: TrainConfig, evaluation: EvalConfig) -> None:
    if not 0.0 <= train.ema_decay < 1.0:
        raise ConfigError(f"train.ema_decay={train.ema_decay} must lie in [0, 1) (0: no EMA)")
    if train.ema_warmup_power < 0 or (train.ema_warmup_power and not train.ema_decay):
        raise ConfigError(
            f"train.ema_warmup_power={train.ema_warmup_power} must be >= 0, and needs train.ema_decay > 0"
        )
    if evaluation.use_ema and not train.ema_decay:
        raise ConfigError("eval.use_ema=true needs train.ema_decay > 0: without an EMA there is none")


def _check_fsdp(train: TrainConfig, optim: OptimConfig) -> None:
    """fp16's GradScaler finds overflows per rank, which sharded gradients would leave unshared;
    torch's Adafactor factors each whole weight matrix, which a shard is not."""
    if train.parallel != "fsdp":
        return
    if train.precision == "fp16":
        raise ConfigError(
            "train.precision=fp16 with train.parallel=fsdp: the loss scaler is not shard-aware; "
            "use train.precision=bf16 (or fp32)"
        )
    if optim.name == "adafactor":
        raise ConfigError(
            "optim.name=adafactor with train.parallel=fsdp: torch's Adafactor cannot step sharded "
            "parameters; use optim.name=adamw, or train.parallel=ddp"
        )


def _check_compile_mode(cfg: Config, world: int) -> None:
    """CUDA graphs (``reduce-overhead``) as measured: each compiled block runs once a step, with
    gradients. Without gradients, each call of a compiled block starts a new generation of torch's
    CUDA-graph trees (one per entry into compiled code while no backward is pending), which frees
    the previous block's output, the input the call reads: Gradient Cache's no_grad encode stopped
    at its second block on an H200 ("accessing tensor output of CUDAGraphs that has been
    overwritten"), and a locked trunk's no_grad pass would too. FSDP's gathers around the blocks are
    untried. Auto chunks are checked once chosen (``one_chunk_for_cuda_graphs``)."""
    if not cfg.train.cuda_graphs:
        return
    key = f"train.compile_mode={cfg.train.compile_mode}"
    if not cfg.train.compile:
        raise ConfigError(f"{key} needs train.compile=true: it is a mode of the compiled blocks")
    if cfg.train.parallel != "ddp":
        raise ConfigError(f"{key} with train.parallel={cfg.train.parallel}: CUDA graphs run with ddp only")
    for name in ("image", "text"):
        if getattr(cfg.model, name).lock:
            raise ConfigError(
                f"{key} with model.{name}.lock=true: a locked trunk runs its blocks without "
                "gradients, where each CUDA-graphed block frees the previous block's output; "
                "use train.compile_mode=default"
            )
    per_rank = cfg.batch.global_size // world
    for key_chunk in ("image_chunk", "text_chunk"):
        chunk = getattr(cfg.batch, key_chunk)
        if chunk != "auto" and chunk not in (0, per_rank):
            raise ConfigError(one_chunk_for_cuda_graphs(f"batch.{key_chunk}={chunk}", per_rank))


def one_chunk_for_cuda_graphs(chunks: str, per_rank: int) -> str:
    """The error for CUDA graphs with Gradient Cache's chunks (set or chosen by auto)."""
    return (
        f"train.compile_mode=reduce-overhead needs one chunk a step, and {chunks} splits the per-rank "
        f"batch {per_rank}: Gradient Cache encodes its chunks without gradients, where each "
        "CUDA-graphed block frees the previous block's output. Set batch.image_chunk=0 and "
        "batch.text_chunk=0 (a batch that fits), or "
        "train.compile_mode=default"
    )


def _check_batch(batch: BatchConfig, world: int) -> None:
    if batch.global_size <= 0 or batch.global_size % world:
        raise ConfigError(
            f"batch.global_size={batch.global_size} must be a positive multiple of the world size "
            f"({world}); try batch.global_size={max(world, batch.global_size // world * world)}"
        )
    per_rank = batch.global_size // world
    if batch.memory_budget < 0:
        raise ConfigError(
            f"batch.memory_budget={batch.memory_budget}: must be >= 0 GiB (0: what the device has)"
        )
    for key in ("image_chunk", "text_chunk"):
        chunk = getattr(batch, key)
        if chunk != "auto" and (chunk < 0 or (chunk and per_rank % chunk)):
            raise ConfigError(
                f"batch.{key}={chunk} must divide the per-rank batch {per_rank} "
                f"(batch.global_size {batch.global_size} / world size {world}), i.e. batch.global_size "
                f"must be divisible by world size x chunk; or set batch.{key}=0 (no chunking) or auto"
            )
