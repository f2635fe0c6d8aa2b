"""The trainer with ``train.parallel=fsdp``, end to end, on CPU gloo.

torchrun runs (2 ranks, fp64): an uninterrupted run is the reference; a fresh run resumed from its
mid-run sharded checkpoint, a run whose worker is killed with SIGKILL under ``--max-restarts=1``,
and a run stopped by SIGTERM and started again all end with bit-identical weights. In-process ranks
(the ``run_distributed`` helper): a checkpoint written by 2 ranks resumes on 4 and then on 1 with
weights and optimizer states exact; the NaN guard, global-norm clipping over sharded gradients and
the logit-scale clamp act on 2 ranks as on one; the consolidated ``model.safetensors`` loads with
``clip_train.load``.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_distributed
from safetensors.torch import load_file
from small_runs import DEMO_CONFIG, run_overrides
from test_checkpoint_verify import RunsCode
from test_trainer import (
    assert_bit_identical,
    finish,
    finish_with_a_worker_killed,
    logged,
    logged_steps,
    signal_rank_group,
    stopped_at,
    torchrun,
    wait_for_logged_steps,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

import clip_train
from clip_train import load_config
from clip_train.checkpoint import (
    MODEL_FILE,
    SHARDS_DIR,
    checkpoint_step,
    complete_checkpoints,
    read_manifest,
    write_manifest,
)
from clip_train.distributed import DistEnv, set_main_only_timeout
from clip_train.errors import UserError
from clip_train.model import build_model
from clip_train.optim import AS_SAVED, MAX_LOGIT_SCALE
from clip_train.trainer import Trainer

STEPS, EVERY = 12, 4


def overrides(digits: Path, out_dir: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return run_overrides(
        digits,
        out_dir,
        steps,
        "train.parallel=fsdp",
        "train.precision=fp64",
        f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep=5",
        "log.every_steps=1",
        *extra,
    )


def weights(out_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(out_dir / "checkpoints" / f"step_{step:08d}" / MODEL_FILE)


@pytest.fixture(scope="module")
def reference(digits, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_reference")
    finish(torchrun(*overrides(digits, out)))
    return out


def test_sharded_checkpoints_hold_every_rank_shards_and_the_consolidated_weights(reference, tmp_path):
    saved = complete_checkpoints(reference)
    assert [p.name for p in saved] == [f"step_{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]
    files = read_manifest(saved[-1])
    shards = sorted(name for name in files if name.startswith(f"{SHARDS_DIR}/"))
    assert shards == [f"{SHARDS_DIR}/.metadata", f"{SHARDS_DIR}/__0_0.distcp", f"{SHARDS_DIR}/__1_0.distcp"]
    consolidated = weights(reference)
    dcp_to_torch_save(saved[-1] / SHARDS_DIR, tmp_path / "shards.pt")  # the shards, put together
    assert_bit_identical(consolidated, torch.load(tmp_path / "shards.pt", weights_only=True)["model"])
    model, _, _ = clip_train.load(saved[-1])  # loads as any checkpoint does (in fp32)
    assert_bit_identical(model.state_dict(), {k: v.float() for k, v in consolidated.items()})


def test_the_time_split_books_the_all_gathers_beside_encode_loss_replay_and_optimizer(reference):
    parts = ("data", "encode", "gather", "loss", "replay", "optimizer")
    for record in logged(reference):
        split = [record[f"time/{part}_s"] for part in parts]
        assert record["time/gather_s"] > 0 and min(split) >= 0, record  # the parts fit in the step


def test_resume_from_a_mid_run_sharded_checkpoint_is_bit_identical(digits, reference, tmp_path):
    copy = tmp_path / "from" / f"step_{EVERY:08d}"
    shutil.copytree(reference / "checkpoints" / copy.name, copy)
    output = finish(torchrun(*overrides(digits, tmp_path / "resumed", f"checkpoint.resume={copy}")))
    assert f"resumed from {copy}" in output
    assert_bit_identical(weights(tmp_path / "resumed"), weights(reference))


def test_sigkill_worker_restarts_and_matches_uninterrupted_run(digits, reference, tmp_path):
    out = tmp_path / "killed"
    output = finish_with_a_worker_killed(
        torchrun(*overrides(digits, out, "checkpoint.resume=auto"), restarts=1), out
    )
    assert "resumed from" in output, output[-3000:]
    assert logged_steps(out) == list(range(1, STEPS + 1))
    assert_bit_identical(weights(out), weights(reference))


def test_sigterm_saves_the_step_in_progress_and_the_rerun_is_bit_identical(digits, reference, tmp_path):
    out = tmp_path / "preempted"
    args = overrides(digits, out, "checkpoint.every_steps=1000", "checkpoint.resume=auto")
    run = torchrun(*args)
    wait_for_logged_steps(run, out, 2)
    signal_rank_group(run, 0, signal.SIGTERM)
    output = run.wait().stdout
    saved, stopped = stopped_at(out)
    assert stopped < STEPS and f"SIGTERM received: stopped after step {stopped};" in output, output[-3000:]
    output = finish(torchrun(*args))
    assert f"resumed from {saved} at step {stopped}" in output
    assert logged_steps(out) == list(range(1, STEPS + 1))  # every step once: none lost, none redone
    assert_bit_identical(weights(out), weights(reference))


# -- in-process ranks ------------------------------------------------------------------------------


def make_trainer(rank: int, world: int, args: list[str]) -> Trainer:
    cfg = load_config(DEMO_CONFIG, [*args, "data.workers=0"]).validate(world_size=world)
    return Trainer(cfg, DistEnv(rank=rank, world_size=world, local_rank=0, device=torch.device("cpu")))


def full_states(trainer: Trainer) -> dict[str, Any]:
    """A copy of the whole model and optimizer state, gathered from the shards (a collective)."""
    options = StateDictOptions(full_state_dict=True)
    model = get_model_state_dict(trainer.model, options=options)
    optimizer = get_optimizer_state_dict(trainer.model, trainer.update.optimizer, options=options)
    # unsharded tensors (the logit scale, its states) come back as themselves: copy them
    copy = {"model": model, "optimizer": optimizer["state"]}
    return {**tree_map_only(torch.Tensor, torch.clone, copy), "step": trainer.step}


def trained_then_resumed(rank: int, world: int, args: list[str]) -> dict[str, dict]:
    """Resume ``args``' run (if it has a checkpoint), note the restored state, train on and save."""
    trainer = make_trainer(rank, world, args)
    restored = full_states(trainer)
    trainer.run()
    return {"restored": restored, "trained": full_states(trainer)}


