"""The plan's activation measure (``NewStoragePeak``) against torch's MemTracker, the independent
reference it replaced: the same peak for a tower's encode and replay, on real and on fake tensors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from clip_train.config import load_config
from clip_train.plan.peak import NewStoragePeak
from clip_train.plan.profile import _planning_model, _random_inputs, build_planning_model
from clip_train.plan.progress import quiet

TINY = "configs/model/tiny.yaml"
DYNAMIC = ("Activation", "Temp", "Other")  # MemTracker's kinds that are not weights or gradients


def memtracker_peak(tracker: MemTracker) -> int:
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    return sum(v for k, v in snapshot.items() if k in DYNAMIC)


def both_peaks(tower: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> list[tuple[int, int]]:
    """(ours, MemTracker's) for a no-grad encode and a forward + backward, gradients pre-allocated
    as in a replay."""
    for p in tower.parameters():
        p.grad = torch.zeros_like(p)
    peaks = []
    for grad in (False, True):
        measured = []
        for tracker in (NewStoragePeak(), MemTracker()):
            with tracker, torch.set_grad_enabled(grad):
                chunk = tuple(t.clone() for t in inputs)
                features = tower(*chunk)
                if grad:
                    features.backward(torch.ones_like(features))
                del features, chunk
            ours = isinstance(tracker, NewStoragePeak)
            measured.append(tracker.bytes if ours else memtracker_peak(tracker))
        peaks.append(tuple(measured))
    return peaks


def compare(model: torch.nn.Module) -> None:
    for tower, name in ((model.visual, "image"), (model.text, "text")):
        for ours, reference in both_peaks(tower, _random_inputs(model, name, 4, 16)):
            assert ours > 0 and ours == pytest.approx(reference, rel=0.02), (name, ours, reference)


def test_a_towers_peak_equals_memtrackers_on_real_tensors():
    torch.manual_seed(0)
    compare(build_planning_model(load_config(TINY).model)[0])


def test_a_towers_peak_equals_memtrackers_on_fake_tensors():
    """As the plan measures on the CPU: fake tensors allocate what real ones would, without data."""
    with _planning_model(load_config(TINY).model, "fp32", "cpu", quiet) as (model, _):
        compare(model)


def test_views_and_in_place_writes_are_not_new_storage_and_frees_are_released():
    x = torch.randn(256, 256)  # 256 KiB, made before: never counted
    with NewStoragePeak() as peak:
        y = x * 2  # new: 256 KiB
        y.t().add_(1)  # a view, written in place: nothing new
        z = y[:128] + 1  # new: 128 KiB
        del y  # released
        w = z.repeat(2, 1)  # new: 256 KiB, after y's release
        assert peak.live == 384 * 2**10
    assert peak.bytes == 384 * 2**10 and w.shape == (256, 256)
