"""CSV/TSV tables of image paths and captions (OpenCLIP's ``--csv-*`` layout), read as shards.

A table is split into *pieces* of a fixed number of rows, each named by a ``table:`` URL that
carries what reading it needs (file, byte offset, first row, columns). The training stream draws,
splits and positions pieces exactly as it does tar shards, and a piece yields the same raw-sample
dicts as ``read_shard``, so CSV data keeps the shards' resume guarantees. Keys are row numbers
(the first row under the header is 1), the same in the stream and in ``make-shards csv`` output.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import parse_qsl, quote, unquote, urlencode

from clip_train.data.samples import IMAGE_EXTENSIONS, BadSample, DataError, sample_key

TABLE_SUFFIXES = (".csv", ".tsv")
PIECE_SCHEME = "table:"
DEFAULT_KEYS = {"image": ("filepath", "path"), "caption": ("title", "caption")}  # OpenCLIP's first


@dataclass(frozen=True)
class TableFormat:
    """How to read a table; empty fields take the defaults (what ``make-shards csv`` and the
    ``data.csv_*`` keys set)."""

    separator: str = ""  # one character, or \t; "" = tab for .tsv, comma otherwise
    image_key: str = ""  # "" = filepath (OpenCLIP's), else path
    caption_key: str = ""  # "" = title (OpenCLIP's), else caption

    def delimiter(self, path: Path) -> str:
        if not self.separator:
            return "\t" if path.suffix.lower() == ".tsv" else ","
        delimiter = "\t" if self.separator == "\\t" else self.separator  # \t as typed in a shell
        if len(delimiter) != 1:
            raise DataError(f"CSV separator {self.separator!r} must be one character (\\t for a tab)")
        return delimiter


@dataclass(frozen=True)
class Piece:
    """``rows`` rows of a table from row number ``first``, which starts at byte ``offset``."""

    path: str
    separator: str
    columns: int  # fields per row, as in the header
    image: int  # column index of the image path
    caption: int  # column index of the caption
    first: int
    rows: int
    offset: int

    @property
    def url(self) -> str:
        query = asdict(self)
        return f"{PIECE_SCHEME}{quote(query.pop('path'))}?{urlencode(query)}"

    @classmethod
    def from_url(cls, url: str) -> Piece:
        path, _, query = url.removeprefix(PIECE_SCHEME).rpartition("?")
        values = dict(parse_qsl(query, keep_blank_values=True))
        separator = values.pop("separator")
        return cls(unquote(path), separator, **{name: int(value) for name, value in values.items()})


def is_table(url: str) -> bool:
    """A local CSV or TSV file (a missing one reads as a missing shard)."""
    return Path(url).suffix.lower() in TABLE_SUFFIXES and os.path.isfile(url)


def is_piece(url: str) -> bool:
    return url.startswith(PIECE_SCHEME)


def expand_tables(urls: list[str], table_format: TableFormat, rows_per_piece: int) -> list[str]:
    """``urls`` with each table replaced by its pieces' URLs, in row order."""
    expanded: list[str] = []
    for url in urls:
        if is_table(url):
            expanded += [piece.url for piece in table_pieces(Path(url), table_format, rows_per_piece)]
        else:
            expanded.append(url)
    return expanded


def table_pieces(path: Path, table_format: TableFormat, rows_per_piece: int) -> list[Piece]:
    """Check the header, then read the table once to find where every ``rows_per_piece``-th row
    starts (quoted fields may hold newlines, so only parsing finds row boundaries)."""
    separator = table_format.delimiter(path)
    try:
        handle = path.open("rb")
    except OSError as err:
        raise DataError(f"CSV file {path}: {err.strerror}") from None
    with handle:
        records = _records(handle, separator, path)
        header, start = next(records, ([], 0))
        image = _column(path, separator, header, table_format.image_key, "image")
        caption = _column(path, separator, header, table_format.caption_key, "caption")
        starts, rows = [start], 0
        for rows, (_, end) in enumerate(records, 1):
            if rows % rows_per_piece == 0:
                starts.append(end)  # the next piece's, if any row follows
    if not rows:
        raise DataError(f"{path}: no rows under the header")
    columns = (str(path), separator, len(header), image, caption)
    return [
        Piece(*columns, first=done + 1, rows=min(rows_per_piece, rows - done), offset=starts[index])
        for index, done in enumerate(range(0, rows, rows_per_piece))
    ]


