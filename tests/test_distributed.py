"""The process-group helpers (on real gloo ranks: where a rank sits, counters summed over ranks) and the
device choice."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from clip_train.distributed import rank_and_world, resolve_device, sum_counts_over_ranks
from clip_train.errors import UserError

KEYS = ("bad_image", "bad_json", "truncated_tar")


def count_rank(rank: int, world_size: int) -> tuple[tuple[int, int], dict[str, int]]:
    # Rank r skipped r + 1 bad images; only rank 1 saw a truncated tar; nobody reports bad_json.
    local = {"bad_image": rank + 1, **({"truncated_tar": 5} if rank == 1 else {})}
    return rank_and_world(), sum_counts_over_ranks(local, KEYS, torch.device("cpu"))


def test_counts_sum_over_three_ranks_with_missing_keys_as_zero():
    results = run_distributed(count_rank, 3)
    assert [place for place, _ in results] == [(0, 3), (1, 3), (2, 3)]
    for _, totals in results:
        assert totals == {"bad_image": 6, "bad_json": 0, "truncated_tar": 5}


def test_one_process_is_rank_zero_of_one():
    assert rank_and_world() == (0, 1)
    assert sum_counts_over_ranks({"bad_json": 2}, KEYS, torch.device("cpu")) == {
        "bad_image": 0,
        "bad_json": 2,
        "truncated_tar": 0,
    }


def test_auto_device_is_the_gpu_when_there_is_one_and_a_missing_gpu_is_a_user_error():
    has_gpu = torch.cuda.is_available()
    assert resolve_device("auto").type == ("cuda" if has_gpu else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not has_gpu:
        with pytest.raises(UserError, match="no CUDA device"):
            resolve_device("cuda")
