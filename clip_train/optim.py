"""Optimizer, parameter groups, the learning-rate schedule, and the guarded update that steps them."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
from transformers.pytorch_utils import Conv1D

from clip_train.config import MAX_LOGIT_SCALE, Config, ConfigError, OptimConfig
from clip_train.distributed import and_over_ranks, rank_and_world
from clip_train.errors import UserError
from clip_train.logs import get_logger, without_warning
from clip_train.skipped_steps import SkippedSteps

# Only the weight matrices of these layers decay (transformers' ``Conv1D`` is GPT-2's linear layer).
# Norms, biases, embeddings, position and class tokens and the logit scale do not, as timm's ViTs
# exclude them; OpenCLIP also decays the embeddings and tokens of two or more dimensions.
_DECAYED_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, Conv1D)
# The towers' parameter prefixes and their names in the config (model.image, optim.image_lr, ...).
_TOWERS = {"visual.": "image", "text.": "text"}
# What a resumed optimizer state needs of the run: the parameter groups of the run that saved it
# (``parameter_places``), which the rates' values do not change.
AS_SAVED = (
    "set or unset optim.image_lr and optim.text_lr, turn optim.layer_decay on or off (1), and lock the "
    "towers (model.image.lock, unlocked_layers, lock_head, freeze_norms) as the run that saved it did; "
    "the rates' values may change"
)
# Torch's warning when a schedule moves on before any optimizer step: a skipped first step does.
_SCHEDULE_BEFORE_STEP = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
# A transformer block's parameter: timm ViTs' ``blocks.N.``, BERT's ``encoder.layer.N.``, CLIP's
# text transformer's ``encoder.layers.N.``; not a stage of blocks (EfficientNet's ``blocks.S.B.``).
_BLOCK = re.compile(r"(?:^|\.)(?:blocks|encoder\.layers?)\.(\d+)\.(?!\d)")


def block_index(name: str) -> tuple[str, int] | None:
    """The list of blocks a parameter ``name`` lies in (its name up to the index) and the block's
    0-based index there; None for a parameter outside the blocks."""
    found = _BLOCK.search(name)
    return (name[: found.start(1)], int(found.group(1))) if found else None


# A parameter's place among the rates: the key that sets its rate (``lr``, or its tower's
# ``image_lr`` / ``text_lr`` where set) and the power of ``optim.layer_decay`` that scales it. The
# groups are keyed by places, never by the rates' values: a resume at other values (``optim.lr``
# lowered after bad steps, another ``layer_decay``) keeps the groups the checkpoint has, where equal
# or unequal values would merge or split them.
Place = tuple[str, int]


def decay_powers(names: list[str], decay: float, tower: str) -> dict[str, int]:
    """Each parameter's power of the layer decay in one tower (``names`` in the tower's
    registration order): block k of L (1-based) ``L - k``, what comes before the first block
    (patch, token and position embeddings, class token, pre-norm) ``L``, and what comes after the
    last (final norm, pooling head, projection) 0."""
    blocks = {name: found for name in names if (found := block_index(name))}
    lists = sorted({holder for holder, _ in blocks.values()})
    if len(lists) != 1:
        found = f"blocks in several lists ({', '.join(lists)})" if lists else "no transformer blocks"
        raise ConfigError(
            f"optim.layer_decay={decay} needs one list of transformer blocks (blocks.N, encoder.layer.N "
            f"or encoder.layers.N) in model.{tower}, which has {found}; set optim.layer_decay=1"
        )
    depth = 1 + max(index for _, index in blocks.values())
    first = next(i for i, name in enumerate(names) if name in blocks)
    return {
        name: depth - (blocks[name][1] + 1) if name in blocks else depth if position < first else 0
        for position, name in enumerate(names)
    }


def parameter_places(model: nn.Module, cfg: OptimConfig) -> dict[str, Place]:
    """Every parameter's place: ``optim.image_lr`` / ``text_lr`` where set (else ``optim.lr``) for
    the towers, with ``optim.layer_decay``; ``optim.lr`` for the rest (the logit scale and bias). A
    tower with nothing to train (a LiT image tower locked whole) needs no rates, so layer decay asks
    nothing of its layout."""
    parameters = dict(model.named_parameters())
    places = dict.fromkeys(parameters, ("lr", 0))
    for prefix, tower in _TOWERS.items():
        in_tower = [name for name in parameters if name.startswith(prefix)]
        key = f"{tower}_lr" if getattr(cfg, f"{tower}_lr") is not None else "lr"
        if not any(parameters[name].requires_grad for name in in_tower):
            continue
        decays = cfg.layer_decay != 1.0
        powers = decay_powers(in_tower, cfg.layer_decay, tower) if decays else dict.fromkeys(in_tower, 0)
        places |= {name: (key, power) for name, power in powers.items()}
    return places


def peak_rate(place: Place, cfg: OptimConfig) -> float:
    key, power = place
    return getattr(cfg, key) * cfg.layer_decay**power


def parameter_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """The trainable parameters grouped by weight decay and place (``parameter_places``), each
    group's ``lr`` its peak rate; frozen ones are left out. The decayed groups come first: without
    per-tower rates or layer decay, the two groups of one rate for all."""
    decayed = {id(m.weight) for m in model.modules() if isinstance(m, _DECAYED_LAYERS)}
    places = parameter_places(model, cfg)
    groups: dict[tuple[Place, bool], dict] = {}  # keyed by whether they decay, not by how much:
    for decays in (True, False):  # optim.weight_decay=0 must not merge groups a checkpoint has apart
        weight_decay = cfg.weight_decay if decays else 0.0
        for name, p in model.named_parameters():
            if p.requires_grad and (id(p) in decayed) == decays:
                place = places[name]
                group = {"params": [], "lr": peak_rate(place, cfg), "weight_decay": weight_decay}
                groups.setdefault((place, decays), group)["params"].append(p)
    return list(groups.values())


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg)
    if cfg.name == "adamw":
        fused = cfg.fused and _fused_kernels_take(p for group in groups for p in group["params"])
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)
    # torch's Adafactor has no momentum and no constant beta2: its beta2 follows 1 - t^-0.8.
    return torch.optim.Adafactor(groups, lr=cfg.lr)


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings but its parameters and rates (which ``Update`` sets itself)."""
    return {k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}


