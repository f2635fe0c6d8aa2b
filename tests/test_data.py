"""The training/eval loaders on real tar shards: rank/worker coverage, equal steps, bad samples,
exact resume. Ranks are simulated in one process (rank and world size are loader arguments)."""

from __future__ import annotations

import collections
import dataclasses
import gzip
import io
import itertools
import json
import re
import shutil
import sys
import tarfile
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image
from processes import run_to_end
from small_runs import DEMO_CONFIG, run_overrides

from clip_train.config import ConfigError, DataConfig, load_config
from clip_train.data import (
    DataError,
    build_eval_loader,
    build_train_loader,
    check_readable,
    check_source_options,
    dataset_size,
    expand_urls,
    sources,
    train_loader,
)
from clip_train.data.batches import BatchBuilder, read_source, source_urls
from clip_train.data.samples import BadSample, SkipTally, decode_sample, sample_key
from clip_train.data.sources import read_shard
from clip_train.data.tables import TableFormat
from clip_train.data.train_loader import position_at, role_batches
from clip_train.data.transforms import apply_seeded, train_transform
from clip_train.data.writers import Record, csv_pairs, write_pairs, write_shards
from clip_train.logs import setup_logging

IMAGE_SIZE = 16


class ClipTokenizer:
    """open_clip's BPE tokenizer (bundled, offline) with an attention mask."""

    def __init__(self, context_length: int = 12) -> None:
        self.context_length = context_length

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        ids = open_clip.tokenize(texts, context_length=self.context_length)
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def png(seed: int, size: int = 20) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size + seed % 7, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def good(key: str, label: int = 0) -> list[tuple[str, bytes]]:
    return [
        (f"{key}.json", json.dumps({"label": label}).encode()),
        (f"{key}.png", png(sum(map(ord, key)))),
        (f"{key}.txt", f"a photo number {key}".encode()),
    ]


def make_shards(root: Path, sizes: list[int]) -> list[str]:
    """Shards of good samples with globally unique keys s{shard}k{index}; return all keys."""
    root.mkdir(parents=True, exist_ok=True)
    keys = []
    for shard, size in enumerate(sizes):
        records = [f"s{shard}k{i}" for i in range(size)]
        keys += records
        write_tar(root / f"shard-{shard:03d}.tar", [m for k in records for m in good(k, shard)])
    return keys


def config(train: str, **overrides) -> DataConfig:
    return DataConfig(train=train, **{"workers": 2, "shuffle_buffer": 8, **overrides})


def loader_for(
    cfg: DataConfig, rank: int = 0, world_size: int = 1, global_batch: int = 8, seed: int = 0, **kw
):
    return build_train_loader(
        cfg,
        global_batch=global_batch,
        rank=rank,
        world_size=world_size,
        seed=seed,
        image_size=IMAGE_SIZE,
        tokenizer=ClipTokenizer(),
        **kw,
    )


def take(loader, steps: int) -> list:
    batches = [batch for _, batch in zip(range(steps), loader, strict=False)]
    assert len(batches) == steps
    return batches


@pytest.fixture(scope="module")
def even_shards(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("even")
    return root, make_shards(root, [6] * 8)


# --------------------------------------------------------------------------------------------


def test_expand_urls_braces_sources_dirs_and_pipes(tmp_path):
    make_shards(tmp_path / "d", [1, 1, 1])
    spec = f"/x/a-{{0..2}}.tar::{tmp_path / 'd'}::pipe:cat /x/b.tar"
    expected = ["/x/a-0.tar", "/x/a-1.tar", "/x/a-2.tar"]
    expected += [str(tmp_path / "d" / f"shard-{i:03d}.tar") for i in range(3)] + ["pipe:cat /x/b.tar"]
    assert expand_urls(spec) == expected
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"holds no \.tar"):
        expand_urls(str(tmp_path / "empty"))
    with pytest.raises(DataError, match=r"data\.train is empty"):
        expand_urls("  ")
    with pytest.raises(DataError, match="empty source"):
        expand_urls("/x/a.tar::")
    with pytest.raises(DataError, match=r"no such file or directory: /x/a-0\.tar"):
        expand_urls("/x/a-{0..2}.tar")  # a typo in the path fails at start-up, not mid-run


def test_dataset_size_from_sizes_json_or_img2dataset_stats(tmp_path):
    make_shards(tmp_path, [2, 3])
    urls = expand_urls(str(tmp_path))
    assert dataset_size(urls) is None
    (tmp_path / "shard-000_stats.json").write_text(json.dumps({"count": 9, "successes": 2}))
    assert dataset_size(urls) is None  # shard-001's size is still unknown
    (tmp_path / "shard-001_stats.json").write_text(json.dumps({"count": 4, "successes": 3}))
    assert dataset_size(urls) == 5
    (tmp_path / "sizes.json").write_text(json.dumps({"shard-000.tar": 20}))
    assert dataset_size(urls) == 23  # sizes.json first, stats for the rest


