"""Tables as a source: one row per sample (CSV, TSV, JSONL, Parquet), and img2dataset's output
folder (its per-shard tables, the images in folders or in the tars beside them).
"""

from __future__ import annotations

import json
import os
import warnings
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError
from ..formats import encode_key
from ..fsutil import staging_name
from ..manifest import SkippedFile
from .keys import _column_keys, _table_keys
from .members import image_stat, member_of, member_path, tar_members
from .pieces import joined_columns, on_disk, remove_pieces, write_piece
from .source import LIST_NON_IMAGES, SourceScan, _image_ext
from .spans import TableSpan, cut_table, span_rows, whole_table
from .strings import StrTable, _Growing

#: File endings read as a table source (``.parquet`` needs pyarrow: the ``parquet`` extra).
TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".parquet")
#: Columns naming the image file (the first one present is used), relative to the table's root.
IMAGE_COLUMNS = ("image", "path", "file", "filename")
#: Columns holding the caption (stored as field ``txt``); the first one present is used.
CAPTION_COLUMNS = ("caption", "text", "txt")
#: The column holding the class name, if the table has one (sorted names give the labels).
LABEL_COLUMN = "label"


def is_table(src: str) -> bool:
    return str(src).lower().endswith(TABLE_SUFFIXES)


def _column(path: str, row: dict, names: Sequence[str]) -> str | None:
    return next((c for c in names if c in row), None)


#: Rows of a table turned into numpy tables at a time: a row's Python objects (its cells, path,
#: fields) live for one chunk only, so scanning a table of any length holds ~its text in arrays.
TABLE_CHUNK = 1 << 13


@dataclass
class TableChunk:
    """What the scan of one span of a table found, as arrays and small lists: it crosses
    processes (an engine's workers) and holds no Python object per row.

    ``codes`` number the span's label names in ``names`` (in order of first appearance; -1:
    no label); ``keys`` is img2dataset's key column, encoded. ``error``: the first row of the
    span that could not be read or refused (then nothing else is filled)."""

    rows: int = 0
    files: StrTable = field(default_factory=StrTable)
    exts: StrTable = field(default_factory=StrTable)
    inline: StrTable = field(default_factory=StrTable)
    keys: StrTable = field(default_factory=StrTable)
    codes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    names: list[str] = field(default_factory=list)
    field_counts: dict[str, int] = field(default_factory=dict)
    unlabelled: int | None = None  # line of the first row without a label
    stats: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    errors: list[SkippedFile] = field(default_factory=list)
    ignored: list[SkippedFile] = field(default_factory=list)
    failed_downloads: int = 0
    #: Whether the table's rows are keyed (img2dataset's); None: the span saw no first row.
    keyed: bool | None = None
    error: InputError | None = None
    #: The folder its arrays were written to (``scan_span_to``; "": they are in this object).
    piece: str = ""


