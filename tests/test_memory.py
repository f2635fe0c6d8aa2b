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
    # a high-water mark: freeing does not lower it (VmHWM and psutil's RSS differ by a few pages)
    assert peak_after_free >= before + 200 * 2**20


PEAK = "import torch; from clip_train.memory import peak_bytes; print(peak_bytes(torch.device('cpu')))"


def test_a_fresh_process_started_by_a_large_one_reports_its_own_peak():
    """ru_maxrss keeps the forking process's resident set across exec: a measurement in a fresh
    process started by a test worker or a benchmark's parent read the parent's size (9.1 GB for a
    plan step that used 0.3)."""
    held = bytearray(1024 * 2**20)
    held[::4096] = b"\1" * len(held[::4096])  # every page resident
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, check=True)
    assert int(out.stdout) < 800 * 2**20  # an interpreter with torch imported, not this process's GiB
    del held
