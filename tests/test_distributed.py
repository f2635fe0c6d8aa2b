"""The process-group helpers (on real gloo ranks: where a rank sits, counters summed over ranks) and the
device choice."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from clip_train.distributed import (
    PeerEnded,
    all_ranks_true,
    announce_ending,
    decided_by_main,
    failing_together,
    rank_and_world,
    resolve_device,
    set_main_only_timeout,
    sum_counts_over_ranks,
)
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


CPU = torch.device("cpu")


def fail_on_some_ranks(rank: int, world_size: int, failing: tuple[int, ...]) -> str | None:
    """The error each rank raises (None: none), then a collective that shows the ranks still agree."""
    try:
        with failing_together(CPU):
            if rank in failing:
                raise UserError(f"rank {rank}'s own check")
    except UserError as err:
        return str(err)
    finally:
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == world_size
    return None


@pytest.mark.parametrize(("failing", "message"), [((), None), ((2,), 2), ((1, 2), 1)])
def test_an_error_on_some_ranks_is_raised_on_all_with_the_lowest_ones_message(failing, message):
    results = run_distributed(fail_on_some_ranks, 3, failing, timeout_s=60)
    expected = None if message is None else f"on rank {message}: rank {message}'s own check"
    assert results == [expected] * 3


def slow_main_decision(rank: int, world_size: int, slow_s: float, wait_s: float) -> object:
    """Rank 0 decides for ``slow_s``, longer than the group's collective timeout; the others wait
    for it up to ``wait_s``. A collective afterwards shows the group is still sound."""
    set_main_only_timeout(wait_s)

    def decide() -> str:
        time.sleep(slow_s)
        return "rank 0's choice"

    try:
        outcome: object = decided_by_main(decide)
    except UserError as err:
        outcome = str(err)
    return outcome, all_ranks_true([True], CPU)


def test_ranks_wait_for_rank_zero_past_the_collective_timeout_up_to_the_io_timeout():
    results = run_distributed(slow_main_decision, 2, 4.0, 60.0, timeout_s=2)
    assert results == [("rank 0's choice", [True])] * 2
    results = run_distributed(slow_main_decision, 2, 4.0, 1.0, timeout_s=20)
    assert results[0] == ("rank 0's choice", [True])
    assert results[1][0].startswith("train.io_timeout_s=1: rank 0 did not finish its part")


def ended_while_waiting(rank: int, world_size: int) -> str:
    """Rank 0 records an ending instead of deciding: the others stop waiting for its decision."""
    if rank == 0:
        announce_ending(b"rank 0's ending")
        return "ended"
    try:
        decided_by_main(lambda: None)
    except PeerEnded:
        return "told"
    return "not told"


def test_a_rank_waiting_for_rank_zero_learns_that_another_rank_ended_the_run():
    assert run_distributed(ended_while_waiting, 3, timeout_s=60) == ["ended", "told", "told"]