class _TableRows:
    """A span's accepted rows, gathered ``TABLE_CHUNK`` at a time into growing tables."""

    def __init__(self, path: str):
        self.path = path
        self.rels: list[str] = []
        self.exts: list[str] = []
        self.inline: list[str] = []
        self.codes: list[int] = []  # label name -> its number in order of first appearance
        self.tables = {"files": _Growing(), "exts": _Growing(), "inline": _Growing()}
        self.keys: list[str] = []  # img2dataset's keys, when rows name their images by key
        self.key_table = _Growing()
        self.code_parts: list[np.ndarray] = []
        self.names: dict[str, int] = {}
        self.field_counts: dict[str, int] = {}
        self.unlabelled: int | None = None  # line of the first row without a label
        self.stats = array("q")  # (size, mtime_ns) of each row's image: 16 bytes a row

    def add(
        self, rel: str, ext: str, fields: dict, name: str | None, line: int, key: str | None
    ) -> None:
        try:
            text = json.dumps(fields, ensure_ascii=False, sort_keys=True) if fields else ""
        except TypeError as exc:  # a Parquet cell of bytes, a date ...
            raise InputError(
                f"{self.path}:{line}: a cell that JSON cannot hold ({exc}); convert the column "
                "to text or numbers, or drop it"
            ) from None
        self.rels.append(rel)
        self.exts.append(ext)
        self.inline.append(text)
        if key is not None:
            self.keys.append(encode_key(key))
        for f in fields:
            self.field_counts[f] = self.field_counts.get(f, 0) + 1
        if name is None:
            self.codes.append(-1)
            if self.unlabelled is None:
                self.unlabelled = line
        else:
            self.codes.append(self.names.setdefault(name, len(self.names)))
        if len(self.rels) >= TABLE_CHUNK:
            self.flush()

    def flush(self) -> None:
        for name, rows in (("files", self.rels), ("exts", self.exts), ("inline", self.inline)):
            self.tables[name].extend(rows)
            rows.clear()
        self.key_table.extend(self.keys)
        self.keys.clear()
        self.code_parts.append(np.array(self.codes, dtype=np.int32))
        self.codes.clear()

    def chunk(self, scan: SourceScan, keyed: bool | None) -> TableChunk:
        """The span's rows as a ``TableChunk`` (``scan``: its errors and ignored rows)."""
        self.flush()
        codes = np.concatenate(self.code_parts) if self.code_parts else np.zeros(0, np.int32)
        self.code_parts = []
        return TableChunk(
            rows=len(codes),
            files=self.tables["files"].table(),
            exts=self.tables["exts"].table(),
            inline=self.tables["inline"].table(),
            keys=self.key_table.table(),
            codes=codes,
            names=list(self.names),
            field_counts=self.field_counts,
            unlabelled=self.unlabelled,
            stats=np.frombuffer(self.stats, dtype=np.int64).reshape(-1, 2),
            errors=scan.errors,
            ignored=scan.ignored,
            failed_downloads=scan.failed_downloads,
            keyed=keyed,
        )


def scan_span(
    span: TableSpan, cols: _Columns | None, base: str, real_base: str, name: str, folder: str
) -> TableChunk:
    """Scan the rows of ``span``: each row's image path resolved (links followed) and checked
    to lie under ``base`` (``real_base``: its real path), ``stat``-ed, its fields and label
    gathered, into a ``TableChunk``; a row that cannot be read or is refused ends the span
    with ``error``. ``cols``: the table's columns (None: decided by the span's first row, which
    is the table's). Runs anywhere that sees the table and its images (an engine's worker)."""
    scan = SourceScan(root=base, classes=[], from_table=True)
    rows = _TableRows(name)
    try:
        for line, row in span_rows(span):
            if cols is None:
                cols = _columns_of(span.path, row, base, folder)
            where = f"{span.path}:{line}"
            rel = cols.image(row, scan, where)
            if rel is None:
                continue
            rel = _inside(rel, base, real_base, where)
            ext = _image_ext(rel.rsplit("/", 1)[-1])
            if ext is None:
                scan.errors.append(SkippedFile(rel, f"{where}: not an image file name"))
            elif (st := image_stat(os.path.join(base, rel))) is None:
                scan.errors.append(SkippedFile(rel, f"{where}: {cols.missing(rel)}"))
            else:
                fields = _row_fields(row, cols.image_col, cols.caption_col, where)
                key = row[KEY_COLUMN] if cols.keyed is not None else None
                rows.add(rel, ext, fields, _label_of(row, where), line, key)
                rows.stats.extend(st)
    except InputError as exc:
        return TableChunk(error=exc)
    return rows.chunk(scan, None if cols is None else cols.keyed is not None)


