"""Evaluate a checkpoint: clip-train eval CHECKPOINT [CONFIG] [key=value ...]

Zero-shot classification and image<->text retrieval recall@k, each rank encoding its own share of
the data; one process or under torchrun. Without a CONFIG, the checkpoint's own model config and
the other sections of its run's config.yaml are used.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from clip_train.checkpoint import find_weights, load_weights_file
from clip_train.distributed import init_distributed, shutdown_distributed
from clip_train.ema import load_ema_weights
from clip_train.eval import eval_config, evaluate
from clip_train.model import build_model
from clip_train.precision import use_tf32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        help="checkpoint directory, run directory (its newest checkpoint) or a .safetensors file",
    )
    parser.add_argument(
        "config",
        nargs="?",
        help="YAML run config whose model, data and eval sections are used; without it, the "
        "checkpoint's own model config and the other sections of its run's config.yaml",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="e.g. eval.zeroshot=imagenet eval.zeroshot_data=/data/imagenet/val train.precision=bf16 "
        "eval.use_ema=true",
    )


def run(args: argparse.Namespace) -> int:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).is_file():  # CONFIG left out
        config, overrides = None, [config, *overrides]
    file = find_weights(args.checkpoint, verify=True)  # its checksums, before any of it is read
    cfg = eval_config(file, config, overrides)
    env = init_distributed(cfg.train.device, cfg.train.dist_timeout_s)
    use_tf32(env.device, cfg.train.precision)
    try:
        model = build_model(cfg.model, load_pretrained=False).to(env.device)
        if cfg.train.precision == "fp64":
            model = model.to(torch.float64)
        load_weights_file(file, model)
        if cfg.eval.use_ema:
            load_ema_weights(file.parent, model)
        metrics = evaluate(model, cfg.eval, cfg.data, device=env.device, precision=cfg.train.precision)
        if env.is_main:
            for key, value in metrics.items():
                print(f"{key:<32} {int(value) if key.endswith('/n') else f'{value:.4f}'}")
            print(json.dumps({"checkpoint": str(file), **metrics}))
    finally:
        shutdown_distributed()
    return 0
