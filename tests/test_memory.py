"""The process memory readings that the trainer, plan and benchmarks report (CPU: resident set size)."""

from __future__ import annotations

import subprocess
import sys

# In a fresh process: a pytest worker may already hold freed pages that a new block reuses, so
# that its resident set does not grow (seen in CI).
TOUCH_256_MIB = """
import torch
from clip_train.memory import peak_bytes, used_bytes
cpu = torch.device("cpu")
before = used_bytes(cpu)
block = torch.ones(64 * 2**20)  # every page written
during = used_bytes(cpu)
del block
print(before, during, peak_bytes(cpu))
"""


def test_touched_memory_shows_in_use_and_stays_in_the_peak():
    out = subprocess.run([sys.executable, "-c", TOUCH_256_MIB], capture_output=True, text=True, check=True)
    before, during, peak_after_free = map(int, out.stdout.split())
    assert during - before >= 200 * 2**20
    # a high-water mark: freeing does not lower it (ru_maxrss and psutil's RSS differ by a few pages)
    assert peak_after_free >= before + 200 * 2**20
