"""``clip-train plan CONFIG --gpus 8 --gpu-mem 80``: per-GPU memory of one Gradient Cache step, for
each loss implementation with and without offload, and the largest global batch that fits.

    M_peak ≈ static + M_data + M_cache + max(M_loss + M_kept, M_backbone)   (Inf-CL eq. 10)

Activations are measured on this machine (the peak bytes of the storages a tower's pass creates,
at two small chunk sizes, scaled linearly; on the CPU with fake tensors, which allocate without
computing); every other term is
counted from shapes (``clip_train/plan/estimate.py`` defines them). The towers are built from their
architectures alone: no pretrained weights, no network. Progress goes to stderr, the plan to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from clip_train.bench.runner import in_fresh_process
from clip_train.config import load_config
from clip_train.errors import UserError
from clip_train.plan.architecture import find_text_architecture
from clip_train.plan.estimate import Setting
from clip_train.plan.progress import announce


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config (e.g. configs/model/vit-b16-bert-base.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument("--gpus", type=int, default=8, help="data-parallel GPUs (default 8)")
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU (default 80)")
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: batch.global_size)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the plan as JSON")
    parser.add_argument(
        "--measure-chunks",
        type=int,
        nargs=2,
        default=(2, 4),
        metavar=("A", "B"),
        help="chunk sizes of the activation measurement (default 2 4)",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="measure on")
    parser.add_argument(
        "--check-cpu",
        action="store_true",
        help="also run 2 real Gradient Cache steps on the CPU and compare their RSS growth with the plan",
    )


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    batch = args.batch if args.batch is not None else cfg.batch.global_size
    _validate_args(args, batch)
    cfg.batch.global_size = batch
    cfg.validate(world_size=args.gpus)
    find_text_architecture(cfg.model.text)  # read from disk: a missing one fails within a second
    with announce("importing torch, transformers and timm"):  # seconds, hence after the checks
        from clip_train.plan.table import cpu_check_prediction, cpu_check_report, make_plan
    chunks = tuple(args.measure_chunks)
    title = f"plan: {args.config} {' '.join(args.overrides)}".rstrip()
    text, record = make_plan(cfg, args.gpus, args.gpu_mem, args.device, chunks, title)
    print(text)
    result = {"config": str(args.config), "overrides": list(args.overrides), **record}
    if args.check_cpu:
        result["check_cpu"] = check = _check_cpu(args, *cpu_check_prediction(cfg, chunks))
        print(cpu_check_report(cfg, check))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def _validate_args(args: argparse.Namespace, batch: int) -> None:
    if args.gpus <= 0:
        raise UserError(f"--gpus {args.gpus}: must be >= 1")
    if not args.gpu_mem > 0:
        raise UserError(f"--gpu-mem {args.gpu_mem}: must be > 0 GiB")
    if batch <= 0:
        named = f"--batch {batch}" if args.batch is not None else f"batch.global_size={batch}"
        raise UserError(f"{named}: must be >= 1")
    if args.check_cpu and args.gpus != 1:
        raise UserError(f"--check-cpu runs one process on this machine: use --gpus 1, not {args.gpus}")
    if args.json and not Path(args.json).parent.is_dir():  # before the measuring, not after it
        raise UserError(f"--json {args.json}: no folder {Path(args.json).parent} to write it in")


def _check_cpu(args: argparse.Namespace, setting: Setting, predicted: float) -> dict[str, float]:
    """``setting``'s predicted peak against the RSS growth of 2 real steps in a fresh process."""
    spec = {
        "config": str(args.config),
        "overrides": list(args.overrides),
        "setting": dataclasses.asdict(setting),
    }
    with announce(f"--check-cpu: {setting.batch} samples through 2 real steps in a fresh process"):
        measured = in_fresh_process(cpu_step, spec)
    return {"predicted": predicted, "measured": measured, "ratio": measured / predicted}


def cpu_step(spec: dict[str, Any]) -> int:
    """``--check-cpu``'s fresh process: the config again, then real steps."""
    from clip_train.plan.profile import measure_cpu_step

    cfg = load_config(spec["config"], spec["overrides"])
    return measure_cpu_step(cfg.model, Setting(**spec["setting"]), cfg.train.precision)
