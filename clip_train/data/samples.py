"""One sample's bytes to a checked ``Decoded`` sample, and the per-worker tally of skipped ones.

A bad sample or shard never stops training by itself: the worker counts its ``BadSample`` reason
and moves on; only a skip *rate* above ``data.max_skip_fraction`` stops the run, with ``DataError``.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from PIL import Image

from clip_train.config import JSON_PREFIX
from clip_train.data.transforms import eight_bit
from clip_train.errors import UserError

log = logging.getLogger("clip_train.data")

# What a sample's image member, a table's image file or make-shards' folder image may be: the
# formats of OpenCLIP's shards, and the others PIL decodes that image sets come in.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
DEFAULT_CAPTION_KEYS = ("txt",)
SKIP_REASONS = (
    "shard_open",  # the shard could not be opened or held no readable tar member
    "truncated_tar",  # the tar ended or broke mid-way; the sample in progress is dropped
    "duplicate_key",  # a key seen before in the same shard, or a file repeated within a sample
    "empty_file",  # a zero-byte image or json (a zero-byte caption is an empty_caption)
    "missing_image",
    "missing_caption",  # none of data.caption_key's members or json fields
    "empty_caption",  # whitespace only
    "bad_caption",  # not UTF-8, or a json field that is not a string
    "bad_json",
    "bad_image",  # bytes PIL cannot decode
    "bad_row",  # a CSV/TSV row with more or fewer fields than its header
)


class DataError(UserError):
    """A data problem the run cannot work around (no shards, too many bad samples, bad resume)."""


class BadSample(Exception):
    """A sample to skip; ``reason`` is one of ``SKIP_REASONS``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def sample_key(number: int) -> str:
    """A written or read sample's key from its running number: unique, sortable and dot-free."""
    return f"{number:09d}"


@dataclass
class Decoded:
    key: str
    image: Image.Image | None  # RGB, fully loaded; None once a batch holds its crop
    caption: str
    meta: dict[str, Any]
    source: int = 0  # which source of a weighted mixture it came from (``"__source__"``)


Meta = dict[str, Any] | BadSample  # a sample's parsed ``.json``, or why it does not parse


def _meta(data: bytes) -> dict[str, Any]:
    """A ``.json`` member's object; ``BadSample`` when it is empty or not a JSON object."""
    if data == b"":
        raise BadSample("empty_file", "zero-byte json")
    try:
        meta = json.loads(data)
    except ValueError as err:
        raise BadSample("bad_json", str(err)) from None
    if not isinstance(meta, dict):
        raise BadSample("bad_json", f"expected an object, got {type(meta).__name__}")
    return meta


def _caption(members: dict[str, bytes], meta: Meta, key: str) -> str:
    """The caption under one key; ``BadSample`` when it is absent, undecodable or blank (a field of
    a broken json: the json's problem)."""
    if key.startswith(JSON_PREFIX):
        if isinstance(meta, BadSample):
            raise meta
        field_name = key[len(JSON_PREFIX) :]
        if field_name not in meta:
            raise BadSample("missing_caption", f"no {key}")
        caption = meta[field_name]
        if not isinstance(caption, str):
            raise BadSample("bad_caption", f"{key} is a {type(caption).__name__}, not a string")
    elif key not in members:
        raise BadSample("missing_caption", f"no {key}")
    else:
        try:
            caption = members[key].decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadSample("bad_caption", str(err)) from None
    if not caption.strip():
        raise BadSample("empty_caption", key)
    return caption.strip()


def _pick_caption(members: dict[str, bytes], meta: Meta, keys: tuple[str, ...], pick: int) -> str:
    """One of the usable captions under ``keys``: number ``pick`` modulo their count. Unusable
    ones are passed over, so whether a sample is usable does not depend on ``pick``; with none,
    the reason is a present caption's problem before a missing one's."""
    usable: list[str] = []
    problems: list[BadSample] = []
    for key in keys:
        try:
            usable.append(_caption(members, meta, key))
        except BadSample as bad:
            problems.append(bad)
    if not usable:
        raise min(problems, key=lambda bad: bad.reason == "missing_caption")
    return usable[pick % len(usable)]


def decode_sample(
    raw: dict[str, Any],
    keys: tuple[str, ...] = DEFAULT_CAPTION_KEYS,
    pick: int = 0,
    *,
    meta_needed: bool = True,
    caption_needed: bool = True,
) -> Decoded:
    """Check a grouped tar sample and decode its image to RGB; raise ``BadSample`` if unusable.
    The caption is under one of ``keys`` (see ``_pick_caption``; the training stream passes a
    seeded random ``pick``, evaluation 0: the first usable key); without ``caption_needed``
    (zero-shot's labelled images) none is looked for. The ``.json`` member is read only where
    ``meta_needed`` (zero-shot's labels) or a key names a field of it, and a broken one costs the
    sample only where the meta is needed or no other key gives a caption: beside a ``.txt``
    caption it costs training and retrieval no sample, as in OpenCLIP."""
    if "__bad__" in raw:
        raise BadSample(raw["__bad__"], raw.get("__error__", ""))
    members = {k: v for k, v in raw.items() if not k.startswith("__")}
    ext = next((e for e in IMAGE_EXTENSIONS if e in members), None)
    if ext is None:
        raise BadSample("missing_image")
    # A zero-byte image is an empty file; a zero-byte caption member a blank caption, passed over
    # for another key.
    if members[ext] == b"":
        raise BadSample("empty_file", f"zero-byte {ext}")
    meta: Meta = {}
    json_keys = caption_needed and any(key.startswith(JSON_PREFIX) for key in keys)
    if "json" in members and (meta_needed or json_keys):
        try:
            meta = _meta(members["json"])
        except BadSample as bad:
            if meta_needed:
                raise
            meta = bad
    caption = _pick_caption(members, meta, keys, pick) if caption_needed else ""
    try:
        image = _rgb(Image.open(io.BytesIO(members[ext])))
    except Exception as err:  # arbitrary bytes make PIL raise many types; all mean "undecodable"
        raise BadSample("bad_image", f"{type(err).__name__}: {err}") from None
    return Decoded(
        key=raw["__key__"],
        image=image,
        caption=caption,
        meta=meta if isinstance(meta, dict) else {},
        source=raw.get("__source__", 0),
    )