def _column(path: Path, separator: str, header: list[str], key: str, role: str) -> int:
    names = (key,) if key else DEFAULT_KEYS[role]
    found = next((name for name in names if name in header), None)
    if found is None:
        raise DataError(
            f"{path}: the header has no {role} column {' or '.join(map(repr, names))} (separator "
            f"{separator!r}); columns found: {header}. Name it with --{role}-key or data.csv_{role}_key"
        )
    return header.index(found)


def _records(handle: BinaryIO, separator: str, path: Path) -> Iterator[tuple[list[str], int]]:
    """Each non-blank record's fields and the byte offset just past it."""
    offset = handle.tell()

    def lines() -> Iterator[str]:  # the csv reader pulls exactly the lines of one record at a time
        nonlocal offset
        for line in handle:
            offset += len(line)
            yield line.decode("utf-8-sig")  # -sig: drops the byte-order mark spreadsheets write

    try:
        for record in csv.reader(lines(), delimiter=separator):
            if record:
                yield record, offset
    except (UnicodeDecodeError, csv.Error) as err:
        problem = str(err)
        if "new-line character" in problem:  # csv's words for a CR outside quotes that no LF follows
            problem = "a carriage return outside quotes (save the table with LF or CRLF line endings)"
        raise DataError(f"{path}: cannot read the row ending near byte {offset}: {problem}") from None


def piece_rows(piece: Piece) -> Iterator[tuple[int, list[str]]]:
    """(row number, fields) of each of the piece's rows."""
    path = Path(piece.path)
    with path.open("rb") as handle:
        handle.seek(piece.offset)
        records = itertools.islice(_records(handle, piece.separator, path), piece.rows)
        for number, (record, _) in enumerate(records, piece.first):
            yield number, record


def row_pair(record: list[str], piece: Piece) -> tuple[Path, str]:
    """A row's image file (relative paths are under the table's folder) and caption; ``BadSample``
    when the row cannot make a sample."""
    if len(record) != piece.columns:
        raise BadSample("bad_row", f"{len(record)} fields, the header has {piece.columns}")
    caption = record[piece.caption].strip()
    if not caption:
        raise BadSample("empty_caption")
    image = Path(piece.path).parent / record[piece.image]  # an absolute path stays as it is
    if image.suffix.lower().lstrip(".") not in IMAGE_EXTENSIONS:
        raise BadSample("missing_image", f"{image} is not a {'/'.join(IMAGE_EXTENSIONS)} file")
    if not image.is_file():
        raise BadSample("missing_image", f"no file {image}")
    return image, caption


def read_piece(url: str, first: int = 0, every: int = 1) -> Iterator[dict[str, Any]]:
    """A piece's rows (every ``every``-th from ``first``) as ``read_shard``'s raw samples (image
    bytes, ``txt`` and a ``json`` naming the source file); a bad row becomes a ``__bad__`` sample,
    counted when consumed like a bad tar sample. The rows passed over are not read."""
    piece = Piece.from_url(url)
    for number, record in itertools.islice(piece_rows(piece), first, None, every):
        raw: dict[str, Any] = {"__key__": sample_key(number), "__url__": url}
        try:
            image, caption = row_pair(record, piece)
            raw[image.suffix.lower().lstrip(".")] = image.read_bytes()
        except BadSample as bad:
            raw.update(__bad__=bad.reason, __error__=bad.detail)
        except OSError as err:  # present when checked, unreadable now
            raw.update(__bad__="missing_image", __error__=f"{err.filename}: {err.strerror}")
        else:
            raw.update(txt=caption.encode(), json=json.dumps({"source": str(image)}).encode())
        yield raw