def assert_states_equal(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    assert_bit_identical(got["model"], want["model"])
    assert got["optimizer"].keys() == want["optimizer"].keys()
    for name, state in want["optimizer"].items():
        assert_bit_identical(got["optimizer"][name], state)


def test_a_two_rank_checkpoint_resumes_on_four_then_on_one_with_weights_and_optimizer_exact(digits, tmp_path):
    out = tmp_path / "reshard"
    args = [*overrides(digits, out, "checkpoint.resume=auto", steps=2), "batch.text_chunk=4"]
    two = run_distributed(trained_then_resumed, 2, args, timeout_s=300)[0]["trained"]
    assert two["step"] == 2 and len(two["optimizer"]) > 0
    args[args.index("train.max_steps=2")] = "train.max_steps=3"
    four = run_distributed(trained_then_resumed, 4, args, timeout_s=300)[0]
    assert_states_equal(four["restored"], two)
    assert four["trained"]["step"] == 3
    args[args.index("train.max_steps=3")] = "train.max_steps=4"
    one = trained_then_resumed(0, 1, args)  # this process, no process group: the towers stay whole
    assert_states_equal(one["restored"], four["trained"])
    assert one["trained"]["step"] == 4
    assert [checkpoint_step(c) for c in complete_checkpoints(out)] == [2, 3, 4]


SLOW_STORAGE_S = 5  # longer than the run's train.dist_timeout_s, well within its train.io_timeout_s


def slowed_on_rank_one(rank: int, storage: type, method: str) -> None:
    """DCP's ``storage.method`` (writing or reading this rank's shards) takes ``SLOW_STORAGE_S``
    longer on rank 1, as on shared storage that serves one node late."""
    if rank != 1:
        return
    real = getattr(storage, method)

    def slow(self, *args, **kwargs):
        time.sleep(SLOW_STORAGE_S)
        return real(self, *args, **kwargs)

    setattr(storage, method, slow)


def saved_and_resumed_on_slow_storage(rank: int, world: int, args: list[str]) -> dict[str, dict]:
    set_main_only_timeout(20)  # train.io_timeout_s, as the command sets it
    slowed_on_rank_one(rank, dcp.FileSystemWriter, "write_data")
    slowed_on_rank_one(rank, dcp.FileSystemReader, "read_data")
    return {
        "trained": trained_then_resumed(rank, world, args)["trained"],
        "resumed": full_states(make_trainer(rank, world, args)),
    }


def test_ranks_wait_for_a_slow_ranks_shards_up_to_the_io_timeout(digits, tmp_path):
    """Rank 1 writes its shards, then reads them, 5 s late, past the 2 s that collectives may wait
    (train.dist_timeout_s): rank 0 waits in DCP's group, bounded by train.io_timeout_s, and the
    checkpoint saves and resumes exact (in the default group, the save failed with gloo's timeout)."""
    args = overrides(digits, tmp_path / "slow", "checkpoint.resume=auto", steps=1)
    results = run_distributed(saved_and_resumed_on_slow_storage, 2, args, timeout_s=2)
    for result in results:
        assert_states_equal(result["resumed"], result["trained"])
    assert [checkpoint_step(c) for c in complete_checkpoints(tmp_path / "slow")] == [1]


@pytest.mark.parametrize(
    ("change", "problem", "ending"),
    [
        (
            "model.image.unlocked_layers=2",
            "'s shards do not fit this run (Missing key in checkpoint ",
            AS_SAVED,
        ),
        (
            "model.image.unlocked_layers=0",
            " holds optimizer states of parameters this run does not train (14 keys (visual.trunk.blocks.1.",
            AS_SAVED,
        ),
        ("loss.kind=sigmoid", " does not fit the model: missing 1 key (logit_bias)", "(logit_bias)"),
    ],
)
def test_a_sharded_checkpoint_that_does_not_fit_is_one_line_naming_the_keys(
    digits, tmp_path, change, problem, ending
):
    """As an unsharded one's, with more trainable parameters, fewer, or another model: torch's
    checkpoint error is a BaseException, which would pass the CLI's one-line ending as a traceback,
    and a sharded load takes the run's own states, passing over the checkpoint's others."""
    out = tmp_path / "run"
    args = [*overrides(digits, out, "checkpoint.resume=auto", steps=1), "model.image.lock=true"]
    make_trainer(0, 1, [*args, "model.image.unlocked_layers=1"]).run()
    with pytest.raises(UserError) as err:
        make_trainer(0, 1, [*args, "model.image.unlocked_layers=1", change])
    message = str(err.value)
    assert message.startswith(f"checkpoint {complete_checkpoints(out)[-1]}{problem}")
    assert "\n" not in message and message.endswith(ending)


def refusals(rank: int, world: int, runs: list[list[str]]) -> list[str]:
    """What each of ``runs``, which must all refuse at start-up, says on this rank."""
    said = []
    for args in runs:
        with pytest.raises(UserError) as refused:
            make_trainer(rank, world, args)
        said.append(str(refused.value))
    return said


def plant_in_an_entry(shards: Path, payload: object) -> str:
    """Point the shards' first entry that is not a tensor (a value of the optimizer's param_groups) at
    ``payload``, saved at the end of its shard file; returns the entry's name."""
    metadata = dcp.FileSystemReader(shards).read_metadata()  # this test's own file
    index = next(
        i
        for i in metadata.storage_data
        if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata)
    )
    place, saved = metadata.storage_data[index], io.BytesIO()
    torch.save(payload, saved)
    shard = shards / place.relative_path
    metadata.storage_data[index] = dataclasses.replace(
        place, offset=shard.stat().st_size, length=saved.tell()
    )
    with shard.open("ab") as file:
        file.write(saved.getvalue())
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))
    return index.fqn


