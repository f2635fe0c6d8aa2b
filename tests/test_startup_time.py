import subprocess
import sys
import time

import pytest

from clip_train.startup_time import StartupClock


def test_the_first_lap_counts_from_the_process_start_not_from_the_clock():
    """What ran before the clock existed (here a 0.5 s sleep standing in for the imports) is the
    first lap's, and the start is the process's own to a clock tick: not up to a second early, as
    a boot time in whole seconds would make it."""
    code = (
        "import time; time.sleep(0.5)\n"
        "from clip_train.startup_time import StartupClock\n"
        "clock = StartupClock(); clock.lap('launch'); print(clock.started, clock.laps['launch'])"
    )
    before = time.time()
    started, launch = map(float, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    assert before - 0.02 <= started <= time.time() - launch and launch >= 0.5


def test_stages_that_ended_before_the_clock_are_its_first_laps():
    """``clip-train train`` ends its imports and its process group before the trainer's clock
    exists: that clock laps them first, in order and back to back."""
    ended = {"imports": time.time()}
    time.sleep(0.1)
    ended["process_group"] = time.time()
    time.sleep(0.05)
    clock = StartupClock(ended=ended)
    clock.lap("launch")
    assert list(clock.laps) == ["imports", "process_group", "launch"]
    assert clock.laps["imports"] == pytest.approx(ended["imports"] - clock.started, abs=1e-9)
    assert clock.laps["process_group"] >= 0.1 and clock.laps["launch"] >= 0.05
    assert sum(clock.laps.values()) == pytest.approx(clock.total_s, abs=1e-9)  # one after the other


def test_laps_add_up_to_the_total_with_the_first_step_and_what_came_between():
    clock = StartupClock()
    clock.lap("launch")
    time.sleep(0.06)
    clock.lap("model")
    clock.lap("model")  # a stage lapped twice adds up
    time.sleep(0.2)  # the loop's own wait, then a 0.05 s batch and a 0.1 s step that it timed
    before = time.time()
    clock.finish(first_batch_s=0.05, first_step_s=0.1)
    after = time.time()
    assert list(clock.laps) == ["launch", "model", "first_batch", "first_step", "other"]
    assert clock.laps["model"] >= 0.06 and clock.laps["first_batch"] == 0.05
    assert clock.laps["other"] >= 0.05 - 1e-3  # the 0.2 s less the 0.15 s timed
    assert clock.total_s == pytest.approx(sum(clock.laps.values()), abs=1e-9)
    assert before <= clock.started + clock.total_s <= after
    metrics = clock.metrics()
    assert metrics["startup/total_s"] == clock.total_s
    assert {key for key in metrics if key != "startup/total_s"} == {f"startup/{s}_s" for s in clock.laps}


def test_the_line_names_the_step_and_leaves_out_stages_under_a_twentieth_of_a_second():
    clock = StartupClock()
    clock.laps = {"launch": 4.04, "flops": 0.01}
    clock.finish(first_batch_s=0.5, first_step_s=21.96)
    line = clock.describe(7)
    assert line.startswith(f"start-up: step 7 ended {clock.total_s:.1f} s after the process started (")
    assert "launch 4.0, first batch 0.5, first step 22.0" in line and "flops" not in line


def test_each_lap_settles_first_and_charges_the_wait_to_its_stage():
    """On a GPU the trainer settles by waiting for the device: a stage's queued kernels are its own.
    The first step's end does not wait: only logged steps do (the loop times those)."""
    settled = []
    clock = StartupClock(settle=lambda: (settled.append(True), time.sleep(0.05)))
    clock.lap("launch")
    clock.lap("flops")
    clock.finish(first_batch_s=0.0, first_step_s=0.0)
    assert len(settled) == 2 and clock.laps["flops"] >= 0.05
