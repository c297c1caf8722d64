"""A table's scan in pieces on disk: each span's arrays written where it was scanned, joined
on disk into whole-table columns, and read back through memory maps, so that the process that
plans an engine's pack (its driver) never holds a column of every row.

- ``scan_span_to`` (an engine's worker): ``scan.table.scan_span`` of one span, its arrays
  written as ``.npy`` files (``numpy.save`` without pickle) into the span's own folder under
  the pieces folder; it returns the span's ``TableChunk`` without its arrays (row count, label
  names, errors: a few small lists).
- ``join_pieces`` (the driver): the spans' arrays appended, a span at a time, into one file per
  column (``Column``: raw little-endian bytes, a string column as its blob and offsets), each
  then memory-mapped read-only and unlinked: the maps keep the files until the plan is done
  with them, and nothing is left on disk when the process ends, however it ends.

The pieces folder is a staging entry of OUT (``fsutil.staging_name``: this host and pid): a
killed pack leaves it, and the next pack into OUT removes it as stale; a re-run plans again
from the table, so it gives what an uninterrupted run gives. The columns are the ones the
in-memory join (``scan.table._joined``) builds, byte for byte, so the keys, the plan and the
fingerprint computed from them are the same; passes over them forget the pages they read
(``strings.forget``), so the driver's resident memory is a block's, not the table's.
"""

from __future__ import annotations

import os
import shutil
import weakref
from collections.abc import Iterable, Sequence
from itertools import islice

import numpy as np

from .strings import StrTable

__all__ = [
    "Column",
    "StrColumn",
    "on_disk",
    "pick",
    "read_piece",
    "remove_pieces",
    "take",
    "write_piece",
]

#: The columns of a span's piece: a ``TableChunk``'s arrays (string tables as blob + offsets).
PIECE_TABLES = ("files", "exts", "inline", "keys")
PIECE_ARRAYS = ("codes", "stats")


def _save(path: str, a: np.ndarray) -> None:
    """``numpy.save`` without pickle, under a temporary name renamed when whole: a span run
    twice (a retry, a duplicate) leaves one whole file either way."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(a), allow_pickle=False)
    os.replace(tmp, path)


def write_piece(chunk, dest: str) -> None:
    """Write ``chunk``'s arrays into the folder ``dest`` and drop them from ``chunk``."""
    os.makedirs(dest, exist_ok=True)
    for name in PIECE_TABLES:
        t = getattr(chunk, name)
        _save(os.path.join(dest, f"{name}.blob.npy"), np.asarray(t.blob, dtype=np.uint8))
        _save(os.path.join(dest, f"{name}.offsets.npy"), np.asarray(t.offsets, dtype="<i8"))
        setattr(chunk, name, StrTable())
    _save(os.path.join(dest, "codes.npy"), np.asarray(chunk.codes, dtype="<i4"))
    _save(os.path.join(dest, "stats.npy"), np.asarray(chunk.stats, dtype="<i8").reshape(-1, 2))
    chunk.codes = np.zeros(0, dtype=np.int32)
    chunk.stats = np.zeros((0, 2), dtype=np.int64)


def read_piece(dest: str, name: str):
    """One column of the piece in ``dest``: a ``StrTable`` (``PIECE_TABLES``) or an array."""
    if name in PIECE_TABLES:
        t = StrTable()
        t.blob = np.load(os.path.join(dest, f"{name}.blob.npy"), allow_pickle=False)
        t.offsets = np.load(os.path.join(dest, f"{name}.offsets.npy"), allow_pickle=False)
        return t
    return np.load(os.path.join(dest, f"{name}.npy"), allow_pickle=False)


