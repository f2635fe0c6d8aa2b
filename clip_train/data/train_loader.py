"""The training loader: a rank's batches, forever across epochs, resumable at any step.

How the training stream makes ranks agree and resume exact:

* S = steps per epoch (``data.num_samples // batch.global_size``), W = loader workers. The DataLoader
  hands batches out round-robin, so step i comes from worker *role* ``i % W`` (worker d plays role
  ``(d + start_step) % W``); role r's k-th batch is step ``r + k*W``, of epoch ``(r + k*W) // S``.
* A role's epoch stream depends only on (seed, epoch, rank, role): shards drawn with replacement
  (``data.resampled``) or its rank's and role's split of the seed+epoch shard shuffle, cycled, then
  a seeded shuffle buffer. A weighted mixture (``mixture``) draws each source's shards with
  replacement on its own, and the source of each item with a generator seeded the same way. It
  makes exactly its share of the epoch's S batches, so every rank yields S batches per epoch
  however uneven its shards are. A CSV/TSV table's fixed row ranges (``tables``) are shards like
  any other.
* Each batch carries its role's position (epoch, batches done, raw items consumed). A loader given
  ``state_dict()`` skips that many raw items undecoded; without a state a role replays its epoch so
  far, decoding to tell good samples from bad (exact too, only slower). Crops, and the caption
  picked among several ``data.caption_key``s, are seeded per item.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from clip_train.config import DataConfig
from clip_train.data.batches import (
    Batch,
    BatchBuilder,
    Decode,
    RawSample,
    Tokenizer,
    keys_for,
    read_source,
    source_urls,
    usable,
)
from clip_train.data.mixture import Source, interleave, mixture_sources, source_index
from clip_train.data.samples import BadSample, DataError, Decoded, SkipTally, decode_sample
from clip_train.data.sources import dataset_size
from clip_train.data.tables import is_piece
from clip_train.data.transforms import ImageTransform, apply_seeded, train_transform
from clip_train.logs import get_logger
from clip_train.preemption import signal_free_workers

STATE_VERSION = 1


class Position(NamedTuple):
    epoch: int
    done: int  # batches the role has made in this epoch
    consumed: int  # raw items taken from the epoch's shuffled stream; -1: unknown, replay instead


def role_batches(role: int, epoch: int, steps_per_epoch: int, roles: int) -> int:
    """How many of the epoch's steps fall to ``role`` (steps i with i % roles == role)."""
    return len(range(role, (epoch + 1) * steps_per_epoch, roles)) - len(
        range(role, epoch * steps_per_epoch, roles)
    )


def position_at(step: int, role: int, steps_per_epoch: int, roles: int) -> Position:
    """Where ``role`` stands when ``step`` is next, as far as step counts tell (no raw cursor)."""
    made = len(range(role, step, roles))
    epoch = (role + made * roles) // steps_per_epoch
    return Position(epoch, made - len(range(role, epoch * steps_per_epoch, roles)), -1)


def _seed(*parts: object) -> int:
    """A stable 63-bit seed from labelled parts (str seeding hashes with SHA-512, not ``hash``)."""
    return random.Random("/".join(map(str, parts))).getrandbits(63)


@dataclass(frozen=True)
class _TrainSpec:
    urls: tuple[str, ...]  # every source's
    mixture: tuple[Source, ...]  # () unless data.train_weights is set
    caption_keys: tuple[str, ...]
    resampled: bool
    seed: int
    rank: int
    world_size: int
    roles: int
    batch_size: int
    steps_per_epoch: int
    shuffle_buffer: int
    max_skip_fraction: float


# A shard sequence whose first shards all fail to open (mistyped URLs, no credentials) stops after
# this many: each failure is one bad record, and the shuffle buffer would take 1,000 of them (10,000
# in the recipes; a download each) before the skip rules saw the first.
UNOPENED_LIMIT = 20


class _FirstOpens:
    """The shards that failed to open before one opened, counted across every pass of a worker's
    epoch: a worker with fewer than ``UNOPENED_LIMIT`` shards would otherwise start over each pass."""

    def __init__(self, where: str = "") -> None:
        self.where = where  # which source, in the error
        self.unopened: int | None = 0  # None once a shard has opened

    def count(self, records: int, opened: bool) -> None:
        """Count a shard read through (``records`` read from it); stop at the limit."""
        if self.unopened is None:
            return
        self.unopened = None if opened else self.unopened + (records > 0)
        if self.unopened == UNOPENED_LIMIT:
            raise DataError(
                f"{self.where}the first {UNOPENED_LIMIT} shards drawn could not be opened (the log names "
                "them and why): check data.train's URLs and the access to them"
            )


