"""Evaluate a checkpoint: clip-train eval CHECKPOINT [CONFIG] [key=value ...]

Zero-shot classification and image<->text retrieval recall@k, each rank encoding its own share of
the data; one process or under torchrun. Without a CONFIG, the checkpoint's own model config and
the other sections of its run's config.yaml are used. ``--wise-ft 0,0.5,1`` evaluates the
checkpoint's weights mixed with those its run started from (WiSE-FT), one column per mixture.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from clip_train.checkpoint import find_weights, load_weights_file
from clip_train.distributed import init_distributed, shutdown_distributed
from clip_train.ema import load_ema_weights
from clip_train.errors import UserError
from clip_train.eval import eval_config, evaluate
from clip_train.model import build_model
from clip_train.precision import use_tf32
from clip_train.startup_checks import check_eval_paths
from clip_train.wise_ft import mixtures, parse_alphas, start_of


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
    parser.add_argument(
        "--wise-ft",
        metavar="ALPHAS",
        type=parse_alphas,
        help="WiSE-FT: evaluate (1 - alpha) * start + alpha * checkpoint for each alpha, e.g. 0,0.5,1 "
        "(the start is the run's model.init_from)",
    )
    parser.add_argument(
        "--wise-ft-from",
        metavar="SOURCE",
        default="",
        help="with --wise-ft: the start's weights, when not the run's model.init_from (a checkpoint or "
        "open_clip:ARCH/TAG)",
    )


def run(args: argparse.Namespace) -> int:
    if args.wise_ft_from and args.wise_ft is None:
        raise UserError("--wise-ft-from names the start of WiSE-FT mixtures: give the alphas with --wise-ft")
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).is_file():  # CONFIG left out
        config, overrides = None, [config, *overrides]
    file = find_weights(args.checkpoint, verify=True)  # its checksums, before any of it is read
    cfg = eval_config(file, config, overrides)
    check_eval_paths(cfg)  # before the model is built and the checkpoint read
    env = init_distributed(cfg.train.device, cfg.train.dist_timeout_s)
    use_tf32(env.device, cfg.train.precision)
    try:
        model = build_model(cfg.model, load_pretrained=False).to(env.device)
        if cfg.train.precision == "fp64":
            model = model.to(torch.float64)
        load_weights_file(file, model)
        if cfg.eval.use_ema:
            load_ema_weights(file.parent, model)
        alphas, source = [None], ""
        if args.wise_ft is not None:
            source = start_of(file.parent, args.wise_ft_from)
            alphas = mixtures(model, cfg.model, args.wise_ft, source)
        results = {
            alpha: evaluate(model, cfg.eval, cfg.data, device=env.device, precision=cfg.train.precision)
            for alpha in alphas
        }
        if env.is_main:
            weights = "the EMA (eval.use_ema) of" if cfg.eval.use_ema else "the weights in"
            print(f"evaluated: {weights} {file}")
            print_metrics(results)
            for alpha, metrics in results.items():
                wise_ft = {} if alpha is None else {"wise_ft": {"alpha": alpha, "from": source}}
                # which weights: eval.use_ema may come from the run's config, where export and load
                # take the weights unless asked for the EMA
                print(json.dumps({"checkpoint": str(file), "ema": cfg.eval.use_ema, **wise_ft, **metrics}))
    finally:
        shutdown_distributed()
    return 0


def print_metrics(results: dict[float | None, dict[str, float]]) -> None:
    """One row per metric, one column per WiSE-FT mixture (headed by its alpha) or one plain column."""
    if None not in results:
        print(f"{'alpha':<32}{''.join(f'{alpha:>10g}' for alpha in results)}")
    for key in next(iter(results.values())):
        counts = key.endswith(("/n", "/skipped"))
        cells = [f"{int(m[key]):>10}" if counts else f"{m[key]:>10.4f}" for m in results.values()]
        print(f"{key:<32}{''.join(cells)}")
