import subprocess
import sys
import time
import types

import pytest

from clip_train import startup_time
from clip_train.startup_time import StartupClock


def test_the_first_lap_counts_from_the_process_start_not_from_the_clock():
    """What ran before the clock existed (here a 0.5 s sleep standing in for the imports) is the
    first lap's, and the start is the process's own to a clock tick: not up to a second early, as
    a boot time in whole seconds would make it. The real clocks, in order only: no duration is
    bounded from above."""
    code = (
        "import time; time.sleep(0.5)\n"
        "from clip_train.startup_time import StartupClock\n"
        "clock = StartupClock(); clock.lap('launch'); print(clock.started, clock.laps['launch'])"
    )
    before = time.time()
    started, launch = map(float, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    assert before - 0.02 <= started <= time.time() - launch and launch >= 0.5


@pytest.mark.parametrize("enabled", [True, False])
def test_imports_run_with_the_collector_paused_and_what_they_made_is_frozen(enabled):
    """In a fresh interpreter (freezing this one's objects would outlive the test): no collection
    during the imports, their objects frozen after them, and the collector as it was before."""
    code = (
        "import gc\n"
        f"gc.enable() if {enabled} else gc.disable()\n"
        "from clip_train.startup_time import collector_paused_then_frozen\n"
        "frozen = gc.get_freeze_count()\n"
        "with collector_paused_then_frozen():\n"
        "    paused = not gc.isenabled()\n"
        "    made = [[] for _ in range(10_000)]  # what an import leaves behind, standing in\n"
        "print(paused, gc.isenabled(), gc.get_freeze_count() - frozen >= len(made))"
    )
    printed = subprocess.check_output([sys.executable, "-c", code], text=True).split()
    assert printed == ["True", str(enabled), "True"]


@pytest.fixture
def clock_at(monkeypatch) -> list[float]:
    """The clock ``StartupClock`` reads, moved by hand: the process started at 100.0."""
    now = [100.0]
    monkeypatch.setattr(startup_time, "process_started", lambda: 100.0)
    monkeypatch.setattr(startup_time, "time", types.SimpleNamespace(time=lambda: now[0]))
    return now


def test_stages_that_ended_before_the_clock_are_its_first_laps(clock_at):
    """``clip-train train`` ends its imports and its process group before the trainer's clock
    exists: that clock laps them first, in order and back to back."""
    clock = StartupClock(ended={"imports": 101.0, "process_group": 101.25})
    clock_at[0] = 101.5
    clock.lap("launch")
    assert list(clock.laps.items()) == [("imports", 1.0), ("process_group", 0.25), ("launch", 0.25)]


def test_laps_add_up_to_the_total_with_the_first_step_and_what_came_between(clock_at):
    clock = StartupClock()
    clock_at[0] = 100.5
    clock.lap("launch")
    clock_at[0] = 101.0
    clock.lap("model")
    clock_at[0] = 101.25
    clock.lap("model")  # a stage lapped twice adds up
    clock_at[0] = 102.0  # the loop's own wait, then a 0.25 s batch and a 0.25 s step that it timed
    clock.finish(first_batch_s=0.25, first_step_s=0.25)
    laps = [("launch", 0.5), ("model", 0.75), ("first_batch", 0.25), ("first_step", 0.25), ("other", 0.25)]
    assert list(clock.laps.items()) == laps
    assert clock.total_s == 2.0  # the first step ended at 102.0
    metrics = clock.metrics()
    assert metrics == {"startup/total_s": 2.0, **{f"startup/{s}_s": t for s, t in clock.laps.items()}}
    late = StartupClock()
    late.finish(first_batch_s=0.5, first_step_s=1.5)  # timed by the loop on another clock: nothing else
    assert late.laps["other"] == 0.0


def test_the_line_names_the_step_and_leaves_out_stages_under_a_twentieth_of_a_second():
    clock = StartupClock()
    clock.laps = {"launch": 4.04, "flops": 0.01}
    clock.finish(first_batch_s=0.5, first_step_s=21.96)
    line = clock.describe(7)
    assert line.startswith(f"start-up: step 7 ended {clock.total_s:.1f} s after the process started (")
    assert "launch 4.0, first batch 0.5, first step 22.0" in line and "flops" not in line


def test_each_lap_settles_first_and_charges_the_wait_to_its_stage(clock_at):
    """On a GPU the trainer settles by waiting for the device: a stage's queued kernels are its own.
    The first step's end does not wait: only logged steps do (the loop times those)."""

    def settle() -> None:
        clock_at[0] += 0.5

    clock = StartupClock(settle=settle)
    clock.lap("launch")
    clock.lap("flops")
    clock.finish(first_batch_s=0.0, first_step_s=0.0)
    assert clock.laps == {"launch": 0.5, "flops": 0.5, "first_batch": 0.0, "first_step": 0.0, "other": 0.0}
