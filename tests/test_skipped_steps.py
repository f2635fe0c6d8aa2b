"""The NaN guard's ledger on its own: what the device records settles to the counts the host keeps
when it reads every step, runs of skipped steps carry across reads, and the stop comes at the first
read after a run of ``train.max_bad_steps``, naming its length and the last good checkpoint."""

from __future__ import annotations

import pickle

import pytest
import torch

from clip_train.skipped_steps import SkippedSteps, TrainingAborted


def _record(ledger: SkippedSteps, step: int, skipped: bool) -> None:
    loss = torch.tensor(float("nan") if skipped else 1.5, requires_grad=True) * 1  # a loss with a graph
    ledger.record(torch.tensor(skipped), step, loss, torch.tensor(2.0))


@pytest.mark.parametrize("pattern", [".....", "..x..", "xx.x", "x..xx", "xxxx"])  # x: a skipped step
def test_what_the_device_records_settles_to_the_counts_read_every_step(tmp_path, pattern):
    on_device, on_host = SkippedSteps(10, tmp_path), SkippedSteps(10, tmp_path)
    for step, mark in enumerate(pattern, 1):
        _record(on_device, step, mark == "x")
        on_host.count(mark == "x", step, torch.tensor(1.5), torch.tensor(2.0))
    on_device.settle(len(pattern))
    assert (on_device.in_a_row, on_device.total) == (on_host.in_a_row, on_host.total)
    assert on_device.total == pattern.count("x") and on_device.in_a_row == len(pattern) - len(
        pattern.rstrip("x")
    )


def test_a_run_carries_across_reads_and_stops_at_the_read_after_it(tmp_path):
    ledger = SkippedSteps(3, tmp_path)
    for step in (1, 2, 3):
        _record(ledger, step, skipped=step > 1)
    ledger.settle(3)  # two in a row: below the limit
    assert (ledger.in_a_row, ledger.total) == (2, 2)
    _record(ledger, 4, skipped=True)
    _record(ledger, 5, skipped=False)  # the run ended before the read, which still stops the run
    assert not ledger._unread.requires_grad  # the losses' graphs are not chained step to step
    with pytest.raises(
        TrainingAborted, match=r"^3 consecutive steps .*max_bad_steps=3\); stopped at step 5\. .*none"
    ) as stopped:
        ledger.settle(5)
    copied = pickle.loads(pickle.dumps(stopped.value))  # as a process pool would hand it on
    assert (str(copied), copied.step, copied.total) == (str(stopped.value), 5, 3)


def test_reading_twice_reads_nothing_new(tmp_path, caplog):
    ledger = SkippedSteps(5, tmp_path)
    _record(ledger, 1, skipped=True)
    ledger.settle(1)
    assert (
        "1 step(s) skipped up to step 1, non-finite (the latest, step 1: loss nan, grad norm 2.0)"
        in caplog.text
    )
    caplog.clear()
    ledger.settle(2)
    assert (ledger.in_a_row, ledger.total) == (1, 1) and not caplog.text