def scan_span_to(
    span: TableSpan,
    cols: _Columns | None,
    base: str,
    real_base: str,
    name: str,
    folder: str,
    dest: str,
) -> TableChunk:
    """``scan_span``, its arrays written into the folder ``dest`` (``pieces.write_piece``, no
    pickle): what comes back to the driver is the span's small lists and counts, never its
    rows. Run twice, it writes the same files (a retried span is harmless)."""
    chunk = scan_span(span, cols, base, real_base, name, folder)
    if chunk.error is None:
        write_piece(chunk, dest)
        chunk.piece = dest
    return chunk


def _columns_of(path: str, row: dict, base: str, folder: str) -> _Columns:
    cols = _Columns.of(path, row, base)
    if folder and cols.keyed is None:
        raise InputError(
            f"{path}: no {KEY_COLUMN!r} column; a folder of tables is packed as "
            "img2dataset's output, whose tables all have one (pack other tables "
            "one at a time)"
        )
    return cols


def scan_table(path: str, root: str | None = None, engine=None, work=None) -> SourceScan:
    """``scan_tables`` of one table (see there)."""
    return scan_tables([path], root, engine=engine, work=work)


#: Rows of a table that a pack without an engine plans in one process (its columns in memory,
#: ~300 bytes a row); past it the pack says once that an engine plans it in pieces.
TABLE_PLAN_IN_MEMORY = 2_000_000


class TablePlanWarning(UserWarning):
    """A table planned in one process past ``TABLE_PLAN_IN_MEMORY`` rows."""


def scan_tables(
    paths: Sequence[str],
    root: str | None = None,
    folder: str = "",
    engine=None,
    work: str | None = None,
) -> SourceScan:
    """List the samples of a table: one row each, in row order.

    The image column (``IMAGE_COLUMNS``) names a file relative to ``root`` (default: the table's
    folder); the caption column (``CAPTION_COLUMNS``) becomes field ``txt``, a ``label`` column
    gives class names (sorted: labels; none: samples carry no label, -1), every other column goes
    into field ``json`` as an object. Nothing is read outside ``root``: a path that is absolute,
    climbs out with ``..`` or resolves (through a symbolic link) outside it is refused, naming
    the row; pass a wider ``root`` to allow it. A row naming a missing or non-image file is
    listed in ``errors`` (pack's ``on_error`` decides). Rows stream through in chunks into
    numpy tables (``TABLE_CHUNK``): no Python object per row outlives its chunk.

    ``engine``: a runner with ``map_chunks`` (``shardkit.write.engines``) scans the tables in
    spans of ``engine.plan_chunk`` rows on its workers (``scan_span``: path resolution, ``stat``,
    fields and labels), each returning arrays (``TableChunk``); this process reads each table
    once to cut it (``spans.cut_table``) and joins the arrays. Either way the same scan: where
    several rows are refused, the first in table order wins, whichever span meets it.

    ``work`` (a folder every worker sees, OUT): with an engine, each span's arrays are written
    there by the worker that scanned it (``scan_span_to``) and joined on disk
    (``scan.pieces``), the scan's columns memory-mapped files: this process holds no column of
    every row, and its passes over them hold a block's pages at a time. The same arrays, so
    the same keys, plan and fingerprint. Without an engine, a table is joined in memory (one
    warning past ``TABLE_PLAN_IN_MEMORY`` rows).

    Several tables (``paths``, of an img2dataset output ``folder``: ``img2dataset_tables``)
    are read as one, in the order given, each row's key being img2dataset's own (``KEY_COLUMN``).
    """
    name = folder or paths[0]
    table = os.path.abspath(paths[0])
    base = os.path.abspath(root) if root is not None else os.path.dirname(table)
    if not os.path.isdir(base):
        raise InputError(f"root {base!r} of table {name!r} is not a directory")
    real_base = os.path.realpath(base)
    mapper = getattr(engine, "map_chunks", None)
    if mapper is None:  # here: each table as one span, scanned as it is read
        chunks = []
        for path in paths:
            chunks.append(scan_span(whole_table(path), None, base, real_base, name, folder))
            if chunks[-1].error is not None:
                break
    else:
        per = int(getattr(engine, "plan_chunk", TABLE_CHUNK))
        cut = _cut(paths, per, base, folder)
        if work is not None:
            return _scan_in_pieces(cut, base, real_base, name, folder, mapper, work)
        calls = [(s, cols, base, real_base, name, folder) for s, cols in cut]
        chunks = mapper(scan_span, calls) if calls else []
    scan = _joined(_checked(chunks), base, name)
    if mapper is None and len(scan.files) > TABLE_PLAN_IN_MEMORY:
        warnings.warn(
            f"table {name!r}: {len(scan.files)} rows planned in this process, their columns "
            f"in memory (past {TABLE_PLAN_IN_MEMORY}); an engine (--engine local) plans it "
            "in pieces on disk",
            TablePlanWarning,
            stacklevel=2,
        )
    return _nonempty(scan, name)