def _samples_of(shards: Iterator[str], pool: set[str], opens: _FirstOpens) -> Iterator[RawSample]:
    """Raw samples of a shard sequence; stops with an error instead of spinning on empty shards or
    on shards that do not open (counted in ``opens``)."""
    empty: set[str] = set()
    for url in shards:
        count, opened = 0, False
        for raw in read_source(url):
            count += 1
            opened = opened or raw.get("__bad__") != "shard_open"
            yield raw
        opens.count(count, opened)
        if count:
            empty.clear()
            continue
        empty.add(url)
        if empty >= pool:
            raise DataError(f"the shards {sorted(pool)[:4]}{'...' if len(pool) > 4 else ''} hold no samples")


def _replay(items: Iterator[RawSample], good_wanted: int, decode: Decode) -> int:
    """Consume items until ``good_wanted`` usable samples went by; return the items consumed. Items
    with none usable stop it as they stop training (``SkipTally``'s rule at ``max_fraction=1``: the
    earlier run counted these skips, and the rate was its to check), where it would spin forever."""
    guard = SkipTally(max_fraction=1.0)
    consumed = 0
    while guard.good < good_wanted:
        consumed += 1
        raw = next(items)
        try:
            decode(raw, consumed)
        except BadSample as bad:
            guard.add_bad(bad, raw)
            continue
        guard.add_good()
    return consumed


@dataclass
class TrainStream(IterableDataset):
    """The per-worker generator of training batches (runs inside DataLoader workers)."""

    spec: _TrainSpec
    transform: ImageTransform
    tokenizer: Tokenizer
    starts: list[Position]  # per role
    start_step: int

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        role = ((info.id if info is not None else 0) + self.start_step) % self.spec.roles
        sources = tuple(source.name for source in self.spec.mixture)
        tally = SkipTally(self.spec.max_skip_fraction, min_seen=self.spec.batch_size, sources=sources)
        epoch, done, consumed = self.starts[role]
        while True:
            yield from self._epoch(role, epoch, done, consumed, tally)
            epoch, done, consumed = epoch + 1, 0, 0

    def _raw_items(self, role: int, epoch: int) -> Iterator[RawSample]:
        """The epoch's shuffled raw samples for ``role``: an endless stream of resampled shards, or
        passes over the role's share of the shards, each pass shuffled on its own (so an epoch of
        exactly one pass sees every sample once)."""
        spec = self.spec
        if spec.mixture:
            streams = [self._resampled(s.urls, role, epoch, index) for index, s in enumerate(spec.mixture)]
            mix_rng = random.Random(_seed("mix", spec.seed, epoch, spec.rank, role))
            mixed = interleave(streams, [s.weight for s in spec.mixture], mix_rng)
            return self._shuffled(mixed, role, epoch, 0)
        if spec.resampled:
            return self._shuffled(self._resampled(spec.urls, role, epoch), role, epoch, 0)
        order = [d["url"] for d in wds.SimpleShardList(list(spec.urls), seed=f"shards/{spec.seed}/{epoch}")]
        mine = order[spec.rank :: spec.world_size][role :: spec.roles]
        opens = _FirstOpens()  # one count over the passes
        passes = (
            self._shuffled(_samples_of(iter(mine), set(mine), opens), role, epoch, p)
            for p in itertools.count()
        )
        return itertools.chain.from_iterable(passes)

    def _resampled(self, urls: tuple[str, ...], role: int, epoch: int, *source: int) -> Iterator[RawSample]:
        """The samples of ``urls`` drawn with replacement, a shard at a time (a mixture's ``source``
        seeds its own draw). Drawn here from the whole 63-bit seed: webdataset's ResampledShards keeps
        31 bits of it, and among the thousands of workers of a large run two would draw the same
        shards in the same order (duplicate pairs in a global batch, a few % of epochs at 8k)."""
        draws = random.Random(_seed("shards", self.spec.seed, epoch, self.spec.rank, role, *source))
        where = f"source {self.spec.mixture[source[0]].name} of data.train: " if source else ""
        shards = (urls[draws.randrange(len(urls))] for _ in itertools.count())
        return _samples_of(shards, set(urls), _FirstOpens(where))

    def _decoder(self, role: int, epoch: int) -> Decode:
        """Decoding with the caption picked among several keys by a seed of the item's position."""
        spec = self.spec

        def decode(raw: RawSample, taken: int) -> Decoded:
            keys = keys_for(raw, spec.caption_keys)
            pick = _seed("caption", spec.seed, epoch, spec.rank, role, taken) if len(keys) > 1 else 0
            return decode_sample(raw, keys, pick, meta_needed=False)

        return decode

    def _shuffled(self, items: Iterator[RawSample], role: int, epoch: int, part: int) -> Iterator[RawSample]:
        spec = self.spec
        if spec.shuffle_buffer <= 1:
            return items
        rng = random.Random(f"samples/{spec.seed}/{epoch}/{spec.rank}/{role}/{part}")
        return iter(wds.shuffle(spec.shuffle_buffer, initial=spec.shuffle_buffer, rng=rng)(items))

    def _epoch(self, role: int, epoch: int, done: int, consumed: int, tally: SkipTally) -> Iterator[Batch]:
        spec = self.spec
        wanted = role_batches(role, epoch, spec.steps_per_epoch, spec.roles)
        if done >= wanted:
            return
        items = self._raw_items(role, epoch)
        decode = self._decoder(role, epoch)
        if consumed >= 0:  # skip the items the saved position went past, undecoded
            collections.deque(itertools.islice(items, consumed), maxlen=0)
        else:
            consumed = _replay(items, done * spec.batch_size, decode)
        batch = BatchBuilder(spec.batch_size)
        for taken, sample in usable(items, tally, decode, consumed):
            crop_seed = _seed("crop", spec.seed, epoch, spec.rank, role, taken)
            batch.add(sample, apply_seeded(self.transform, sample.image, crop_seed))
            if batch.full():
                done += 1
                position = (role, epoch, done, taken)
                names = [spec.mixture[s.source].name for s in batch.samples] if spec.mixture else []
                sources = collections.Counter(names)
                extra = {"skipped": tally.take_pending(), "sources": dict(sources), "position": position}
                yield batch.batch(self.tokenizer, **extra)
                if done == wanted:
                    return


