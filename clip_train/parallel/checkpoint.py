"""Checkpoints of FSDP runs: every rank writes its own shards of the weights and the optimizer
(``torch.distributed.checkpoint``, under ``shards/``), rank 0 the rest as for any checkpoint.

The shards hold the EMA of the weights too (``train.ema_decay``), each rank's own. Beside the
shards, ``model.safetensors`` (and ``ema.safetensors``) holds the consolidated weights, gathered one
tensor at a time into rank 0's host memory, so ``clip_train.load``, ``eval``, ``export`` and
``model.init_from`` read an FSDP checkpoint like any other. The hidden folder, the rename and the
manifest (which covers the shards) are those of every checkpoint. Loading reshards: a checkpoint
resumes at any world size with its weights and optimizer states exact.

DCP reads its files with pickle: ``.metadata`` whole, and the entries that are not tensors (the
optimizer's ``param_groups``) with ``torch.load(weights_only=False)``, so a crafted checkpoint (from
``checkpoint.remote``, or named by ``checkpoint.resume``) would run its code on every rank. Here the
metadata is read by an unpickler that knows only what DCP's metadata holds, and those entries with
``weights_only=True``, as ``train_state.pt`` is: anything else is refused in one line.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from clip_train.checkpoint import (
    EMA_FILE,
    SHARDS_DIR,
    WRITE_ERRORS,
    Checkpointer,
    Stateful,
    cannot_save,
    checkpoint_dir,
    fresh_temp_dir,
    load_train_state,
    publish_checkpoint,
    write_checkpoint_files,
    write_failure,
)
from clip_train.distributed import all_ranks_true, decided_by_main, new_io_group, rank_and_world
from clip_train.errors import UserError
from clip_train.logs import without_warning
from clip_train.memory import tensor_bytes
from clip_train.model.state_dicts import listed, misfit
from clip_train.optim import AS_SAVED

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
EMA_KEY = "ema"
# DCP warns that it assumes one process whenever there is no group, even when ``no_dist`` asks for
# that: a one-process FSDP run would print it at each save and resume.
_ASSUMED_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"
# What DCP's ``.metadata`` names (listed from real checkpoints, fp32 and fp64): its records, the
# shapes, dtypes and layouts of the tensors they describe, and the path it was saved to.
_METADATA_GLOBALS = frozenset(
    [
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),  # the path it was saved to: checkpoints saved before it was a str
        ("pathlib._local", "PosixPath"),  # Python 3.13 pickles paths under this module
        *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
    ]
)


class OptimizerApart:
    """A component (the guarded update) whose ``optimizer`` entry the shards hold: left out of
    ``train_state.pt``, and on loading taken from the optimizer, which the shards filled first."""

    def __init__(self, part: Stateful, optimizer: torch.optim.Optimizer) -> None:
        self.part, self.optimizer = part, optimizer

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.part.state_dict().items() if k != OPTIMIZER_KEY}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part.load_state_dict({**state, OPTIMIZER_KEY: self.optimizer.state_dict()})


class _UntrustedShards(Exception):
    """A sharded checkpoint's pickle names what clip_train never saves: loading it could run code."""


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata``, refusing any global outside ``_METADATA_GLOBALS`` before it is
    imported, let alone called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _METADATA_GLOBALS:
            raise _UntrustedShards(f"{SHARDS_DIR}/.metadata names {module}.{name}")
        return super().find_class(module, name)