def _checked(chunks: list[TableChunk]) -> list[TableChunk]:
    for c in chunks:  # the first refused row in table order
        if c.error is not None:
            raise c.error
    return chunks


def _nonempty(scan: SourceScan, name: str) -> SourceScan:
    if not len(scan.files) and not scan.errors:
        raise InputError(f"table {name!r} has no rows")
    return scan


def _scan_in_pieces(cut, base, real_base, name, folder, mapper, work: str) -> SourceScan:
    """The spans scanned on the engine into a pieces folder under ``work``, joined on disk."""
    pieces = os.path.join(os.path.abspath(work), staging_name())
    calls = [
        (s, cols, base, real_base, name, folder, os.path.join(pieces, f"{i:06d}"))
        for i, (s, cols) in enumerate(cut)
    ]
    try:
        os.makedirs(pieces)
        chunks = _checked(mapper(scan_span_to, calls) if calls else [])
        return _nonempty(_joined(chunks, base, name, pieces), name)
    finally:
        remove_pieces(pieces)  # the columns are mapped; their files are unlinked already


def _cut(paths: Sequence[str], per: int, base: str, folder: str) -> list[tuple]:
    """``(span, the table's columns)`` of every span of ``paths`` in order, ``per`` rows each.
    A table whose first row is refused (or that cannot be read) is one span with no columns:
    its scan meets the error in its place, after every earlier table's rows; a row that stops
    a cut stops the list there (nothing after it is scanned, as in one process)."""
    out: list[tuple] = []
    for path in paths:
        try:
            spans, first, stopped = cut_table(path, per)
        except InputError:  # unreadable: the span's scan meets it, in its place
            spans, first, stopped = [whole_table(path)], None, True
        cols = None
        if first is not None:
            try:
                cols = _columns_of(path, first, base, folder)
            except InputError:  # the first row's scan meets it
                spans, stopped = [whole_table(path)], True
        out += [(s, cols) for s in spans]
        if stopped:
            break
    return out


