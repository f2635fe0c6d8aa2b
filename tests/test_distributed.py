"""The process-group helpers (on real gloo ranks: where a rank sits, counters summed over ranks), the
device choice and the backends a CUDA run's group maps each device to."""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch.testing._internal.distributed.fake_pg import _create_fake_pg

from clip_train.config import DataConfig, EvalConfig
from clip_train.distributed import (
    DistEnv,
    PeerEnded,
    all_ranks_true,
    announce_ending,
    decided_by_main,
    failing_together,
    gather_rows,
    host_values_device,
    local_gpu,
    new_group_of_all,
    process_group_backend,
    rank_and_world,
    require_host_collectives,
    resolve_device,
    set_main_only_timeout,
    sum_counts_over_ranks,
)
from clip_train.errors import UserError
from clip_train.eval import evaluate
from clip_train.loss.checks import check_inputs
from clip_train.preemption import Preempted, SignalFlag
from clip_train.stopping import Ending, StoppableEvaluation, exit_code

KEYS = ("bad_image", "bad_json", "truncated_tar")


def count_rank(rank: int, world_size: int) -> tuple[tuple[int, int], dict[str, int]]:
    # Rank r skipped r + 1 bad images; only rank 1 saw a truncated tar; nobody reports bad_json.
    local = {"bad_image": rank + 1, **({"truncated_tar": 5} if rank == 1 else {})}
    return rank_and_world(), sum_counts_over_ranks(local, KEYS)


def test_counts_sum_over_three_ranks_with_missing_keys_as_zero():
    results = run_distributed(count_rank, 3)
    assert [place for place, _ in results] == [(0, 3), (1, 3), (2, 3)]
    for _, totals in results:
        assert totals == {"bad_image": 6, "bad_json": 0, "truncated_tar": 5}


def agree_on_host_values(rank: int, world_size: int) -> tuple[list[bool], int, str | None]:
    """The per-step agreements on host values (signals, data errors, skip counts) with the default
    device an accelerator would be: the meta device stands in for a GPU, where these collectives
    would go through NCCL and wait for the step's kernels. Host values must stay host tensors."""
    error = None
    with torch.device("meta"):
        flags = all_ranks_true([True, rank == 0])
        counts = sum_counts_over_ranks({"bad_json": rank + 1}, KEYS)
        try:
            with failing_together():
                if rank == 1:
                    raise UserError("rank 1's own check")
        except UserError as err:
            error = str(err)
    return flags, counts["bad_json"], error


def test_agreements_on_host_values_stay_on_the_host_whatever_the_default_device():
    results = run_distributed(agree_on_host_values, 2)
    assert results == [([True, False], 3, "on rank 1: rank 1's own check")] * 2


def environment_and_fresh_state(rank: int, world_size: int) -> tuple[str | None, bool]:
    """What a rank sees: the caller's environment, and a library no earlier rank left state in."""
    import torch._dynamo.config as dynamo

    seen = (os.environ.get("CLIP_TRAIN_TEST_PROBE"), dynamo.recompile_limit == 1234)
    dynamo.recompile_limit = 1234  # process-wide, as compile_towers sets it: the next ranks must not see it
    return seen


def test_ranks_forked_from_the_server_see_the_callers_environment_and_a_fresh_library(monkeypatch):
    """The test helper forks ranks from a server started by the first caller: a later test's
    ``setenv`` must still reach them, and one rank's changes must not reach the next ranks."""
    for value in ("first", "second"):
        monkeypatch.setenv("CLIP_TRAIN_TEST_PROBE", value)
        assert run_distributed(environment_and_fresh_state, 2) == [(value, False), (value, False)]


def test_one_process_is_rank_zero_of_one():
    assert rank_and_world() == (0, 1)
    assert sum_counts_over_ranks({"bad_json": 2}, KEYS) == {
        "bad_image": 0,
        "bad_json": 2,
        "truncated_tar": 0,
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU's side is in test_cuda.py")
def test_auto_device_is_the_cpu_without_a_gpu_and_a_missing_gpu_is_a_user_error():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="no CUDA device"):
        resolve_device("cuda")


def test_a_gpu_per_local_rank_or_one_line_naming_the_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert local_gpu(1, visible=2) == torch.device("cuda", 1)
    with pytest.raises(UserError, match=r"local rank 2 has no GPU: 2 visible \(CUDA_VISIBLE_DEVICES=2,3\)"):
        local_gpu(2, visible=2)