def remove_pieces(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


class Column:
    """A column written a part at a time into a file, then read back as a read-only memory map
    (``array``): the driver holds a part, never the column."""

    def __init__(self, path: str, dtype, width: int = 0):
        self.path, self.dtype, self.width = path, np.dtype(dtype), width
        self.f = open(path, "wb")
        self.n = 0

    def add(self, part: np.ndarray) -> None:
        part = np.ascontiguousarray(part, dtype=self.dtype)
        self.f.write(memoryview(part).cast("B"))
        self.n += len(part)

    def array(self) -> np.ndarray:
        """The column, mapped (the file is unlinked: the map holds it until dropped), with
        the file kept open as ``fd`` for reads that do not map it (``take``, ``pick``)."""
        self.f.close()
        shape = (self.n, self.width) if self.width else (self.n,)
        if self.n == 0:
            out = np.zeros(shape, dtype=self.dtype)
        else:
            out = np.memmap(self.path, dtype=self.dtype, mode="r", shape=shape)
            out.fd = os.open(self.path, os.O_RDONLY)
            weakref.finalize(out, os.close, out.fd)
        os.unlink(self.path)
        return out


class StrColumn:
    """A ``StrTable`` written a part at a time into a blob file and an offsets file."""

    def __init__(self, path: str):
        self.blob = Column(path + ".blob", np.uint8)
        self.offsets = Column(path + ".offsets", "<i8")
        self.offsets.add(np.zeros(1, dtype=np.int64))
        self.bytes = 0

    def add(self, part: StrTable) -> None:
        self.blob.add(part.blob)
        self.offsets.add(np.asarray(part.offsets[1:], dtype=np.int64) + self.bytes)
        self.bytes += int(part.offsets[-1])

    def table(self) -> StrTable:
        out = StrTable()
        out.blob, out.offsets = self.blob.array(), self.offsets.array()
        return out


def take(table: StrTable, rows: np.ndarray) -> StrTable:
    """``table.take(rows)``; of a column on disk, each row read with ``pread`` (its two offsets,
    then its bytes), not through the map: a fault maps a whole folio of the page cache in (on
    ext4, up to megabytes), so scattered rows read through a map would hold the column."""
    ofd, bfd = getattr(table.offsets, "fd", None), getattr(table.blob, "fd", None)
    if ofd is None or bfd is None:
        return table.take(rows)
    rows = np.asarray(rows, dtype=np.int64).tolist()
    raw = b"".join([os.pread(ofd, 16, 8 * r) for r in rows])
    pairs = np.frombuffer(raw, dtype="<i8").reshape(-1, 2)
    blob = b"".join([os.pread(bfd, b - a, a) for a, b in pairs.tolist()])
    out = StrTable()
    out.offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(pairs[:, 1] - pairs[:, 0], out=out.offsets[1:])
    out.blob = np.frombuffer(blob, dtype=np.uint8) if blob else np.zeros(0, dtype=np.uint8)
    return out


def pick(column: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``column[rows]`` of a one-dimensional column; on disk, read with ``pread`` (``take``)."""
    fd = getattr(column, "fd", None)
    if fd is None:
        return column[rows]
    size = column.dtype.itemsize
    raw = b"".join([os.pread(fd, size, size * r) for r in np.asarray(rows).tolist()])
    return np.frombuffer(raw, dtype=column.dtype).astype(column.dtype.newbyteorder("="))


#: Strings encoded into a ``StrColumn`` at a time by ``on_disk``.
ON_DISK_BLOCK = 1 << 14


def on_disk(folder: str, name: str):
    """A maker of ``StrTable``s from strings, on disk under ``folder`` (``name`` + a count):
    what the key rule builds its keys with when the table's columns are on disk."""
    made = [0]

    def make(strings: Iterable[str]) -> StrTable:
        made[0] += 1
        col = StrColumn(os.path.join(folder, f"{name}-{made[0]}"))
        it = iter(strings)
        while block := list(islice(it, ON_DISK_BLOCK)):
            col.add(StrTable(block))
        return col.table()

    return make


def joined_columns(folder: str, pieces: Sequence[str], ranks: Sequence[np.ndarray]):
    """``(files, exts, inline, keys, labels, stats)`` of the spans' pieces (their folders, in
    table order) joined on disk under ``folder``; ``ranks``: per piece, the whole table's label
    of each of its label numbers (-1 last, which a row without a label's code -1 reads)."""
    tables = {name: StrColumn(os.path.join(folder, name)) for name in PIECE_TABLES}
    labels = Column(os.path.join(folder, "labels"), "<i8")
    stats = Column(os.path.join(folder, "stats"), "<i8", 2)
    for dest, local in zip(pieces, ranks, strict=True):
        for name, col in tables.items():
            col.add(read_piece(dest, name))
        labels.add(local[read_piece(dest, "codes")])
        stats.add(read_piece(dest, "stats").reshape(-1, 2))
        remove_pieces(dest)  # copied: the disk holds each row once
    out = [tables[n].table() for n in PIECE_TABLES]
    return (*out, labels.array(), stats.array())
