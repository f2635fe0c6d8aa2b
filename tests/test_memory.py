"""The process memory readings that the trainer, plan and benchmarks report (CPU: resident set size)."""

from __future__ import annotations

import torch

from clip_train.memory import peak_bytes, used_bytes

CPU = torch.device("cpu")


def test_touched_memory_shows_in_use_and_stays_in_the_peak():
    before = used_bytes(CPU)
    block = torch.ones(64 * 2**20)  # 256 MiB, every page written
    during = used_bytes(CPU)
    assert during - before >= 200 * 2**20
    del block
    # a high-water mark: freeing does not lower it (ru_maxrss and psutil's RSS differ by a few pages)
    assert peak_bytes(CPU) >= before + 200 * 2**20
