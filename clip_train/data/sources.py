"""Where samples come from: shard specs, their sizes, and tar reading.

A shard spec (``data.train``/``data.val``) is webdataset URLs with brace expansion
(``/data/{00000..00099}.tar``) or ``pipe:`` commands, several sources joined with ``::``, and local
directories, which stand for every ``.tar`` in them (sorted). ``data.train`` also takes CSV/TSV
tables, which the training loader splits into pieces read like shards (see ``tables``).
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from webdataset.shardlists import expand_urls as wds_expand_urls
from webdataset.tariterators import base_plus_ext, tar_file_expander, url_opener

from clip_train.data.samples import DataError
from clip_train.data.tables import Piece, is_piece, is_table

log = logging.getLogger("clip_train.data")


def expand_urls(spec: str, *, what: str = "data.train") -> list[str]:
    """Every shard URL of a spec, in order; ``what`` names the option in error messages."""
    if not spec.strip():
        raise DataError(f"{what} is empty: give shard URLs, e.g. {what}=/data/shards/{{00000..00099}}.tar")
    urls: list[str] = []
    for url in wds_expand_urls(spec):
        url = url.strip()
        if not url:
            raise DataError(f"{what}={spec!r} has an empty source (check the '::' separators)")
        if os.path.isdir(url):
            tars = sorted(str(p) for p in Path(url).glob("*.tar"))
            if not tars:
                raise DataError(f"{what}: directory {url} holds no .tar shards")
            urls.extend(tars)
        else:
            urls.append(url)
    local = [u for u in urls if is_local(u)]
    missing = [u for u in local if not os.path.exists(u)]
    if local and len(missing) == len(local):
        raise DataError(f"{what}: no such file or directory: {missing[0]}")
    if missing:
        log.warning(
            "%s: %d of %d local shards are missing, e.g. %s", what, len(missing), len(local), missing[0]
        )
    return urls


def is_local(url: str) -> bool:
    """A path on this machine: neither a ``pipe:`` command nor a URL (``s3://``, ``https://``)."""
    return not url.startswith("pipe:") and "://" not in url


def check_readable(urls: list[str], *, what: str) -> None:
    """Fail at start-up, not in a data worker mid-run, when no local shard opens as a tar (a 0-byte
    or non-tar file). Stops at the first one that opens, so a long shard list costs one read.
    Tables pass: their readers check their headers when they split them into pieces."""
    local = [u for u in urls if is_local(u) and os.path.isfile(u) and not is_table(u)]
    problem = ""
    for url in local:
        try:
            with tarfile.open(url):
                return
        except tarfile.TarError:
            problem = problem or f"{url} is {'empty' if os.path.getsize(url) == 0 else 'not a tar file'}"
        except OSError as err:
            problem = problem or f"{url}: {err.strerror}"
    if local:
        raise DataError(f"{what}: none of its {len(local)} local shards is a readable tar, e.g. {problem}")


def dataset_size(urls: list[str]) -> int | None:
    """Samples in local shards from ``sizes.json`` (ours, open_clip's) or img2dataset's
    ``*_stats.json``, and rows in table pieces; None if any shard's count is unknown."""
    sizes_by_dir: dict[Path, dict[str, int]] = {}
    total = 0
    for url in urls:
        if is_piece(url):
            total += Piece.from_url(url).rows
            continue
        path = Path(url)
        if path.parent not in sizes_by_dir:
            sizes_file = path.parent / "sizes.json"
            sizes_by_dir[path.parent] = json.loads(sizes_file.read_text()) if sizes_file.is_file() else {}
        sizes = sizes_by_dir[path.parent]
        stats = path.with_name(path.name.removesuffix(".tar") + "_stats.json")
        if path.name in sizes:
            total += int(sizes[path.name])
        elif stats.is_file():
            total += int(json.loads(stats.read_text())["successes"])
        else:
            return None
    return total


def read_shard(url: str) -> Iterator[dict[str, Any]]:
    """Yield one shard's samples as ``{"__key__", "__url__", ext: bytes, ...}`` dicts, in tar order.

    Problems become samples marked ``"__bad__": reason``, so they pass the shuffle in order and are
    counted when consumed (that keeps resume exact): a repeated key is ``duplicate_key``, an
    unreadable shard one ``shard_open`` record, a tar that breaks mid-way one ``truncated_tar``
    record after its last complete sample: cut or damaged in a member's data, or in a header, which
    the tar reader takes for the archive's end (seen where a local file holds data after it, or a
    ``pipe:`` command fails: its exit status is checked when the stream is closed).
    """
    errors: list[Exception] = []  # handlers append and return None, which tells webdataset to stop
    attempted: list[str] = []  # names tar_file_iterator is about to read (its select_files hook)
    opened: list[_Counted] = []  # closed here, so a pipe's exit status is always checked

    def counted(sources: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for source in sources:
            opened.append(_Counted(source["stream"]))
            yield {**source, "stream": opened[-1]}

    members = tar_file_expander(
        counted(url_opener([{"url": url}], handler=errors.append)),
        handler=errors.append,
        select_files=lambda name: attempted.append(name) is None,
    )
    seen: set[str] = set()
    current: dict[str, Any] | None = None
    delivered = 0
    for member in members:
        if "fname" not in member:  # webdataset >= 1.0's end-of-shard marker
            continue
        delivered += 1
        key, ext = base_plus_ext(member["fname"])
        if key is None:
            continue
        ext = ext.lower()
        if current is None or key != current["__key__"]:
            if current is not None:
                yield current
            current = {"__key__": key, "__url__": url}
            if key in seen:
                current["__bad__"] = "duplicate_key"
            seen.add(key)
        if ext in current:
            current["__bad__"] = "duplicate_key"
        current[ext] = member["data"]
    for stream in opened:
        try:
            stream.close()  # a pipe waits for its command here, and raises if it failed
        except OSError as err:
            errors.append(err)
    if not errors:
        if current is not None:
            yield current
        if opened and _ends_early(url, opened[0].taken):
            yield _unread_rest(url, "truncated_tar", tarfile.ReadError("a damaged header ends its members"))
        return
    # A member whose data broke is the last one attempted; one whose header broke was never named:
    # the group before it is whole, or else counted as a bad sample when decoded.
    failed_key = base_plus_ext(attempted[-1])[0] if len(attempted) > delivered else None
    if current is not None and failed_key != current["__key__"]:
        yield current
    yield _unread_rest(url, "truncated_tar" if attempted else "shard_open", errors[0])


_warned_shards: set[str] = set()  # in this process: a resampled run draws a broken shard again and again


def _unread_rest(url: str, reason: str, error: Exception) -> dict[str, Any]:
    """The bad record that stands for what could not be read of a shard, with a warning the first
    time (each record is counted, and the skip tally's own warnings go on at their rate)."""
    if url not in _warned_shards:
        _warned_shards.add(url)
        log.warning(
            "shard %s: %s (%s); skipping the rest of it (this worker warns once a shard)", url, reason, error
        )
    return {"__key__": "", "__url__": url, "__bad__": reason, "__error__": repr(error)}


class _Counted:
    """A shard's stream that counts the bytes the tar reader took from it."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.taken = stream, 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.taken += len(data)
        return data

    def close(self) -> None:
        self.stream.close()

    def __str__(self) -> str:  # webdataset names the stream in its errors
        return str(self.stream)


def _ends_early(url: str, taken: int) -> bool:
    """Whether a local tar ends before its data does: the tar reader takes a damaged or cut header
    (past the first) for the archive's end, and says nothing. After the bytes it took, a whole tar
    holds only zeros, and it ends with two zero blocks (the end-of-archive marker): both are checked
    by reading from where the reader stopped (or the last two blocks) to the end, nothing else again.
    A damaged header in the reader's last buffered read (10 KB) before the marker goes unseen."""
    if not os.path.isfile(url):  # pipe: and remote shards stream once
        return False
    with open(url, "rb") as file:
        if file.read(tarfile.BLOCKSIZE)[257:262] != b"ustar":  # compressed (or a pre-POSIX tar)
            return False
        file.seek(max(0, min(taken, os.fstat(file.fileno()).st_size - 2 * tarfile.BLOCKSIZE)))
        while chunk := file.read(1 << 16):
            if chunk.count(0) != len(chunk):
                return True
    return False
