import random

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from clip_train.checkpoint import (
    MODEL_FILE,
    STATE_FILE,
    complete_checkpoints,
    load_train_state,
    load_weights,
    resolve_resume,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from clip_train.errors import UserError


def _state(step: int) -> dict:
    return {"step": step, "rng": [rng_state()], "data": {"epoch": 0, "consumed": [3, 4]}}


def test_save_load_round_trip_weights_only(tmp_path):
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    path = save_checkpoint(tmp_path, 7, model, {**_state(7), "optimizer": optimizer.state_dict()}, keep=2)
    assert path.name == "step_00000007"
    raw = load_file(path / MODEL_FILE)  # readable without project code
    assert torch.equal(raw["weight"], model.weight.detach())
    state = torch.load(path / STATE_FILE, weights_only=True)
    assert state["step"] == 7 and state["data"]["consumed"] == [3, 4]
    other = nn.Linear(3, 2)
    load_weights(path, other)
    assert torch.equal(other.weight, model.weight)
    restored = torch.optim.AdamW(other.parameters())
    restored.load_state_dict(load_train_state(path)["optimizer"])
    assert torch.equal(
        restored.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )


def test_keep_prunes_oldest_and_auto_picks_newest(tmp_path):
    model = nn.Linear(2, 2)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, _state(step), keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert resolve_resume("auto", tmp_path).name == "step_00000004"


def test_half_written_checkpoints_are_ignored(tmp_path):
    model = nn.Linear(2, 2)
    save_checkpoint(tmp_path, 5, model, _state(5), keep=3)
    root = tmp_path / "checkpoints"
    (root / ".tmp_step_00000009_123").mkdir()  # killed before the rename
    (root / ".tmp_step_00000009_123" / MODEL_FILE).write_bytes(b"partial")
    (root / "step_00000008").mkdir()  # a directory that lost its files
    (root / "step_00000008" / MODEL_FILE).write_bytes(b"x")
    assert resolve_resume("auto", tmp_path).name == "step_00000005"
    assert resolve_resume("", tmp_path) is None
    assert resolve_resume("auto", tmp_path / "elsewhere") is None


def test_resume_from_bad_path_is_clear(tmp_path):
    with pytest.raises(UserError, match="not a complete checkpoint"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_rng_state_round_trip():
    state = rng_state()
    first = (random.random(), torch.rand(3))
    set_rng_state(state)
    again = (random.random(), torch.rand(3))
    assert first[0] == again[0] and torch.equal(first[1], again[1])