def _first_moved(saved: list[list[str]], members: list[list[str]]) -> str:
    """The first parameter whose group differs between a checkpoint's ``saved`` groups and this
    run's, in words."""
    there = {name: index for index, group in enumerate(saved) for name in group}
    here = {name: index for index, group in enumerate(members) for name in group}
    name = next((n for n in [*here, *there] if there.get(n) != here.get(n)), None)
    if name is None:
        return "the same groups, their parameters in another order"
    if name not in there or name not in here:
        return f"{name} is trained {'here' if name in here else 'there'} only"
    return f"{name} is in group {there[name]} there, {here[name]} here"


def _fused_kernels_take(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch has a fused AdamW kernel for every parameter's device and dtype (CUDA and the
    CPU have one): one kernel per step instead of a dozen foreach passes over the states."""
    supported = _get_fused_kernels_supported_devices()
    return all(p.device.type in supported and p.is_floating_point() for p in params)


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """The multiple of each group's peak rate at ``step``: linear warmup over ``warmup_steps``, then
    ``cfg.schedule``: cosine from ``lr`` down to ``min_lr`` at ``max_steps``; const; or const until
    the last ``cooldown_steps``, which decay to ``min_lr`` as ``(1 - progress) ** cooldown_power``
    (OpenCLIP's const-cooldown). A group with its own rate ends at the same fraction ``min_lr / lr``
    of it."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr / cfg.lr
    if cfg.schedule == "const":
        return 1.0
    if cfg.schedule == "const-cooldown":
        start = max_steps - cfg.cooldown_steps
        progress = min(1.0, max(0, step - start) / cfg.cooldown_steps)
        return floor + (1.0 - floor) * (1.0 - progress) ** cfg.cooldown_power
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    cfg: OptimConfig, optimizer: torch.optim.Optimizer, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, max_steps))