def load_rgb(path: str) -> Image.Image:
    """An image file decoded as a sample's image is (``ImageFolder``'s loader for evaluation folders)."""
    with open(path, "rb") as file:
        return _rgb(Image.open(file))


def _rgb(image: Image.Image) -> Image.Image:
    """``image`` in RGB, a 16-bit grey one by its top 8 bits (``eight_bit``)."""
    return eight_bit(image).convert("RGB")


class SkipTally:
    """Skipped samples in one worker: counts by reason, a rate-limited warning, the abort rule.

    Both rules wait for ``MIN_SEEN`` samples (or ``min_seen``, a rank's batch, where more), so the
    bad samples among the first few cannot stop a run: with 5 % of them bad, the share over 1,000
    passes 10 % with odds under one in a billion, where from a batch of 32 on it did in about one
    run in six. The rate stops the run above ``max_fraction``; at ``max_fraction=1`` a stream that
    gave not one usable sample stops too: a training stream cycles its shards, so it would never
    yield a batch. A weighted mixture's ``sources`` are held to the same rules each: bad samples are
    dropped after the draw, so a source's share of the batches falls below its weight by its own
    skip rate, to 0 for a source that has no usable sample, however sound the others keep the whole
    stream. A shard that cannot be opened counts as one skip (the training stream stops sooner when
    its first shards all fail: ``train_loader.UNOPENED_LIMIT``).
    """

    WARN_EVERY_S = 30.0
    MIN_SEEN = 1000

    def __init__(self, max_fraction: float, min_seen: int = 0, sources: tuple[str, ...] = ()) -> None:
        self.max_fraction = max_fraction
        self.min_seen = max(min_seen, self.MIN_SEEN)
        self.sources = sources
        self.good = 0
        self.total: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()
        self._good_by_source: Counter[int] = Counter()
        self._reasons_by_source: dict[int, Counter[str]] = defaultdict(Counter)
        self._last_warning = -float("inf")

    @classmethod
    def counting_only(cls) -> SkipTally:
        """A tally that never stops its stream: evaluation's, one finite pass that counts."""
        return cls(max_fraction=1.0, min_seen=sys.maxsize)

    def add_good(self, source: int = 0) -> None:
        self.good += 1
        self._good_by_source[source] += 1

    def add_bad(self, bad: BadSample, raw: dict[str, Any]) -> None:
        self.total[bad.reason] += 1
        self._pending[bad.reason] += 1
        now = time.monotonic()
        if now - self._last_warning >= self.WARN_EVERY_S:
            self._last_warning = now
            log.warning(
                "skipped sample %r of %s (%s); skipped so far by this worker: %s",
                raw.get("__key__", ""),
                raw.get("__url__", "?"),
                bad,
                dict(self.total),
            )
        self._check(self.total, self.good, "")
        if self.sources:
            source = raw.get("__source__", 0)
            self._reasons_by_source[source][bad.reason] += 1
            where = f"source {self.sources[source]} of data.train: "
            self._check(self._reasons_by_source[source], self._good_by_source[source], where)

    def _check(self, reasons: Counter[str], good: int, where: str) -> None:
        """Stop when too many of the samples looked at (of the whole stream, or of one source) were bad."""
        skipped = sum(reasons.values())
        seen = skipped + good
        if seen < self.min_seen:
            return
        if skipped > self.max_fraction * seen:
            share = " (its share of the batches falls below its weight as much)" if where else ""
            fix = (
                "Check data.caption_key: every skipped sample lacked a caption under it"
                if set(reasons) == {"missing_caption"}
                else "Fix or drop the bad shards (the log names them), or raise data.max_skip_fraction"
            )
            raise DataError(
                f"{where}{skipped} of {seen} samples ({skipped / seen:.1%}) were skipped, more than "
                f"data.max_skip_fraction={self.max_fraction}{share}; reasons: {dict(reasons)}. {fix}"
            )
        if not good:
            raise DataError(
                f"{where}none of the first {seen} samples could be used; reasons: "
                f"{dict(reasons)}. Check data.caption_key and the shards (the log names them)"
            )

    def take_pending(self) -> dict[str, int]:
        """Counts since the last call: what the next batch carries to the trainer."""
        pending = dict(self._pending)
        self._pending.clear()
        return pending
