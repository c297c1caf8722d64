"""``StrTable``: per-sample strings as numpy arrays (one byte blob plus offsets), not lists of
str: DataLoader workers forked from a process holding a million Python strings would copy every
page they touch through refcount writes.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

import numpy as np

__all__ = ["StrTable", "forget"]

#: Rows ``StrTable.take`` gathers at a time (its int64 byte indexes are of one block, not all).
TAKE_BLOCK = 1 << 12


class StrTable(Sequence[str]):
    """An immutable list of str stored as one uint8 blob and int64 offsets (fork-friendly)."""

    def __init__(self, strings: Iterable[str] = ()):
        # A block of strings is encoded at a time: a table of any length is built holding
        # its bytes (and one block's objects), not a bytes object per string.
        grow = _Growing()
        it = iter(strings)
        while block := list(islice(it, 1 << 13)):
            grow.extend(block)
        self.blob, self.offsets = grow.arrays()

    @classmethod
    def concat(cls, tables: Sequence[StrTable]) -> StrTable:
        """One table of ``tables`` end to end, from their arrays (no str objects made)."""
        out = cls()
        if not tables:
            return out
        out.blob = np.concatenate([t.blob for t in tables])
        offsets = [np.zeros(1, dtype=np.int64)]
        base = 0
        for t in tables:
            offsets.append(t.offsets[1:] + base)
            base += int(t.offsets[-1])
        out.offsets = np.concatenate(offsets)
        return out

    def take(self, rows: np.ndarray) -> StrTable:
        """The strings at ``rows`` as a new table, gathered from the arrays (no str made),
        ``TAKE_BLOCK`` rows at a time: beside the result it holds one block's byte indexes."""
        rows = np.asarray(rows, dtype=np.int64)
        starts = self.offsets[rows]
        lengths = self.offsets[rows + 1] - starts
        out = StrTable()
        out.offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=out.offsets[1:])
        out.blob = np.empty(int(out.offsets[-1]), dtype=np.uint8)
        for a in range(0, len(rows), TAKE_BLOCK):
            b = min(a + TAKE_BLOCK, len(rows))
            lo, hi = int(out.offsets[a]), int(out.offsets[b])
            shift = np.repeat(starts[a:b] - out.offsets[a:b], lengths[a:b])
            out.blob[lo:hi] = self.blob[np.arange(lo, hi, dtype=np.int64) + shift]
        return out

    def span(self, lo: int, hi: int) -> StrTable:
        """Strings ``lo..hi-1`` as a table viewing this one's blob (only the offsets are new):
        what a planning chunk sent to another process carries."""
        out = StrTable()
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        out.blob, out.offsets = self.blob[a:b], self.offsets[lo : hi + 1] - a
        return out

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        raw = self.blob[self.offsets[index] : self.offsets[index + 1]].tobytes()
        return raw.decode("utf-8", "surrogateescape")

    def __iter__(self) -> Iterator[str]:
        """Each string in order, decoded a block of the blob at a time (fast, bounded)."""
        offsets, step = self.offsets, 1 << 14
        for a in range(0, len(self), step):
            cuts = offsets[a : a + step + 1]
            raw = self.blob[cuts[0] : cuts[-1]].tobytes()
            cuts = (cuts - cuts[0]).tolist()
            forget(self)  # a table on disk: one block's pages held, not the column's
            for x, y in zip(cuts[:-1], cuts[1:], strict=True):
                yield raw[x:y].decode("utf-8", "surrogateescape")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StrTable):
            return np.array_equal(self.offsets, other.offsets) and np.array_equal(
                self.blob, other.blob
            )
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StrTable({len(self)} strings, {self.blob.nbytes} bytes)"


def forget(*columns) -> None:
    """Drop from this process's resident memory the pages it touched of ``columns`` (arrays or
    ``StrTable``s) that are memory-mapped files (``scan.pieces``: a table's columns kept on
    disk); the kernel's page cache keeps them, so a later read costs no disk. A pass over a
    column on disk then holds a block's pages, not the column; arrays in memory are left."""
    for c in columns:
        for a in (c.blob, c.offsets) if isinstance(c, StrTable) else (c,):
            m = getattr(a, "_mmap", None)  # np.memmap and its slices
            if m is not None and hasattr(m, "madvise"):
                try:
                    m.madvise(mmap.MADV_DONTNEED)
                except (OSError, ValueError):  # closed, or a kernel without it: only memory
                    pass


class _Growing:
    """A ``StrTable`` being filled a block at a time: one bytearray (grown in place, so a long
    table is not copied from parts at the end) and each block's lengths."""

    def __init__(self):
        self.blob = bytearray()
        self.lengths: list[np.ndarray] = []

    def extend(self, strings: Sequence[str]) -> None:
        encoded = [s.encode("utf-8", "surrogateescape") for s in strings]
        self.lengths.append(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
        self.blob += b"".join(encoded)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(blob, offsets)``; the blob is a view of the bytearray, not a copy."""
        n = sum(len(x) for x in self.lengths)
        offsets = np.zeros(n + 1, dtype=np.int64)
        if n:
            np.cumsum(np.concatenate(self.lengths), out=offsets[1:])
        self.lengths = []
        blob = np.frombuffer(self.blob, dtype=np.uint8) if self.blob else np.zeros(0, np.uint8)
        return blob, offsets

    def table(self) -> StrTable:
        out = StrTable()
        out.blob, out.offsets = self.arrays()
        return out