class Update:
    """One optimizer step and its guards: the fp16 loss scale, global-norm clipping, and skipping a
    step whose loss or gradient is not finite on any rank (``skipped_steps`` counts them;
    ``train.max_bad_steps`` in a row stop the run).

    With fused AdamW and no loss scale, the skip happens on the device: the all-reduced flag goes to
    the fused kernel as ``found_inf`` (as GradScaler hands it over), which leaves the weights, the
    moments and the step count as they were, and the step reads nothing. Otherwise (fp16, Adafactor,
    ``optim.fused=false``) the flag is read on the host every step, which on CUDA waits for the step's
    kernels.
    """

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device) -> None:
        self.model, self.device = model, device
        self.grad_clip = cfg.optim.grad_clip
        self.optimizer = build_optimizer(cfg.optim, model)
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, cfg.train.max_steps)
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
        self.skipped_steps = SkippedSteps(cfg.train.max_bad_steps, Path(cfg.train.out_dir))
        fused = any(group.get("fused") for group in self.optimizer.param_groups)
        self.skips_on_device = fused and not self.scaler.is_enabled()
        self.stepped = torch.ones((), dtype=torch.bool, device=device)  # the last step's, on the device
        self._stat_norms = [m for m in model.modules() if getattr(m, "track_running_stats", False)]
        self.base_lr = cfg.optim.lr
        self.peak_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]  # this config's
        self.settings = [_settings(group) for group in self.optimizer.param_groups]  # weight decay, betas...
        names = {p: name for name, p in model.named_parameters()}
        self.members = [[names[p] for p in group["params"]] for group in self.optimizer.param_groups]

    @property
    def lr(self) -> float:
        """``optim.lr`` as the last step ran at it (``train/lr``, logged with that step's loss, as
        OpenCLIP logs it); each group's rate is its own multiple of it."""
        return self.base_lr * self.scheduler.lr_lambdas[0](max(self.scheduler.last_epoch - 1, 0))

    @contextlib.contextmanager
    def running_stats_guarded(self) -> Iterator[None]:
        """Around a step's forward and update: batch norm's running statistics as they were before it
        if the step is skipped. Its forward folded the bad batch's statistics into them, and a NaN
        there would outlive the skip in every evaluation, checkpoint and export while the weights,
        and the training losses (batch statistics), stayed finite. Decided on the device."""
        live = [b for norm in self._stat_norms for b in norm.buffers(recurse=False)]
        kept = [b.clone() for b in live]
        yield
        for buffer, before in zip(live, kept, strict=True):
            buffer.copy_(torch.where(self.stepped, buffer, before))

    def __call__(self, loss: torch.Tensor | float, step: int) -> torch.Tensor:
        """Unscale, clip and take optimizer step ``step`` (1 for the first), or skip it; returns the
        gradient norm, on the device. ``stepped`` says on the device whether the weights moved (the
        EMA follows it)."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(grad_norm, DTensor):  # FSDP: the norm of the whole gradient
            grad_norm = grad_norm.full_tensor()
        loss = torch.as_tensor(loss, device=grad_norm.device)
        finite = and_over_ranks(torch.stack([loss.isfinite(), grad_norm.isfinite()]))
        self.stepped = finite.all()
        if self.skips_on_device:
            self.optimizer.found_inf = (~self.stepped).float()  # 1.0: the fused kernel skips the step
            self.optimizer.step()
            del self.optimizer.found_inf
            self._clamp_logit_scale()
            self.skipped_steps.record(~self.stepped, step, loss, grad_norm)
        else:
            self._step_unless_read_bad(finite, loss, grad_norm, step)
        self.scaler.update()
        # A skipped first step moves the schedule on as every step does; torch takes it for a misuse.
        with without_warning(_SCHEDULE_BEFORE_STEP) if step == 1 else contextlib.nullcontext():
            self.scheduler.step()
        return grad_norm

    def _step_unless_read_bad(
        self, finite: torch.Tensor, loss: torch.Tensor, grad_norm: torch.Tensor, step: int
    ) -> None:
        """The guard with the flags read on the host. An fp16 overflow (a finite loss, a gradient
        that is not finite) is not a bad step while the scale it ran at is above 1: the scaler is
        still searching, and halves it. At 1 or below the gradient is not finite unscaled either, and
        the step is bad as any other: halved on without a floor, the scale would reach 0 (166 steps
        from the initial 2^16), after which no step could run, and ``train.max_bad_steps`` would
        never stop the run."""
        loss_ok, norm_ok = finite.tolist()
        if loss_ok and norm_ok:
            self.scaler.step(self.optimizer)  # a plain optimizer.step() when the scaler is off
            self._clamp_logit_scale()
        overflow = loss_ok and not norm_ok and self.scaler.is_enabled()
        searching = overflow and self.scaler.get_scale() > 1.0  # the host has waited for the flags already
        self.skipped_steps.count(not ((loss_ok and norm_ok) or searching), step, loss, grad_norm)

    @torch.no_grad()
    def _clamp_logit_scale(self) -> None:
        """exp(scale) in [1, 100], as OpenCLIP keeps it: logits never below the cosine similarity."""
        self.model.logit_scale.clamp_(0.0, MAX_LOGIT_SCALE)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "members": self.members,  # torch checks only the groups' sizes on loading
            "bad_total": self.skipped_steps.total,
            "bad_in_a_row": self.skipped_steps.in_a_row,  # a last step or a preemption saves mid-run
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The optimizer's moments, the schedule's position and the guards' counts. The rates stay
        this config's, as the schedule's shape does: the saved groups' rates would otherwise win over
        a changed ``optim.lr``, ``image_lr``, ``text_lr`` or ``layer_decay`` while ``train/lr``
        showed the new one. So do the groups' other settings (``optim.weight_decay``, ``betas``,
        ``eps``, ``fused``). A change is said in one line."""
        if (saved := state.get("members", self.members)) != self.members:  # not in checkpoints before it
            raise UserError(
                f"the checkpoint's optimizer state groups the parameters otherwise than this run "
                f"({_first_moved(saved, self.members)}): {AS_SAVED}"
            )
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except ValueError as err:  # torch's, on a state saved without members: other groups or sizes
            raise UserError(
                f"the checkpoint's optimizer state does not fit this run's parameter groups ({err}; saved "
                "before 2026-11-30, it merged the groups of equal rates: a tower's rate equal to optim.lr "
                f"resumes unset): {AS_SAVED}"
            ) from None
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"] or not self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        elif rank_and_world()[0] == 0:  # the run that saved it had no loss scale: bf16 or fp32
            get_logger().info("the checkpoint has no fp16 loss scale: the run starts at the initial scale")
        self.skipped_steps.total = state["bad_total"]
        self.skipped_steps.in_a_row = state.get("bad_in_a_row", 0)  # not in checkpoints before it
        if self.scheduler.base_lrs != self.peak_lrs and rank_and_world()[0] == 0:
            get_logger().info(
                "the learning rates differ from the checkpoint's (optim.lr, image_lr, text_lr or "
                "layer_decay changed): the run goes on at this config's"
            )
        pairs = list(zip(self.optimizer.param_groups, self.settings, strict=True))
        changed = sorted(
            {key for group, own in pairs for key, value in own.items() if group.get(key) != value}
        )
        if changed and rank_and_world()[0] == 0:
            get_logger().info(
                f"the optimizer's {', '.join(changed)} differ from the checkpoint's: the run goes on at "
                "this config's"
            )
        for group, own in pairs:
            group.update(own)
            if group.get("fused") or group.get("capturable"):  # torch placed the steps by the saved flags
                for param in group["params"]:
                    if (state := self.optimizer.state.get(param)) and "step" in state:
                        state["step"] = state["step"].to(param.device, torch.float32)
        self.scheduler.base_lrs = list(self.peak_lrs)
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group, peak in zip(self.optimizer.param_groups, self.peak_lrs, strict=True):
            group["initial_lr"], group["lr"] = peak, peak * factor
