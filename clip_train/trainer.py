"""The training loop: the loader's batch goes to the Gradient Cache engine, the guarded update steps
the optimizer (or skips a non-finite step), and around it logging, checkpoints, evaluation and
stopping cleanly on preemption. The trainer, update, loader and RNG streams are checkpoint components.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clip_train.checkpoint import (
    RUN_CONFIG_FILE,
    Checkpointer,
    latest_checkpoint,
    record_launch,
    resolve_resume,
    run_config_file,
)
from clip_train.config import (
    BatchConfig,
    Config,
    ConfigError,
    load_config,
    one_chunk_for_cuda_graphs,
    save_config,
)
from clip_train.data import SKIP_REASONS, Batch, build_train_loader
from clip_train.distributed import (
    DistEnv,
    all_ranks_true,
    decided_by_main,
    failing_together,
    main_done,
    require_host_collectives,
    sum_counts_over_ranks,
    wait_for_device,
)
from clip_train.ema import WeightsEMA
from clip_train.engine import GradCache, StepStats
from clip_train.engine.rng import ProcessRng, preserved_rng
from clip_train.errors import UserError, naming_key
from clip_train.eval import evaluate, evaluates_anything
from clip_train.flops import TowerFlops, device_peak_tflops, tower_flops, training_flops_per_sample
from clip_train.init_from import load_init_from, pinned
from clip_train.logs import get_logger, timed
from clip_train.memory import peak_bytes
from clip_train.model import CLIP, build_model
from clip_train.model.compiling import compile_towers, cudagraph_skips
from clip_train.monitor import METRICS_FILE, RunMonitor
from clip_train.optim import Update
from clip_train.parallel import builds_on_meta, gathered_for_eval, shard_towers
from clip_train.parallel.checkpoint import OptimizerApart, ShardedCheckpointer
from clip_train.plan import choose_chunks
from clip_train.plan.auto_chunks import ChunkChoice
from clip_train.precision import use_tf32
from clip_train.preemption import Preempted, SignalFlag, preemption_signals
from clip_train.profiling import StepProfiler, phase
from clip_train.remote import RemoteMirror
from clip_train.run_lock import RunLock
from clip_train.skipped_steps import TrainingAborted
from clip_train.startup_time import StartupClock
from clip_train.stopping import StoppableEvaluation, exit_code, waiting_for_data, writing_checkpoint
from clip_train.teacher import load_teacher

Metrics = dict[str, float]
# Runs an evaluation, given its process group: the metrics, or None when a signal stopped it.
EvaluationRun = Callable[[Callable[[torch.distributed.ProcessGroup | None], Metrics]], Metrics | None]


@dataclass
class LogWindow:
    """The steps since the last log: when the first began and how many ran. Its samples/s is the
    rate a run keeps, since only logged steps wait for the device; logging, checkpoints and
    evaluation fall outside it, at the last log and between logs alike."""

    started: float
    steps: int = 0
    elapsed: float = 0.0

    def add_step(self, ended: float) -> None:
        self.steps += 1
        self.elapsed = ended - self.started

    def leave_out(self, seconds: float) -> None:
        """Time between two of its steps spent on something else (a save, an evaluation)."""
        self.started += seconds


class CudaGraphSkips:
    """The compiled graphs run without the CUDA graphs asked for (``compile_mode=reduce-overhead``).
    Inductor says so only in its ``perf_hints`` log, so a run that is plain compiled would pass for
    one with CUDA graphs: the first skip counted here warns, once."""

    def __init__(self) -> None:
        self.told = False

    def count(self) -> int:
        skips = cudagraph_skips()
        if skips and not self.told:
            self.told = True
            get_logger().warning(
                f"warning: train.compile_mode=reduce-overhead: inductor ran {skips} compiled graph(s) "
                "without CUDA graphs (TORCH_LOGS=perf_hints says why); those run as with compile_mode=default"
            )
        return skips


@dataclass
class StepResult:
    stats: StepStats
    grad_norm: torch.Tensor  # on the device, like ``stats.loss``: read on logged steps only


def chunks_chosen_for(batch: BatchConfig) -> dict[str, Any]:
    """The settings auto chunks are chosen for, besides the world size: saved beside the choice."""
    return {
        "asked": list(batch.chunks),
        "global_size": batch.global_size,
        "memory_budget": batch.memory_budget,
    }


def chunks_kept_from(
    saved: dict[str, Any] | None, batch: BatchConfig, world_size: int
) -> tuple[int, int] | None:
    """The chunks a checkpoint's run chose, when they were chosen for this run's setting: the same
    world size, global batch and chunk settings, and no other ``batch.memory_budget`` set (a tower's
    fixed chunk or the budget lowered at a resume, after running out of memory, must not give way to
    the saved choice; a budget left unset keeps it). None: choose again. A setting a checkpoint from
    before it was saved lacks counts as this run's."""
    if saved is None or saved["world_size"] != world_size:
        return None
    now = chunks_chosen_for(batch)
    if not batch.memory_budget:
        del now["memory_budget"]
    if any(saved.get(key, value) != value for key, value in now.items()):
        return None
    image, text = saved["chunks"]
    return image, text