class _TrustedReader(dcp.FileSystemReader):
    """DCP's reader of a checkpoint's shards, its metadata read with ``_MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        metadata.storage_meta = metadata.storage_meta or StorageMeta()  # as DCP's own reader does
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, whose entries that are not tensors (the optimizer's ``param_groups``) load
    with ``torch.load(weights_only=True)``. DCP's own ``load_bytes``, which puts them in place, loads
    the bytes itself with ``weights_only=False``: it gets them written anew from what the weights-only
    load returned, plain data."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise _UntrustedShards(
                f"the {SHARDS_DIR} entry {read_item.dest_index.fqn} holds Python objects"
            ) from None
        plain = io.BytesIO()
        torch.save(loaded, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)


@dataclasses.dataclass(eq=False)
class ShardedCheckpointer(Checkpointer):
    """``Checkpointer`` for a model whose towers are sharded with FSDP2 and its ``optimizer``.

    Making one is a collective: DCP's ranks meet in a group of their own (``new_io_group``), where
    those done with their shards wait for the slowest up to ``train.io_timeout_s``, as they wait for
    rank 0's files; in the default group they would fail after ``train.dist_timeout_s``."""

    optimizer: torch.optim.Optimizer
    io_group: dist.ProcessGroup | None = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.io_group = new_io_group()

    def save(self, step: int) -> None:
        """A collective: each rank writes its shards, rank 0 the rest; a failure on any rank removes
        the folder and raises the same one-line ``UserError`` on every rank."""
        gathered = self._gathered_per_rank()
        final = checkpoint_dir(self.run_dir, step)
        needed = self._bytes_needed()
        check_space = self.cfg.check_free_space
        tmp = Path(
            decided_by_main(lambda: str(fresh_temp_dir(self.run_dir, step, needed, check_space=check_space)))
        )
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        failure = ""
        try:
            shards = {MODEL_KEY: model_state, OPTIMIZER_KEY: optimizer_state}
            if self.ema is not None:
                shards[EMA_KEY] = self.ema.state_dict()
            with without_warning(_ASSUMED_ONE_PROCESS):
                dcp.save(
                    shards,
                    checkpoint_id=str(tmp / SHARDS_DIR),
                    process_group=self.io_group,
                    no_dist=_one_process(),
                )
        except (*WRITE_ERRORS, dcp.api.CheckpointException) as err:
            failure = write_failure(err)
        (written,) = all_ranks_true([not failure])
        # Gathered one tensor at a time into rank 0's host memory; the other ranks get nothing.
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(self.model, options=full) if written else {}
        main = rank_and_world()[0] == 0
        ema = self.ema.full_weights(keep=main) if written and self.ema is not None else None

        def finish() -> Path:
            try:
                if not written:
                    raise OSError(failure or "another rank could not write its shards")
                state = self._train_state(gathered)
                write_checkpoint_files(tmp, step, weights, state, self.model, self.model_cfg, ema)
            except WRITE_ERRORS as err:
                shutil.rmtree(tmp, ignore_errors=True)
                raise UserError(cannot_save(final, needed, write_failure(err))) from None
            return publish_checkpoint(tmp, self.run_dir, step, self.cfg.keep, self.cfg.keep_every)

        decided_by_main(finish)

    def _bytes_needed(self) -> int:
        """The shards (weights, optimizer states, EMA) plus the consolidated weights and EMA, at full size."""
        ema = self.ema.state_dict() if self.ema is not None else {}
        weights = 2 * (tensor_bytes(self.model.state_dict()) + tensor_bytes(ema))
        return weights + tensor_bytes(list(self.optimizer.state.values()))

    def restore(self) -> Path | None:
        """Load ``checkpoint.resume`` into the sharded model and optimizer, whatever world size wrote
        it, then every component as ``Checkpointer`` does."""
        path = decided_by_main(self._resume_point)
        if path is None:
            return None
        if not (path / SHARDS_DIR).is_dir():
            raise UserError(
                f"checkpoint {path} has no {SHARDS_DIR}/: it was written by a train.parallel=ddp run; "
                f"resume it with train.parallel=ddp, or start a new run from its weights with "
                f"model.init_from={path}"
            )
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        reader = _TrustedReader(path / SHARDS_DIR)  # dcp.load reads the metadata through it too
        try:
            saved = reader.read_metadata().state_dict_metadata
        except _UntrustedShards as err:
            raise _untrusted(path, err) from None
        if problem := misfit(_saved_weights(saved), model_state):  # said as an unsharded load says it
            raise UserError(f"checkpoint {path} does not fit the model: {problem}")
        if untrained := _saved_optimizer_params(saved) - optimizer_state["state"].keys():
            raise UserError(  # DCP would load this run's states and pass over those, as no other load does
                f"checkpoint {path} holds optimizer states of parameters this run does not train "
                f"({listed(untrained)}): {AS_SAVED}"
            )
        state = {MODEL_KEY: model_state, OPTIMIZER_KEY: optimizer_state}
        with_ema = self.ema is not None and (path / EMA_FILE).is_file()
        if with_ema:  # loaded in place, each rank its shards
            state[EMA_KEY] = self.ema.state_dict()
        try:
            with without_warning(_ASSUMED_ONE_PROCESS):
                dcp.load(
                    state,
                    storage_reader=reader,
                    planner=_WeightsOnlyPlanner(),
                    process_group=self.io_group,
                    no_dist=_one_process(),
                )
        except dcp.api.CheckpointException as err:  # a BaseException: past the CLI's one-line ending
            failures = [failure for failure, _ in err.failures.values()]
            if untrusted := [failure for failure in failures if isinstance(failure, _UntrustedShards)]:
                raise _untrusted(path, untrusted[0]) from None
            reason = " ".join(str(failures[0]).split())
            raise UserError(
                f"checkpoint {path}'s shards do not fit this run ({reason}): {AS_SAVED}"
            ) from None
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state[MODEL_KEY],
            optim_state_dict=state[OPTIMIZER_KEY],
        )
        if not with_ema:
            self._resumes_ema(path)  # an EMA turned on at this resume starts from the weights
        self._load_components(load_train_state(path))
        return path


def _untrusted(checkpoint: Path, err: _UntrustedShards) -> UserError:
    return UserError(
        f"checkpoint {checkpoint} is not a trusted clip_train checkpoint: {err}, which clip_train never "
        "saves, so it is not loaded"
    )


def _saved_weights(saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A sharded checkpoint's weights (``model.NAME`` in its metadata) as meta tensors of their shapes."""
    prefix = f"{MODEL_KEY}."
    return {
        key.removeprefix(prefix): torch.empty(tuple(entry.size), device="meta")
        for key, entry in saved.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }


def _saved_optimizer_params(saved: dict[str, Any]) -> set[str]:
    """The parameters whose optimizer states a sharded checkpoint holds (``optimizer.state.NAME.STATE``)."""
    prefix = f"{OPTIMIZER_KEY}.state."
    return {key.removeprefix(prefix).rpartition(".")[0] for key in saved if key.startswith(prefix)}


def _one_process() -> bool:
    """No process group: one rank writes, or reads, every shard."""
    return not (dist.is_available() and dist.is_initialized())
