"""This process's memory, now and at its peak: the caching allocator's counts on CUDA, else the resident
set size, whose peak is process-wide (a measurement that needs its own peak runs in a fresh process).
"""

from __future__ import annotations

import resource
import sys

import psutil
import torch

MIB = 2**20


def used_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return psutil.Process().memory_info().rss


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _resident_peak()


def _resident_peak() -> int:
    """The resident set's peak since this program started. On Linux that is VmHWM: ru_maxrss also
    holds the resident set of the process that forked this one, kept across exec, so a fresh process
    started by a large one (a test worker, a benchmark's parent) would report the parent's."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:  # no procfs (macOS)
        pass
    kib_or_bytes = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib_or_bytes


def tensor_bytes(tree: object) -> int:
    """The bytes of the tensors in nested dicts, lists and tuples (anything else counts 0): what
    holding or saving them takes, give or take a little metadata."""
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    if isinstance(tree, dict):
        tree = list(tree.values())
    return sum(tensor_bytes(item) for item in tree) if isinstance(tree, list | tuple) else 0


def format_bytes(num_bytes: float) -> str:
    """Binary units short enough for a table cell: ``1.50G``, ``12.3M``, ``4.0K``."""
    size = abs(num_bytes)
    if size >= 2**30:
        return f"{num_bytes / 2**30:.2f}G"
    if size >= MIB:
        return f"{num_bytes / MIB:.1f}M"
    return f"{num_bytes / 2**10:.1f}K"