class Trainer:
    def __init__(
        self,
        cfg: Config,
        env: DistEnv,
        startup_ended: Mapping[str, float] | None = None,
        out_dir_lock: RunLock | None = None,
    ) -> None:
        """``startup_ended``: when the start-up's stages before the trainer ended (``clip-train
        train``'s imports and process group), the first laps of its start-up clock. ``out_dir_lock``:
        the lock ``clip-train train`` holds on ``train.out_dir``, which the run checks it still holds
        before each step and each save."""
        self.cfg, self.env, self.out_dir_lock = cfg, env, out_dir_lock
        require_host_collectives()
        # Every rank makes the periodic evaluations' group, before the model: see StoppableEvaluation
        periodic = evaluates_anything(cfg.eval, cfg.data) and 0 < cfg.eval.every_steps < cfg.train.max_steps
        self.evaluations = StoppableEvaluation(cfg.train.dist_timeout_s) if periodic else None
        clock = StartupClock(settle=lambda: wait_for_device(env.device), ended=startup_ended)
        self.startup: StartupClock | None = clock  # None once this process's first step ended
        clock.lap("launch")  # since those stages (or the process's start): logging, the folder's lock
        self.startup_metrics: dict[str, float] = {}  # for the first metrics record after the first step
        self.cudagraph_skips = CudaGraphSkips()  # logged under compile_mode=reduce-overhead
        self.run_dir = Path(cfg.train.out_dir)
        self.step = 0
        self.restored_chunks: dict[str, Any] | None = None  # what auto chose before a resume
        self.skipped = dict.fromkeys(SKIP_REASONS, 0)  # every rank's skipped samples, as of the last log
        self.sources: dict[str, int] = {}  # every rank's samples per mixture source, likewise

        use_tf32(env.device, cfg.train.precision)
        # checkpoint.remote on rank 0; the checkpointer pulls from it when it picks the step to resume.
        saving = cfg.checkpoint
        self.remote = (
            RemoteMirror(saving.remote, self.run_dir, keep=saving.keep, keep_every=saving.keep_every)
            if saving.remote and env.is_main
            else None
        )
        # A requeued run resumes its own checkpoint and never reads init_from or the towers' pretrained
        # weights (they may be gone; the checkpoint holds every weight).
        resumes = decided_by_main(self._finds_a_checkpoint)
        if resumes and self.remote is not None:  # a fresh disk: the run's config, read for its pins
            self.remote.pull_run_files()
        self._pin_weight_sources(resumes)
        self.sharded = cfg.train.parallel == "fsdp"
        self.model = self._built_model(resumes)
        # Loaded at every start, a resumed one's too: the teacher is an input, never checkpointed. It
        # takes the student's parameter dtype (fp64 runs are fp64 throughout).
        dtype = self.model.logit_scale.dtype
        self.teacher = None
        if cfg.distill.teacher:
            self.teacher = load_teacher(cfg.distill, self.model, env.device, dtype)
        clock.lap("model")
        # Rank 0 logs the MFU against its device's peak, and decides for every rank: ranks' GPUs may
        # differ, and each decision must be made by all. Counted on the whole towers, before compiling
        # (one-sample shapes) and sharding.
        self.peak_tflops, towers_flops = decided_by_main(self._peak_and_tower_flops)
        clock.lap("flops")
        if cfg.train.compile:  # before sharding, as torchtitan does: FSDP2 shards the compiled blocks
            compile_towers(self.model, cuda_graphs=cfg.train.cuda_graphs)
        measured = None
        if self.sharded:  # what needs the whole towers runs on rank 0 before they are sharded
            measured = self._measure_chunks() if "auto" in cfg.batch.chunks else None
            shard_towers(self.model, cfg.fsdp, cfg.train.precision, env.device)
        clock.lap("sharding")
        self.update = Update(self.model, cfg, env.device)
        self.ema = WeightsEMA.from_config(self.model, cfg.train)  # of the weights as loaded and sharded
        first_traced = cfg.log.profile_after + 1
        self.profiler = StepProfiler(first_traced, cfg.log.profile_steps, self.run_dir, env.device, env.rank)
        self.loader = build_train_loader(
            cfg.data,
            global_batch=cfg.batch.global_size,
            rank=env.rank,
            world_size=env.world_size,
            seed=cfg.train.seed,
            image_size=self.model.image_size,
            tokenizer=self.model.tokenizer,
            pin_memory=env.device.type == "cuda",
        )
        self.checkpointer = self._checkpointer()
        torch.manual_seed(cfg.train.seed + 1 + env.rank)  # dropout masks differ across ranks
        clock.lap("optimizer_and_loader")
        self.resumed_from = self.checkpointer.restore()
        clock.lap("resume")
        if self.step > cfg.train.max_steps:
            raise UserError(
                f"train.max_steps={cfg.train.max_steps} is below step {self.step} of the checkpoint "
                f"{self.resumed_from}: nothing to train; raise train.max_steps to continue the run"
            )
        self.saved_step = self.step  # the newest step on disk (0: none worth saving)
        self.chunks, self.chunk_note = self._chunks(measured)
        self._check_one_chunk_for_cuda_graphs()
        clock.lap("chunks")
        # The engine wraps the towers in DDP, which broadcasts rank 0's weights: they are final now.
        # Towers sharded with FSDP2 reduce their own gradients.
        self.engine = GradCache.from_config(self.model, cfg, self.chunks, self.teacher)
        self.flops_per_sample = None
        if towers_flops is not None:
            rows = cfg.batch.global_size // env.world_size
            trains, replayed = self.engine.trains_and_replays(rows)
            self.flops_per_sample = training_flops_per_sample(towers_flops, trains, replayed)
        clock.lap("engine")

    def _built_model(self, resumes: bool) -> CLIP:
        """The model with its first weights on the run's device: built from the seed (the same on every
        rank) or pretrained, then ``model.init_from``'s when fine-tuning; a run that ``resumes`` reads
        neither (its checkpoint's weights follow). Ranks that build on meta (FSDP) get rank 0's weights
        when the towers are sharded."""
        cfg, device = self.cfg, self.env.device
        on_meta = self.sharded and builds_on_meta(cfg.fsdp)
        fine_tune = bool(cfg.model.init_from) and not resumes
        torch.manual_seed(cfg.train.seed)
        load_pretrained = not (cfg.model.init_from or resumes)
        model = build_model(cfg.model, load_pretrained=load_pretrained, on_meta=on_meta)
        model = model.double() if cfg.train.precision == "fp64" else model
        model = model if on_meta else model.to(device)
        if fine_tune and not on_meta:
            with naming_key("model.init_from", cfg.model.init_from):
                load_init_from(cfg.model, model)
        if fine_tune and self.sharded:
            main_done()  # the ranks on meta wait for rank 0's load here, not in shard_towers' broadcast
        return model

    def _checkpointer(self) -> Checkpointer:
        """What a checkpoint holds: the weights, the EMA, this trainer's and the update's state, and
        each rank's RNG and data position; under FSDP the optimizer's states in shards."""
        per_rank = {"rng": ProcessRng(), "data": self.loader}
        if self.sharded:  # the optimizer's states are saved in shards, beside the weights'
            optimizer = self.update.optimizer
            make_checkpointer = functools.partial(ShardedCheckpointer, optimizer=optimizer)
            update = OptimizerApart(self.update, optimizer)
        else:
            make_checkpointer, update = Checkpointer, self.update
        return make_checkpointer(
            self.run_dir,
            self.cfg.checkpoint,
            self.model,
            self.cfg.model,
            shared={"trainer": self, "update": update},
            per_rank=per_rank,
            ema=self.ema,
            remote=self.remote,
        )

    def _check_one_chunk_for_cuda_graphs(self) -> None:
        """What ``Config.validate`` cannot see: the chunks auto chose (or a checkpoint kept)."""
        per_rank = self.cfg.batch.global_size // self.env.world_size
        if self.cfg.train.cuda_graphs and self.chunks != (per_rank, per_rank):
            chunks = "/".join(map(str, self.chunks))
            chosen = f"image/text chunks {chunks} ({self.chunk_note})"
            raise ConfigError(one_chunk_for_cuda_graphs(chosen, per_rank))

    def _finds_a_checkpoint(self) -> bool:
        """Whether ``checkpoint.resume`` names one (sizes checked), or ``auto`` finds one on the remote:
        ``restore`` then resumes it or refuses a damaged one, so the run never starts over from
        ``init_from``."""
        resume = self.cfg.checkpoint.resume
        if resolve_resume(resume, self.run_dir) is not None:
            return True
        return resume == "auto" and self.remote is not None and self.remote.newest_complete() is not None

    def _pin_weight_sources(self, resumes: bool) -> None:
        """``model.init_from`` and ``distill.teacher`` as the weights files they named at the run's
        start (``pinned``; rank 0 decides), recorded so in config.yaml (and init_from in each
        checkpoint's model.yaml, for WiSE-FT). A resumed run keeps its start's, as its config.yaml
        says (that of the run whose checkpoint it resumes); it resolves a teacher it never pinned, but
        not an init_from, which it does not read."""
        cfg, config_file = self.cfg, self._resumed_run_config() if resumes else None
        earlier = None
        if config_file is not None:
            try:
                earlier = load_config(config_file, saved=True)
            except ConfigError as err:  # cut short by a kill as it was written, say: it pins nothing
                get_logger().warning(f"{config_file} does not read ({err}): no earlier pins taken from it")
        for part, field, resolve in (("model", "init_from", not resumes), ("distill", "teacher", True)):
            section, key = getattr(cfg, part), f"{part}.{field}"
            named = getattr(section, field)
            before = getattr(getattr(earlier, part), field) if earlier is not None else ""
            with naming_key(key, named):
                file = decided_by_main(functools.partial(pinned, named, before, resolve=resolve))
            if file != named:
                setattr(section, field, file)
                if self.env.is_main:
                    get_logger().info(f"{key}={named}: {file}")

    def _resumed_run_config(self) -> Path | None:
        """The config.yaml of the run this one continues: its own, or that of the run directory whose
        checkpoint ``checkpoint.resume=PATH`` names (a run continued in another ``train.out_dir``)."""
        own, resume = self.run_dir / RUN_CONFIG_FILE, self.cfg.checkpoint.resume
        if own.is_file():
            return own
        return run_config_file(Path(resume)) if resume not in ("", "auto") else None

    def _measure_chunks(self, also_held: object = ()) -> ChunkChoice:
        """Auto chunks fitted on rank 0 alone (its towers measured); every rank gets its choice.
        Compiled towers are measured eager: each probed chunk size would otherwise compile anew.
        ``also_held``: see ``choose_chunks``."""
        return decided_by_main(functools.partial(self._measured_eager, also_held))

    def _measured_eager(self, also_held: object) -> ChunkChoice:
        with torch.compiler.set_stance("force_eager"):
            return choose_chunks(self.model, self.cfg, self.env.world_size, also_held)

    def _chunks(self, measured: ChunkChoice | None = None) -> tuple[tuple[int, int], str]:
        """The per-rank image and text chunks, and how auto ones were chosen. A resumed run at the
        same world size keeps its checkpoint's choice, so its steps sum in the same order. Sharded
        towers are ``measured`` before sharding (rank 0 alone runs them), and the choice counts their
        sharded states (``run_setting``)."""
        batch, world = self.cfg.batch, self.env.world_size
        per_rank = batch.global_size // world
        if "auto" not in batch.chunks:
            return (batch.image_chunk or per_rank, batch.text_chunk or per_rank), ""
        if kept := chunks_kept_from(self.restored_chunks, batch, world):
            note = f"auto chunks: image {kept[0]} / text {kept[1]} per rank, as chosen before the resume"
            return kept, note
        if measured is None:  # unsharded towers: now, beside the EMA and a resumed optimizer's states
            ema = self.ema.averages if self.ema is not None else {}
            measured = self._measure_chunks((list(self.update.optimizer.state.values()), ema))
        return (measured.image, measured.text), measured.describe()

    def state_dict(self) -> dict[str, Any]:
        chunks = {"chunks": list(self.chunks), "world_size": self.env.world_size}
        chunks |= chunks_chosen_for(self.cfg.batch)  # what they were chosen for
        return {"step": self.step, "chunks": chunks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The step (and the chunks auto chose); a loader whose own position was not restored replays
        its way to it."""
        self.step = state["step"]
        self.restored_chunks = state.get("chunks")
        self.loader.start_at(self.step)

    def train_step(self, batch: Batch, logged: bool = False) -> StepResult:
        """One optimizer step on this rank's share of the global batch. A ``logged`` one waits for the
        device at each stage and at its end, so that its time split is its own."""
        self.update.optimizer.zero_grad(set_to_none=not self.engine.grads_in_buckets)
        with self.update.running_stats_guarded():
            stats = self.engine.step(
                batch.images,
                batch.input_ids,
                batch.attention_mask,
                scale_loss=self.update.scaler.scale,
                timed=logged,
            )
            with phase("optimizer"):
                grad_norm = self.update(stats.loss, self.step + 1)
                if self.ema is not None:
                    self.ema.update(self.step + 1, self.update.stepped)  # a skipped step leaves it as it is
        self.step += 1
        if logged:  # the optimizer's and the EMA's queued kernels are this step's time
            wait_for_device(self.env.device)
        return StepResult(stats, grad_norm)

    def run(self, signals: SignalFlag | None = None) -> Metrics:
        """Train to ``train.max_steps``; returns the final evaluation metrics (empty without eval).

        A SIGTERM or SIGUSR1 on any rank during a step checkpoints that step and raises ``Preempted``:
        the ranks agree on it at each step boundary. A periodic evaluation stops on every rank first
        (``StoppableEvaluation``). During the final evaluation, when the last step is saved, a signal
        raises ``Preempted`` at once. ``signals`` is the flag of handlers the caller holds (the train
        command holds them from start-up to exit); without it, they are held for this call."""
        cfg, env = self.cfg, self.env
        monitor = None
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / RUN_CONFIG_FILE)
            record_launch(self.run_dir, os.environ)  # its restarts go on from the folder's checkpoints
            monitor = RunMonitor(cfg, self.run_dir, self.step)
            monitor.message(self.summary())
            if self.chunk_note:
                monitor.message(self.chunk_note)
            if self.flops_per_sample is not None:
                monitor.message(
                    f"model FLOPs {self.flops_per_sample / 1e9:.3g} GFLOP a sample (forward x 3 + replay); "
                    f"mfu against {self.peak_tflops:g} TFLOP/s a device"
                )
            if self.resumed_from is not None:
                monitor.message(f"resumed from {self.resumed_from} at step {self.step}")
                if untraced := self.profiler.missed_by(self.step, cfg.train.max_steps):
                    get_logger().warning(untraced)
        if self.startup is not None:
            self.startup.lap("monitor")  # the run folder, metrics.jsonl and wandb's start
        ending: BaseException | None = None  # what ended the run, for wandb
        try:
            with contextlib.nullcontext(signals) if signals is not None else preemption_signals() as signals:
                self.signals = signals
                self._evaluate_if_owed(monitor)
                window = LogWindow(time.perf_counter())
                while self._goes_on(signals):
                    if self.step >= cfg.train.max_steps:
                        return self._final_evaluation(signals, monitor)
                    logged = self._logs_at(self.step + 1)  # only logged steps wait for the device
                    if logged:  # the earlier steps' queued kernels are not this step's time
                        wait_for_device(env.device)
                    with self.profiler.around(self.step + 1):
                        started = time.perf_counter()
                        # A rank's data error stops all at once; a signal gives slow storage time,
                        # to the ranks that wait in failing_together's all-reduce for a slower one too
                        with waiting_for_data(), phase("data"), failing_together():
                            batch = next(self.loader)
                        data_s = time.perf_counter() - started
                        result = self.train_step(batch, logged)
                    ended = time.perf_counter()
                    window.add_step(ended)
                    first = self.startup is not None  # this process's: compiling, first calls, warm-up
                    self._after_step(result, monitor, data_s, ended - started, window)
                    # The next window starts after this step's logs and saves; after the first step
                    # too, which the start-up metrics time: in a window it made the rate 10x low.
                    if first or self._logs_at(self.step):
                        window = LogWindow(time.perf_counter())
                self.update.skipped_steps.settle(self.step)
                if cfg.checkpoint.every_steps and self.step > self.saved_step:  # 0: saves nothing
                    self._save()
                self._wait_for_the_upload()
                raise self._preempted(signals)
        except BaseException as err:
            ending = err
            if isinstance(err, TrainingAborted) and monitor is not None:  # the step that stopped it
                monitor.log(err.step, {"train/skipped_steps": err.total})
            raise
        finally:
            self.profiler.close()
            self.loader.close()  # its workers ignore SIGTERM (kept for preemption): stop them here
            if self.remote is not None:
                self.remote.wait()  # the last checkpoint's upload
            if monitor is not None:
                monitor.close(exit_code(ending, env))

    def _goes_on(self, signals: SignalFlag) -> bool:
        """The vote at each step boundary, in one all-reduce: False once a rank got a signal (the step
        is saved and the run stops); once another run took over rank 0's lock on ``train.out_dir``,
        the same one-line ``UserError`` on every rank, which saves nothing more there."""
        kept = self.out_dir_lock is None or self.out_dir_lock.kept
        unsignalled, out_dir_kept = all_ranks_true([signals.received is None, kept])
        if not out_dir_kept:
            self._check_out_dir_kept()
        return unsignalled

    def _check_out_dir_kept(self) -> None:
        """The same one-line ``UserError`` on every rank once another run took over rank 0's lock on
        ``train.out_dir``: this run must write nothing more there."""
        if self.out_dir_lock is not None:
            decided_by_main(self.out_dir_lock.check_kept)

    def _after_step(
        self, result: StepResult, monitor: RunMonitor | None, data_s: float, step_s: float, window: LogWindow
    ) -> None:
        """Log, checkpoint (only good steps) and evaluate."""
        cfg, last = self.cfg, self.step == self.cfg.train.max_steps
        if self.startup is not None:  # the first step this process ran
            self.startup.finish(data_s, step_s - data_s)
            self.startup_metrics = self.startup.metrics()
            if monitor is not None:
                monitor.message(self.startup.describe(self.step))
            self.startup = None
        at_log = self._logs_at(self.step)
        every = cfg.checkpoint.every_steps
        at_checkpoint = every > 0 and (self.step % every == 0 or last)
        if at_log or at_checkpoint:  # every rank reads the NaN guard's ledger at the same steps
            self.update.skipped_steps.settle(self.step)
        if at_log:  # every rank joins: each counts only the samples its own loader skipped
            self.skipped = sum_counts_over_ranks(self.loader.skip_counts(), SKIP_REASONS)
            if names := self.loader.source_names:
                self.sources = sum_counts_over_ranks(self.loader.source_counts(), names)
        if monitor is not None:
            self._report(monitor, result, data_s, step_s, window if at_log else None)
        saves = at_checkpoint and (last or not self.update.skipped_steps.in_a_row)
        evaluates = self._evaluates_at(self.step)
        if (saves or evaluates) and not at_log:  # the step's queued kernels are the window's time, not theirs
            wait_for_device(self.env.device)
        aside = time.perf_counter()
        self.profiler.write_finished()
        if saves:
            self._save()
        if evaluates:  # a signal on any rank stops it on every rank
            self._evaluate(monitor, self._stoppable())
        if not at_log:  # the window goes on after them (at a log step the next one starts then)
            window.leave_out(time.perf_counter() - aside)

    def _evaluate_if_owed(self, monitor: RunMonitor | None) -> None:
        """The resumed step's periodic evaluation, when metrics.jsonl holds no record of it: the run
        stopped during it (its step is saved first), or the file lacks it (a fresh disk's copy, whose
        upload after the evaluation did not complete), and it runs again."""
        if self.resumed_from is None or not self._evaluates_at(self.step):
            return
        if decided_by_main(lambda: self.step in monitor.evaluated_steps):  # rank 0, which holds the monitor
            return
        if monitor is not None:
            monitor.message(f"step {self.step}: {METRICS_FILE} holds no evaluation of it; evaluating it now")
        self._evaluate(monitor, self._stoppable())
        if self.startup is not None:
            self.startup.lap("evaluation")

    def _stoppable(self) -> EvaluationRun | None:
        """A periodic evaluation's run: one that a signal on any rank stops on every rank."""
        if self.evaluations is None:
            return None
        return functools.partial(self.evaluations.run, self.signals)

    def _evaluates_at(self, step: int) -> bool:
        """Whether ``step`` has a periodic evaluation (the last step's is the final evaluation)."""
        every = self.cfg.eval.every_steps
        return bool(every) and step % every == 0 and step < self.cfg.train.max_steps

    def _logs_at(self, step: int) -> bool:
        return step % self.cfg.log.every_steps == 0 or step == self.cfg.train.max_steps

    def _save(self) -> None:
        """Save the step; with ``checkpoint.remote``, rank 0 (which alone uploads) may first wait for
        the previous upload, longer than a collective may wait: the others wait for it through the
        store (``train.io_timeout_s``), not in their next collective (``train.dist_timeout_s``)."""
        mirrored = bool(self.cfg.checkpoint.remote)
        self._check_out_dir_kept()  # displaced from train.out_dir since the step's vote: no save
        with writing_checkpoint():  # waiting for an upload first is part of the save, not a stall
            if mirrored:  # the save prunes: never a checkpoint still going up
                decided_by_main(lambda: self.remote.before_save(self.cfg.checkpoint.keep))
            self.checkpointer.save(self.step)
        self.saved_step = self.step
        if mirrored:
            decided_by_main(lambda: self.remote.push(latest_checkpoint(self.run_dir)))

    def _final_evaluation(self, signals: SignalFlag, monitor: RunMonitor | None) -> Metrics:
        """The last step is saved (unless ``checkpoint.every_steps=0``), so a signal during the
        evaluation stops the process without saving anything. One after it (its record, the last
        uploads) is only recorded: the run has finished."""

        def stopped_by_signals(evaluate_on: Callable[[None], Metrics]) -> Metrics:
            with signals.raising():
                return evaluate_on(None)

        try:
            return self._evaluate(monitor, stopped_by_signals)
        except Preempted as stop:
            saved = latest_checkpoint(self.run_dir)
            kept = f"the last step's checkpoint {saved} is complete (clip-train eval evaluates it)"
            raise Preempted(
                f"{stop} during the final evaluation: nothing new saved; "
                f"{kept if saved else 'checkpoint.every_steps=0 saves none'}"
            ) from None

    def _wait_for_the_upload(self) -> None:
        """Every rank waits (through the store) for rank 0's upload of the checkpoint a preemption
        saved: a rank that ended first would have the launcher end rank 0 mid-upload (srun's
        ``--kill-on-bad-exit`` kills the step at the first rank's exit code 75)."""
        if self.cfg.checkpoint.remote:
            decided_by_main(lambda: self.remote.wait())

    def _preempted(self, signals: SignalFlag) -> Preempted:
        return Preempted(
            f"{signals.cause}: stopped after step {self.step}; checkpoint.resume=auto continues from "
            f"{latest_checkpoint(self.run_dir) or 'the start'}"
        )

    def summary(self) -> str:
        """The start-up line: how big the model is, where it runs, and how each step is cut up."""
        cfg, world = self.cfg, self.env.world_size
        total = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.model.trainable_parameters())
        per_rank = cfg.batch.global_size // world
        chunks = "/".join(map(str, self.chunks))
        return (
            f"{total:,} parameters ({trainable:,} trainable), world size {world}, device {self.env.device}, "
            f"per-rank batch {per_rank} in image/text chunks of {chunks}, "
            f"steps {self.step} to {cfg.train.max_steps}"
        )

    def _report(
        self, monitor: RunMonitor, result: StepResult, data_s: float, step_s: float, window: LogWindow | None
    ) -> None:
        """On log steps (a ``window``), show the headline numbers in the progress bar and write the
        metrics (skip counts: all ranks), the step's device values read in one transfer. Other steps
        only move the bar: a read there would make the host wait for the device every step.

        samples/s (and MFU) is over the whole window since the last log, whose steps run without
        waiting for the device; the time split is the logged step's own, which waits for the device
        at each stage (``timed``) to measure it."""
        if window is None:
            monitor.advance(self.step)
            return
        stats, bias = result.stats, self.model.logit_bias
        on_device = [stats.loss, result.grad_norm, self.model.logit_scale.detach().exp()]
        on_device += [value for value in (stats.distill_loss, bias) if value is not None]
        loss, grad_norm, scale, *distill_and_bias = torch.stack(
            [value.detach().to(self.env.device, torch.float64) for value in on_device]
        ).tolist()
        distilled = {"train/distill_loss": distill_and_bias.pop(0)} if stats.distill_loss is not None else {}
        bias_value = distill_and_bias
        samples_per_s = self.cfg.batch.global_size * window.steps / window.elapsed
        lr = self.update.lr
        peak = self.engine.peak_since_step_start() or peak_bytes(self.env.device)  # the optimizer's too
        parts = {"enc": stats.encode_s, "gat": stats.gather_s, "loss": stats.loss_s, "rep": stats.replay_s}
        optimizer_s = step_s - data_s - sum(parts.values())
        split = {**parts, "opt": optimizer_s}
        if not self.sharded:
            del split["gat"]  # nothing is gathered
        utilization = self._utilization(samples_per_s)
        monitor.advance(
            self.step,
            {
                "loss": loss,
                "samples/s": round(samples_per_s),
                **({"mfu": f"{utilization['train/mfu']:.1%}"} if utilization else {}),
                "lr": lr,
                "scale": scale,
                f"{'/'.join(split)} s": "/".join(f"{t:.2f}" for t in split.values()),
                "mem GiB": round(peak / 2**30, 2),
                "skipped": sum(self.skipped.values()),
            },
        )
        metrics = {
            "train/loss": loss,
            "train/lr": lr,
            "train/logit_scale": scale,
            **({"train/logit_bias": bias_value[0]} if bias_value else {}),
            **distilled,
            "train/grad_norm": grad_norm,
            "train/samples_per_s": samples_per_s,
            **utilization,
            "time/step_s": step_s,
            "time/window_s": window.elapsed,
            "time/data_s": data_s,
            "time/encode_s": stats.encode_s,
            "time/gather_s": stats.gather_s,
            "time/loss_s": stats.loss_s,
            "time/replay_s": stats.replay_s,
            "time/optimizer_s": optimizer_s,
            "memory/peak_bytes": peak,
            "memory/cache_bytes": stats.cache_bytes,
            "train/skipped_steps": self.update.skipped_steps.total,
        }
        metrics.update({f"data/skipped_{reason}": n for reason, n in self.skipped.items()})
        metrics.update({f"data/source/{name}": n for name, n in self.sources.items()})
        if self.cfg.train.cuda_graphs:
            metrics["compile/cudagraph_skips"] = self.cudagraph_skips.count()
        metrics.update(self.startup_metrics)  # in the first record only
        self.startup_metrics = {}
        monitor.log(self.step, metrics)

    def _peak_and_tower_flops(self) -> tuple[float | None, tuple[TowerFlops, TowerFlops] | None]:
        """This device's peak TFLOP/s and the towers' FLOPs, when a peak is known (for ``mfu``)."""
        cfg = self.cfg
        peak = device_peak_tflops(self.env.device, cfg.train.precision, cfg.log.peak_tflops)
        return peak, tower_flops(self.model) if peak else None

    def _utilization(self, samples_per_s: float) -> dict[str, float]:
        """Model TFLOP/s a device and MFU (their share of the device's peak), when a peak is known."""
        if self.flops_per_sample is None:
            return {}
        tflops = self.flops_per_sample * samples_per_s / self.env.world_size / 1e12
        return {"train/tflops": tflops, "train/mfu": tflops / self.peak_tflops}

    def _evaluate(self, monitor: RunMonitor | None, run: EvaluationRun | None = None) -> Metrics:
        """The evaluation metrics; empty without eval data, or when ``run`` (which calls the
        evaluation with its process group, e.g. ``StoppableEvaluation.run``) returns None."""
        if not evaluates_anything(self.cfg.eval, self.cfg.data):
            return {}
        averaged = self.ema.swapped_in() if self.cfg.eval.use_ema else contextlib.nullcontext()
        whole = contextlib.nullcontext()
        if self.sharded:  # every rank gathers the full weights: eval's ranks see uneven batches
            whole = gathered_for_eval(self.model, self.cfg.fsdp.reshard_after_forward)
        run = run or (lambda evaluate_on: evaluate_on(None))
        # eval must not shift the training RNG streams; a line marks its start in a Slurm log
        # Under CUDA graphs, eager: a no_grad pass stops at its second graphed block
        # (``_check_compile_mode``), and each eval shape would be recorded and kept.
        eager = (
            torch.compiler.set_stance("force_eager")
            if self.cfg.train.cuda_graphs
            else contextlib.nullcontext()
        )
        with preserved_rng(self.env.device), averaged, whole, eager, timed(f"step {self.step}: evaluating"):
            metrics = run(
                lambda group: evaluate(
                    self.model,
                    self.cfg.eval,
                    self.cfg.data,
                    device=self.env.device,
                    precision=self.cfg.train.precision,
                    group=group,
                )
            )
        if metrics is None:
            get_logger().warning(f"step {self.step}: evaluation stopped by a signal")
            return {}
        if monitor is not None:
            monitor.log(self.step, metrics)
            monitor.message(f"step {self.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if self.remote is not None:  # its checkpoint went up before this record was written
            self.remote.push_metrics()
        return metrics