class TrainLoader:
    """A rank's training batches, forever across epochs (the trainer stops at its max_steps).

    ``state_dict()`` is the JSON-able position after the batches handed out so far, per rank (the
    checkpoint gathers every rank's); ``load_state_dict`` or ``start_at`` positions a fresh loader.
    """

    def __init__(
        self,
        spec: _TrainSpec,
        transform: ImageTransform,
        tokenizer: Tokenizer,
        *,
        workers: int,
        pin_memory: bool,
    ) -> None:
        self._spec, self._transform, self._tokenizer = spec, transform, tokenizer
        self._workers, self._pin_memory = workers, pin_memory
        self.steps_per_epoch = spec.steps_per_epoch
        self.batch_size = spec.batch_size  # per rank
        self.source_names = tuple(source.name for source in spec.mixture)  # () without a mixture
        self.start_at(0)

    def start_at(self, step: int, state: dict[str, Any] | None = None) -> None:
        """Position the stream before batch ``step``, from this rank's ``state_dict()`` at that step
        if given (fast), else by replaying each role's epoch so far."""
        spec = self._spec
        starts = _restore(state, spec, step) if state is not None else None
        if starts is None:
            starts = [position_at(step, role, spec.steps_per_epoch, spec.roles) for role in range(spec.roles)]
        stream = TrainStream(spec, self._transform, self._tokenizer, starts, step)
        self._loader = DataLoader(
            stream,
            batch_size=None,
            num_workers=self._workers,
            pin_memory=self._pin_memory and torch.cuda.is_available(),
            **signal_free_workers(),
            # Its own generator: starting an iterator must not draw from the global RNG, whose state
            # (dropout masks) a checkpoint restores exactly.
            generator=torch.Generator().manual_seed(_seed(spec.seed, spec.rank)),
        )
        self._iterator: Iterator[Batch] | None = None
        self._step = step
        self._positions = list(starts)  # per role: where it stands after its last batch handed out
        self._skipped: collections.Counter[str] = collections.Counter(state["skipped"] if state else {})
        self._sources: collections.Counter[str] = collections.Counter(
            _renamed_sources(state.get("sources", {}), spec.mixture) if state else {}
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start_at(state["step"], state)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> Batch:
        if self._iterator is None:
            self._iterator = iter(self._loader)
        try:
            batch = next(self._iterator)
        except DataError as err:  # raised in a worker: the DataLoader re-raises it wrapped in a traceback
            raise DataError(str(err).strip().rpartition("DataError: ")[2]) from None
        role, epoch, done, consumed = batch.position
        if role != self._step % self._spec.roles:
            raise RuntimeError(f"data loader order broke: step {self._step} came from worker role {role}")
        self._positions[role] = Position(epoch, done, consumed)
        self._step += 1
        self._skipped.update(batch.skipped)
        self._sources.update(batch.sources)
        return batch

    def skip_counts(self) -> dict[str, int]:
        """Skipped samples by reason, over all workers and, after a resume, the run so far."""
        return dict(self._skipped)

    def source_counts(self) -> dict[str, int]:
        """Samples handed out per mixture source (``source_names``), over all workers and, after a
        resume, the run so far."""
        return dict(self._sources)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "step": self._step,
            **_fingerprint(self._spec),
            "positions": [list(position) for position in self._positions],
            "skipped": dict(self._skipped),
            "sources": dict(self._sources),
        }

    def close(self) -> None:
        """Stop the worker processes."""
        self._iterator = None


