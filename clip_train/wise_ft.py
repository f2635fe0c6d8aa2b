"""WiSE-FT (Wortsman et al., 2022): a fine-tuned CLIP's weights mixed with the weights it started
from, ``(1 - alpha) * start + alpha * fine_tuned``, tensor by tensor.

Fine-tuning a released CLIP gains on the target data and loses robustness under distribution
shift; a mixture keeps most of the gain and recovers most of the robustness, at no cost at
inference. The start is a fine-tuned run's ``model.init_from`` (an open_clip CLIP or a clip_train
checkpoint), loaded as the run loaded it at step 0, so the two share every shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from clip_train.checkpoint import checkpoint_init_from
from clip_train.config import ModelConfig
from clip_train.errors import UserError
from clip_train.init_from import built_from
from clip_train.logs import get_logger
from clip_train.model import CLIP

ENDS = "0: the weights the run started from, 1: the fine-tuned weights"


def parse_alpha(text: str) -> float:
    """A command line's alpha: a number in [0, 1], else argparse's one-line error."""
    try:
        alpha = float(text)
    except ValueError:
        alpha = math.nan
    if not 0.0 <= alpha <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1] ({ENDS})")
    return alpha


def parse_alphas(text: str) -> list[float]:
    """``0,0.5,1``: several alphas."""
    return [parse_alpha(part) for part in text.split(",")]


def start_of(checkpoint: Path, source: str = "") -> str:
    """Where the mixture's start comes from: ``source`` if given, else the ``model.init_from`` of the
    run that wrote ``checkpoint``."""
    source = source or checkpoint_init_from(checkpoint)
    if not source:
        raise UserError(
            "--wise-ft: the run has no model.init_from to mix with; name the weights it started from "
            "with --wise-ft-from (a checkpoint or open_clip:ARCH/TAG)"
        )
    return source


def starting_weights(cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """The weights ``source`` gives a model built from ``cfg``: with ``source`` the run's
    ``model.init_from``, what the run's model held before its first step."""
    cfg = dataclasses.replace(cfg, init_from=source)
    try:
        start = built_from(cfg, "the WiSE-FT start")
    except UserError as err:
        raise UserError(f"the WiSE-FT start {source}: {err} (--wise-ft-from names another)") from None
    return start.state_dict()


def check_alphas(alphas: list[float]) -> None:
    outside = [alpha for alpha in alphas if not 0.0 <= alpha <= 1.0]
    if outside:
        raise UserError(f"WiSE-FT alpha {outside[0]:g} is outside [0, 1] ({ENDS})")


def mixture(
    start: dict[str, torch.Tensor], fine_tuned: dict[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """``(1 - alpha) * start + alpha * fine_tuned`` for every floating-point tensor, in the fine-tuned
    tensor's dtype and device; other tensors (integer buffers) are the fine-tuned model's own."""
    if start.keys() != fine_tuned.keys():
        differ = sorted(start.keys() ^ fine_tuned.keys())
        raise UserError(f"--wise-ft: the start and the fine-tuned model differ in {differ[:3]}")
    return {
        name: torch.lerp(start[name].to(tensor), tensor, alpha) if tensor.is_floating_point() else tensor
        for name, tensor in fine_tuned.items()
    }


@torch.no_grad()
def mixtures(model: CLIP, cfg: ModelConfig, alphas: list[float], source: str) -> Iterator[float]:
    """Put the mixture at each alpha in turn into ``model``, which holds the fine-tuned weights,
    yielding the alpha; ``source`` as ``start_of`` returns it."""
    check_alphas(alphas)
    start = starting_weights(cfg, source)
    fine_tuned = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for alpha in alphas:
        model.load_state_dict(mixture(start, fine_tuned, alpha))
        get_logger().info(
            f"WiSE-FT alpha {alpha:g}: {1 - alpha:g} x {source} + {alpha:g} x the fine-tuned weights"
        )
        yield alpha


@torch.no_grad()
def mix_into(model: CLIP, cfg: ModelConfig, alpha: float, source: str) -> None:
    """Replace ``model``'s fine-tuned weights with their mixture at ``alpha``."""
    check_alphas([alpha])
    model.load_state_dict(mixture(starting_weights(cfg, source), model.state_dict(), alpha))