def _joined(
    chunks: list[TableChunk], base: str, name: str, pieces: str | None = None
) -> SourceScan:
    """One ``SourceScan`` of the spans' chunks, in order: each chunk's arrays copied into the
    whole table's and dropped as they go (a chunk's beside the whole, not every chunk twice).
    ``pieces``: the chunks' arrays are in their ``piece`` folders, joined there on disk."""
    scan = SourceScan(root=base, classes=[], from_table=True)
    names, unlabelled = _lists(chunks, scan)
    if names and unlabelled is not None:
        raise InputError(
            f"{name}:{unlabelled}: no {LABEL_COLUMN!r}; give every row a label or none"
        )
    scan.classes = sorted(names)
    rank = np.zeros(len(names) + 1, dtype=np.int64)
    rank[-1] = -1  # code -1 (no label) reads the last entry
    for label, cls in enumerate(scan.classes):
        rank[names[cls]] = label
    if pieces is not None:
        return _joined_on_disk(scan, chunks, names, rank, pieces)
    n = sum(c.rows for c in chunks)
    scan.labels = np.empty(n, dtype=np.int64)
    one = len(chunks) == 1  # a table scanned here: its arrays are the whole's
    scan.stats = chunks[0].stats if one else np.empty((n, 2), dtype=np.int64)
    tables = {k: _Joining(chunks, k) for k in ("files", "exts", "inline", "keys")}
    at = 0
    for i, c in enumerate(chunks):
        local = rank[np.array([names[x] for x in c.names] + [-1], dtype=np.int64)]
        np.take(local, c.codes, out=scan.labels[at : at + c.rows])  # no temporary per row
        if not one:
            scan.stats[at : at + c.rows] = c.stats
        for t in tables.values():
            t.add(c)
        at += c.rows
        chunks[i] = None  # type: ignore[call-overload]  # copied: not held twice
        del c
        if not one:
            _give_back()
    scan.files, scan.exts, scan.inline = (tables[k].table for k in ("files", "exts", "inline"))
    scan.field_counts = dict(sorted(scan.field_counts.items()))
    if scan.keyed:  # img2dataset's keys, as its tars and `shardkit index` have them
        scan.keys, scan.again = _column_keys(tables["keys"].table)
    else:
        scan.keys = _table_keys(scan.files, scan.exts)
    return scan


def _joined_on_disk(scan: SourceScan, chunks, names, rank, pieces: str) -> SourceScan:
    """``_joined``'s columns built on disk from the chunks' pieces (``pieces.joined_columns``)
    and the keys made there too: the same arrays, memory-mapped."""
    ranks = [rank[np.array([names[x] for x in c.names] + [-1], dtype=np.int64)] for c in chunks]
    files, exts, inline, keys, labels, stats = joined_columns(
        pieces, [c.piece for c in chunks], ranks
    )
    scan.files, scan.exts, scan.inline, scan.labels, scan.stats = files, exts, inline, labels, stats
    scan.field_counts = dict(sorted(scan.field_counts.items()))
    make = on_disk(pieces, "keys")
    if scan.keyed:
        scan.keys, scan.again = _column_keys(keys, make)
    else:
        scan.keys = _table_keys(scan.files, scan.exts, make)
    return scan


def _lists(chunks: list[TableChunk], scan: SourceScan) -> tuple[dict[str, int], int | None]:
    """Fill ``scan``'s lists and counts from the chunks, in order; return the label names in
    order of first appearance (name -> number) and the line of the first unlabelled row."""
    names: dict[str, int] = {}
    unlabelled = None
    for c in chunks:
        if c.keyed is not None:
            scan.keyed = c.keyed
        scan.errors += c.errors
        scan.ignored += c.ignored[: max(LIST_NON_IMAGES - len(scan.ignored), 0)]
        scan.failed_downloads += c.failed_downloads
        for f, k in c.field_counts.items():
            scan.field_counts[f] = scan.field_counts.get(f, 0) + k
        if unlabelled is None:
            unlabelled = c.unlabelled
        for label in c.names:
            names.setdefault(label, len(names))
    return names, unlabelled


def _give_back() -> None:
    """Hand the heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). A span's arrays come back from a worker as allocations that glibc's rising mmap
    threshold keeps on the heap: freed, they stay resident unless trimmed, and the driver held
    every span twice (429 MB where 293 MB with the trim, 1.28M rows on a process pool)."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


class _Joining:
    """One string column of the whole table, filled from the chunks' in order."""

    def __init__(self, chunks: list[TableChunk], column: str):
        self.column = column
        parts = [getattr(c, column) for c in chunks]
        self.one = len(parts) == 1
        if self.one:  # the chunk's own table, not a copy
            self.table = parts[0]
            return
        self.table = StrTable()
        self.table.blob = np.empty(sum(int(p.offsets[-1]) for p in parts), dtype=np.uint8)
        self.table.offsets = np.zeros(sum(len(p) for p in parts) + 1, dtype=np.int64)
        self.at, self.byte = 0, 0

    def add(self, chunk: TableChunk) -> None:
        if self.one:
            return
        part = getattr(chunk, self.column)
        n, size = len(part), int(part.offsets[-1])
        self.table.blob[self.byte : self.byte + size] = part.blob
        self.table.offsets[self.at + 1 : self.at + n + 1] = part.offsets[1:] + self.byte
        self.at, self.byte = self.at + n, self.byte + size


