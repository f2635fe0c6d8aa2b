"""Where training steps spend their time: ``log.profile_steps`` traces a few steps of a run with
``torch.profiler`` and writes a Chrome trace and a summary into the run folder (``profile/``).

The summary splits the traced steps' device time into matmul, attention, elementwise, optimizer,
copies and idle, and says what the host was doing while the device sat idle: the step's phases
(:data:`PHASES`) are ``record_function`` ranges, so an idle gap that falls while the host is still in
the loss (its host reads) or in the data wait is charged to it. That is the question a profile must
answer before the step gets faster: the device's work, or the gaps between it.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from clip_train.distributed import wait_for_device
from clip_train.logs import get_logger

PREFIX = "clip_train."
PHASES = ("data", "encode", "loss", "replay", "optimizer")
TRACED = PREFIX + "traced"  # the whole traced window, from one wait for the device to another
SHARES = ("matmul", "attention", "elementwise", "optimizer", "copies", "idle")
TOP_KERNELS = 15
CATEGORIES = (  # by kernel or op name, first match wins; the rest is elementwise (and other) work
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::baddbmm", "convolution")),
    ("copies", ("memcpy", "memset", "copy_kernel", "aten::copy_", "aten::to", "aten::clone", "aten::cat",
                "catarraybatched")),
)  # fmt: skip
# Collectives (NCCL's kernels, gloo's and c10d's ops): on their own stream, overlapping the compute,
# and their time is mostly waiting for the other ranks. They are reported apart, out of the shares
# and the busy time, so that a wait for a peer shows as idle compute rather than as work.
COMMUNICATION = ("nccl", "c10d::", "gloo:")


def phase(name: str) -> record_function:
    """A range of the step that the profile charges time to (a few µs when nothing profiles)."""
    return record_function(PREFIX + name)


def communicates(name: str) -> bool:
    """Whether a kernel (CUDA) or op (CPU) is a collective's (:data:`COMMUNICATION`)."""
    return any(needle in name.lower() for needle in COMMUNICATION)


def category(name: str, in_optimizer: bool) -> str:
    """Which share a kernel (CUDA) or op (CPU) counts toward. Inductor's fused kernels (``triton_*``)
    are elementwise work whatever their name holds (``_to_copy`` fused into a LayerNorm, say)."""
    if in_optimizer:
        return "optimizer"
    lowered = name.lower()
    if lowered.startswith("triton_"):
        return "elementwise"
    for label, needles in CATEGORIES:
        if any(needle in lowered for needle in needles):
            return label
    return "elementwise"


def profiler_events(prof: profile) -> list[dict[str, Any]]:
    """The profiler's events as plain records: ``name``, ``device`` (cuda or cpu), ``start`` and
    ``end`` in µs, CPU ``self`` µs, and whether it is an ``annotation`` (a ``record_function`` range,
    on the host or, for CUDA, its span on the GPU) rather than an op or a kernel."""
    return [
        {
            "name": e.name,
            "device": "cuda" if e.device_type == torch.autograd.DeviceType.CUDA else "cpu",
            "start": e.time_range.start,
            "end": e.time_range.end,
            "self": e.self_cpu_time_total,
            "annotation": e.is_user_annotation,
        }
        for e in prof.events()
    ]


def summarise(events: list[dict[str, Any]], device: str, steps: int) -> dict[str, Any]:
    """The traced window (the :data:`TRACED` range on the host) split into :data:`SHARES`, per step.

    On CUDA the work is the kernels' time on the GPU (their union: overlaps count once), on the CPU
    the ops' time; idle is the rest of the window. Work that starts inside the optimizer phase's span
    on the device (its GPU annotation on CUDA) is the optimizer's. ``idle_s`` charges each idle
    moment to the host phase it fell in (``other``: the loop between phases); ``host_s`` is how long
    the host spent in each phase. Collectives are none of these: ``communication_s`` is the time
    they ran, overlapping the rest or not."""
    window = next(e for e in events if e["device"] == "cpu" and e["name"] == TRACED)
    span = window["end"] - window["start"]
    host = _phase_intervals(events, "cpu")
    # On CUDA the optimizer range's span on the GPU; without GPU ranges (or on the CPU) the host's.
    optimizer = _phase_intervals(events, device)["optimizer"] or host["optimizer"]
    traced = [
        e
        for e in events
        if e["device"] == device and not e["annotation"] and window["start"] <= e["start"] <= window["end"]
    ]
    work = [e for e in traced if not communicates(e["name"])]
    talking = _union([(e["start"], min(e["end"], window["end"])) for e in traced if communicates(e["name"])])
    totals: dict[str, float] = defaultdict(float)
    kernel_us: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    for e in work:
        time_us = e["end"] - e["start"] if device == "cuda" else e["self"]
        in_optimizer = any(start <= e["start"] < end for start, end in optimizer)
        totals[category(e["name"], in_optimizer)] += time_us
        kernel_us[e["name"]] += time_us
        calls[e["name"]] += 1
    busy_intervals = _union([(e["start"], min(e["end"], window["end"])) for e in work])
    busy = sum(end - start for start, end in busy_intervals)
    worked = sum(totals.values()) or 1.0  # more than busy where work overlaps: shared pro rata
    shares = {name: busy / span * totals[name] / worked for name in SHARES if name != "idle"}
    shares["idle"] = 1 - busy / span
    gaps = _gaps(busy_intervals, window["start"], window["end"])
    idle = {name: _overlap(gaps, host[name]) / steps for name in PHASES}
    idle["other"] = (span - busy) / steps - sum(idle.values())
    top = sorted(kernel_us, key=kernel_us.__getitem__, reverse=True)[:TOP_KERNELS]
    seconds = 1e-6 / steps  # µs over the window -> s a step
    return {
        "device": device,
        "steps": steps,
        "step_s": span * seconds,
        "busy_s": busy * seconds,
        "communication_s": sum(end - start for start, end in talking) * seconds,
        "shares": shares,
        "idle_s": {name: us * 1e-6 for name, us in idle.items()},
        "host_s": {name: sum(end - start for start, end in host[name]) * seconds for name in PHASES},
        "top_kernels": [
            {
                "name": name,
                "calls": calls[name] / steps,
                "time_s": kernel_us[name] * seconds,
                "share": kernel_us[name] / span,
            }
            for name in top
        ],
    }


