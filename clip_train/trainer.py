"""The training loop. It composes the model, the data pipeline and the Gradient Cache engine, and
owns what a week-long run needs around them: the optimizer and schedule, the NaN guard, step
checkpoints with exact resume, logging and periodic evaluation.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from clip_train.checkpoint import (
    RUN_CONFIG_FILE,
    complete_checkpoints,
    find_weights,
    load_train_state,
    load_weights,
    resolve_resume,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from clip_train.config import Config, save_config
from clip_train.data import SKIP_REASONS, build_train_loader
from clip_train.distributed import DistEnv, all_ranks_true, barrier, gather_to_main, sum_counts_over_ranks
from clip_train.engine import GradCache, StepStats, wrap_ddp
from clip_train.engine.rng import preserved_rng
from clip_train.errors import UserError
from clip_train.memory import peak_bytes
from clip_train.model import build_model
from clip_train.monitor import RunMonitor
from clip_train.optim import build_optimizer, build_scheduler
from clip_train.preemption import Preempted, SignalFlag, preemption_signals

MAX_LOGIT_SCALE = math.log(100.0)


class TrainingAborted(UserError):
    """Too many consecutive non-finite steps: the run stops, keeping its last good checkpoint."""


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.run_dir = Path(cfg.train.out_dir)
        self.step = 0
        self.bad_in_a_row = 0
        self.bad_total = 0
        self.skipped = dict.fromkeys(SKIP_REASONS, 0)  # every rank's skipped samples, as of the last log

        if env.device.type == "cuda" and cfg.train.precision != "fp64":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and newer
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        model = build_model(cfg.model, load_pretrained=not cfg.model.init_from)
        self.model = (model.double() if cfg.train.precision == "fp64" else model).to(env.device)
        self.optimizer = build_optimizer(cfg.optim, self.model)
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, cfg.train.max_steps)
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.train.precision == "fp16")

        torch.manual_seed(cfg.train.seed + 1 + env.rank)  # dropout masks differ across ranks
        resume_from = resolve_resume(cfg.checkpoint.resume, self.run_dir)
        if resume_from is None and cfg.checkpoint.resume != "auto" and complete_checkpoints(self.run_dir):
            raise UserError(
                f"train.out_dir={self.run_dir} already holds checkpoints of another run; continue it with "
                "checkpoint.resume=auto or pick a new train.out_dir"
            )
        data_state = self._restore(resume_from) if resume_from is not None else None
        if resume_from is None and cfg.model.init_from:
            self._init_weights(cfg.model.init_from)

        ddp = {}
        if env.world_size > 1:
            device_ids = [env.device.index] if env.device.type == "cuda" else None
            ddp = {
                "image_ddp": wrap_ddp(self.model.visual, device_ids=device_ids),
                "text_ddp": wrap_ddp(self.model.text, device_ids=device_ids),
            }
        self.engine = GradCache.from_config(self.model, cfg, **ddp)
        self.loader = build_train_loader(
            cfg.data,
            global_batch=cfg.batch.global_size,
            rank=env.rank,
            world_size=env.world_size,
            seed=cfg.train.seed,
            image_size=self.model.image_size,
            tokenizer=self.model.tokenizer,
            start_step=self.step,
            pin_memory=env.device.type == "cuda",
            state=data_state,
        )
        self.resumed_from = resume_from

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> dict[str, float]:
        """Train to ``train.max_steps``; returns the final evaluation metrics (empty without eval).

        A SIGTERM or SIGUSR1 on any rank ends the run after the current step, with a checkpoint
        of it, by raising ``Preempted``.
        """
        cfg, env = self.cfg, self.env
        monitor = None
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / RUN_CONFIG_FILE)
            monitor = RunMonitor(cfg, self.run_dir, self.step)
            monitor.message(self.summary())
            if self.resumed_from is not None:
                monitor.message(f"resumed from {self.resumed_from} at step {self.step}")
        final_metrics: dict[str, float] = {}
        try:
            with preemption_signals() as signals:
                batches = iter(self.loader)
                while self.step < cfg.train.max_steps:
                    started = time.perf_counter()
                    batch = next(batches)
                    fetched = time.perf_counter()
                    self.optimizer.zero_grad(set_to_none=True)
                    stats = self.engine.step(
                        batch.images,
                        batch.input_ids,
                        batch.attention_mask,
                        self.scaler if self.scaler.is_enabled() else None,
                    )
                    grad_norm, stop = self._apply_update(stats.loss, signals.received is not None)
                    self.scheduler.step()
                    self.step += 1
                    finished = time.perf_counter()
                    at_log = self.step % cfg.log.every_steps == 0 or self.step == cfg.train.max_steps
                    if at_log:  # every rank joins: each counts only the samples its own loader skipped
                        self.skipped = sum_counts_over_ranks(
                            self.loader.skip_counts(), SKIP_REASONS, env.device
                        )
                    if monitor is not None:
                        self._report(monitor, stats, grad_norm, fetched - started, finished - started, at_log)
                    at_checkpoint = (
                        self.step % cfg.checkpoint.every_steps == 0 or self.step == cfg.train.max_steps
                    )
                    if (at_checkpoint or stop) and not self.bad_in_a_row:  # only good steps are saved
                        self.save()
                    if stop:
                        raise self._preempted(signals)
                    if (
                        cfg.eval.every_steps
                        and self.step % cfg.eval.every_steps == 0
                        and self.step < cfg.train.max_steps
                    ):
                        self._evaluate(monitor)
            final_metrics = self._evaluate(monitor)
        finally:
            if monitor is not None:
                monitor.close()
        return final_metrics

    def _apply_update(self, loss: float, signalled: bool) -> tuple[float, bool]:
        """Clip and step, unless the loss or gradient norm is not finite on some rank (then skip).

        Returns the gradient norm and whether any rank was signalled to stop: the same all-reduce
        answers both, so every rank stops after the same step at no extra collective.
        """
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        loss_ok, none_signalled = all_ranks_true([math.isfinite(loss), not signalled], self.env.device)
        grads_ok = math.isfinite(grad_norm)
        if loss_ok and grads_ok:
            if self.scaler.is_enabled():
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
            with torch.no_grad():
                self.model.logit_scale.clamp_(max=MAX_LOGIT_SCALE)
            self.bad_in_a_row = 0
        elif loss_ok and self.scaler.is_enabled():
            pass  # an fp16 overflow: the scaler lowers its scale and the step is retried next time
        else:
            self._count_bad_step(loss, grad_norm)
        if self.scaler.is_enabled():
            self.scaler.update()
        return grad_norm, not none_signalled

    def _preempted(self, signals: SignalFlag) -> Preempted:
        kept = complete_checkpoints(self.run_dir)
        cause = f"{signals.received.name} received" if signals.received else "another rank was signalled"
        return Preempted(
            f"{cause}: stopped after step {self.step}; checkpoint.resume=auto continues from "
            f"{kept[-1] if kept else 'the start'}"
        )

    def _count_bad_step(self, loss: float, grad_norm: float) -> None:
        self.bad_in_a_row += 1
        self.bad_total += 1
        print(
            f"clip-train: rank {self.env.rank}: step {self.step} skipped, non-finite "
            f"(loss {loss}, grad norm {grad_norm}); {self.bad_in_a_row} in a row",
            file=sys.stderr,
        )
        if self.bad_in_a_row >= self.cfg.train.max_bad_steps:
            kept = complete_checkpoints(self.run_dir)
            raise TrainingAborted(
                f"{self.bad_in_a_row} consecutive steps had a non-finite loss or gradient norm "
                f"(train.max_bad_steps={self.cfg.train.max_bad_steps}); stopped at step {self.step}. "
                f"Last good checkpoint: {kept[-1] if kept else 'none'}. Lower optim.lr or use fp32/bf16."
            )

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self) -> None:
        """Every rank contributes its RNG and data position; rank 0 writes."""
        rngs = gather_to_main(rng_state())
        data = gather_to_main(self.loader.state_dict(self.step))
        if self.env.is_main:
            state = {
                "step": self.step,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "bad_total": self.bad_total,
                "world_size": self.env.world_size,
                "rng": rngs,
                "data": data,
            }
            ckpt = self.cfg.checkpoint
            save_checkpoint(
                self.run_dir, self.step, self.model, self.cfg.model, state, ckpt.keep, ckpt.keep_every
            )
        barrier()

    def _init_weights(self, source: str) -> None:
        """Fine-tuning: another run's weights and nothing else; a resumed run skips this (its own win)."""
        try:
            load_weights(find_weights(source), self.model)
        except UserError as err:
            raise UserError(f"model.init_from={source}: {err}") from None

    def _restore(self, path: Path) -> dict | None:
        """Load a checkpoint into the model, optimizer and RNG; returns this rank's data position."""
        load_weights(path, self.model)
        state = load_train_state(path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.bad_total = state["step"], state["bad_total"]
        if state["world_size"] == self.env.world_size:
            set_rng_state(state["rng"][self.env.rank])
            return state["data"][self.env.rank]
        if self.env.is_main:
            print(
                f"clip-train: resuming on {self.env.world_size} ranks from a {state['world_size']}-rank "
                "checkpoint: weights and optimizer are exact; dropout and data streams restart at the step",
                file=sys.stderr,
            )
        return None

    # -- reporting -----------------------------------------------------------------------------

    def summary(self) -> str:
        """The start-up line: how big the model is, where it runs, and how each step is cut up."""
        cfg, world = self.cfg, self.env.world_size
        total = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.model.trainable_parameters())
        per_rank = cfg.batch.global_size // world
        chunks = "/".join(str(chunk or per_rank) for chunk in (cfg.batch.image_chunk, cfg.batch.text_chunk))
        return (
            f"{total:,} parameters ({trainable:,} trainable), world size {world}, device {self.env.device}, "
            f"per-rank batch {per_rank} in image/text chunks of {chunks}, "
            f"steps {self.step} to {cfg.train.max_steps}"
        )

    def _report(
        self,
        monitor: RunMonitor,
        stats: StepStats,
        grad_norm: float,
        data_s: float,
        step_s: float,
        log: bool,
    ) -> None:
        """Advance the progress bar; on log steps also write the metrics (skip counts: all ranks)."""
        samples_per_s = self.cfg.batch.global_size / step_s
        scale = float(self.model.logit_scale.detach().exp())
        lr = self.optimizer.param_groups[0]["lr"]
        peak = stats.peak_mem or peak_bytes(self.env.device)
        optimizer_s = step_s - data_s - stats.encode_s - stats.loss_s - stats.replay_s
        split = (stats.encode_s, stats.loss_s, stats.replay_s, optimizer_s)
        monitor.advance(
            self.step,
            {
                "loss": stats.loss,
                "samples/s": round(samples_per_s),
                "lr": lr,
                "scale": scale,
                "enc/loss/rep/opt s": "/".join(f"{t:.2f}" for t in split),
                "mem GiB": round(peak / 2**30, 2),
                "skipped": sum(self.skipped.values()),
            },
        )
        if not log:
            return
        metrics = {
            "train/loss": stats.loss,
            "train/lr": lr,
            "train/logit_scale": scale,
            **(
                {"train/logit_bias": self.model.logit_bias.item()}
                if self.model.logit_bias is not None
                else {}
            ),
            "train/grad_norm": grad_norm,
            "train/samples_per_s": samples_per_s,
            "time/step_s": step_s,
            "time/data_s": data_s,
            "time/encode_s": stats.encode_s,
            "time/loss_s": stats.loss_s,
            "time/replay_s": stats.replay_s,
            "time/optimizer_s": optimizer_s,
            "memory/peak_bytes": peak,
            "memory/cache_bytes": stats.cache_bytes,
            "train/skipped_steps": self.bad_total,
        }
        metrics.update({f"data/skipped_{reason}": n for reason, n in self.skipped.items()})
        monitor.log(self.step, metrics)

    def _evaluate(self, monitor: RunMonitor | None) -> dict[str, float]:
        if not (self.cfg.data.val or self.cfg.eval.zeroshot):
            return {}
        from clip_train.evaluate import evaluate

        with preserved_rng(self.env.device):  # eval must not shift the training RNG streams
            metrics = evaluate(
                self.model,
                self.cfg.eval,
                self.cfg.data,
                device=self.env.device,
                precision=self.cfg.train.precision,
            )
        if monitor is not None:
            monitor.log(self.step, metrics)
            monitor.message(f"step {self.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return metrics
