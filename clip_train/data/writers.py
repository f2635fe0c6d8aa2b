"""Write WebDataset shards of ``{key}.{jpg|png|...}``, ``{key}.txt`` and optional ``{key}.json``.

A directory is written under ``OUT.partial`` and renamed into place when complete, with
``sizes.json`` and a manifest of its source, so a rerun on an unchanged source does nothing.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm
from webdataset import ShardWriter

from clip_train.data.samples import IMAGE_EXTENSIONS, DataError

MANIFEST = ".make_shards.json"
SHARD_PATTERN = "shard-%06d.tar"


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
        for record in tqdm(records, total=total, desc=desc, unit="sample"):
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


def folder_pairs(src: Path) -> tuple[list[tuple[Path, str]], list[Path]]:
    """(image, caption) for every image under ``src`` with a non-empty same-name ``.txt``, sorted;
    and the images left out for lack of one."""
    if not src.is_dir():
        raise DataError(f"{src} is not a directory")
    images = sorted(
        p for p in src.rglob("*") if p.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS and p.is_file()
    )
    pairs, skipped = [], []
    for image in images:
        caption_file = image.with_suffix(".txt")
        caption = caption_file.read_text(encoding="utf-8").strip() if caption_file.is_file() else ""
        if caption:
            pairs.append((image, caption))
        else:
            skipped.append(image)
    return pairs, skipped


def csv_pairs(csv_path: Path) -> tuple[list[tuple[Path, str]], list[Path]]:
    """(image, caption) per row of a CSV with ``path`` and ``caption`` columns (paths relative to the
    CSV's folder); and the rows' images left out as missing or captionless."""
    try:
        with csv_path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            if not {"path", "caption"} <= set(reader.fieldnames or ()):
                raise DataError(
                    f"{csv_path}: needs a header row with columns path,caption; found {reader.fieldnames}"
                )
            rows = [(csv_path.parent / row["path"], (row["caption"] or "").strip()) for row in reader]
    except FileNotFoundError:
        raise DataError(f"CSV file not found: {csv_path}") from None
    pairs = [(path, caption) for path, caption in rows if caption and path.is_file()]
    skipped = [path for path, caption in rows if not (caption and path.is_file())]
    return pairs, skipped


def write_pairs(pairs: list[tuple[Path, str]], out_dir: Path, *, per_shard: int, desc: str) -> bool:
    """Shard image files with their captions; each sample's json records its source path."""
    digest = hashlib.sha256()
    for path, caption in pairs:
        stat = path.stat()
        digest.update(f"{path.resolve()}\t{stat.st_size}\t{stat.st_mtime_ns}\t{caption}\n".encode())
    records = (
        Record(
            key=f"{index:09d}",  # unique and dot-free, whatever the file names
            image=path.read_bytes(),
            image_ext=path.suffix.lower().lstrip("."),
            caption=caption,
            meta={"source": str(path)},
        )
        for index, (path, caption) in enumerate(pairs)
    )
    source = {"files": digest.hexdigest()}
    return write_shards(records, out_dir, per_shard=per_shard, total=len(pairs), source=source, desc=desc)