# What a saved position is only valid for, and the settings that decide it. A change of one of
# ``RESTARTING_KEYS`` restarts the data streams at the step, as a world-size change does (fewer
# workers for a node short of host memory); a change of the others is refused.
RESTARTING_KEYS = ("workers", "shuffle_buffer")
FINGERPRINT_KEYS = {
    "rank": "the world size",
    "world_size": "the world size",
    "workers": "data.workers (0 counts as 1)",
    "batch_size": "batch.global_size (per rank here)",
    "steps_per_epoch": "data.num_samples (or the shards' sizes)",
    "seed": "train.seed",
    "resampled": "data.resampled",
    # a table's pieces are named by its csv keys and counted by its rows a piece
    "shards": "data.train (a table's: and data.csv_shard_rows)",
    "shard_names": "data.train (a table's: and data.csv_shard_rows, data.csv_*_key, data.csv_separator)",
    "mixture_shares": "data.train and data.train_weights",
    "shuffle_buffer": "data.shuffle_buffer",
    "caption_keys": "data.caption_key",
}


def _fingerprint(spec: _TrainSpec) -> dict[str, Any]:
    return {
        "rank": spec.rank,
        "world_size": spec.world_size,
        "workers": spec.roles,
        "batch_size": spec.batch_size,
        "steps_per_epoch": spec.steps_per_epoch,
        "seed": spec.seed,
        "resampled": spec.resampled,
        "shards": len(spec.urls),
        "shard_names": _shard_names_digest(spec.urls),
        # each source's shard count and weight, not its name (its folder's): a source's shards moved
        # to another folder resume, as a single source's do. None without a mixture.
        "mixture_shares": [[len(s.urls), s.weight] for s in spec.mixture] or None,
        "shuffle_buffer": spec.shuffle_buffer,
        "caption_keys": list(spec.caption_keys),
    }


def _renamed_sources(counts: dict[str, int], mixture: tuple[Source, ...]) -> dict[str, int]:
    """Saved per-source counts under this run's source names: a name is the source's index and its
    folder's name (``mixture.source_name``), and a source may have moved to another folder."""
    return {mixture[source_index(name)].name: count for name, count in counts.items()}


def _shard_names_digest(urls: Iterable[str]) -> str:
    """A digest of the shards' file names in order: another range of as many shards is refused on
    resume, while the same shards copied to another folder, or streamed with ``pipe:``, resume."""
    names = (url.removesuffix(" -").rsplit("/", 1)[-1] for url in urls)
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def _same(saved: Any, now: Any) -> bool:
    """Equal, floats to rounding: a mixture's weights spelled ``[7, 2, 1]`` and ``[0.7, 0.2, 0.1]``
    are one mixture, whose normalised shares differ in the last bit."""
    if isinstance(saved, list) and isinstance(now, list):
        return len(saved) == len(now) and all(map(_same, saved, now))
    if isinstance(saved, float) and isinstance(now, float):
        return math.isclose(saved, now, rel_tol=1e-12)
    return saved == now


