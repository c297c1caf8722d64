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
import itertools
import os

import numpy as np

from ..errors import ShardFormatError, StorageError
from ..formats.sample_index import SPLIT_SALT, IndexColumns
from ..formats.tar.parse import BLOCK
from ..formats.tar.reader import read_run
from ..records import Record, ShardInfo, ShardSlice
from ..urls import is_url
from .indexes import columns_range, shard_columns

__all__ = ["SKIPPED", "RangeReader", "read_range"]


def read_range(url: str, start: int, stop: int, fd, storage_options, fix: str, ahead=None) -> bytes:
    """Bytes [start, stop) of a shard, as its sample index placed them: one ``pread`` on a
    local file (its descriptor from ``fd()``, kept by the caller), one ranged GET on object
    storage (``ahead``, a ``remote.ranged.RangesAhead``: that GET, started ahead). A short
    answer is a shard truncated or replaced since; ``fix`` says what to do."""
    try:
        if is_url(url) and ahead is not None:
            data = ahead.take(url, start, stop)  # the same GET, begun while earlier ones ran
        elif is_url(url):
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


#: Runs of wanted samples are read one by one, not gathered with the holes between them into
#: fewer, larger reads: a ``pread`` from the page cache costs about what copying its bytes does,
#: and a 10% split of 2.6 kB samples read in groups with holes up to 64 kB cost 11.6 us a
#: sample against 10.2 run by run (``benchmarks/bench_split.py``). (On object storage, where a
#: GET costs milliseconds, gathering would pay; it is not measured here, so each run is one GET.)
#: A slice is read as ranges when it wants at most this share of its shard's samples, streamed
#: above it: streamed, a sample costs 2.7 us, ranged 10 us (tiny samples, warm cache; the same
#: benchmark), so ranges win below about a quarter.
RANGED_SHARE = 0.25

#: What a sample the plan reads through but does not want stands as (dropped by its mask).
SKIPPED = Record("", "", b"", -1)


