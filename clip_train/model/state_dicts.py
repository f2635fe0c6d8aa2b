"""Loading state dicts: why one does not fit a model, in one line a user can act on, and the hook
that adapts one before it is checked (a position embedding resampled to the run's image size)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

import torch

Adapt = Callable[[dict[str, torch.Tensor]], None]  # replaces tensors of a weights file in place


def listed(names: Iterable[str], shown: int = 3) -> str:
    """``N keys (a, b, c and M more)``: enough names to recognise a layout, on one line."""
    names = sorted(names)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} key{'s' if len(names) != 1 else ''} ({', '.join(names[:shown])}{more})"


def misfit(
    weights: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], kept_if_absent: Collection[str] = ()
) -> str:
    """The keys that keep ``weights`` from loading strictly into ``own`` (missing ones, unless
    ``kept_if_absent``, unexpected ones and those of another shape); "" when it loads."""
    problems = {
        "missing": own.keys() - weights.keys() - set(kept_if_absent),
        "unexpected": weights.keys() - own.keys(),
        "mis-shaped (weights vs model)": [
            f"{key} {tuple(weights[key].shape)} vs {tuple(own[key].shape)}"
            for key in own.keys() & weights.keys()
            if weights[key].shape != own[key].shape
        ],
    }
    return "; ".join(f"{what} {listed(names)}" for what, names in problems.items() if names)