def test_a_process_bound_to_one_gpu_takes_it_whatever_its_local_rank(monkeypatch):
    """srun --gpus-per-task=1: local rank 3 sees only its own GPU, as cuda:0."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert local_gpu(3, visible=1) == torch.device("cuda", 0)


CPU = torch.device("cpu")
NCCL_STAND_IN = "nccl_stand_in"  # a backend for CUDA tensors only, as NCCL is; no GPU here to run NCCL


def _register_nccl_stand_in() -> None:
    if NCCL_STAND_IN not in dist.Backend.backend_list:
        dist.Backend.register_backend(NCCL_STAND_IN, _create_fake_pg, extended_api=True, devices=["cuda"])


def host_all_reduce(rank: int, world_size: int, backend: str) -> float | str:
    """A CPU tensor all-reduced in a group made with ``backend``'s device map, NCCL's part played by a
    stand-in (torch's fake group) that, like NCCL, takes CUDA tensors only; the sum or the error."""
    _register_nccl_stand_in()
    group = dist.new_group(backend=backend.replace("nccl", NCCL_STAND_IN))
    host = torch.tensor([rank + 1.0])
    try:
        dist.all_reduce(host, group=group)
    except RuntimeError as err:
        return str(err)
    return host.item()


def test_a_cuda_runs_group_reduces_host_tensors_on_gloo():
    """fsdp.cpu_offload computes the gradient norm of host shards: an NCCL-only group has no backend
    for CPU tensors (pytorch/pytorch#148532), the group a CUDA run makes hands them to gloo."""
    assert process_group_backend(torch.device("cpu")) == "gloo"
    cuda_run = process_group_backend(torch.device("cuda", 0))
    assert cuda_run == "cuda:nccl,cpu:gloo"
    assert run_distributed(host_all_reduce, 2, cuda_run, timeout_s=60) == [3.0, 3.0]
    for outcome in run_distributed(host_all_reduce, 2, "nccl", timeout_s=60):  # the group it replaces
        assert "No backend type associated with device type cpu" in outcome


def gathered_rows(rank: int, world_size: int) -> tuple[list[list[float]], list[int]]:
    rows = torch.empty(0, 0) if rank == 1 else torch.full((rank + 1, 2), float(rank))
    gathered, counts = gather_rows(rows)
    return gathered.tolist(), counts


def test_rows_of_uneven_ranks_gather_in_rank_order_and_an_empty_rank_may_pass_no_width():
    expected = ([[0.0, 0.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]], [1, 0, 3])
    assert run_distributed(gathered_rows, 3, timeout_s=60) == [expected] * 3


def loss_shape_agreement(rank: int, world_size: int) -> tuple[str, str, list[str]]:
    """The loss's check that every rank holds the same rows, on meta features (a GPU's stand-in,
    whose values no collective could carry) in the group a CUDA run makes, and where each group
    would compare them."""
    _register_nccl_stand_in()
    group = dist.new_group(backend=process_group_backend(torch.device("cuda")).replace("nccl", NCCL_STAND_IN))
    nccl_only = dist.new_group(backend=NCCL_STAND_IN)
    scale = torch.tensor(1.0)
    outcomes = []
    for rows in (4, 4 + rank):  # the same rows on every rank, then one more on rank 1
        images, texts = (torch.empty(rows, 8, device="meta") for _ in range(2))
        try:
            outcomes.append(str(check_inputs(images, texts, scale, None, group).labels.device))
        except ValueError as err:
            outcomes.append(str(err))
    devices = [str(host_values_device(g, torch.device("cuda", 0))) for g in (group, nccl_only)]
    return (*outcomes, devices)


def test_the_losss_shape_check_runs_on_the_host_in_a_cuda_runs_group():
    """On the host, the check never waits for the kernels queued before the loss; an NCCL-only
    group, which has no host collectives, compares them beside the features."""
    mismatch = (
        "contrastive_loss: every rank must hold the same number of rows and dim, "
        "got rank 0: n=4 m=4 d=8, rank 1: n=5 m=5 d=8"
    )
    assert (
        run_distributed(loss_shape_agreement, 2, timeout_s=60) == [("meta", mismatch, ["cpu", "cuda:0"])] * 2
    )


def refusals_of_a_group_without_host_collectives(rank: int, world_size: int) -> list[str | None]:
    """What the evaluation and the check say of an NCCL-only group, and the check of the default."""
    _register_nccl_stand_in()
    nccl_only = dist.new_group(backend=NCCL_STAND_IN)
    said = []
    for check in (
        lambda: evaluate(
            torch.nn.Identity(), EvalConfig(), DataConfig(), device=CPU, precision="fp32", group=nccl_only
        ),
        lambda: require_host_collectives(nccl_only),
        require_host_collectives,
    ):
        try:
            check()
            said.append(None)
        except UserError as err:
            said.append(str(err))
    return said


def test_a_group_without_host_collectives_is_refused_before_any_of_them():
    """A group made by code that calls the library with NCCL alone: the votes and counts the trainer
    and the evaluation exchange on the host failed at the first step or evaluation, on every rank."""
    refusal = (
        "the process group's backends (cuda:nccl_stand_in) take no host tensors, which clip_train exchanges "
        "through it: add gloo for them, init_process_group('cuda:nccl,cpu:gloo') (or no backend: torch's "
        "default makes both)"
    )
    assert (
        run_distributed(refusals_of_a_group_without_host_collectives, 2, timeout_s=60)
        == [[refusal, refusal, None]] * 2
    )


def fail_on_some_ranks(rank: int, world_size: int, failing: tuple[int, ...]) -> str | None:
    """The error each rank raises (None: none), then a collective that shows the ranks still agree."""
    try:
        with failing_together():
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
    return outcome, all_ranks_true([True])


def test_ranks_wait_for_rank_zero_past_the_collective_timeout_up_to_the_io_timeout():
    results = run_distributed(slow_main_decision, 2, 6.0, 60.0, timeout_s=3)  # 2.5 s to spare after it
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


def exit_codes_after_rank_one_was_preempted(rank: int, world_size: int) -> list[int]:
    """Rank 1 records a preemption as the run's ending; every rank then tells wandb what the process
    will exit with: a rank's own UserError is its own, any other exception (the watch's interrupt, a
    broken collective) takes the recorded ending."""
    if rank == 1:
        announce_ending(pickle.dumps(Ending.of(Preempted("SIGTERM"), rank)))
    dist.barrier()
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    endings = (None, KeyboardInterrupt(), RuntimeError("a peer's collective broke"), UserError("its own"))
    return [exit_code(err, env) for err in endings]


def test_the_exit_code_wandb_gets_is_the_run_s_not_the_interrupted_rank_s():
    assert run_distributed(exit_codes_after_rank_one_was_preempted, 2, timeout_s=60) == [[0, 75, 75, 2]] * 2


def collective_rank_one_skips(rank: int, world_size: int, timeout_s: float, wait_s: float) -> str:
    """Rank 0 all-reduces in a new group of all ranks, which rank 1 never joins: rank 0's collective
    must end at ``timeout_s``; rank 1 waits up to ``wait_s`` for rank 0 to come back."""
    group, store = new_group_of_all(timeout_s), dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["rank 0 is back"], datetime.timedelta(seconds=wait_s))
        return "rank 0 came back"
    try:
        dist.all_reduce(torch.ones(1), group=group)
        outcome = "all-reduced"
    except RuntimeError as err:
        outcome = str(err)
    store.set("rank 0 is back", b"1")
    return outcome


