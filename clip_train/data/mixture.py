"""Weighted mixtures: each ``::``-joined part of ``data.train`` is a source with its own shards, and
``data.train_weights`` gives each a share of the samples.

Every source is an endless stream of its own resampled shards, so the source of each sample can be
drawn in proportion to the weights, from a generator seeded like the rest of the stream: the mixed
stream is a function of the seed and the stream position, which keeps resume exact.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from clip_train.config import SOURCE_SEPARATOR


@dataclass(frozen=True)
class Source:
    name: str  # short and stable (its index and folder name): the data/source/<name> metric
    urls: tuple[str, ...]
    weight: float  # its share of the samples (the weights normalised to sum to 1)


def source_name(index: int, spec: str) -> str:
    """``index`` and the last brace-free, named part of ``spec``'s path: ``/d/laion/{0..9}.tar`` ->
    ``0-laion``, ``/d/cc12m`` -> ``0-cc12m``, ``/d/x/000.tar`` -> ``0-000``."""
    parts = [p for p in re.split(r"[/\s]+", spec) if "{" not in p and re.search(r"[A-Za-z0-9]", p)]
    base = parts[-1].removesuffix(".tar") if parts else "source"
    return f"{index}-{re.sub(r'[^A-Za-z0-9._-]+', '_', base)[:40]}"


def source_index(name: str) -> int:
    """The index a ``source_name`` begins with: which source of ``data.train`` it names."""
    return int(name.split("-", 1)[0])


def mixture_sources(
    spec: str, weights: list[float], expand: Callable[[str, str], list[str]]
) -> tuple[Source, ...]:
    """The sources of ``spec``, one per weight (checked by ``Config.validate``); ``expand(part,
    what)`` lists one part's shard URLs."""
    parts = spec.split(SOURCE_SEPARATOR)
    total = sum(weights)
    return tuple(
        Source(
            source_name(index, part),
            tuple(expand(part, f"data.train source {index} ({part})")),
            weight / total,
        )
        for index, (part, weight) in enumerate(zip(parts, weights, strict=True))
    )


def interleave(
    streams: list[Iterator[dict[str, Any]]], weights: list[float], rng: random.Random
) -> Iterator[dict[str, Any]]:
    """Endless: each item from the stream ``rng`` draws in proportion to ``weights``, tagged with its
    index as ``"__source__"``. The streams must be endless too (resampled shards)."""
    cumulative = list(itertools.accumulate(weights))
    indices = range(len(streams))
    while True:
        index = rng.choices(indices, cum_weights=cumulative)[0]
        raw = next(streams[index])
        raw["__source__"] = index
        yield raw