#: img2dataset's per-shard table: no image column, a ``key`` per row whose image it wrote as
#: ``<table name>/<key>.<ext>`` beside the table (``--output_format files``), and a ``status``.
KEY_COLUMN = "key"


@dataclass
class _Columns:
    """Which columns of a table name the image and hold the caption (its first row decides)."""

    image_col: str | None
    caption_col: str | None
    #: img2dataset's layout: the folder of the images named by ``key`` (None: an image column),
    #: relative to the root; its tar (``--output_format webdataset``) is ``keyed + ".tar"``.
    keyed: str | None = None
    #: The ``keyed`` folder exists (else each row's image is looked for in the tar alone).
    keyed_dir: bool = False

    @classmethod
    def of(cls, path: str, row: dict, base: str) -> _Columns:
        image_col = _column(path, row, IMAGE_COLUMNS)
        keyed = None
        if image_col is None and KEY_COLUMN in row:
            stem = os.path.basename(path).rsplit(".", 1)[0]
            keyed = os.path.relpath(
                os.path.join(os.path.dirname(os.path.abspath(path)), stem), base
            )
        elif image_col is None:
            raise InputError(
                f"{path}: no image column; name the column holding the image paths one of "
                f"{', '.join(IMAGE_COLUMNS)} (or give a {KEY_COLUMN!r} column, as img2dataset "
                "does, with the images in a folder named like the table)"
            )
        keyed_dir = keyed is not None and os.path.isdir(os.path.join(base, keyed))
        return cls(image_col, _column(path, row, CAPTION_COLUMNS), keyed, keyed_dir)

    def image(self, row: dict, scan: SourceScan, where: str) -> str | None:
        """The row's image path as written (None: listed in ``scan`` as an error or ignored)."""
        if self.keyed is not None:
            return self._keyed(row, scan, where)
        rel = row.get(self.image_col)
        if rel is not None and not isinstance(rel, str):  # an int, the image's bytes ...
            what = "bytes" if isinstance(rel, (bytes, bytearray)) else type(rel).__name__
            raise InputError(
                f"{where}: column {self.image_col!r} holds {what} ({_short(rel)}), not an image "
                "path; make it the text path of each image file (relative to the table), "
                "writing images held in the table to files first"
            )
        if not rel or "\0" in rel:
            why = "a NUL character in the image path" if rel else "no image path"
            scan.errors.append(SkippedFile(where, f"{why} in column {self.image_col!r}"))
            return None
        return rel

    def missing(self, rel: str) -> str:
        """Why ``rel`` (a row's image) is no file: for img2dataset, where it was looked for."""
        if self.keyed is None:
            return "no such image file"
        name = rel.rsplit("/", 1)[-1]
        return (
            f"no image {name} in {self.keyed}/ or {self.keyed}.tar beside the table (where "
            "img2dataset writes them); tars without their tables: `shardkit index DIR`"
        )

    def _keyed(self, row: dict, scan: SourceScan, where: str) -> str | None:
        key, status = row.get(KEY_COLUMN), row.get("status")
        if not isinstance(key, str) or not key or "\0" in key or "/" in key:
            scan.errors.append(SkippedFile(where, f"no usable {KEY_COLUMN!r} ({key!r})"))
            return None
        stem = f"{self.keyed}/{key}"
        if status is not None and status != "success":  # a failed download: no image
            scan.add_failed_download(
                stem, f"{where}: failed download (img2dataset status {status!r}), no image"
            )
            return None
        base = scan.root
        for e in _KEYED_EXTS if self.keyed_dir else ():  # --output_format files
            if os.path.isfile(os.path.join(base, f"{stem}.{e}")):
                return f"{stem}.{e}"
        tar = f"{self.keyed}.tar"  # --output_format webdataset
        if os.path.isfile(os.path.join(base, tar)):
            members = tar_members(os.path.join(base, tar))
            for e in _KEYED_EXTS:
                if f"{key}.{e}" in members:
                    return member_path(tar, f"{key}.{e}", members[f"{key}.{e}"])
        return f"{stem}.jpg"


