"""Write WebDataset shards of ``{key}.{jpg|png|...}``, ``{key}.txt`` and optional ``{key}.json``.

A directory is written under ``OUT.partial`` and renamed into place when complete, with
``sizes.json`` and a manifest of its source, so a rerun on an unchanged source does nothing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from webdataset import ShardWriter

from clip_train.data.samples import IMAGE_EXTENSIONS, BadSample, DataError, sample_key
from clip_train.data.tables import TableFormat, piece_rows, row_pair, table_pieces
from clip_train.logs import progress

MANIFEST = ".make_shards.json"
SHARD_PATTERN = "shard-%06d.tar"
Pair = tuple[str, Path, str]  # (sample key, image file, caption)


@dataclass
class Record:
    key: str
    image: bytes
    image_ext: str  # one of IMAGE_EXTENSIONS
    caption: str
    meta: dict[str, Any] | None = None


def write_shards(
    records: Iterable[Record], out_dir: Path, *, per_shard: int, total: int, source: dict[str, Any], desc: str
) -> bool:
    """Write ``records`` (``total`` of them) as shards of ``per_shard`` samples into ``out_dir``.
    Return False, writing nothing, if it holds shards of the same ``source`` and ``per_shard``."""
    out_dir = out_dir.resolve()  # a link's target, swapped in place (the link left as it is); "." named
    if per_shard <= 0:
        raise DataError(f"--per-shard={per_shard} must be > 0")
    if total <= 0:
        raise DataError(f"no samples to write into {out_dir}")
    manifest = {"version": 1, "per_shard": per_shard, "source": source}
    if _up_to_date(out_dir, manifest):
        return False
    if out_dir.exists() and not (out_dir / MANIFEST).is_file() and any(out_dir.iterdir()):
        raise DataError(f"{out_dir} exists and was not written by make-shards; pick a new or empty directory")
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    sizes: Counter[str] = Counter()
    with ShardWriter(
        str(partial / SHARD_PATTERN), maxcount=per_shard, verbose=0, encoder=False, mtime=0
    ) as sink:
        for record in progress(records, desc, total=total, unit="sample"):
            entry = {"__key__": record.key, record.image_ext: record.image, "txt": record.caption.encode()}
            if record.meta is not None:
                entry["json"] = json.dumps(record.meta).encode()
            sink.write(entry)
            sizes[Path(sink.fname).name] += 1
    (partial / "sizes.json").write_text(json.dumps(dict(sorted(sizes.items())), indent=1))
    (partial / MANIFEST).write_text(json.dumps({**manifest, "samples": sum(sizes.values())}, indent=1))
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    return True


def _up_to_date(out_dir: Path, manifest: dict[str, Any]) -> bool:
    try:
        written = json.loads((out_dir / MANIFEST).read_text())
        sizes = json.loads((out_dir / "sizes.json").read_text())
    except (OSError, ValueError):
        return False
    same = all(written.get(k) == v for k, v in manifest.items())
    return same and all((out_dir / name).is_file() for name in sizes)


def folder_pairs(src: Path) -> tuple[list[Pair], list[tuple[str, str]]]:
    """(key, image, caption) for every image under ``src`` with a non-empty same-name ``.txt``,
    sorted; and (reason, "path: why") for each image left out. A caption that is not UTF-8 leaves
    its image out rather than stopping the conversion; a byte-order mark is not part of it."""
    if not src.is_dir():
        raise DataError(f"{src} is not a directory")
    images = sorted(
        p for p in src.rglob("*") if p.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS and p.is_file()
    )
    pairs: list[Pair] = []
    skipped: list[tuple[str, str]] = []
    for image in images:
        caption_file = image.with_suffix(".txt")
        try:
            caption = caption_file.read_text(encoding="utf-8-sig").strip() if caption_file.is_file() else ""
        except UnicodeDecodeError as err:
            skipped.append(("bad_caption", f"{caption_file}: not UTF-8 ({err.reason} at byte {err.start})"))
            continue
        if caption:
            pairs.append((sample_key(len(pairs)), image, caption))
        else:
            skipped.append(("empty_caption", f"{image}: no non-empty {caption_file.name}"))
    return pairs, skipped


def csv_pairs(csv_path: Path, table_format: TableFormat) -> tuple[list[Pair], list[tuple[str, str]]]:
    """(row key, image, caption) per usable row of a CSV/TSV table, keyed as the training stream
    keys them; and (reason, "row N: why") for each other row. Messages, not the exceptions: their
    tracebacks would keep the caller's frame alive."""
    pairs: list[Pair] = []
    skipped: list[tuple[str, str]] = []
    for piece in table_pieces(csv_path, table_format, rows_per_piece=sys.maxsize):
        for number, record in piece_rows(piece):
            try:
                pairs.append((sample_key(number), *row_pair(record, piece)))
            except BadSample as bad:
                skipped.append((bad.reason, f"row {number}: {bad}"))
    return pairs, skipped


def write_pairs(pairs: list[Pair], out_dir: Path, *, per_shard: int, desc: str) -> bool:
    """Shard image files with their captions; each sample's json records its source path."""
    digest = hashlib.sha256()
    for key, path, caption in pairs:
        stat = path.stat()
        digest.update(f"{key}\t{path.resolve()}\t{stat.st_size}\t{stat.st_mtime_ns}\t{caption}\n".encode())
    records = (
        Record(
            key=key,
            image=path.read_bytes(),
            image_ext=path.suffix.lower().lstrip("."),
            caption=caption,
            meta={"source": str(path)},
        )
        for key, path, caption in pairs
    )
    source = {"files": digest.hexdigest()}
    return write_shards(records, out_dir, per_shard=per_shard, total=len(pairs), source=source, desc=desc)