def test_a_new_group_of_all_ranks_bounds_its_collectives_as_the_default_group_does():
    """torch gives a new group 30 minutes unless told: the evaluation's group must take
    train.dist_timeout_s as the training group does."""
    rank_zero, rank_one = run_distributed(collective_rank_one_skips, 2, 1.0, 300.0, timeout_s=300)
    assert rank_one == "rank 0 came back"
    assert "timed out" in rank_zero.lower() or "timeout" in rank_zero.lower(), rank_zero


def evaluations_on_one_group(rank: int, world_size: int) -> tuple[list[float | None], list[bool], int]:
    """Four periodic evaluations, each an all-reduce on the evaluations' group; before the third,
    rank 0 has been signalled. Returns the sums, whether each ran on the group the first did, and the
    groups made."""
    with mock.patch.object(dist, "new_group", wraps=dist.new_group) as new_group:
        evaluations = StoppableEvaluation(timeout_s=60)
        first_group, sums, same_group = evaluations.group, [], []

        def evaluate(group: dist.ProcessGroup | None) -> float:
            same_group.append(group is first_group)
            total = torch.tensor([rank + 1.0])
            dist.all_reduce(total, group=group)
            return total.item()

        for index in range(4):
            signals = SignalFlag(received=signal.SIGUSR1 if rank == 0 and index == 2 else None)
            sums.append(evaluations.run(signals, evaluate))
        return sums, same_group, new_group.call_count


def test_periodic_evaluations_share_one_group_made_with_the_run_until_a_stop_breaks_it():
    """Under NCCL a group is a communicator with device buffers: made at each evaluation, it took
    them mid-run from a cache the training had filled. A stop (rank 0's signal) breaks it on every
    rank, and ends the evaluations as it ends the run."""
    (sums_0, same_0, made_0), (sums_1, same_1, made_1) = run_distributed(
        evaluations_on_one_group, 2, timeout_s=60
    )
    assert sums_0 == sums_1 == [3.0, 3.0, None, None]
    assert same_0 == [True, True] and same_1 == [True, True, True]  # rank 0 ran no 3rd: it was signalled
    assert made_0 == made_1 == 1