def test_role_schedule_splits_every_epoch_exactly():
    for steps, roles in [(6, 2), (7, 3), (1, 2), (5, 1)]:
        for epoch in range(4):
            assert sum(role_batches(r, epoch, steps, roles) for r in range(roles)) == steps
        for step in range(3 * steps + 1):
            for role in range(roles):
                nxt = next(i for i in range(step, step + roles) if i % roles == role)  # role's next step
                epoch, done, consumed = position_at(step, role, steps, roles)
                assert (epoch, consumed) == (nxt // steps, -1)
                earlier = [i for i in range(epoch * steps, nxt) if i % roles == role]
                assert done == len(earlier)


def test_non_resampled_ranks_and_workers_cover_each_sample_once_per_epoch(even_shards):
    root, keys = even_shards
    cfg = config(str(root), resampled=False, num_samples=len(keys))
    per_rank = []
    for rank in range(2):
        loader = loader_for(cfg, rank=rank, world_size=2)
        assert loader.steps_per_epoch == 6 and loader.batch_size == 4
        batches = take(loader, 2 * loader.steps_per_epoch)
        assert all(
            b.images.shape == (4, 3, IMAGE_SIZE, IMAGE_SIZE) and b.images.dtype == torch.uint8
            for b in batches
        )
        per_rank.append([[k for b in batches[e * 6 : (e + 1) * 6] for k in b.keys] for e in range(2)])
    for epoch in range(2):
        seen = per_rank[0][epoch] + per_rank[1][epoch]
        assert sorted(seen) == sorted(keys), f"epoch {epoch} does not cover every sample exactly once"
    assert per_rank[0][0] != per_rank[0][1]  # reshuffled between epochs


def test_resampled_ranks_draw_differently_and_the_seed_reproduces(even_shards):
    root, _ = even_shards
    cfg = config(str(root), resampled=True, num_samples=48)

    def run(rank: int, seed: int):
        batches = take(loader_for(cfg, rank=rank, world_size=2, seed=seed), 8)
        return [k for b in batches for k in b.keys], torch.cat([b.images for b in batches])

    keys0, images0 = run(0, seed=0)
    keys0_again, images0_again = run(0, seed=0)
    assert keys0 == keys0_again and torch.equal(images0, images0_again)
    assert run(1, seed=0)[0] != keys0
    assert run(0, seed=1)[0] != keys0


@pytest.mark.parametrize("resampled", [False, True])
def test_uneven_shards_give_every_rank_the_same_steps_per_epoch(tmp_path, resampled):
    sizes = [1, 2, 3, 20, 5, 9, 2, 7]
    make_shards(tmp_path, sizes)
    (tmp_path / "sizes.json").write_text(json.dumps({f"shard-{i:03d}.tar": n for i, n in enumerate(sizes)}))
    cfg = config(str(tmp_path), resampled=resampled, num_samples=0)  # 0: one pass, sized by sizes.json
    for rank in range(2):
        loader = loader_for(cfg, rank=rank, world_size=2)
        assert loader.steps_per_epoch == sum(sizes) // 8
        batches = take(loader, 2 * loader.steps_per_epoch + 1)
        assert all(len(b) == 4 for b in batches)
        epochs = [b.position[1] for b in batches]
        assert epochs == [step // loader.steps_per_epoch for step in range(len(batches))]


def test_too_few_shards_for_ranks_times_workers_is_a_clear_error(even_shards):
    root, _ = even_shards
    cfg = config(f"{root}/shard-00{{0..2}}.tar", resampled=False, num_samples=48)
    with pytest.raises(DataError, match=r"3 shards, fewer than 2 ranks x 2 workers"):
        loader_for(cfg, world_size=2)
    loader_for(dataclasses.replace(cfg, resampled=True), world_size=2)  # resampled: fine


def test_a_table_in_too_few_pieces_names_the_rows_per_piece(table):
    """A table's shards are its pieces of data.csv_shard_rows rows: the error names that key."""
    cfg = config(str(table.path), resampled=False, num_samples=16, csv_shard_rows=12)
    message = (
        r"2 shards \(a table counts one per data\.csv_shard_rows=12 rows\), fewer than 2 ranks x 2 workers"
    )
    with pytest.raises(DataError, match=message + r".* or a smaller data\.csv_shard_rows=12$"):
        loader_for(cfg, world_size=2)
    loader_for(dataclasses.replace(cfg, csv_shard_rows=6), world_size=2)  # 4 pieces: one each


def test_unknown_epoch_size_and_tiny_epochs_are_clear_errors(even_shards):
    root, _ = even_shards
    with pytest.raises(DataError, match=r"set data\.num_samples"):
        loader_for(config(str(root), num_samples=0))
    with pytest.raises(DataError, match="less than one global batch"):
        loader_for(config(str(root), num_samples=7))


# --------------------------------------------------------------------------------------------
# Bad samples
# --------------------------------------------------------------------------------------------

EXPECTED_SKIPS = {
    "bad_image": 1,
    "empty_caption": 1,
    "missing_caption": 1,
    "missing_image": 1,
    "empty_file": 1,
    "duplicate_key": 1,
    "truncated_tar": 1,
    "shard_open": 1,
}


@pytest.fixture(scope="module")
def corrupt_shards(tmp_path_factory) -> tuple[Path, list[str]]:
    """Every bad kind once, each flanked by good samples; returns the good keys."""
    root = tmp_path_factory.mktemp("corrupt")
    members = [*good("a0"), ("bad.png", b"\x89PNG not really"), ("bad.txt", b"undecodable image")]
    members += [*good("a1"), ("blank.png", png(1)), ("blank.txt", b"  \n")]
    members += [("nocap.png", png(2)), *good("a2"), ("noimg.txt", b"caption without image")]
    members += [*good("a3"), ("zero.png", b""), ("zero.txt", b"zero-byte image")]
    members += [*good("a4"), *good("a0"), *good("a5")]  # a0 again: a duplicate key
    write_tar(root / "shard-000.tar", members)
    write_tar(root / "shard-001.tar", good("b0") + good("b1") + good("b2") + good("b3"))
    data = (root / "shard-001.tar").read_bytes()
    cut = data.index(b"b3.png") + 512 + 40  # in the middle of b3.png's data
    (root / "shard-001.tar").write_bytes(data[:cut])
    write_tar(root / "shard-002.tar", good("c0"))
    return root, ["a0", "a1", "a2", "a3", "a4", "a5", "b0", "b1", "b2", "c0"]


def corrupt_spec(root: Path) -> str:
    return f"{root}/shard-00{{0..2}}.tar::{root}/missing.tar"


def test_each_bad_kind_is_classified_and_counted_once(corrupt_shards):
    root, good_keys = corrupt_shards
    tally = SkipTally(max_fraction=1.0)
    arrived = []
    for url in expand_urls(corrupt_spec(root)):
        for raw in read_shard(url):
            try:
                arrived.append(decode_sample(raw).key)
                tally.add_good()
            except BadSample as bad:
                tally.add_bad(bad, raw)
    assert arrived == good_keys
    assert dict(tally.total) == EXPECTED_SKIPS
    assert tally.take_pending() == EXPECTED_SKIPS and tally.take_pending() == {}


@pytest.mark.parametrize("damage", ["garbled", "cut"])
def test_a_damaged_header_mid_shard_is_counted_not_taken_for_its_end(tmp_path, damage):
    """Python's tar reader ends quietly at a bad header past the first: the shard's rest went
    uncounted. The samples before it arrive, then one truncated_tar record."""
    write_tar(tmp_path / "shard.tar", good("k0") + good("k1") + good("k2") + good("k3"))
    data = bytearray((tmp_path / "shard.tar").read_bytes())
    header = data.index(b"k2.png")  # a header starts with its member's name
    if damage == "garbled":
        data[header : header + 4] = b"\xff" * 4  # its checksum no longer matches
    else:
        data = data[: header + 200]
    (tmp_path / "shard.tar").write_bytes(bytes(data))
    raws = list(read_shard(str(tmp_path / "shard.tar")))
    assert [r["__key__"] for r in raws if "__bad__" not in r][:2] == ["k0", "k1"]
    assert [r["__bad__"] for r in raws if "__bad__" in r] == ["truncated_tar"]
    assert raws[-1]["__bad__"] == "truncated_tar"


def test_a_broken_shard_drawn_again_is_counted_each_time_and_said_once(tmp_path, capsys):
    """A resampled run draws a broken shard again and again: a line each time filled the log."""
    setup_logging()
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"not a tar file" * 100)
    reads = [[raw["__bad__"] for raw in read_shard(str(broken))] for _ in range(3)]
    assert reads == [["shard_open"]] * 3
    assert capsys.readouterr().err.count(f"shard {broken}: shard_open") == 1


def records(url: str) -> list[tuple[str, str | None]]:
    """Each sample ``read_shard`` yields, as its key and its bad-sample reason (None when whole)."""
    return [(raw["__key__"], raw.get("__bad__")) for raw in read_shard(url)]


def test_a_whole_compressed_shard_is_not_taken_for_a_cut_one(tmp_path):
    """The end-of-archive check reads a plain tar's last bytes; a gzipped one ends otherwise."""
    write_tar(tmp_path / "shard.tar", good("k0") + good("k1"))
    (tmp_path / "shard.tar.gz").write_bytes(gzip.compress((tmp_path / "shard.tar").read_bytes()))
    for name in ("shard.tar", "shard.tar.gz"):
        assert records(str(tmp_path / name)) == [("k0", None), ("k1", None)]


class _ResetAt(io.RawIOBase):
    """A remote shard's stream that breaks at byte ``at`` (a connection reset), every byte before it
    delivered: the break is deterministic, as a real network's is not."""

    def __init__(self, data: bytes, at: int) -> None:
        self.data, self.at, self.position = data, at, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.position >= self.at:
            raise ConnectionResetError("connection reset by peer")
        chunk = self.data[self.position : min(self.at, self.position + len(buffer))]
        buffer[: len(chunk)] = chunk
        self.position += len(chunk)
        return len(chunk)


def test_a_stream_that_breaks_in_a_header_keeps_the_whole_sample_before_it(tmp_path, monkeypatch):
    """The stream breaks inside k2's first header: k1 was whole, and was dropped uncounted."""
    write_tar(tmp_path / "shard.tar", good("k0") + good("k1") + good("k2"))
    data = (tmp_path / "shard.tar").read_bytes()
    url = "s3://bucket/shard.tar"
    stream = _ResetAt(data, data.index(b"k2.") + 100)
    monkeypatch.setattr(sources, "url_opener", lambda urls, handler: iter([{"url": url, "stream": stream}]))
    assert records(url) == [
        ("k0", None),
        ("k1", None),
        ("", "truncated_tar"),
    ]


def test_a_pipe_that_fails_after_a_whole_tar_is_counted(tmp_path):
    """Its exit status is checked when the stream is closed: a command that failed once its output
    was read (webdataset checks it at reads only) counted nothing. This one writes end-of-archive
    zeros until the reader closes the pipe, then fails."""
    write_tar(tmp_path / "shard.tar", good("k0"))
    command = tmp_path / "fails.sh"
    command.write_text(
        f"trap '' PIPE\ncat {tmp_path / 'shard.tar'}\nwhile printf '\\0' 2>/dev/null; do :; done\nexit 1\n"
    )
    assert records(f"pipe:bash {command}") == [("k0", None), ("", "truncated_tar")]


def test_shards_that_cannot_be_opened_stop_the_run_before_a_batchs_worth_of_them(two_sources):
    """A bucket's name mistyped, or no credentials: every shard fails to open. Each counts as one
    skipped sample, so a rank's batch of them (32,768 at a large run's scale, a download each) went
    by before the run stopped, after the shuffle buffer's 1,000; now the first 20, of the stream or
    of a mixture's source."""
    unreachable = "pipe:false {0..99}"
    plain = config(unreachable, workers=0, num_samples=4096, shuffle_buffer=1000)
    with pytest.raises(DataError, match=r"^the first 20 shards drawn could not be opened"):
        take(loader_for(plain, global_batch=2048), 1)
    mixture = dataclasses.replace(plain, train=f"{two_sources}/a::{unreachable}", train_weights=[0.5, 0.5])
    with pytest.raises(DataError, match=r"^source 1-pipe_false of data.train: the first 20 shards drawn"):
        take(loader_for(mixture, global_batch=2048), 1)


def test_a_worker_with_fewer_unopenable_shards_than_the_limit_stops_after_the_limit_too():
    """Without resampling a worker reads its shards pass after pass: with 4 of them the count of the
    first unopened ones started over every pass and never reached 20, so the run went on to the
    skip rate's rule, a rank's batch of failed opens (2048 here) later."""
    unreachable = config(
        "pipe:false {0..3}", resampled=False, workers=0, num_samples=4096, shuffle_buffer=1000
    )
    with pytest.raises(DataError, match=r"^the first 20 shards drawn could not be opened"):
        take(loader_for(unreachable, global_batch=2048), 1)


def test_loader_skips_and_counts_bad_samples_from_its_worker(corrupt_shards):
    """One worker, no sample shuffle: passes repeat in the same order, so the counts between the
    end of pass 1 and the end of pass 2 are exactly one pass's skips, wherever they fall."""
    root, good_keys = corrupt_shards
    cfg = config(corrupt_spec(root), resampled=False, workers=1, shuffle_buffer=0, num_samples=1000)
    cfg = dataclasses.replace(cfg, max_skip_fraction=1.0)
    loader = loader_for(cfg, global_batch=1)
    passes = []
    counts = []
    for _ in range(2):
        passes.append([b.keys[0] for b in take(loader, len(good_keys))])
        counts.append(collections.Counter(loader.skip_counts()))
    assert sorted(passes[0]) == sorted(good_keys) and passes[1] == passes[0]
    assert dict(counts[1] - counts[0]) == EXPECTED_SKIPS


def test_a_script_that_never_closes_its_loader_still_exits(tmp_path):
    """Workers ignore SIGTERM (it is the trainer's), which is all the interpreter's exit sends its
    daemonic children before waiting for them: a script using the loader without close() hung."""
    make_shards(tmp_path / "shards", [6] * 4)
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_data import config, loader_for
loader = loader_for(config({str(tmp_path / "shards")!r}, num_samples=24))
next(loader)
print("exiting", flush=True)
"""
    result = run_to_end([sys.executable, "-c", script], idle_limit_s=60)
    assert result.returncode == 0 and result.stdout == "exiting\n", result.stderr[-2000:]


def test_a_replayed_resume_over_shards_that_hold_nothing_usable_stops(tmp_path):
    """A resume without a saved position (another world size) replays the epoch so far: over shards
    gone unreadable it spun forever; it stops as a fresh start does, at the 20th that fails to open."""
    cfg = config(f"pipe:cat {tmp_path}/gone-{{0..3}}.tar", num_samples=24, workers=0, max_skip_fraction=1.0)
    loader = loader_for(cfg)
    loader.start_at(2)
    with pytest.raises(DataError, match=r"^the first 20 shards drawn could not be opened"):
        next(loader)


def test_workers_of_a_large_run_draw_their_own_shard_sequences(monkeypatch):
    """Seed 0, 2048 ranks x 8 workers, epoch 21: rank 1373's worker 7 and rank 1615's worker 3 drew
    the same shards in the same order (webdataset's ResampledShards keeps 31 bits of the seed)."""
    urls = tuple(f"/d/{i:05d}.tar" for i in range(41408))
    monkeypatch.setattr(train_loader, "_samples_of", lambda drawn, *_: drawn)  # the shard names drawn

    def draws(rank: int, role: int) -> list[str]:
        stream = train_loader.TrainStream(SimpleNamespace(seed=0, rank=rank), None, None, [], 0)
        return list(itertools.islice(stream._resampled(urls, role, 21), 5))

    first, second = draws(1373, 7), draws(1615, 3)
    assert first != second and draws(1373, 7) == first  # apart, and each one reproducible


def test_skip_rate_above_the_limit_stops_with_a_clear_error(corrupt_shards):
    root, _ = corrupt_shards
    cfg = config(corrupt_spec(root), resampled=False, workers=1, num_samples=1000, max_skip_fraction=0.2)
    loader = loader_for(cfg, global_batch=2)
    take(loader, 20)  # a pass skips 8 of 18: judged from the first 1,000 samples on
    with pytest.raises(DataError, match=r"were skipped, more than data.max_skip_fraction=0.2") as err:
        take(loader, 500)
    skipped, seen = map(int, re.search(r"(\d+) of (\d+) samples", str(err.value)).groups())
    assert SkipTally.MIN_SEEN <= seen < SkipTally.MIN_SEEN + 18 and 0.4 < skipped / seen < 0.5


def test_the_skip_rate_is_judged_from_1000_samples_on_and_per_source_by_its_own_reasons():
    """From a rank's batch of 8 on, one bad sample in the first 8 stopped the run; a source's error
    names its own skips, not the whole stream's."""
    early = SkipTally(max_fraction=0.1, min_seen=8)
    for _ in range(7):
        early.add_good()
    early.add_bad(BadSample("bad_image"), {})
    tally = SkipTally(max_fraction=0.5, min_seen=8, sources=("0-a", "1-b"))
    for _ in range(60):
        tally.add_bad(BadSample("missing_caption"), {"__source__": 0})
    for _ in range(2000):
        tally.add_good(0)
    for _ in range(400):
        tally.add_good(1)
    with pytest.raises(DataError) as err:  # the stream's 660 of 3060 are under its limit
        for _ in range(600):
            tally.add_bad(BadSample("bad_image"), {"__source__": 1})
    assert str(err.value).startswith("source 1-b of data.train: 600 of 1000 samples (60.0%) were skipped")
    assert "reasons: {'bad_image': 600}." in str(err.value)


@pytest.mark.timeout(120)  # without the rule the loader cycles the shards forever
def test_a_stream_with_no_usable_sample_stops_even_when_every_skip_is_allowed(tmp_path):
    """data.max_skip_fraction=1 allows any share of bad samples, but a training stream with no
    usable one (here a caption key that no sample has) would never yield a batch: it stops."""
    write_tar(tmp_path / "shard-000.tar", good("a") + good("b") + good("c"))
    # In the process (workers=0): the rule is the worker's tally, and no worker outlives the error.
    cfg = config(str(tmp_path), workers=0, num_samples=64, max_skip_fraction=1.0, caption_key="json:title")
    with pytest.raises(
        DataError, match=r"none of the first 1000 samples could be used; reasons: \{'missing_caption': 1000\}"
    ):
        take(loader_for(cfg, global_batch=2), 1)
    evaluation = SkipTally.counting_only()  # one finite pass: counts, never stops
    for _ in range(100):
        evaluation.add_bad(BadSample("missing_caption"), {})
    assert evaluation.total == {"missing_caption": 100}
    # under the usual limit, the same stream is stopped naming the key, not the shards or the limit
    strict = dataclasses.replace(cfg, max_skip_fraction=0.1)
    with pytest.raises(
        DataError, match=r"reasons: \{'missing_caption': \d+\}\. Check data\.caption_key: every"
    ):
        take(loader_for(strict, global_batch=2), 1)


# --------------------------------------------------------------------------------------------
# Exact resume
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resume_shards(tmp_path_factory) -> Path:
    """Uneven shards with some undecodable images, so skipped samples shift the stream."""
    root = tmp_path_factory.mktemp("resume")
    for shard, size in enumerate([9, 5, 12, 7, 8, 10]):
        members = []
        for i in range(size):
            key = f"s{shard}k{i}"
            members += [(f"{key}.png", b"broken"), (f"{key}.txt", b"x")] if i % 4 == 3 else good(key)
        write_tar(root / f"shard-{shard:03d}.tar", members)
    return root


@pytest.fixture(params=["shards", "table"])
def resume_data(request, resume_shards, table) -> str:
    return str(resume_shards) if request.param == "shards" else str(table.path)


@pytest.mark.parametrize("resampled", [False, True])
def test_resume_yields_the_same_batches_as_an_uninterrupted_run(resume_data, resampled):
    cfg = config(resume_data, resampled=resampled, num_samples=36, max_skip_fraction=0.5, csv_shard_rows=5)
    total, resume_at = 14, (5, 8)  # 4 steps per epoch: mid-epoch and at an epoch boundary
    reference = loader_for(cfg, world_size=2, rank=1)
    batches, states = [], {}
    for step in range(total):
        batches.append(next(reference))
        states[step + 1] = reference.state_dict()
        assert json.loads(json.dumps(states[step + 1])) == states[step + 1]
    for start in resume_at:
        for state in (states[start], None):  # cheap skip from the saved state / replay from the step
            loader = loader_for(cfg, world_size=2, rank=1)
            loader.start_at(start, state)
            resumed = take(loader, total - start)
            assert [b.keys for b in resumed] == [b.keys for b in batches[start:]]
            assert all(torch.equal(a.images, b.images) for a, b in zip(resumed, batches[start:], strict=True))


def test_a_state_from_a_different_setup_is_refused(resume_shards):
    cfg = config(str(resume_shards), resampled=True, num_samples=36, max_skip_fraction=0.5)
    loader = loader_for(cfg, world_size=2)
    take(loader, 3)
    state = loader.state_dict()
    # other usable samples: the saved count of items taken no longer places it
    with pytest.raises(DataError, match=r"saved with caption_keys=\['txt'\], .* set data.caption_key as"):
        loader_for(dataclasses.replace(cfg, caption_key="json"), world_size=2).load_state_dict(state)
    with pytest.raises(DataError, match=r"saved with resampled=True, .* set data.resampled as"):
        loader_for(dataclasses.replace(cfg, resampled=False), world_size=2).load_state_dict(state)
    with pytest.raises(DataError, match="saved at step 3, not at step 4"):
        loader_for(cfg, world_size=2).start_at(4, state)


def test_a_state_saved_with_other_workers_or_shuffle_buffer_restarts_the_streams_at_its_step(
    resume_shards, capsys
):
    """Fewer data.workers, for a node short of host memory, was refused at a resume. Now the streams
    restart at the step as after a world-size change: each worker of the new setting replays its
    way there, the run's skip counts go on, and a line says what it means for the epoch."""
    setup_logging()
    cfg = config(str(resume_shards), resampled=True, num_samples=36, max_skip_fraction=0.5)
    loader = loader_for(cfg, world_size=2)
    take(loader, 3)
    state = loader.state_dict()
    for change, said in [({"workers": 1}, "data.workers 2 -> 1"), ({"shuffle_buffer": 16}, "buffer 8 -> 16")]:
        changed = dataclasses.replace(cfg, **change)
        resumed, replayed = loader_for(changed, world_size=2), loader_for(changed, world_size=2)
        resumed.load_state_dict(state)
        replayed.start_at(3)
        assert [b.keys for b in take(resumed, 3)] == [b.keys for b in take(replayed, 3)]
        skipped = collections.Counter(state["skipped"]) + collections.Counter(replayed.skip_counts())
        assert resumed.skip_counts() == skipped and state["skipped"]
        assert f"{said} since the checkpoint: the data streams restart at step 3" in capsys.readouterr().err


def test_a_state_resumes_over_the_same_shards_moved_but_not_over_others_as_many(resume_shards, tmp_path):
    cfg = config(str(resume_shards), resampled=True, num_samples=36, max_skip_fraction=0.5)
    loader = loader_for(cfg)
    take(loader, 3)
    state, following = loader.state_dict(), take(loader, 3)
    moved, renamed = tmp_path / "moved", tmp_path / "renamed"
    shutil.copytree(resume_shards, moved)
    renamed.mkdir()
    for index, shard in enumerate(sorted(resume_shards.glob("*.tar"))):
        shutil.copy(shard, renamed / f"part-{index + 10:03d}.tar")
    resumed = loader_for(dataclasses.replace(cfg, train=str(moved)))
    resumed.start_at(3, state)
    assert [b.keys for b in take(resumed, 3)] == [b.keys for b in following]
    with pytest.raises(DataError, match=r"saved with shard_names=\w{16}, .* set data\.train \(a table's: "):
        loader_for(dataclasses.replace(cfg, train=str(renamed))).start_at(3, state)


def test_a_table_cut_otherwise_since_the_saved_state_is_refused_naming_the_rows_a_piece(table):
    """The user changed no data.train: the error names the key a table's pieces depend on too."""
    cfg = config(str(table.path), resampled=True, num_samples=16, csv_shard_rows=6)  # 24 rows: 4 pieces
    loader = loader_for(cfg)
    take(loader, 2)
    with pytest.raises(
        DataError,
        match=r"shards=4, this run has shards=3; set data\.train \(a table's: and data\.csv_shard_rows\) as",
    ):
        loader_for(dataclasses.replace(cfg, csv_shard_rows=8)).load_state_dict(loader.state_dict())


# --------------------------------------------------------------------------------------------
# CSV/TSV tables as training data
# --------------------------------------------------------------------------------------------


class Table(NamedTuple):
    path: Path
    good_keys: list[str]


TABLE_BAD_ROWS = {"missing_image": 1, "empty_caption": 1, "bad_image": 1, "bad_row": 1}


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Table:
    """A TSV of 24 rows under OpenCLIP's header, with square images (so a full-image crop is exact),
    captions quoted around a tab and a newline, one absolute path, and one row of each bad kind."""
    root = tmp_path_factory.mktemp("table")
    (root / "images").mkdir()
    lines = ["filepath\ttitle"]
    for row in range(1, 25):
        (root / f"images/{row}.png").write_bytes(png(row * 7, size=20))  # seed % 7 == 0: square
        lines.append(f'images/{row}.png\t"row {row}:\tsplit\nover lines"')
    (root / "images/broken.png").write_bytes(b"not a png")
    lines[2] = f"{root / 'images/2.png'}\tan absolute path"
    lines[5] = "images/gone.png\tmissing_image"
    lines[11] = "images/11.png\t  "
    lines[17] = "images/broken.png\tbad_image"
    lines[23] = "images/23.png\tbad_row\tthree fields"
    (root / "table.tsv").write_text("\n".join(lines) + "\n")
    return Table(root / "table.tsv", [sample_key(row) for row in range(1, 25) if row not in (5, 11, 17, 23)])


def test_a_table_reads_the_image_formats_pil_decodes(tmp_path):
    """OpenCLIP's CSV reader opens any image PIL can: BMP, GIF and TIFF rows train too."""
    lines = ["filepath,title"]
    for number, fmt in enumerate(("BMP", "GIF", "TIFF", "PNG")):
        path = tmp_path / f"{number}.{fmt.lower()}"
        Image.open(io.BytesIO(png(number))).save(path, format=fmt)
        lines.append(f"{path.name},a {fmt} image")
    (tmp_path / "table.csv").write_text("\n".join(lines) + "\n")
    cfg = config(
        str(tmp_path / "table.csv"), resampled=False, workers=0, num_samples=4, max_skip_fraction=0.0
    )
    (batch,) = take(loader_for(cfg, global_batch=4), 1)
    assert sorted(batch.keys) == [sample_key(row) for row in range(1, 5)] and batch.skipped == {}


def test_a_table_trains_on_the_same_samples_as_shards_made_from_it(table, tmp_path):
    pairs, _ = csv_pairs(table.path, TableFormat())
    write_pairs(pairs, tmp_path / "shards", per_shard=7, desc="t")
    one_pass = dict(resampled=False, workers=1, num_samples=len(table.good_keys), max_skip_fraction=0.5)
    whole_image = {"rrc_scale": [1.0, 1.0], "rrc_ratio": [1.0, 1.0]}  # crops independent of the crop seed
    epochs = []
    for spec in (table.path, tmp_path / "shards"):
        loader = loader_for(config(str(spec), **one_pass, **whole_image, csv_shard_rows=5), global_batch=4)
        assert loader.steps_per_epoch == 5
        batches = take(loader, 5)
        epochs.append(
            {
                key: (image, ids)
                for b in batches
                for key, image, ids in zip(b.keys, b.images, b.input_ids, strict=True)
            }
        )
    assert sorted(epochs[0]) == table.good_keys and epochs[0].keys() == epochs[1].keys()
    for key, (image, ids) in epochs[0].items():
        assert torch.equal(image, epochs[1][key][0]) and torch.equal(ids, epochs[1][key][1]), key


def test_table_bad_rows_are_skipped_and_counted_by_reason(table):
    """As for shards: one worker, no shuffle, so pass 2 repeats pass 1 and counts exactly its skips."""
    cfg = config(str(table.path), resampled=False, workers=1, shuffle_buffer=0, num_samples=1000)
    loader = loader_for(dataclasses.replace(cfg, max_skip_fraction=1.0, csv_shard_rows=5), global_batch=1)
    passes, counts = [], []
    for _ in range(2):
        passes.append([b.keys[0] for b in take(loader, len(table.good_keys))])
        counts.append(collections.Counter(loader.skip_counts()))
    assert sorted(passes[0]) == table.good_keys and passes[1] == passes[0]
    assert dict(counts[1] - counts[0]) == TABLE_BAD_ROWS
    assert loader_for(config(str(table.path), num_samples=0), global_batch=4).steps_per_epoch == 24 // 4


def test_table_options_reach_the_loader_and_bad_ones_name_their_key(table):
    with pytest.raises(DataError, match=r"no image column 'file' \(separator '\\t'\).*data\.csv_image_key"):
        loader_for(config(str(table.path), num_samples=8, csv_image_key="file"))
    with pytest.raises(DataError, match=r"columns found: \['filepath\\ttitle'\]"):
        loader_for(config(str(table.path), num_samples=8, csv_separator=","))
    loader_for(config(str(table.path), num_samples=8, csv_separator="\\t", csv_caption_key="title"))
    base = ["model.text.hf=bert-base-uncased"]
    assert load_config(None, [*base, "data.csv_separator=\\t"]).validate().data.csv_separator == "\\t"
    with pytest.raises(ConfigError, match=r"data\.csv_separator=';;' must be one character"):
        load_config(None, [*base, "data.csv_separator=;;"]).validate()
    with pytest.raises(ConfigError, match=r"data\.csv_shard_rows=0 must be > 0"):
        load_config(None, [*base, "data.csv_shard_rows=0"]).validate()
    with pytest.raises(
        ConfigError, match=r"unknown config key data\.csv_img_key: did you mean data\.csv_image_key"
    ):
        load_config(None, ["data.csv_img_key=filepath"])


def eval_batches(spec: str, rank: int, **options) -> list:
    """Rank ``rank`` of 2's eval batches, read by 2 workers."""
    loader = build_eval_loader(
        spec, rank=rank, world_size=2, image_size=IMAGE_SIZE, tokenizer=ClipTokenizer(), workers=2, **options
    )
    return list(loader)


def test_a_table_evaluates_on_the_same_samples_as_shards_made_from_it(table, tmp_path):
    """As OpenCLIP's --val-data takes a CSV: pieces spread over 2 workers, rows over 2 ranks, each
    good row once, bad rows skipped; pixels and tokens equal those of shards made from the table."""
    pairs, _ = csv_pairs(table.path, TableFormat())
    write_pairs(pairs, tmp_path / "shards", per_shard=7, desc="t")
    check_readable(expand_urls(str(table.path)), what="data.val")  # a table is not refused as a bad tar
    runs = []
    for spec in (str(table.path), str(tmp_path / "shards")):
        tables = DataConfig(csv_shard_rows=5)
        batches = [b for rank in range(2) for b in eval_batches(spec, rank, batch_size=3, data_cfg=tables)]
        samples = {k: (i, t) for b in batches for k, i, t in zip(b.keys, b.images, b.input_ids, strict=True)}
        assert len(samples) == sum(len(b) for b in batches)  # no row seen twice
        runs.append(samples)
    assert sorted(runs[0]) == table.good_keys and runs[0].keys() == runs[1].keys()
    for key, (image, ids) in runs[0].items():
        assert torch.equal(image, runs[1][key][0]) and torch.equal(ids, runs[1][key][1]), key


def test_a_rank_reads_only_its_own_rows_of_a_table(table, monkeypatch):
    """Evaluation spreads a table's rows over the ranks: each rank read every row's image, then kept
    its share (the world size times the reads)."""
    (piece,) = source_urls(str(table.path), DataConfig(), what="data.val")
    every_row = [raw["__key__"] for raw in read_source(piece)]
    read, real = [], Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda path: read.append(path.name) or real(path))
    mine = [raw["__key__"] for raw in read_source(piece, 1, 2)]
    assert mine == every_row[1::2] and 0 < len(read) <= len(mine)


# --------------------------------------------------------------------------------------------
# Eval
# --------------------------------------------------------------------------------------------


def test_eval_loader_gives_each_sample_once_across_ranks_with_labels(even_shards):
    root, keys = even_shards
    spec = f"pipe:cat {root}/shard-000.tar::{root}/shard-00{{1..7}}.tar"  # pipes and sources mix
    runs = []
    for _ in range(2):
        per_rank = []
        for rank in range(2):
            batches = eval_batches(spec, rank, batch_size=5)
            assert all(b.labels is not None and len(b.labels) == len(b) for b in batches)
            per_rank.append(
                {k: int(label) for b in batches for k, label in zip(b.keys, b.labels, strict=True)}
            )
        runs.append(per_rank)
    assert runs[0] == runs[1]  # deterministic
    assert sorted(runs[0][0] | runs[0][1]) == sorted(keys) and not runs[0][0].keys() & runs[0][1].keys()
    assert all(label == int(key[1 : key.index("k")]) for part in runs[0] for key, label in part.items())


@pytest.mark.parametrize(
    ("failure", "reason", "rank_1_keys"),
    [
        ("exit 1", "shard_open", []),
        ("head -c {cut} {shard}", "truncated_tar", ["s0k1"]),
    ],
)
def test_a_shard_that_fails_on_one_rank_only_is_counted_by_that_rank(
    even_shards, monkeypatch, failure, reason, rank_1_keys
):
    """Data staged on one node only, a transient pipe: or S3 error: the failure is the reading rank's
    own. Its record went to one rank's share by its place in the shard (a shard_open record is
    record 0: rank 0's; a cut after k1 is record 2: rank 0's too), so rank 1 lost its samples
    with nothing counted."""
    root, _ = even_shards
    shard = root / "shard-000.tar"
    cut = shard.read_bytes().index(b"s0k2.png") + 600  # inside k2's image data
    failing = failure.format(cut=cut, shard=shard)
    spec = f"pipe:sh -c 'if [ $READING_RANK = 1 ]; then {failing}; else cat {shard}; fi'"
    seen = []
    for rank in range(2):
        monkeypatch.setenv("READING_RANK", str(rank))
        batches = eval_batches(spec, rank, batch_size=4)
        skipped = collections.Counter()
        for batch in batches:
            skipped.update(batch.skipped)
        seen.append(([key for batch in batches for key in batch.keys], dict(skipped)))
    assert seen == [(["s0k0", "s0k2", "s0k4"], {}), (rank_1_keys, {reason: 1})]


def test_written_shards_load_and_captions_are_truncated_to_the_context(tmp_path):
    records = [Record(f"{i:03d}", png(i), "png", "a very long caption " * 20, {"label": i}) for i in range(6)]
    write_shards(records, tmp_path / "w", per_shard=4, total=6, source={"test": 1}, desc="t")
    cfg = config(str(tmp_path / "w"), num_samples=0, resampled=False, workers=1)
    batch = next(loader_for(cfg, global_batch=6))
    assert sorted(batch.keys) == [f"{i:03d}" for i in range(6)]
    assert batch.input_ids.shape == (6, 12) and batch.attention_mask.all()  # 12 = context length, full
    assert batch.labels is None  # the labels are in the json, which training reads for a caption only
    evaluated = build_eval_loader(
        str(tmp_path / "w"),
        batch_size=6,
        rank=0,
        world_size=1,
        image_size=IMAGE_SIZE,
        tokenizer=ClipTokenizer(),
    )
    assert sorted(label for batch in evaluated for label in batch.labels.tolist()) == list(range(6))


# --------------------------------------------------------------------------------------------
# Weighted mixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> Path:
    """Two sources of 8-px images written by ``write_shards``: a/ (60 samples, keys a000...) and
    b/ (45 samples, keys b000...)."""
    root = tmp_path_factory.mktemp("mixture")
    for name, count, per_shard in (("a", 60, 20), ("b", 45, 15)):
        records = [Record(f"{name}{i:03d}", png(i, size=8), "png", f"{name} {i}") for i in range(count)]
        write_shards(records, root / name, per_shard=per_shard, total=count, source={"t": name}, desc=name)
    return root


def test_a_weighted_mixture_draws_each_source_in_proportion(two_sources):
    """10,000 samples, 5,000 on each of 2 ranks, from sources weighted 0.8 / 0.2."""
    cfg = config(f"{two_sources}/a::{two_sources}/b", train_weights=[0.8, 0.2], num_samples=1000)
    per_rank = []
    for rank in range(2):
        loader = loader_for(cfg, rank=rank, world_size=2, global_batch=200)
        assert loader.source_names == ("0-a", "1-b")
        keys = [key for batch in take(loader, 50) for key in batch.keys]
        by_source = collections.Counter(key[0] for key in keys)
        assert loader.source_counts() == {"0-a": by_source["a"], "1-b": by_source["b"]}  # what is logged
        per_rank.append(keys)
    drawn = per_rank[0] + per_rank[1]
    assert len(drawn) == 10_000
    share_a = sum(key.startswith("a") for key in drawn) / len(drawn)
    assert abs(share_a - 0.8) < 0.01, share_a
    assert per_rank[0] != per_rank[1]  # ranks draw their own streams
    assert len(set(drawn)) == 60 + 45  # every shard of both sources was reached


@pytest.mark.timeout(120)  # without the rule the stream trains on source a alone, forever
@pytest.mark.parametrize(
    ("max_skip_fraction", "dead_weight", "message"),
    [
        (
            0.5,
            0.3,
            r"source 1-dead of data.train: 1000 of 1000 samples \(100.0%\) were skipped, more than data.max",
        ),
        (1.0, 0.5, r"source 1-dead of data.train: none of the first 1000 samples could be used"),
    ],
)
def test_a_mixture_source_with_no_usable_sample_stops_the_run_naming_it(
    two_sources, tmp_path, max_skip_fraction, dead_weight, message
):
    """Some of the draws come from a source whose images do not decode: the whole stream's skip rate
    stays under the limit, so without a rule per source it trained on source a alone."""
    dead = tmp_path / "dead"
    dead.mkdir()
    samples = [(f"d{i}.{ext}", b"not an image") for i in range(10) for ext in ("png", "txt")]
    write_tar(dead / "shard-000.tar", samples)
    cfg = config(
        f"{two_sources}/a::{dead}",
        train_weights=[1 - dead_weight, dead_weight],
        num_samples=1000,
        workers=0,
        max_skip_fraction=max_skip_fraction,
    )
    with pytest.raises(DataError, match=message):
        take(loader_for(cfg, global_batch=8), 1000)


def test_mixture_options_are_checked_at_start_up_naming_the_key():
    base = ["model.text.hf=bert-base-uncased", "data.train=/a::/b"]
    assert load_config(None, [*base, "data.train_weights=[0.7,0.3]"]).validate().data.train_weights == [
        0.7,
        0.3,
    ]
    with pytest.raises(
        ConfigError, match=r"data\.train_weights=\[1\.0\] has 1 weights, but data\.train has 2"
    ):
        load_config(None, [*base, "data.train_weights=[1]"]).validate()
    with pytest.raises(
        ConfigError, match=r"data\.train_weights=\[1\.0, 0\.0\]: every weight must be a positive"
    ):
        load_config(None, [*base, "data.train_weights=[1,0]"]).validate()
    with pytest.raises(ConfigError, match=r"data\.train_weights needs data\.resampled=true"):
        load_config(None, [*base, "data.train_weights=[1,1]", "data.resampled=false"]).validate()


# --------------------------------------------------------------------------------------------
# Colour augmentation (OpenCLIP's --aug-cfg color_jitter / gray_scale_prob)
# --------------------------------------------------------------------------------------------

CROP = {"scale": (0.5, 1.0), "ratio": (0.75, 4 / 3)}


def augmented(image: Image.Image, seed: int, **colour) -> torch.Tensor:
    return apply_seeded(train_transform(IMAGE_SIZE, **CROP, **colour), image, seed)


def test_colour_augmentation_follows_the_crop_it_was_seeded_with():
    """Off, it leaves the crop as it was; grayscale is PIL's luma of that same crop; brightness
    jitter scales it by one factor within the strength's range; each applies to its share."""
    image = Image.open(io.BytesIO(png(3, size=40)))
    for seed in range(5):
        plain = augmented(image, seed)
        assert torch.equal(augmented(image, seed, color_jitter=[0.4] * 4, color_jitter_prob=0.0), plain)
        assert torch.equal(augmented(image, seed, grayscale_prob=0.0), plain)
        gray = augmented(image, seed, grayscale_prob=1.0)
        luma = torch.tensor(np.array(Image.fromarray(plain.permute(1, 2, 0).numpy()).convert("L")))
        assert all(torch.equal(channel, luma) for channel in gray)

        brighter = augmented(image, seed, color_jitter=[0.5, 0, 0, 0]).double()
        assert torch.equal(augmented(image, seed, color_jitter=[0.5, 0, 0, 0]).double(), brighter)  # seeded
        unclamped = (brighter > 0) & (brighter < 255) & (plain > 8)
        factor = (brighter[unclamped] / plain[unclamped].double()).median()
        assert 0.5 <= factor <= 1.5 and not torch.equal(brighter, plain.double())
        assert (brighter[unclamped] - plain[unclamped].double() * factor).abs().max() <= 1.5
    jittered = [
        not torch.equal(
            augmented(image, s, color_jitter=[0.4] * 4, color_jitter_prob=0.3), augmented(image, s)
        )
        for s in range(200)
    ]
    grayed = [bool((augmented(image, s, grayscale_prob=0.3).diff(dim=0) == 0).all()) for s in range(200)]
    assert 0.2 < np.mean(jittered) < 0.4 and 0.2 < np.mean(grayed) < 0.4


def test_colour_augmentation_reaches_the_loader_and_bad_settings_name_their_key(even_shards):
    root, keys = even_shards
    (batch,) = take(loader_for(config(str(root), num_samples=len(keys), workers=0, grayscale_prob=1.0)), 1)
    assert (batch.images.diff(dim=1) == 0).all()
    base = ["model.text.hf=bert-base-uncased", "data.train=/a"]
    data = load_config(None, [*base, "data.color_jitter=[0.4,0.4,0.4,0.1]", "data.grayscale_prob=0.2"]).data
    assert (data.color_jitter, data.color_jitter_prob, data.grayscale_prob) == (
        [0.4, 0.4, 0.4, 0.1],
        1.0,
        0.2,
    )
    for override, message in [
        (
            "data.color_jitter=[0.4,0.4,0.4]",
            r"data\.color_jitter=\[0\.4, 0\.4, 0\.4\] must be four strengths",
        ),
        ("data.color_jitter=[0.4,0.4,0.4,0.6]", r"data\.color_jitter=.* hue <= 0\.5"),
        ("data.color_jitter=[-0.1,0,0,0]", r"data\.color_jitter=\[-0\.1, .* must be four strengths >= 0"),
        ("data.grayscale_prob=1.5", r"data\.grayscale_prob=1\.5 must lie in \[0, 1\]"),
        ("data.color_jitter_prob=-0.1", r"data\.color_jitter_prob=-0\.1 must lie in \[0, 1\]"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*base, override]).validate()


def test_a_mixture_changed_since_the_saved_state_is_refused(two_sources):
    cfg = config(f"{two_sources}/a::{two_sources}/b", train_weights=[0.8, 0.2], num_samples=64)
    loader = loader_for(cfg)
    take(loader, 2)
    state = loader.state_dict()
    with pytest.raises(DataError, match=r"saved with mixture_shares=\[\[3, 0\.8\].*data\.train_weights"):
        loader_for(dataclasses.replace(cfg, train_weights=[0.5, 0.5])).load_state_dict(state)
    with pytest.raises(DataError, match=r"saved with mixture_shares=.*this run has mixture_shares=None"):
        loader_for(dataclasses.replace(cfg, train_weights=[])).load_state_dict(state)
    # The same mixture otherwise spelled: its shares differ in the last bit (0.875 and 0.8750000000000001)
    tenths = dataclasses.replace(cfg, train_weights=[0.7, 0.1])
    loader = loader_for(tenths)
    take(loader, 2)
    state, going_on = loader.state_dict(), take(loader, 2)
    resumed = loader_for(dataclasses.replace(cfg, train_weights=[7, 1]))
    resumed.load_state_dict(state)
    assert [batch.keys for batch in take(resumed, 2)] == [batch.keys for batch in going_on]


def test_a_mixture_whose_source_moved_to_another_folder_resumes_and_keeps_counting_it(two_sources, tmp_path):
    """As a single source's shards copied elsewhere do (a local cache of a dataset): the state holds
    each source's shard names and share, and the per-source counts follow the source to its new name."""
    cfg = config(f"{two_sources}/a::{two_sources}/b", train_weights=[0.8, 0.2], num_samples=64)
    loader = loader_for(cfg)
    take(loader, 3)
    state, saved_counts, following = loader.state_dict(), loader.source_counts(), take(loader, 3)
    cache = tmp_path / "cache"
    shutil.copytree(two_sources / "b", cache)
    resumed = loader_for(dataclasses.replace(cfg, train=f"{two_sources}/a::{cache}"))
    assert resumed.source_names == ("0-a", "1-cache")
    resumed.load_state_dict(state)
    assert [b.keys for b in take(resumed, 3)] == [b.keys for b in following]
    from_b = sum(key.startswith("b") for batch in following for key in batch.keys)
    assert resumed.source_counts() == {
        "0-a": loader.source_counts()["0-a"],
        "1-cache": saved_counts["1-b"] + from_b,
    }


# --------------------------------------------------------------------------------------------
# Caption keys
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def caption_shards(tmp_path_factory) -> Path:
    """Captions written both ways. both/: ``write_shards`` output, each sample with a txt caption and
    another in its json (b00..b29). mixed/: a tar whose samples have only a txt (t*), only a json
    caption (j*), only a .caption member (c*), no caption (n0), or a blank txt and a number as
    json caption (x0)."""
    root = tmp_path_factory.mktemp("captions")
    both = [
        Record(f"b{i:02d}", png(i, 8), "png", f"txt b{i:02d}", {"caption": f"json b{i:02d}"})
        for i in range(30)
    ]
    write_shards(both, root / "both", per_shard=10, total=30, source={"t": "both"}, desc="both")
    members: list[tuple[str, bytes]] = []
    for i in range(4):
        members += [(f"t{i}.png", png(i, 8)), (f"t{i}.txt", f"txt t{i}".encode())]
        members += [(f"j{i}.json", json.dumps({"caption": f"json j{i}"}).encode()), (f"j{i}.png", png(i, 8))]
        members += [(f"c{i}.caption", f"caption c{i}".encode()), (f"c{i}.png", png(i, 8))]
    members += [("n0.json", json.dumps({"label": 1}).encode()), ("n0.png", png(5, 8))]
    members += [("x0.json", json.dumps({"caption": 7}).encode()), ("x0.png", png(6, 8)), ("x0.txt", b" ")]
    (root / "mixed").mkdir()
    write_tar(root / "mixed" / "shard-000.tar", members)
    return root


ALL_CAPTIONS = [f"{kind} b{i:02d}" for i in range(30) for kind in ("txt", "json")]
ALL_CAPTIONS += [f"{kind} {kind[0]}{i}" for i in range(4) for kind in ("txt", "json", "caption")]


def captions_of(batches: list) -> dict[str, str]:
    """Each sample's caption, read back from its tokens (samples with none of ``ALL_CAPTIONS`` left out)."""
    ids = ClipTokenizer()(ALL_CAPTIONS)["input_ids"]
    by_ids = {tuple(row.tolist()): text for text, row in zip(ALL_CAPTIONS, ids, strict=True)}
    pairs = (
        (key, tuple(row.tolist())) for b in batches for key, row in zip(b.keys, b.input_ids, strict=True)
    )
    return {key: by_ids[row] for key, row in pairs if row in by_ids}


def two_passes(root: Path, caption_key, good: int) -> tuple[list[dict[str, str]], dict[str, int]]:
    """Two passes over both/ and mixed/ in one epoch, in the same order (one worker, no shuffle):
    each pass's captions by key, and the skips counted from the end of pass 1 to the end of pass 2,
    which are exactly one pass's wherever they fall."""
    cfg = config(f"{root}/both::{root}/mixed", resampled=False, workers=1, shuffle_buffer=0, num_samples=1000)
    cfg = dataclasses.replace(cfg, caption_key=caption_key, max_skip_fraction=1.0)
    loader = loader_for(cfg, global_batch=1)
    runs, counts = [], []
    for _ in range(2):
        runs.append(captions_of(take(loader, good)))
        counts.append(collections.Counter(loader.skip_counts()))
    return runs, dict(counts[1] - counts[0])


def test_a_json_field_or_another_member_is_the_caption(caption_shards):
    (json_run, _), json_skips = two_passes(caption_shards, "json:caption", good=34)
    expected = {f"b{i:02d}": f"json b{i:02d}" for i in range(30)} | {f"j{i}": f"json j{i}" for i in range(4)}
    assert json_run == expected
    assert json_skips == {"missing_caption": 9, "bad_caption": 1}  # t*, c*, n0 lack it; x0's is 7
    (member_run, _), member_skips = two_passes(caption_shards, "caption", good=4)
    assert member_run == {f"c{i}": f"caption c{i}" for i in range(4)}
    assert member_skips == {"missing_caption": 40}
    (txt_run, _), txt_skips = two_passes(caption_shards, "txt", good=34)
    assert txt_run == {f"b{i:02d}": f"txt b{i:02d}" for i in range(30)} | {
        f"t{i}": f"txt t{i}" for i in range(4)
    }
    assert txt_skips == {"missing_caption": 9, "empty_caption": 1}


def test_a_caption_key_list_picks_one_present_caption_per_sample_at_random(caption_shards):
    keys = ["txt", "json:caption", "caption"]
    runs, skips = two_passes(caption_shards, keys, good=42)
    assert skips == {"missing_caption": 1, "empty_caption": 1}  # n0 has none; x0's txt is blank (reported
    # before its non-string json caption), so no key gives a usable caption
    for run in runs:
        assert run.keys() == {f"b{i:02d}" for i in range(30)} | {f"{k}{i}" for k in "tjc" for i in range(4)}
        assert all(
            run[f"{k}{i}"] == f"{kind} {k}{i}"
            for k, kind in zip("tjc", ("txt", "json", "caption"), strict=True)
            for i in range(4)
        )
        picked = collections.Counter(run[f"b{i:02d}"].split()[0] for i in range(30))
        assert set(picked) == {"txt", "json"}  # among the two present, never the absent .caption
    assert runs[0] != runs[1]  # picked afresh each time a sample comes round
    assert two_passes(caption_shards, keys, good=42)[0] == runs  # by the seeded stream
    spec, keys_cfg = f"{caption_shards}/both::{caption_shards}/mixed", DataConfig(caption_key=keys)
    evaluated: dict[str, str] = {}
    for rank in range(2):
        evaluated |= captions_of(eval_batches(spec, rank, batch_size=4, data_cfg=keys_cfg))
    first_usable = {key: f"txt {key}" if key[0] in "bt" else caption for key, caption in runs[0].items()}
    assert evaluated == first_usable  # evaluation takes the first usable key: no randomness there


def test_decoding_rules_for_caption_keys():
    def raw(**members) -> dict:
        return {
            "__key__": "k",
            "__url__": "u",
            "png": png(1, 8),
            **{k: v.encode() for k, v in members.items()},
        }

    keys = DataConfig(caption_key=["TXT", " json:Title ", "en.txt"]).caption_keys
    assert keys == ("txt", "json:Title", "en.txt")
    sample = raw(txt="a", json=json.dumps({"title": "b", "n": 3}))
    assert [decode_sample(sample, ("txt", "json:title"), pick).caption for pick in range(4)] == [
        "a",
        "b",
        "a",
        "b",
    ]
    assert decode_sample(sample, ("caption", "json:title"), 7).caption == "b"  # the only present one
    for keys, reason in [(("json:n",), "bad_caption"), (("json:x", "caption"), "missing_caption")]:
        with pytest.raises(BadSample, match=reason):
            decode_sample(sample, keys)
    with pytest.raises(BadSample, match="missing_caption: no json:title"):
        decode_sample(raw(txt="a"), ("json:title",))  # no json at all
    base = ["model.text.hf=bert-base-uncased"]
    assert load_config(None, [*base, "data.caption_key=[txt, json:caption]"]).validate().data.caption_key == [
        "txt",
        "json:caption",
    ]
    for bad in ("json", "'json:'", "[]", "[txt, '']"):
        with pytest.raises(ConfigError, match=r"data\.caption_key=.*json:FIELD"):
            load_config(None, [*base, f"data.caption_key={bad}"]).validate()


def test_a_zero_byte_caption_is_a_blank_one_and_unread_members_do_not_count():
    """A zero-byte .txt beside a json caption: the json's caption trains (as for a blank .txt);
    alone it is an empty caption. A zero-byte image or json is an empty file; a zero-byte member
    that no caption key names is never read."""
    sample = {"__key__": "k", "__url__": "u", "png": png(1, 8), "txt": b"", "json": b'{"caption": "j"}'}
    assert decode_sample(sample, ("txt", "json:caption")).caption == "j"
    assert decode_sample(sample, ("json:caption",)).caption == "j"
    with pytest.raises(BadSample, match="empty_caption"):
        decode_sample(sample, ("txt",))
    assert decode_sample(sample | {"txt": b"t", "cls": b""}).caption == "t"
    for member in ("png", "json"):
        with pytest.raises(BadSample, match=f"empty_file: zero-byte {member}"):
            decode_sample(sample | {"txt": b"t", member: b""})


def test_a_broken_json_costs_a_sample_only_where_it_is_needed(tmp_path):
    """Beside a .txt caption, a zero-byte json, one that does not parse and one that is no object
    cost training no sample, as in OpenCLIP, nor with json:caption as a second key, nor retrieval,
    which reads no label (both dropped them as bad_json). A caption from the json alone, and the
    labels of zero-shot, skip them, counted as the json's problem."""
    broken = {"e": b"", "f": b"{not json", "g": b"[1]"}
    members = [m for key in "abc" for m in good(key)]
    members += [m for key, meta in broken.items() for m in [*good(key)[1:], (f"{key}.json", meta)]]
    write_tar(tmp_path / "shard-000.tar", members)
    txt_first = ["txt", "json:caption"]
    for caption_key in ("txt", txt_first):
        cfg = config(str(tmp_path), workers=0, num_samples=6, resampled=False, caption_key=caption_key)
        loader = loader_for(cfg, global_batch=6)
        (batch,) = take(loader, 1)
        assert sorted(batch.keys) == ["a", "b", "c", "e", "f", "g"] and loader.skip_counts() == {}
    from_json = config(
        str(tmp_path), workers=0, num_samples=6, caption_key="json:caption", max_skip_fraction=1.0
    )
    with pytest.raises(DataError, match=r"none of the first 1000 samples could be used") as err:
        take(loader_for(from_json, global_batch=2), 1)
    assert "'bad_json'" in str(err.value) and "'empty_file'" in str(err.value)
    for labels, kept, skipped in [(False, "abcefg", {}), (True, "abc", {"empty_file": 1, "bad_json": 2})]:
        loader = build_eval_loader(
            str(tmp_path),
            batch_size=6,
            rank=0,
            world_size=1,
            image_size=IMAGE_SIZE,
            tokenizer=ClipTokenizer(),
            data_cfg=DataConfig(caption_key=txt_first),
            labels=labels,
        )
        (batch,) = list(loader)
        assert (batch.keys, batch.skipped) == (list(kept), skipped)
    no_txt = {"__key__": "f", "__url__": "u", "png": png(1, 8), "json": b"{not json"}
    for meta_needed in (False, True):
        with pytest.raises(BadSample, match="bad_json"):
            decode_sample(no_txt, tuple(txt_first), meta_needed=meta_needed)


def test_a_batch_in_the_making_holds_each_crop_once_and_no_decoded_picture():
    """Each crop goes into the batch's tensor as it comes and the decoded picture is let go: a
    worker building a large rank batch holds one crop per sample. A short last batch (evaluation's)
    takes its rows alone; labels only where every sample has one."""
    transform = train_transform(IMAGE_SIZE, **CROP)
    raws = [{"__key__": f"k{i}", "__url__": "u", "png": png(i), "txt": b"t"} for i in range(4)]
    decoded = [decode_sample(raw) for raw in raws]
    crops = [apply_seeded(transform, sample.image, seed) for seed, sample in enumerate(decoded)]
    pictures = [weakref.ref(sample.image) for sample in decoded]
    builder = BatchBuilder(3)
    for sample, crop in zip(decoded[:3], crops[:3], strict=True):
        builder.add(sample, crop)
    assert builder.full() and builder.images.data_ptr() not in {crop.data_ptr() for crop in crops}
    kept, waiting = builder.images, decoded[3]
    del decoded, sample
    assert [picture() is None for picture in pictures] == [True, True, True, False]  # the 4th not added
    batch = builder.batch(ClipTokenizer())
    assert batch.images is kept and torch.equal(batch.images, torch.stack(crops[:3]))
    assert batch.keys == ["k0", "k1", "k2"] and batch.labels is None and len(builder) == 0
    builder.add(dataclasses.replace(waiting, meta={"label": 4}), crops[3])
    last = builder.batch(ClipTokenizer())
    assert last.images.shape == (1, *crops[3].shape) and torch.equal(last.images[0], crops[3])
    assert last.images.untyped_storage().nbytes() == crops[3].nbytes and last.labels.tolist() == [4]


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_a_16_bit_grey_image_keeps_its_top_8_bits_in_each_channel(fmt):
    """PIL's own RGB conversion clips 16-bit grey at 255: all but the darkest pixels would be white."""
    grey = np.random.default_rng(0).integers(0, 1 << 16, (6, 9), dtype=np.uint16)
    encoded = io.BytesIO()
    Image.fromarray(grey).save(encoded, format=fmt)
    assert Image.open(encoded).mode == "I;16"
    sample = {"__key__": "k", "__url__": "u", fmt.lower(): encoded.getvalue(), "txt": b"a"}
    pixels = np.asarray(decode_sample(sample).image)
    assert pixels.shape == (6, 9, 3) and pixels.dtype == np.uint8
    assert all(np.array_equal(pixels[..., channel], grey >> 8) for channel in range(3))


def test_caption_key_and_csv_caption_key_are_not_mixed_up(table, caption_shards):
    shards, tsv = expand_urls(f"{caption_shards}/both"), expand_urls(str(table.path))
    with pytest.raises(
        DataError,
        match=r"data\.caption_key='json:caption' picks a member of tar shards.*data\.csv_caption_key",
    ):
        check_source_options(DataConfig(caption_key="json:caption"), tsv)
    with pytest.raises(DataError, match=r"data\.csv_caption_key='caption' names a column.*data\.caption_key"):
        check_source_options(DataConfig(csv_caption_key="caption"), shards)
    check_source_options(DataConfig(caption_key="json:caption", csv_caption_key="title"), shards + tsv)


@pytest.mark.parametrize("key", ["csv_separator", "csv_image_key", "csv_shard_rows"])
def test_a_table_key_over_tar_shards_alone_is_a_mix_up(table, caption_shards, key):
    shards, tsv = expand_urls(f"{caption_shards}/both"), expand_urls(str(table.path))
    value = {"csv_separator": ";", "csv_image_key": "image", "csv_shard_rows": 50}[key]
    with pytest.raises(
        DataError, match=rf"^data\.{key}={value!r} reads CSV/TSV tables, but .* tar shards: drop"
    ):
        check_source_options(DataConfig(**{key: value}), shards)
    check_source_options(DataConfig(**{key: value}), shards + tsv)  # data.val's table reads it


def test_a_mixture_with_a_table_and_caption_picks_resumes_exactly(resume_shards, caption_shards, table):
    """The samples after a resume equal an uninterrupted run's: keys, pixels, picked captions and
    the per-source counts, from the saved state or by replay."""
    cfg = config(
        f"{resume_shards}::{caption_shards}/both::{table.path}",
        train_weights=[1, 2, 1],
        caption_key=["txt", "json:caption"],
        num_samples=36,
        max_skip_fraction=0.5,
        csv_shard_rows=5,
    )
    total = 14
    reference = loader_for(cfg, world_size=2, rank=1)
    batches, states, counts = [], {}, {}
    for step in range(total):
        batches.append(next(reference))
        states[step + 1] = reference.state_dict()
        counts[step + 1] = collections.Counter(reference.source_counts())
    names = reference.source_names
    assert names[0].startswith("0-resume") and names[1:] == ("1-both", "2-table.tsv")
    assert set(counts[total]) == set(names)
    picked = collections.Counter(caption.split()[0] for caption in captions_of(batches).values())
    assert set(picked) == {"txt", "json"}, picked  # both/'s samples: either caption
    for start in (5, 8):
        for state in (states[start], None):
            loader = loader_for(cfg, world_size=2, rank=1)
            loader.start_at(start, state)
            resumed = take(loader, total - start)
            for a, b in zip(resumed, batches[start:], strict=True):
                assert (
                    a.keys == b.keys
                    and torch.equal(a.images, b.images)
                    and torch.equal(a.input_ids, b.input_ids)
                )
            since = counts[total] - (counts[start] if state is None else collections.Counter())
            assert loader.source_counts() == dict(since)


def test_training_logs_each_sources_samples_summed_over_ranks(digits, tmp_path):
    """A 2-rank run on two sources (the same shards twice, told apart by their index) logs
    data/source/<name> at each log step: every sample of every rank counted once."""
    overrides = run_overrides(digits, tmp_path, 4, "log.every_steps=2", "log.wandb.mode=offline")
    overrides += [f"data.train={digits}/train::{digits}/train", "data.train_weights=[3,1]"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = run_to_end([*torchrun, "-m", "clip_train", "train", str(DEMO_CONFIG), *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    counts = [(r["step"], r["data/source/0-train"], r["data/source/1-train"]) for r in records]
    assert [step for step, *_ in counts] == [2, 4]
    assert all(first + second == step * 16 for step, first, second in counts)  # batch.global_size=16
    assert counts[-1][1] > counts[-1][2] > 0  # weighted 3 : 1