class RangeReader:
    """Reads slices as exact ranges where their shard has a sample index (tar) or is a B-tree
    (LMDB)."""

    def __init__(self, fmt_name: str, storage, unindexed: frozenset[str] = frozenset()):
        self.tar, self.lmdb = fmt_name == "tar", fmt_name == "lmdb"
        self.storage = storage
        #: Shards whose index the dataset refused when it was built: streamed, never read
        #: through it.
        self.unindexed = unindexed
        self.storage_options = getattr(storage, "storage_options", None)
        self._indexes: dict[str, IndexColumns | None] = {}
        self._fd: tuple[str, int] | None = None
        self._shard: tuple[str, object] | None = None  # (url, LmdbSampleReader)
        self._lists: tuple[str, list[int], list[int]] | None = None
        #: Ranges read (reads or GETs), for tests and benchmarks.
        self.reads = 0
        #: Remote tar shards: the GETs of the planned slices, kept in flight ahead (``plan``).
        self.ahead = None

    def plan(self, items) -> None:
        """The slices to be read as ranges, in order: ``(slice, shard, mask)``, the slices
        ``exact`` accepted. Remote: their ranged GETs (the next runs of this shard, then the
        next shards') are started ahead, up to the storage's ``ranged_gets`` in flight and
        ``ranged_bytes`` held (``remote.ranged``); the reads, and so the records, stay the
        same and in the same order. Local reads, and ``ranged_gets`` 1: one at a time."""
        requests = int(getattr(self.storage, "ranged_gets", 1))
        items = [(sl, shard, mask) for sl, shard, mask in items if is_url(shard.url)]
        if not self.tar or requests <= 1 or not items:
            return
        from ..remote.ranged import RangesAhead

        limit = int(getattr(self.storage, "ranged_bytes", 0))
        self.ahead = RangesAhead(self.storage_options, requests, limit)
        self.ahead.plan(self._planned(items))

    def preload(self, wanted) -> None:
        """Load at once the indexes ``exact`` will load for ``wanted`` (``(slice, shard,
        samples wanted)``) on object storage: their ranged GETs in flight together, up to the
        storage's ``ranged_gets``, where one at a time they cost a first-byte latency each
        before the first sample. What each holds, and what a missing or foreign one does, is
        ``shard_columns``'s."""
        requests = int(getattr(self.storage, "ranged_gets", 1))
        if not self.tar or requests <= 1:
            return
        todo: dict[str, ShardInfo] = {}
        for sl, shard, count in wanted:
            url = shard.url
            if sl.stop <= sl.start or count > RANGED_SHARE * shard.samples or not is_url(url):
                continue
            if url not in self._indexes and url not in self.unindexed and columns_range(shard):
                todo[url] = shard
        if len(todo) < 2:
            return
        from ..remote.ranged import RangesAhead

        ahead = RangesAhead(
            self.storage_options, requests, int(getattr(self.storage, "ranged_bytes", 0))
        )
        ahead.plan((where, 0, n) for where, n in map(columns_range, todo.values()))
        try:
            for url, shard in todo.items():
                self._indexes[url] = shard_columns(
                    shard, self.storage_options, lambda where, n: ahead.take(where, 0, n)
                )
        finally:
            ahead.close()

    def _planned(self, items):
        """(url, start, stop) of each read ``records`` will make for ``items``, lazily."""
        for sl, shard, mask in items:
            at = self._indexes[shard.url].offsets
            want = np.ones(sl.stop - sl.start, bool) if mask is None else mask
            runs = wanted_runs(sl.start, want)
            starts, stops = at[runs[:, 0]], at[runs[:, 1]] + BLOCK
            for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
                yield shard.url, a, b

    def exact(self, sl: ShardSlice, shard: ShardInfo, wanted: int) -> bool:
        """Whether the slice is read as exact ranges: its shard has an index (tar: its offsets;
        LMDB: its B-tree), and it wants (``wanted`` of its samples) at most ``RANGED_SHARE`` of
        the shard: above it, streaming the shard is faster."""
        if not (self.tar or self.lmdb) or sl.stop <= sl.start:
            return False
        if wanted > RANGED_SHARE * shard.samples:
            return False  # the index is not even read
        if shard.url in self.unindexed:
            return False
        if self.lmdb:
            return True  # each sample is one descent of the tree: nothing to load first
        if shard.url not in self._indexes:
            self._indexes[shard.url] = shard_columns(shard, self.storage_options)
        return self._indexes[shard.url] is not None

    def records(
        self,
        sl: ShardSlice,
        shard: ShardInfo,
        mask: np.ndarray | None,
        fields=(),
        skipped: bool = True,
    ):
        """The slice's records, the wanted ones only (``mask``: which are; None: all). A
        sample not wanted (a hole a plan reads through) is ``SKIPPED``, never parsed: the
        plan's mask drops it. Tar: each run of wanted samples is one ``pread`` or GET, parsed
        in C, each sample checked against the key hash its index stores. LMDB: each wanted
        sample is one lookup in the shard's B-tree, the shard kept open across slices (its
        upper pages too), so a read costs its leaf and value pages. ``skipped`` False: the
        wanted records alone, no ``SKIPPED`` between them."""
        want = np.ones(sl.stop - sl.start, bool) if mask is None else mask
        if self.lmdb:
            yield from self._lmdb_records(sl, shard, want, fields, skipped)
            return
        index = self._indexes[shard.url]
        at, hashes = self._columns(shard.url, index)  # as ints: a run costs no numpy
        runs = wanted_runs(sl.start, want)  # [first, stop) of each run of wanted samples
        j = sl.start
        for lo, hi in runs.tolist():
            if skipped:
                yield from itertools.repeat(SKIPPED, lo - j)
            a = int(at[lo])
            # one block past the run: the next header, which closes its last sample for the C
            # parser (a shard ends with two zero blocks, so it is always there)
            blob = self._read(shard, a, int(at[hi]) + BLOCK)
            starts = [x - a for x in at[lo : hi + 1]]
            got = read_run(blob, starts, len(blob), shard.url, fields)
            for k, rec in enumerate(got, lo):
                if rec is None or _hash(rec.key) != hashes[k]:
                    raise ShardFormatError(
                        f"{shard.url}: sample {k} is not where its sample index says (the "
                        "shard changed after packing?); re-pack it, or delete its .idx file"
                    )
                yield rec
            j = hi
        if skipped:
            yield from itertools.repeat(SKIPPED, sl.stop - j)

    def _columns(self, url: str, index: IndexColumns) -> tuple[list[int], list[int]]:
        """The shard's sample offsets and key hashes as lists of ints, kept while slices read
        the shard."""
        if self._lists is None or self._lists[0] != url:
            self._lists = (url, index.offsets.tolist(), index.hashes.tolist())
        return self._lists[1], self._lists[2]

    def _lmdb_records(self, sl: ShardSlice, shard: ShardInfo, want: np.ndarray, fields, skipped):
        reader = self._lmdb_reader(shard)
        names = tuple(fields or ())
        for k, wanted in zip(range(sl.start, sl.stop), want.tolist(), strict=True):
            if wanted:
                self.reads += 1
                yield reader.get(k, names)
            elif skipped:
                yield SKIPPED

    def _lmdb_reader(self, shard: ShardInfo):
        """One open LMDB shard, kept while consecutive slices read it; its sample count is
        checked against the manifest's once, when it is opened."""
        from ..formats.lmdb import LmdbSampleReader

        if self._shard is not None and self._shard[0] == shard.url:
            return self._shard[1]
        self.close()
        reader = LmdbSampleReader(self.storage.local_path(shard), shard.url, walk=None)
        if shard.samples >= 0 and reader.samples != shard.samples:
            reader.close()
            raise ShardFormatError(
                f"{shard.url}: holds {reader.samples} samples, its manifest says "
                f"{shard.samples}; the manifest belongs to another version of the shard: "
                "re-pack it or rebuild the manifest"
            )
        self._shard = (shard.url, reader)
        return reader

    def _read(self, shard: ShardInfo, a: int, b: int) -> bytes:
        self.reads += 1
        return read_range(
            shard.url,
            a,
            b,
            lambda: self._file(shard),
            self.storage_options,
            "re-pack it",
            self.ahead,
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
        if self.ahead is not None:
            self.ahead.close()  # GETs in flight cancelled; the plan stays (remote reads only)
        if self._fd is not None:
            fd, self._fd = self._fd[1], None
            os.close(fd)
        if self._shard is not None:
            reader, self._shard = self._shard[1], None
            reader.close()


def wanted_runs(start: int, want: np.ndarray) -> np.ndarray:
    """[first, stop) of each run of True in ``want`` (a slice's mask from sample ``start``),
    as shard sample numbers: one row per range read."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], want, [False])).astype(np.int8)))
    return edges.reshape(-1, 2) + start


def _hash(key: str) -> int:
    """A key's split hash, as the index stores it: the check that a range holds its sample."""
    raw = SPLIT_SALT + key.encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")