def _phase_intervals(events: list[dict[str, Any]], device: str) -> dict[str, list[tuple[float, float]]]:
    ranges: dict[str, list[tuple[float, float]]] = {name: [] for name in PHASES}
    for e in events:
        if e["device"] == device and e["annotation"] and e["name"].removeprefix(PREFIX) in ranges:
            ranges[e["name"].removeprefix(PREFIX)].append((e["start"], e["end"]))
    return {name: _union(intervals) for name, intervals in ranges.items()}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def _gaps(busy: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The parts of [start, end] outside the sorted, disjoint ``busy`` intervals."""
    edges = [start, *(t for interval in busy for t in interval), end]
    return [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if b > a]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two lists of disjoint intervals."""
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in a for b0, b1 in b)


def describe(summary: dict[str, Any]) -> str:
    """One line for the run's log."""
    shares = ", ".join(f"{name} {summary['shares'][name]:.0%}" for name in SHARES)
    idle = sorted(summary["idle_s"].items(), key=lambda item: -item[1])[:3]
    waits = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in idle if seconds > 0)
    step_ms, busy_ms = summary["step_s"] * 1e3, summary["busy_s"] * 1e3
    line = f"{step_ms:.1f} ms a step, {summary['device']} busy {busy_ms:.1f} ms: {shares}"
    return line + (f"; idle while the host was in {waits}" if waits else "")


class StepProfiler:
    """Traces steps ``first`` to ``first + steps - 1`` (numbered from 1, as the logs number them) on
    every rank. The window starts and ends with a wait for the device, so it holds exactly those
    steps' work; the first step's launch shows as idle, a cost shared by ``steps`` steps."""

    def __init__(self, first: int, steps: int, out_dir: Path, device: torch.device, rank: int) -> None:
        self.first, self.last = first, first + steps - 1
        self.out_dir, self.device, self.rank = out_dir, device, rank
        self._tracing = contextlib.ExitStack()
        self._profile: profile | None = None  # while tracing
        self._ended: profile | None = None  # traced, not yet written

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        """Around everything step ``step`` does up to its optimizer's last kernel."""
        if step == self.first <= self.last:  # profile_steps=0 traces nothing
            wait_for_device(self.device)
            activities = [ProfilerActivity.CPU]
            activities += [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            self._profile = self._tracing.enter_context(profile(activities=activities))
            self._tracing.enter_context(record_function(TRACED))
        yield
        if step == self.last and self._profile is not None:
            wait_for_device(self.device)
            self._tracing.close()
            self._profile, self._ended = None, self._profile

    def missed_by(self, resumed_step: int, max_steps: int) -> str | None:
        """Why a run resumed at ``resumed_step`` (of ``max_steps``) traces nothing, when it does not:
        the window began at or before that step, and its trace was not written (a run stopped
        within it writes none)."""
        if self.last < self.first or not self.first <= resumed_step < max_steps or self._written():
            return None
        latest = max_steps - (self.last - self.first + 1)  # the last profile_after whose window fits
        if resumed_step < latest:
            fix = f"log.profile_after={resumed_step} to {latest}"
        elif resumed_step == latest:
            fix = f"log.profile_after={resumed_step}"
        else:
            fix = (
                f"log.profile_after={resumed_step} with log.profile_steps={max_steps - resumed_step} or fewer"
            )
        return (
            f"warning: nothing is traced: log.profile_after={self.first - 1} starts the trace at step "
            f"{self.first}, and this run resumed at step {resumed_step}; {fix} traces the steps it runs"
        )

    def _written(self) -> bool:
        """Whether this window's trace is in the run folder: the run wrote it before it stopped."""
        summary = self.out_dir / "profile" / f"summary-rank{self.rank}.json"
        try:
            return json.loads(summary.read_text())["steps_traced"] == [self.first, self.last]
        except (OSError, ValueError, KeyError):
            return False

    def write_finished(self) -> None:
        """Write a trace that has ended: outside the steps' time, since exporting takes a while."""
        if self._ended is not None:
            self._write(self._ended)
            self._ended = None

    def close(self) -> None:
        """Stop a trace that the run left before its last step (nothing is written)."""
        self._tracing.close()

    def _write(self, prof: profile) -> None:
        folder = self.out_dir / "profile"
        folder.mkdir(parents=True, exist_ok=True)
        summary = summarise(profiler_events(prof), self.device.type, self.last - self.first + 1)
        summary["steps_traced"] = [self.first, self.last]
        (folder / f"summary-rank{self.rank}.json").write_text(json.dumps(summary, indent=2))
        trace = folder / f"trace-rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        with trace.open("rb") as raw, gzip.open(trace.with_suffix(".json.gz"), "wb") as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
        if self.rank == 0:
            get_logger().info(
                f"profile of steps {self.first}-{self.last}: {describe(summary)}; "
                f"trace and summary in {folder}"
            )