#: The extensions a keyed image is looked for with, img2dataset's default first.
_KEYED_EXTS = ("jpg", "png", "webp", "jpeg")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def img2dataset_tables(src: str) -> list[str]:
    """The per-shard tables of an img2dataset output folder, in name order ([] if ``src`` is
    none): ``.parquet`` files with their shard's images beside them, as ``<stem>.tar``
    (``--output_format webdataset``), or as a ``<stem>/`` folder (``files``) with the shard's
    ``<stem>_stats.json`` (a class folder beside a table of the same name is not enough)."""
    try:
        names = sorted(n for n in os.listdir(src) if not n.startswith("."))
    except OSError:
        return []
    here = set(names)
    tables = [n for n in names if n.lower().endswith(".parquet")]
    stems = [t[: -len(".parquet")] for t in tables]
    if not any(f"{s}.tar" in here or (s in here and f"{s}_stats.json" in here) for s in stems):
        return []
    return [os.path.join(src, t) for t in tables]


def _label_of(row: dict, where: str) -> str | None:
    """A row's class name (None: the row has no label), refused where no manifest could hold
    it as a class name."""
    label = row.get(LABEL_COLUMN)
    if label is None:
        return None
    name = str(label)
    if "\0" in name:
        raise InputError(f"{where}: label {name!r} holds a NUL character; fix the row")
    return name


def _row_fields(row: dict, image_col: str, caption_col: str | None, where: str) -> dict:
    """A row's fields: the caption as ``txt``, the other columns but label as ``json``."""
    fields: dict = {}
    rest = {k: v for k, v in row.items() if k not in (image_col, caption_col, LABEL_COLUMN)}
    if caption_col is not None and row.get(caption_col) is not None:
        caption = row[caption_col]
        try:
            fields["txt"] = caption if isinstance(caption, str) else json.dumps(caption)
        except TypeError as exc:  # bytes, a date ...
            raise InputError(
                f"{where}: column {caption_col!r} holds a cell that JSON cannot hold ({exc}); "
                "make the captions text"
            ) from None
    if rest:
        fields["json"] = rest
    return fields


def _inside(rel: str, base: str, real_base: str, where: str) -> str:
    """``rel`` normalised relative to ``base``, if it names a file under ``base`` (links
    resolved); else refused. An absolute path is taken when it lies under ``base``."""
    norm = os.path.normpath(rel).replace(os.sep, "/")
    if os.path.isabs(norm):
        norm = next(
            (
                os.path.relpath(norm, b).replace(os.sep, "/")
                for b in (base, real_base)
                if norm.startswith(b.rstrip(os.sep) + os.sep)
            ),
            "..",  # not under the root: refused below
        )
    member = member_of(os.path.join(base, norm))  # a tar's member: where the tar leads
    target = os.path.realpath(member[0] if member else os.path.join(base, norm))
    if (
        norm == ".."
        or norm.startswith("../")
        or not target.startswith(real_base.rstrip(os.sep) + os.sep)
    ):
        raise InputError(
            f"{where}: image path {rel!r} leads outside {base!r}; nothing outside the table's "
            "folder is read unless you pass a root that holds it (--root DIR, root=DIR)"
        )
    return norm