def test_a_sharded_checkpoint_that_would_run_code_is_refused_on_every_rank(digits, reference, tmp_path):
    """A ``.metadata`` replaced, or a param_groups entry of the shards, by a pickle that would create a
    file when loaded (DCP reads both with plain pickle), the manifest written anew as a tamperer would:
    both ranks refuse the resume in one line, and the file is never created."""
    marker = tmp_path / "code-ran"
    metadata, entry = (
        Path(shutil.copytree(reference / "checkpoints" / f"step_{EVERY:08d}", tmp_path / part / "step"))
        for part in ("metadata", "entry")
    )
    (metadata / SHARDS_DIR / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    name = plant_in_an_entry(entry / SHARDS_DIR, RunsCode(marker))
    for checkpoint in (metadata, entry):
        write_manifest(checkpoint)
    runs = [overrides(digits, tmp_path / "resumed", f"checkpoint.resume={c}") for c in (metadata, entry)]
    said = run_distributed(refusals, 2, runs, timeout_s=300)
    refused = "which clip_train never saves, so it is not loaded"
    assert said == 2 * [
        [
            f"checkpoint {metadata} is not a trusted clip_train checkpoint: {SHARDS_DIR}/.metadata names "
            f"pathlib.Path.touch, {refused}",
            f"checkpoint {entry} is not a trusted clip_train checkpoint: the {SHARDS_DIR} entry {name} holds "
            f"Python objects, {refused}",
        ]
    ]
    assert not marker.exists()


def step_on(trainer: Trainer):
    batch = next(trainer.loader)
    return trainer.engine.step(batch.images, batch.input_ids, batch.attention_mask)


def guarded_updates(rank: int, world: int, args: list[str]) -> dict:
    """The NaN guard, clipping and the logit-scale clamp on sharded towers, on every rank."""
    trainer = make_trainer(rank, world, args)
    model, update = trainer.model, trainer.update
    assert isinstance(model.visual.proj.weight, DTensor)

    def snapshot() -> dict[str, torch.Tensor]:
        return {
            k: v.clone()
            for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()
        }

    # a non-finite loss on rank 1 alone: every rank skips the step
    before = snapshot()
    update.optimizer.zero_grad(set_to_none=True)
    stats = step_on(trainer)
    update(float("nan") if rank == 1 else stats.loss, 1)
    update.skipped_steps.settle(1)
    skipped = {
        "unchanged": all(torch.equal(v, before[k]) for k, v in snapshot().items()),
        "bad": update.skipped_steps.total,
    }

    # clipping: the norm of the whole (sharded) gradient, then every shard scaled to the limit
    update.optimizer.zero_grad(set_to_none=True)
    stats = step_on(trainer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    whole = math.sqrt(
        sum(float((g.full_tensor() if isinstance(g, DTensor) else g).pow(2).sum()) for g in grads)
    )
    with torch.no_grad():
        model.logit_scale.fill_(MAX_LOGIT_SCALE + 0.5)  # the clamp must bring it back
    norm = update(stats.loss, 2)
    clipped = math.sqrt(
        sum(float((g.full_tensor() if isinstance(g, DTensor) else g).pow(2).sum()) for g in grads)
    )
    return {
        **skipped,
        "whole": whole,
        "norm": float(norm),
        "clipped": clipped,
        "scale": float(model.logit_scale),
        "changed": not all(torch.equal(v, before[k]) for k, v in snapshot().items()),
    }


def test_nan_guard_clipping_and_scale_clamp_on_two_ranks(digits, tmp_path):
    args = overrides(digits, tmp_path / "guards", "optim.grad_clip=0.01", steps=4)
    results = run_distributed(guarded_updates, 2, args, timeout_s=300)
    for result in results:
        assert result["unchanged"] and result["bad"] == 1
        assert result["norm"] == pytest.approx(result["whole"], rel=1e-12)
        assert result["whole"] > 0.01 and result["clipped"] == pytest.approx(0.01, rel=1e-4)
        assert result["scale"] == MAX_LOGIT_SCALE and result["changed"]
    assert results[0]["norm"] == results[1]["norm"]


def test_lit_run_keeps_the_locked_trunk_as_built_and_trains_the_rest_on_two_ranks(digits, tmp_path):
    args = overrides(digits, tmp_path / "lit", "model.image.lock=true", steps=2)
    finish(torchrun(*args))
    torch.manual_seed(0)  # train.seed: the weights every rank built
    built = build_model(load_config(DEMO_CONFIG, args).model).double().state_dict()
    trained = weights(tmp_path / "lit", 2)
    moved = {k for k in built if not torch.equal(built[k], trained[k])}
    assert moved and all(not k.startswith("visual.trunk.") for k in moved)
    assert {"visual.proj.weight", "text.proj.weight"} <= moved


def evaluated_then_stepped(rank: int, world: int, args: list[str]) -> dict:
    """Train with an evaluation midway and at the end; then one more forward-backward, which needs
    the towers sharded again after the gathered evaluation."""
    trainer = make_trainer(rank, world, args)
    final = trainer.run()
    sharded = {name for name, p in trainer.model.named_parameters() if isinstance(p, DTensor)}
    trainer.update.optimizer.zero_grad(set_to_none=True)
    return {"final": final, "sharded": sharded, "loss": step_on(trainer).loss}


def test_evaluation_on_gathered_weights_equals_one_process_evaluation_of_the_checkpoint(digits, tmp_path):
    """Zero-shot, retrieval and val loss of a 2-rank FSDP run (each rank evaluates its uneven
    share on the gathered weights) equal one process evaluating the saved weights, in fp64; the
    towers are sharded again afterwards and train on."""
    from clip_train.eval import evaluate

    evaluation = [f"data.val={digits}/val", f"eval.zeroshot={digits}/zeroshot.json", "eval.every_steps=1"]
    args = overrides(digits, tmp_path / "eval", *evaluation, "eval.zeroshot_data=", steps=2)
    results = run_distributed(evaluated_then_stepped, 2, args, timeout_s=300)
    cfg = load_config(DEMO_CONFIG, args)
    model = build_model(cfg.model).double()
    model.load_state_dict(weights(tmp_path / "eval", 2))
    alone = evaluate(model, cfg.eval, cfg.data, device=torch.device("cpu"), precision="fp64")
    assert {"zeroshot/top1", "val/loss"} <= alone.keys()
    for result in results:
        assert result["final"].keys() == alone.keys()
        for name, value in alone.items():
            # the digits' captions repeat: their duplicates, encoded in other batches, differ in the
            # last bits and still tie (eval.metrics.TIE_TOLERANCE)
            assert result["final"][name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
        assert math.isfinite(result["loss"])
        towers = {name for name, _ in model.named_parameters() if name.startswith(("visual.", "text."))}
        assert result["sharded"] == towers
