"""Train a CLIP model: ``clip-train train CONFIG [key=value ...]``, as one process or under torchrun.

Under torchrun every rank runs this. A rank that fails prints its rank and error and exits
non-zero, so torchrun stops (or restarts) the group; collectives time out after
``train.dist_timeout_s`` instead of hanging. The config is checked before torch is imported (a
typo is reported in a second, not after the imports), every path the run reads (and wandb, where
it logs there) before the process group and the model exist, the run holds ``train.out_dir``'s
lock before it touches the folder, and a run stopped by SIGTERM or SIGUSR1 exits with
``EXIT_PREEMPTED`` (75) after its checkpoint. However a run ends, every rank prints the same
one-line cause and exits with the same code (``stopping``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from clip_train.config import load_config
from clip_train.config.unused import warn_unused_settings
from clip_train.logs import get_logger, setup_logging
from clip_train.startup_time import collector_paused_then_frozen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML run config, e.g. configs/demo-digits.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. batch.global_size=65536")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides).validate()  # fails before any process group exists
    if cfg.data.workers > 0:
        # Read when torch starts its OpenMP threads: idle ones sleep instead of spinning, so the
        # loader workers that share the cores get them (8 % faster CPU steps with one worker on 2).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # Imported only now: torch, timm and transformers take seconds to load.
    with collector_paused_then_frozen():
        from clip_train.checkpoint import resume_at_restart
        from clip_train.compat import torchrun_waits_for_its_workers
        from clip_train.distributed import init_distributed, set_main_only_timeout, shutdown_distributed
        from clip_train.preemption import Preempted, preemption_signals, torchrun_grace_warning
        from clip_train.run_lock import hold_out_dir
        from clip_train.startup_checks import check_paths, check_wandb
        from clip_train.stopping import StopWatch
        from clip_train.trainer import Trainer

    # The start-up's first stages, for the trainer's clock: the interpreter, the config and the
    # library (torch, timm, transformers), then the paths, the device's context and the process group.
    ended = {"imports": time.time()}
    # A restart goes on from the run's own newest checkpoint: decided before the paths are checked,
    # since a requeue's checkpoint.resume=PATH may have been pruned since the first start.
    cfg.checkpoint.resume, restart = resume_at_restart(cfg.checkpoint.resume, cfg.train.out_dir, os.environ)
    check_paths(cfg)
    check_wandb(cfg.log.wandb)
    env = init_distributed(cfg.train.device, cfg.train.dist_timeout_s)
    ended["process_group"] = time.time()
    set_main_only_timeout(cfg.train.io_timeout_s)
    setup_logging(cfg.log.level, rank=env.rank, world_size=env.world_size, all_ranks=cfg.log.all_ranks)
    if env.is_main:
        warn_unused_settings(cfg)
        if restart is not None:
            get_logger().info(restart)
        if warning := torchrun_grace_warning(os.environ, torchrun_waits_for_its_workers()):
            get_logger().warning(warning)
    watch = StopWatch(env, Path(cfg.train.out_dir))
    # Held from here to the exit: a signal during start-up stops the run before its first step, and
    # one during the ending (torchrun stops the other ranks once one has ended) cannot kill this rank
    # before it prints its line.
    with preemption_signals() as signals:
        try:
            with hold_out_dir(cfg.train.out_dir) as lock:  # one run per out_dir, before the model is built
                Trainer(cfg, env, startup_ended=ended, out_dir_lock=lock).run(signals)
        except (Exception, KeyboardInterrupt, Preempted) as err:  # every way out: one line, on every rank
            return watch.ended_by(err)
        finally:
            watch.close()
        shutdown_distributed()
    return 0