def _restore(state: dict[str, Any], spec: _TrainSpec, start_step: int) -> list[Position] | None:
    """The saved positions, once the state is checked to be this setting's; None where only
    ``RESTARTING_KEYS`` changed, said in a line (the streams restart at the step). A key the state
    lacks (saved before it was recorded) is not checked."""
    if state.get("version") != STATE_VERSION:
        raise DataError(f"data loader state has version {state.get('version')!r}; expected {STATE_VERSION}")
    if state["step"] != start_step:
        raise DataError(f"the data loader state was saved at step {state['step']}, not at step {start_step}")
    changed = {
        key: now for key, now in _fingerprint(spec).items() if key in state and not _same(state[key], now)
    }
    for key, now in changed.items():
        if key not in RESTARTING_KEYS:
            raise DataError(
                f"cannot restore the data position: it was saved with {key}={state[key]}, this run has "
                f"{key}={now}; set {FINGERPRINT_KEYS[key]} as the run that saved it did to resume exactly"
            )
    if not changed:
        return [Position(*p) for p in state["positions"]]
    if spec.rank == 0:
        settings = ", ".join(f"data.{key} {state[key]} -> {now}" for key, now in changed.items())
        get_logger().warning(
            f"{settings} since the checkpoint: the data streams restart at step {start_step}, in the "
            f"order of the new setting; the rest of epoch {start_step // spec.steps_per_epoch} may repeat "
            "samples it trained on and leave out others it did not, and later epochs are whole"
        )
    return None


def build_train_loader(
    data_cfg: DataConfig,
    *,
    global_batch: int,
    rank: int,
    world_size: int,
    seed: int,
    image_size: int,
    tokenizer: Tokenizer,
    pin_memory: bool = False,
) -> TrainLoader:
    """The training loader of one rank, at step 0; rank and world size come from the arguments,
    not from ``torch.distributed``."""
    mixture: tuple[Source, ...] = ()
    if data_cfg.train_weights:

        def expand(part: str, what: str) -> list[str]:
            return source_urls(part, data_cfg, what=what)

        mixture = mixture_sources(data_cfg.train, data_cfg.train_weights, expand)
        urls = [url for source in mixture for url in source.urls]
    else:
        urls = source_urls(data_cfg.train, data_cfg, what="data.train")
    if global_batch <= 0 or global_batch % world_size:
        raise DataError(
            f"batch.global_size={global_batch} must be a positive multiple of the world size {world_size}"
        )
    num_samples = data_cfg.num_samples or dataset_size(urls)
    if not num_samples:
        raise DataError(
            "data.num_samples=0 means one pass over the shards, but their sizes are unknown (no sizes.json "
            "or img2dataset *_stats.json next to them); set data.num_samples"
        )
    steps = num_samples // global_batch
    if steps == 0:
        raise DataError(
            f"an epoch of {num_samples} samples is less than one global batch of {global_batch}; "
            "raise data.num_samples or lower batch.global_size"
        )
    roles = max(1, data_cfg.workers)
    if not data_cfg.resampled and len(urls) < world_size * roles:
        rows = f"data.csv_shard_rows={data_cfg.csv_shard_rows}"
        tables = f" (a table counts one per {rows} rows)" if any(map(is_piece, urls)) else ""
        raise DataError(
            f"data.train has {len(urls)} shards{tables}, fewer than {world_size} ranks x {roles} workers: "
            "some workers would get none. Use data.resampled=true, fewer data.workers, or "
            + (f"a smaller {rows}" if tables else "more (smaller) shards")
        )
    spec = _TrainSpec(
        urls=tuple(urls),
        mixture=mixture,
        caption_keys=data_cfg.caption_keys,
        resampled=data_cfg.resampled,
        seed=seed,
        rank=rank,
        world_size=world_size,
        roles=roles,
        batch_size=global_batch // world_size,
        steps_per_epoch=steps,
        shuffle_buffer=data_cfg.shuffle_buffer,
        max_skip_fraction=data_cfg.max_skip_fraction,
    )
    transform = train_transform(
        image_size,
        data_cfg.rrc_scale,
        data_cfg.rrc_ratio,
        color_jitter=data_cfg.color_jitter,
        color_jitter_prob=data_cfg.color_jitter_prob,
        grayscale_prob=data_cfg.grayscale_prob,
    )
    return TrainLoader(spec, transform, tokenizer, workers=data_cfg.workers, pin_memory=pin_memory)
