"""Exact byte ranges for slices that take a few samples of a shard (subsets, splits, a
mixture's repeats), read through the shard's sample index.

Streamed, such a slice reopens its shard and fills a 4 MiB read window (or, remote, fetches the
whole shard) for one sample of a few kilobytes: an epoch of a 1% subset read the dataset 7.7
times over. With the index, a slice is one ``pread`` of its samples' bytes (one open file per
shard, kept while consecutive slices read it), or one ranged GET on object storage. Whole or
large slices still stream, which is faster for them.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from ..errors import ShardFormatError, StorageError
from ..formats.sample_index import SPLIT_SALT, IndexColumns
from ..formats.tar.reader import read_sample
from ..records import Record, ShardInfo, ShardSlice
from ..urls import is_url
from .indexes import shard_columns

__all__ = ["SKIPPED", "RangeReader", "read_range"]


def read_range(url: str, start: int, stop: int, fd, storage_options, fix: str) -> bytes:
    """Bytes [start, stop) of a shard, as its sample index placed them: one ``pread`` on a
    local file (its descriptor from ``fd()``, kept by the caller), one ranged GET on object
    storage. A short answer is a shard truncated or replaced since; ``fix`` says what to do."""
    try:
        if is_url(url):
            from ..remote.fs import filesystem, protocol_of, strip

            fs = filesystem(protocol_of(url), storage_options)
            data = fs.cat_file(strip(fs, url), start=start, end=stop)  # one ranged GET
        else:
            data = os.pread(fd(), stop - start, start)
    except OSError as exc:
        raise StorageError(f"{url}: read of sample bytes failed: {exc}") from exc
    if len(data) != stop - start:
        raise ShardFormatError(
            f"{url}: shorter than its sample index says (truncated or replaced?); {fix}"
        )
    return data


#: What a sample the plan reads through but does not want stands as (dropped by its mask).
SKIPPED = Record("", "", b"", -1)


class RangeReader:
    """Reads slices as exact ranges where their shard has a sample index (tar only)."""

    def __init__(self, fmt_name: str, storage, unindexed: frozenset[str] = frozenset()):
        self.tar = fmt_name == "tar"
        #: Shards whose index the dataset refused when it was built: streamed, never read
        #: through it.
        self.unindexed = unindexed
        self.storage_options = getattr(storage, "storage_options", None)
        self._indexes: dict[str, IndexColumns | None] = {}
        self._fd: tuple[str, int] | None = None
        #: Ranges read (reads or GETs), for tests and benchmarks.
        self.reads = 0

    def exact(self, sl: ShardSlice, shard: ShardInfo, wanted: int) -> bool:
        """Whether the slice is read as exact ranges: its shard has an index, and it wants
        (``wanted`` of its samples) less than half the shard, which streaming reads as fast."""
        if not self.tar or sl.stop <= sl.start or 2 * wanted > shard.samples:
            return False  # the index is not even read
        if shard.url in self.unindexed:
            return False
        if shard.url not in self._indexes:
            self._indexes[shard.url] = shard_columns(shard, self.storage_options)
        return self._indexes[shard.url] is not None

    def records(self, sl: ShardSlice, shard: ShardInfo, mask: np.ndarray | None, fields=()):
        """The slice's records, one read per run of wanted samples (``mask``: which are; None:
        all), each checked against the key hash its index stores. A sample not wanted (a hole
        a plan reads through) is ``SKIPPED``, never read: the plan's mask drops it."""
        index = self._indexes[shard.url]
        off = index.offsets
        want = np.ones(sl.stop - sl.start, bool) if mask is None else mask
        edges = np.flatnonzero(np.diff(np.concatenate(([False], want, [False])).astype(np.int8)))
        runs = edges.reshape(-1, 2) + sl.start  # [first, stop) of each run of wanted samples
        j = sl.start
        for lo, hi in runs.tolist():
            for _ in range(j, lo):
                yield SKIPPED
            a = int(off[lo])
            blob = self._read(shard, a, int(off[hi]))
            for k in range(lo, hi):
                piece = blob[int(off[k]) - a : int(off[k + 1]) - a]
                rec: Record | None = read_sample(piece, shard.url, fields)
                if rec is None or _hash(rec.key) != int(index.hashes[k]):
                    raise ShardFormatError(
                        f"{shard.url}: sample {k} is not where its sample index says (the shard "
                        "changed after packing?); re-pack it, or delete its .idx file"
                    )
                yield rec
            j = hi
        for _ in range(j, sl.stop):
            yield SKIPPED

    def _read(self, shard: ShardInfo, a: int, b: int) -> bytes:
        self.reads += 1
        return read_range(
            shard.url, a, b, lambda: self._file(shard), self.storage_options, "re-pack it"
        )

    def _file(self, shard: ShardInfo) -> int:
        """One open file per shard, kept while consecutive slices read it."""
        path = shard.url.removeprefix("file://")
        if self._fd is not None and self._fd[0] == path:
            return self._fd[1]
        self.close()
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise StorageError(
                f"{path}: no such file (was it moved or deleted after the dataset was built?)"
            ) from None
        size = os.fstat(fd).st_size
        if shard.bytes >= 0 and size != shard.bytes:
            os.close(fd)
            raise ShardFormatError(
                f"{path}: {size} bytes, its manifest says {shard.bytes}: the shard changed after "
                "packing; re-pack it, or build the dataset again"
            )
        self._fd = (path, fd)
        return fd

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd[1], None
            os.close(fd)


def _hash(key: str) -> int:
    """A key's split hash, as the index stores it: the check that a range holds its sample."""
    raw = SPLIT_SALT + key.encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")
