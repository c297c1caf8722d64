"""Exact byte ranges for slices that take up to half of a shard (subsets, splits, a mixture's
repeats), read through the shard's sample index.

Streamed, such a slice reopens its shard and fills a 4 MiB read window (or, remote, fetches the
whole shard) for one sample of a few kilobytes: an epoch of a 1% subset read the dataset 7.7
times over. With the index, each run of adjacent wanted samples is one read (one open file per
shard, kept while consecutive slices read it), or one ranged GET on object storage; a shard's
runs go into one buffer and its wanted samples are parsed in C at their index's offsets, so no
Python runs per run or per sample but the key's check. Slices wanting more of their shard
still stream, which is faster for them (``RANGED_SHARE``).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import stat
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..errors import ShardFormatError, StorageError
from ..formats import sample_index
from ..formats.sample_index import (
    SPLIT_SALT,
    ShardDigests,
    ShardSides,
    index_path,
    sample_digest,
)
from ..formats.tar.parse import BLOCK
from ..formats.tar.reader import SampleAltered, read_at
from ..records import Record, ShardInfo, ShardSlice
from ..urls import is_url
from .indexes import columns_range, drop_held, held_columns, shard_columns, shard_index

try:  # a local chunk's spans read in one call (the extension is optional: os.preadv without it)
    from ..images._native import pread_at as _pread_at
    from ..images._native import pread_spans as _pread_spans
except ImportError:  # pragma: no cover - built without libjpeg's headers
    _pread_spans = _pread_at = None

__all__ = ["SKIPPED", "RangeReader", "check_sample", "read_range", "warn_undigested"]


def read_range(url: str, start: int, stop: int, fd, storage, fix: str, ahead=None) -> bytes:
    """Bytes [start, stop) of a shard, as its sample index placed them: one ``pread`` on a
    local file (its descriptor from ``fd()``, kept by the caller), one ranged GET on object
    storage (``ahead``, a ``remote.ranged.RangesAhead``: that GET, started ahead), retried under
    ``storage``'s policy and timeout as a whole shard is (``RemoteStorage.read_range``). A
    shard that ends before the range is truncated or replaced since; ``fix`` says what to do."""
    if is_url(url):
        from ..remote.fetch import ShortObjectError
        from ..remote.storage import remote_of

        try:
            if ahead is not None:
                return ahead.take(url, start, stop)  # the same GET, begun while earlier ones ran
            return remote_of(storage).read_range(url, start, stop)  # one ranged GET
        except ShortObjectError:
            raise ShardFormatError(
                f"{url}: shorter than its sample index says (truncated or replaced?); {fix}"
            ) from None
    try:
        data = os.pread(fd(), stop - start, start)
    except OSError as exc:
        raise StorageError(f"{url}: read of sample bytes failed: {exc}") from exc
    if len(data) != stop - start:
        raise ShardFormatError(
            f"{url}: shorter than its sample index says (truncated or replaced?); {fix}"
        )
    return data


#: A slice is read as ranges when it wants at most this share of its shard's samples, streamed
#: above it. Measured at 1.28M tiny samples (5.6 kB each, 887 a shard; warm cache; CPU per
#: delivered sample, ``benchmarks/bench_split.py``'s child): a split of 20% costs 13.1 us
#: streamed and 6.4 ranged, 30%: 8.9 and 6.1, 40%: 7.7 and 5.7, 50%: 6.3 and 5.6, 70%: 4.4 and
#: 4.7; so ranges win up to about 60%.
RANGED_SHARE = 0.5

#: The same for an LMDB shard, whose wanted samples are each a lookup in its B-tree (measured
#: when the lookups replaced the walk; not measured again here).
LMDB_RANGED_SHARE = 0.25

#: Wanted samples at most this many bytes apart are read in one span, the bytes between them
#: read and passed over; 0: only adjacent samples (a run) share a read. Measured the same way
#: (a 10% split, ranged reads alone): 4.9 us a sample with 0, 5.1 with 6 kB, 5.8 with 12 kB.
#: A random read from the page cache costs about 2 us of system time, a further kilobyte about
#: 0.15 us: a hole of two samples already costs more to read than a read of its own.
GAP = 0

#: The most bytes one ranged GET of coalesced samples asks for (plus one sample): a GET stays
#: bounded in memory and in what a retry reads again (``spans``' ``cap``).
SPAN = 8 << 20

#: The most bytes read at once for a slice (its spans in chunks): a slice of a large shard is
#: never held whole.
CHUNK = 4 << 20

#: Records parsed in one call: at most ``BATCH``, and at most ``BATCH_BYTES`` of their bytes
#: (and one sample), so their images are made and freed in runs of bounded size (a whole
#: shard's alive at once makes glibc trim and re-fault the heap: ``formats.tar.reader._BUDGET``).
#: Each call costs Python around it (slicing the chunk's columns, ``read_at``, the C call's
#: arguments): about 9,000 instructions, 560 a sample at 16 a call, 140 at 64.
BATCH = 64
BATCH_BYTES = 1 << 20

#: What a sample the plan reads through but does not want stands as (dropped by its mask).
SKIPPED = Record("", "", b"", -1)


@dataclass(frozen=True)
class _Columns:
    """A shard's index head as the range reader uses it: offsets as int64 (``offsets[k]`` to
    ``offsets[k + 1]``: sample k's bytes) and key hashes as big-endian bytes (each key's
    BLAKE2b digest as it comes), and each sample's digest (None: an index from before them).
    ``keys``: for each identity of the shard's file read through this index (``_identity``),
    which samples' keys the C parser found to hash to this index's hashes, in this process.
    A sample whose bytes hash to its digest again (checked every read) under the same index and
    file holds the same key, so its key is not hashed again (as a streamed slice's are
    remembered: ``sample_index.sides_checked``)."""

    offsets: np.ndarray
    hashes: np.ndarray
    digests: np.ndarray | None = None
    keys: dict = field(default_factory=dict, compare=False, repr=False)
    #: For each split's sides of this shard (``_off_side``'s key), the samples whose stored
    #: hash is not on the side the split put them (sorted; nearly always none): worked out over
    #: the whole shard once a process, not over each slice's samples each epoch (some ten numpy
    #: calls a shard, the big-endian hashes compared through a cast: about 700 instructions a
    #: sample of a 10% split).
    off: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.digests is None else self.digests.nbytes
        return self.offsets.nbytes + self.hashes.nbytes + extra


#: Index heads kept across epochs (local shards; the least recently used dropped past
#: ``CACHED`` bytes): loaded once, not once an epoch (at a 10% split of tiny samples, loading
#: every shard's head again cost about a tenth of the epoch). Keyed by the index file's identity
#: (inode, mtime, size) and the shard's manifest facts, so a rewritten index is read again.
_CACHE: OrderedDict[tuple, _Columns | None] = OrderedDict()
CACHED = 64 << 20
_cached = [0]


def _columns(shard: ShardInfo, storage, read=None) -> _Columns | None:
    """``shard``'s index head for ranged reads (``shard_columns``; ``read``: its GET, started
    already; ``storage``: whose policy a GET follows), from ``_CACHE`` when its file is
    unchanged (local shards)."""
    key = None
    if not is_url(shard.url):
        try:
            st = os.stat(index_path(shard.url.removeprefix("file://")))
        except OSError:
            st = None
        if st is not None:
            key = (shard.url, shard.sha256, shard.samples, shard.bytes, shard.index_sha256,
                   st.st_ino, st.st_mtime_ns, st.st_size)  # fmt: skip
            if key in _CACHE:
                _CACHE.move_to_end(key)
                drop_held(shard)  # a head its split held for it: the same, read before
                return _CACHE[key]
    index = shard_columns(shard, storage, read)
    got = None
    if index is not None:
        digests = None if index.digests is None else index.digests.astype(np.uint64)
        got = _Columns(index.offsets.astype(np.int64), index.hashes.astype(">u8"), digests)
    if key is not None:
        _CACHE[key] = got
        _cached[0] += got.nbytes if got is not None else 0
        while _cached[0] > CACHED and _CACHE:
            _, old = _CACHE.popitem(last=False)
            _cached[0] -= old.nbytes if old is not None else 0
    return got


class RangeReader:
    """Reads slices as exact ranges where their shard has a sample index (tar) or is a B-tree
    (LMDB)."""

    def __init__(self, fmt_name: str, storage, unindexed: frozenset[str] = frozenset()):
        self.tar, self.lmdb = fmt_name == "tar", fmt_name == "lmdb"
        self.storage = storage
        #: Shards whose index the dataset refused when it was built: streamed, never read
        #: through it.
        self.unindexed = unindexed
        self._indexes: dict[str, _Columns | None] = {}
        #: Whole indexes, loaded where a stored hash is not its key's (``_key_of``).
        self._tables: dict[str, object] = {}
        self._warned: set[str] = set()
        self._fd: tuple[str, int] | None = None
        self._who: tuple | None = None  # the kept file's identity (``_identity``)
        #: The bytes of a chunk of spans (``_read_spans``), taken from ``_BUFFERS`` at the first
        #: read and given back at ``close``.
        self._buf: bytearray | None = None
        #: (url, LmdbSampleReader, its samples' digests or None)
        self._shard: tuple[str, object, np.ndarray | None] | None = None
        #: Ranges read (reads or GETs), for tests and benchmarks.
        self.reads = 0
        #: Remote spans fetched a second time for a sample whose digest differed.
        self._fetched_again: set[tuple[str, tuple[int, int]]] = set()
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
        self.ahead = RangesAhead(self.storage, requests, limit)
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
                if held_columns(shard):  # its split read it a moment ago: no GET
                    self._indexes[url] = _columns(shard, self.storage)
                else:
                    todo[url] = shard
        if len(todo) < 2:
            return
        from ..remote.ranged import RangesAhead

        ahead = RangesAhead(self.storage, requests, int(getattr(self.storage, "ranged_bytes", 0)))
        ahead.plan((where, 0, n) for where, n in map(columns_range, todo.values()))
        try:
            for url, shard in todo.items():
                self._indexes[url] = _columns(
                    shard, self.storage, lambda where, n: ahead.take(where, 0, n)
                )
        finally:
            ahead.close()

    def _planned(self, items):
        """(url, start, stop) of each read ``records`` will make for ``items``, lazily."""
        for sl, shard, mask in items:
            want = np.ones(sl.stop - sl.start, bool) if mask is None else mask
            *_, lo, hi = _span_bounds(self._indexes[shard.url], sl, want, *self._coalesce(shard))
            for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
                yield shard.url, a, b

    def _coalesce(self, shard: ShardInfo) -> tuple[int, int]:
        """How far apart wanted samples may lie and still share one read (``spans``): local,
        ``GAP`` (a hole costs more than a read from the page cache); object storage, the
        storage's ``ranged_gap`` (a GET's first-byte latency costs more than the hole's bytes)
        and at most ``SPAN`` bytes a GET. The one rule both the reader and the GETs planned
        ahead (``_planned``) follow."""
        if not is_url(shard.url):
            return GAP, 0
        gap = getattr(self.storage, "ranged_gap", None)
        if gap is None:
            from ..remote.storage import remote_of

            gap = remote_of(self.storage).ranged_gap
        return int(gap), SPAN

    def exact(self, sl: ShardSlice, shard: ShardInfo, wanted: int) -> bool:
        """Whether the slice is read as exact ranges: its shard has an index (tar: its offsets;
        LMDB: its B-tree), and it wants (``wanted`` of its samples) at most ``RANGED_SHARE``
        (LMDB: ``LMDB_RANGED_SHARE``) of the shard: above it, streaming the shard is faster."""
        if not (self.tar or self.lmdb) or sl.stop <= sl.start:
            return False
        if wanted > (LMDB_RANGED_SHARE if self.lmdb else RANGED_SHARE) * shard.samples:
            if is_url(shard.url):
                drop_held(shard)  # streamed and checked whole: its split's head is let go
            return False  # the index is not even read
        if shard.url in self.unindexed:
            return False
        if self.lmdb:
            return True  # each sample is one descent of the tree: nothing to load first
        if shard.url not in self._indexes:
            self._indexes[shard.url] = _columns(shard, self.storage)
        index = self._indexes[shard.url]
        if index is not None and index.digests is None:
            warn_undigested(shard.url, "tar")
        return index is not None

    def digests(self, shard: ShardInfo) -> ShardDigests | np.ndarray | None:
        """What a slice of a partial read that streams a local shard (it wants more than
        ``RANGED_SHARE`` of it, LMDB ``LMDB_RANGED_SHARE``) checks each sample it hands out
        against, as ranges are checked: a tar's index's digests and offsets (``_columns``:
        loaded once a process, the manifest's checksums checked); an LMDB shard's index record's
        digests (the record its lookups read, ``_lmdb_reader``: one lookup, its own checksum
        checked). None: a remote shard (fetched whole and checked against the manifest's sha256
        before its first sample), a shard whose index the dataset refused or a tar without an
        index the manifest vouches for, or one whose index predates digests (said once,
        ``warn_undigested``)."""
        url = shard.url
        if is_url(url) or url in self.unindexed:
            return None
        if self.lmdb:
            return self._lmdb_reader(shard)[1]
        if not self.tar or not shard.index_sha256:
            return None
        if url not in self._indexes:
            self._indexes[url] = _columns(shard, self.storage)
        index = self._indexes[url]
        if index is None:
            return None
        if index.digests is None:
            warn_undigested(url, "tar")
            return None
        return ShardDigests(index.digests, index.offsets)

    def records(
        self,
        sl: ShardSlice,
        shard: ShardInfo,
        mask: np.ndarray | None,
        fields=(),
        skipped: bool = True,
        sides: ShardSides | None = None,
    ):
        """The slice's records, the wanted ones only (``mask``: which are; None: all). A
        sample not wanted (a hole a plan reads through) is ``SKIPPED``, never parsed: the
        plan's mask drops it. Tar: each run of wanted samples is one read (``preadv``) or GET,
        parsed in C (``_tar_records``), each sample checked against the key hash its index
        stores. LMDB: each wanted sample is one lookup in the shard's B-tree, the shard kept
        open across slices (its upper pages too), so a read costs its leaf and value pages.
        ``skipped`` False: the wanted records alone, no ``SKIPPED`` between them. ``sides`` (a
        split's): each sample on the side the split put it, by its own key (tar: the index's
        key hash, which C compares with the key's, is on the split's side; LMDB: each value's
        key hashed), else a ``ShardFormatError`` naming it."""
        want = np.ones(sl.stop - sl.start, bool) if mask is None else mask
        # the reader's own generator, not one around it: one frame less for every record
        if self.lmdb:
            return self._lmdb_records(sl, shard, want, fields, skipped, sides)
        if not skipped:
            return _flat(self._tar_batches(sl, shard, want, fields, sides))
        return self._tar_records(sl, shard, want, fields, sides)

    def batches(
        self,
        sl: ShardSlice,
        shard: ShardInfo,
        mask: np.ndarray | None,
        fields=(),
        sides: ShardSides | None = None,
    ):
        """``records(..., skipped=False)`` a list at a time: the wanted records of the slice
        in the lists their parse made (tar: one C call's, at most ``BATCH``; LMDB: ``BATCH``
        lookups), each checked as ``records`` checks it before its list is handed out. A
        sparse epoch's records then pass the stages above in lists (``stages.read_batches``),
        no generator resumed per record below the shuffle buffer."""
        want = np.ones(sl.stop - sl.start, bool) if mask is None else mask
        if self.lmdb:
            return _in_lists(self._lmdb_records(sl, shard, want, fields, False, sides))
        return (got for got, _ in self._tar_batches(sl, shard, want, fields, sides))

    def _tar_records(self, sl: ShardSlice, shard: ShardInfo, want: np.ndarray, fields, sides):
        """A tar slice's records with ``SKIPPED`` standing for each sample not wanted
        (``_tar_batches``' records laid at their places)."""
        done = sl.start  # where the SKIPPED before the next wanted sample start
        for got, at in self._tar_batches(sl, shard, want, fields, sides):
            for n, rec in zip(at.tolist(), got, strict=True):
                yield from itertools.repeat(SKIPPED, n - done)
                yield rec
                done = n + 1
        yield from itertools.repeat(SKIPPED, sl.stop - done)

    def _tar_batches(self, sl: ShardSlice, shard: ShardInfo, want: np.ndarray, fields, sides=None):
        """The wanted samples of a tar slice, a parse call's list at a time with their numbers
        in the shard: their byte ranges from the index, gathered into
        spans (``spans``), read a chunk of spans at a time (one ``pread`` or GET a span) and
        parsed in one C call a chunk; the keys then hashed and compared with the index's in one
        comparison a chunk. No Python runs per sample but its key's hash. A split's: the
        index's hashes of the wanted samples compared with the split's sides in one comparison
        (they agree unless the index changed since the split was made); where one does not,
        that sample's own key decides."""
        index = self._indexes[shard.url]
        if _pread_at is not None and not is_url(shard.url):
            return self._local_batches(shard, index, want.nonzero()[0] + sl.start, fields, sides)
        return self._spans_batches(sl, shard, index, want, fields, sides)

    def _local_batches(self, shard: ShardInfo, index: _Columns, pos: np.ndarray, fields, sides):
        """``_tar_batches`` of a local shard: a chunk's spans worked out, read and cut into
        parse calls in one C call (``_native.pread_at``, which keeps ``_spans_batches``' rules:
        ``GAP`` 0, ``CHUNK``, ``_batches``), where a shard's numpy arithmetic around them cost
        about 80 calls, some 6,000 instructions a sample of a 10% split. The same reads, lists
        and checks as ``_spans_batches``."""
        expect = index.hashes[pos]
        digests = None if index.digests is None else index.digests[pos]
        odd = _off_side_of(index, pos, sides)
        fd = self._file(shard)
        memo = self._memo(index)  # under this file's identity: after ``_file``
        if self._buf is None:
            self._buf = _take_buffer()
        offsets, wanted = index.offsets, pos.astype(np.int64, copy=False)
        j, n = 0, len(pos)
        while j < n:
            try:
                got = _pread_at(fd, self._buf, offsets, wanted, j, CHUNK, BLOCK, BATCH, BATCH_BYTES)
            except OSError as exc:
                raise StorageError(f"{shard.url}: read of sample bytes failed: {exc}") from exc
            except ValueError:  # cannot be from an index its checks passed: offsets ascend
                raise ShardFormatError(
                    f"{shard.url}.idx: places samples out of order or outside it (damaged); "
                    "delete it and run `shardkit index` on the dataset"
                ) from None
            if isinstance(got, int):  # the chunk's bytes: more than the buffer holds
                self._buf = bytearray(got)
                continue
            if got is None:
                raise ShardFormatError(
                    f"{shard.url}: shorter than its sample index says (truncated or "
                    "replaced?); re-pack it"
                )
            k, rel_starts, rel_ends, reads, cuts = got
            self.reads += reads
            rel_starts, rel_ends = memoryview(rel_starts).cast("q"), memoryview(rel_ends).cast("q")
            known = memo is not None and bool(memo[pos[j:k]].all())
            for c, d in zip(cuts[:-1], cuts[1:], strict=True):  # within this chunk
                a, b = j + c, j + d
                rel = (rel_starts[c:d], rel_ends[c:d])
                yield self._checked(
                    shard, self._buf, rel, fields, expect, digests, pos, a, b, None, known,
                    memo, sides, odd,
                ), pos[a:b]  # fmt: skip
            j = k

    def _spans_batches(self, sl, shard, index, want, fields, sides):
        """``_tar_batches`` of a remote shard (or a local one without the C extension): the
        spans worked out in numpy (``_span_bounds``), a chunk of them read together."""
        pos, starts, ends, bounds, lo, hi = _span_bounds(index, sl, want, *self._coalesce(shard))
        expect = index.hashes[pos]
        digests = None if index.digests is None else index.digests[pos]
        odd = _off_side(expect, pos, sides)
        # Object storage: a span at a time, so a sample waits for its own GET alone, not for
        # a chunk's (their GETs are in flight ahead together: ``plan``).
        chunk = 0 if is_url(shard.url) else CHUNK
        sizes = hi - lo
        read = sizes.cumsum()  # the bytes of the spans up to each one's end
        j = 0  # spans read so far
        while j < len(lo):
            # a chunk of spans read together: at least one, at most ``chunk`` bytes
            before = int(read[j - 1]) if j else 0
            k = j + max(1, int(read[j:].searchsorted(before + chunk, "right")))
            blob = self._read_spans(shard, lo[j:k], hi[j:k], int(read[k - 1]) - before)
            # each sample's place in ``blob``: the chunk's spans laid end to end
            shift = (lo[j:k] - (read[j:k] - sizes[j:k] - before)).repeat(
                bounds[j + 1 : k + 1] - bounds[j:k]
            )
            a, b = bounds[j], bounds[k]
            rel_starts, rel_ends = starts[a:b] - shift, ends[a:b] - shift
            # every byte handed out is the packer's: checked by the parse (``_read_batch``)
            span = (int(lo[j]), int(hi[j])) if is_url(shard.url) and k == j + 1 else None
            memo = None if is_url(shard.url) else self._memo(index)
            known = memo is not None and bool(memo[pos[a:b]].all())
            cuts = _batches(rel_ends - rel_starts)
            for c, d in zip(cuts[:-1], cuts[1:], strict=True):  # within this chunk
                rel = (rel_starts[c:d], rel_ends[c:d])
                yield self._checked(
                    shard, blob, rel, fields, expect, digests, pos, a + c, a + d, span, known,
                    memo, sides, odd,
                ), pos[a + c : a + d]  # fmt: skip
            j = k

    def _checked(
        self, shard, blob, rel, fields, expect, digests, pos, a, b, span, known, memo, sides, odd
    ) -> list:
        """The records of one parse call, samples ``a .. b`` of ``pos`` (their places in
        ``blob``: ``rel``), each checked before the list is handed out: by the C parse (its
        digest, and its key against the index's hash), a key it did not take by its own hash
        (``_check_keys``), and a sample the split put on the other side than its stored hash
        says by its key (``_keys_on_side``); the keys found the index's are remembered under
        the file's identity (``memo``) so a later epoch hashes none. What ``_local_batches``
        and ``_spans_batches`` do with each list, whichever way its bytes were read."""
        hashes = expect[a:b]
        got, unchecked = self._read_batch(
            shard, blob, rel, fields, hashes, None if digests is None else digests[a:b],
            pos[a:b], span, known,
        )  # fmt: skip
        if memo is not None and not known:  # the keys the C parser found its index's
            took = pos[a:b]
            memo[np.delete(took, unchecked) if unchecked else took] = True
        if unchecked:  # those the C parser did not take (it checks the ones it takes)
            self._check_keys(
                [got[i] for i in unchecked], hashes[unchecked], pos[a:b][unchecked], shard, sides
            )
        if odd:
            _keys_on_side(got, range(a, b), odd, pos, sides, shard.url)
        return got

    def _read_spans(
        self, shard: ShardInfo, lo: np.ndarray, hi: np.ndarray, total: int
    ) -> bytearray:
        """Bytes ``[lo[i], hi[i])`` of the shard (int64 arrays) laid end to end, in a buffer
        reused from chunk to chunk (the records parsed from it are copies): one ``pread`` a
        span on the shard's kept descriptor, all in one C call (``_native.pread_spans``; local:
        no bytes object made and joined per span, no Python per span), one ranged GET a span
        (object storage); ``total``: their bytes."""
        if self._buf is None:
            self._buf = _take_buffer()
        if len(self._buf) < total:
            self._buf = bytearray(total)
        buf = memoryview(self._buf)
        p = 0
        if is_url(shard.url):
            for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
                buf[p : p + b - a] = self._read(shard, a, b)
                p += b - a
            return self._buf
        fd, preadv = self._file(shard), os.preadv
        self.reads += len(lo)
        try:
            if _pread_spans is not None:
                if _pread_spans(fd, self._buf, lo, hi) != total:
                    raise ShardFormatError(
                        f"{shard.url}: shorter than its sample index says (truncated or "
                        "replaced?); re-pack it"
                    )
                return self._buf
            for a, b in zip(lo.tolist(), hi.tolist(), strict=True):  # pragma: no cover
                if preadv(fd, [buf[p : p + b - a]], a) != b - a:
                    raise ShardFormatError(
                        f"{shard.url}: shorter than its sample index says (truncated or "
                        "replaced?); re-pack it"
                    )
                p += b - a
        except OSError as exc:
            raise StorageError(f"{shard.url}: read of sample bytes failed: {exc}") from exc
        return self._buf

    def _memo(self, index: _Columns) -> np.ndarray | None:
        """Which samples' keys were found to hash to ``index``'s hashes in the shard's file as
        it is now (``_Columns.keys``), or None where nothing is remembered: a remote shard or
        one just changed (no ``_who``), an index without digests (the bytes read again are not
        known to be the same)."""
        if self._who is None or index.digests is None:
            return None
        memo = index.keys.get(self._who)
        if memo is None:
            index.keys.clear()  # another file's: its answers do not hold for this one
            memo = index.keys[self._who] = np.zeros(len(index.digests), bool)
        return memo

    def _read_batch(self, shard, blob, at, fields, hashes, sums, pos, span, known=False):
        """``read_at`` of the samples at ``at`` (their starts and ends in ``blob``), each checked
        against its index digest (``sums``; None: an index from before digests) as it is parsed,
        in C (one call a batch, the bytes hashed while in cache for the parse, no Python a
        sample). ``pos``: the samples numbered in the shard. Remote (a chunk is one span,
        ``span``: its bytes in the shard), a span that differs is fetched again once (a byte
        altered in transit), then it is an error; local, it is an error at once: never a sample
        with other bytes than packed (the batches of the span handed out before were checked,
        and are copies)."""
        while True:
            try:
                return read_at(blob, at[0], at[1], shard.url, fields, hashes, sums, known)
            except SampleAltered as exc:
                bad = exc.args[0]
            if span is None or (shard.url, span) in self._fetched_again:
                raise altered(shard, int(pos[bad]), self.storage)
            self._fetched_again.add((shard.url, span))  # once a range, however it then differs
            lo, hi = span
            blob[: hi - lo] = read_range(shard.url, lo, hi, None, self.storage, "re-pack it")
            self.reads += 1

    def _lmdb_records(
        self, sl: ShardSlice, shard: ShardInfo, want: np.ndarray, fields, skipped, sides=None
    ):
        """The wanted samples of an LMDB slice: one lookup each, checked against the digest its
        shard's index record holds (``LmdbSampleReader.get``) before it is handed out, and its
        key against the split's side (``sides``)."""
        reader, digests = self._lmdb_reader(shard)
        names = tuple(fields or ())
        get = reader.get
        if not skipped:  # the wanted alone (a shard's slices joined: the holes between are long)
            self.reads += int(np.count_nonzero(want))
            for k in (np.flatnonzero(want) + sl.start).tolist():
                yield _on_side(
                    get(k, names, None if digests is None else int(digests[k])), k, sides, shard.url
                )
            return
        for k, wanted in zip(range(sl.start, sl.stop), want.tolist(), strict=True):
            if wanted:
                self.reads += 1
                yield _on_side(
                    get(k, names, None if digests is None else int(digests[k])), k, sides, shard.url
                )
            elif skipped:
                yield SKIPPED

    def _lmdb_reader(self, shard: ShardInfo):
        """One open LMDB shard, kept while consecutive slices read it; its sample count is
        checked against the manifest's once, when it is opened."""
        from ..formats.lmdb import LmdbSampleReader

        if self._shard is not None and self._shard[0] == shard.url:
            return self._shard[1], self._shard[2]
        self._close_shard()
        reader = LmdbSampleReader(self.storage.local_path(shard), shard.url, walk=None)
        try:
            if shard.samples >= 0 and reader.samples != shard.samples:
                raise ShardFormatError(
                    f"{shard.url}: holds {reader.samples} samples, its manifest says "
                    f"{shard.samples}; the manifest belongs to another version of the shard: "
                    "re-pack it or rebuild the manifest"
                )
            index = reader.index(shard.samples)  # one lookup: the samples' digests
        except BaseException:
            reader.close()
            raise
        digests = None if index is None else index.digests
        if digests is None:
            warn_undigested(shard.url, "lmdb")
        self._shard = (shard.url, reader, digests)
        return reader, digests

    def _read(self, shard: ShardInfo, a: int, b: int) -> bytes:
        self.reads += 1
        return read_range(
            shard.url,
            a,
            b,
            lambda: self._file(shard),
            self.storage,
            "re-pack it",
            self.ahead,
        )

    def _check_keys(
        self, got: list, expect: np.ndarray, pos: np.ndarray, shard: ShardInfo, sides
    ) -> None:
        """The check that each range holds its sample (the index's offsets are not covered by
        a checksum here, and a shard may have been replaced since): its key's hash is the one
        the index stores. Where it is not, the key decides: a sample on the other side of a
        split is an error naming it; one whose key is the index's key for its place (the key
        table, checked against the manifest) is that sample, its stored hash the damaged part:
        a warning names the index, once, and the sample is handed out; anything else is an
        error naming the shard."""
        if _digests_match(got, expect):
            return
        url = shard.url
        for i, rec in enumerate(got):
            n = int(pos[i])
            if rec is not None and _hash(rec.key) == int(expect[i]):
                continue
            if rec is not None and sides is not None and not sides.on_side(n, rec.key):
                raise sides.error(url, n, rec.key)
            if rec is not None and self._key_of(shard, n) == rec.key:
                if url not in self._warned:
                    self._warned.add(url)
                    warnings.warn(
                        f"{url}.idx: the split hash of sample {n} (key {rec.key!r}) is not its "
                        "key's hash (the index is damaged); the sample is read by its key "
                        "(rebuild the index: delete it and run `shardkit index` on the dataset)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                continue
            raise ShardFormatError(
                f"{url}: sample {n} is not where its sample index says (the shard changed "
                "after packing?); re-pack it, or delete its .idx file"
            )

    def _key_of(self, shard: ShardInfo, n: int) -> str | None:
        """Sample ``n``'s key as the shard's whole index gives it (its key table, the file
        checked against the manifest's ``index_sha256`` or its own trailer); None where it has
        none that checks out (a warning names it)."""
        if shard.url not in self._tables:
            self._tables[shard.url] = shard_index(shard, self.storage)
        index = self._tables[shard.url]
        return None if index is None else index.key(n)

    def _file(self, shard: ShardInfo) -> int:
        """One open file per shard, kept while consecutive slices read it."""
        path = shard.url.removeprefix("file://")
        if self._fd is not None and self._fd[0] == path:
            return self._fd[1]
        self._close_shard()
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise StorageError(
                f"{path}: no such file (was it moved or deleted after the dataset was built?)"
            ) from None
        st = os.fstat(fd)
        if shard.bytes >= 0 and st.st_size != shard.bytes:
            os.close(fd)
            raise ShardFormatError(
                f"{path}: {st.st_size} bytes, its manifest says {shard.bytes}: the shard changed "
                "after packing; re-pack it, or build the dataset again"
            )
        self._fd = (path, fd)
        self._who = _identity(st)
        return fd

    def close(self) -> None:
        """The reader done: its shard closed (``_close_shard``) and its buffer given back."""
        self._close_shard()
        if self._buf is not None:
            buf, self._buf = self._buf, None
            _give_buffer(buf)

    def _close_shard(self) -> None:
        if self.ahead is not None:
            self.ahead.close()  # GETs in flight cancelled; the plan stays (remote reads only)
        if self._fd is not None:
            fd, self._fd, self._who = self._fd[1], None, None
            os.close(fd)
        if self._shard is not None:
            reader, self._shard = self._shard[1], None
            reader.close()


def _flat(batches) -> Iterator[Record]:
    """The records of ``_tar_batches``' lists, one by one."""
    for got, _ in batches:
        yield from got


def _in_lists(records: Iterator[Record]) -> Iterator[list[Record]]:
    """``records`` in lists of at most ``BATCH``."""
    while got := list(itertools.islice(records, BATCH)):
        yield got


def _identity(st: os.stat_result) -> tuple | None:
    """A shard file's identity (device, inode, size, mtime, ctime: any write, rename or
    ``utime`` changes one), under which the keys its samples were found to hold are remembered
    (``_Columns.keys``); None for a file changed within ``RACY_NS`` (a write in the clock's
    granularity could leave the same stat) or not a regular file: its keys are hashed each read."""
    if time.time_ns() - st.st_ctime_ns < sample_index.RACY_NS or not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: Read buffers given back by closed readers, taken by the next (``list.pop`` and ``append``
#: are atomic, so threads share it safely): a buffer of a chunk's size is made (and zeroed) once
#: a process, not once an epoch or a plan piece, which cost a tenth of a 10% split's
#: instructions a sample. Each reader holds its own while it reads (two sources of a mixture
#: interleave their readers in one thread), so at most ``BUFFERS`` are kept.
_BUFFERS: list[bytearray] = []
BUFFERS = 2


def _take_buffer() -> bytearray:
    try:
        return _BUFFERS.pop()
    except IndexError:
        return bytearray()


def _give_buffer(buf: bytearray) -> None:
    if len(_BUFFERS) < BUFFERS and len(buf) <= 2 * CHUNK:
        _BUFFERS.append(buf)


def _batches(sizes: np.ndarray) -> list[int]:
    """Where each call's samples begin in a chunk of samples of ``sizes`` bytes (and, last,
    the chunk's end): at most ``BATCH`` samples a call, a call ending past ``BATCH_BYTES``."""
    n = len(sizes)
    if n and int(sizes.max()) * BATCH <= BATCH_BYTES:  # small samples: by count alone
        return [*range(0, n, BATCH), n]
    ends = np.cumsum(sizes)
    bucket = (ends - sizes) // BATCH_BYTES  # the bytes before each sample, in whole budgets
    new = (np.diff(bucket) != 0) | (np.diff(np.arange(n) // BATCH) != 0)
    return [0, *(np.flatnonzero(new) + 1).tolist(), n]


def _span_bounds(index: _Columns, sl: ShardSlice, want: np.ndarray, gap: int = GAP, cap: int = 0):
    """The reads of a slice's wanted samples (``want``: its mask), as ``_tar_records`` makes
    them and ``RangeReader.plan`` starts them ahead: ``pos`` (the wanted samples, numbered in
    the shard), their ``starts`` and ``ends``, ``bounds`` (span i: samples ``bounds[i]`` to
    ``bounds[i + 1]``), and each span's bytes ``[lo, hi)``: its samples and one block past the
    last (the next header, which closes it for the parser; a shard ends with two zero blocks,
    so it is always there). ``gap``, ``cap``: how far apart samples may lie and still share a
    read (``spans``; ``RangeReader._coalesce``)."""
    pos = want.nonzero()[0] + sl.start
    starts, ends = index.offsets[pos], index.offsets[pos + 1]
    bounds = np.concatenate((spans(starts, ends, gap, cap), [len(pos)]))
    lo, hi = starts[bounds[:-1]], ends[bounds[1:] - 1] + BLOCK
    return pos, starts, ends, bounds, lo, hi


def _off_side(expect: np.ndarray, pos: np.ndarray, sides) -> frozenset:
    """The places (in ``pos``) of wanted samples whose stored hash is not on the side ``sides``
    put them (empty without a split): they agree unless the index changed since the split was
    made, and where one does not, that sample's own key decides (``_keys_on_side``)."""
    if sides is None or not len(pos):
        return frozenset()
    p = pos + sides.base
    bit = (sides.bits[p >> 3] >> (7 - (p & 7))) & 1
    return frozenset(((expect < np.uint64(sides.threshold)) != bit).nonzero()[0].tolist())


def _off_side_of(index: _Columns, pos: np.ndarray, sides) -> frozenset:
    """``_off_side`` of the samples ``pos`` of the shard ``index`` is the head of, from the
    shard's own answer for these sides (``_Columns.off``: the whole shard's, worked out once)."""
    if sides is None or not len(pos):
        return frozenset()
    n = len(index.hashes)
    if len(sides.bits) * 8 < sides.base + n:  # bits short of the shard: the slice's alone
        return _off_side(index.hashes[pos], pos, sides)
    key = (
        sides.threshold,
        sides.base & 7,
        sides.bits[sides.base >> 3 : (sides.base + n + 7) >> 3].tobytes(),
    )
    off = index.off.get(key)
    if off is None:
        every = np.arange(n, dtype=np.int64)
        off = every[sorted(_off_side(index.hashes, every, sides))]
        if len(index.off) > 8:  # another split's sides each time: keep a few
            index.off.clear()
        index.off[key] = off
    if not len(off):
        return frozenset()
    return frozenset(np.isin(pos, off).nonzero()[0].tolist())


def _keys_on_side(got, places, odd: frozenset, pos, sides, url: str) -> None:
    """Each record of ``got`` (at ``places`` in ``pos``) that ``_off_side`` named, checked by
    its own key: one on the other side is ``sides.error``."""
    for rec, i in zip(got, places, strict=True):
        if i in odd and not sides.on_side(int(pos[i]), rec.key):
            raise sides.error(url, int(pos[i]), rec.key)


def spans(starts: np.ndarray, ends: np.ndarray, gap: int = GAP, cap: int = 0) -> np.ndarray:
    """Where each span of the samples at ``[starts[i], ends[i])`` (ascending) begins. Adjacent
    samples share a span; with ``gap`` > 0 (object storage) a run of them also joins the span
    before it when the hole between them (read and passed over) is at most ``gap`` bytes and
    the joined span, its closing block counted, reads at most twice its samples' bytes: so an
    epoch reads at most twice the bytes it draws. ``cap`` (0: none): no span joined past
    ``cap`` bytes, and a run of adjacent samples cut where its samples' ends cross a multiple
    of ``cap`` from its start: a read holds at most ``cap`` plus one sample."""
    if not len(starts):
        return np.zeros(0, np.int64)
    begin = np.concatenate(([True], starts[1:] - ends[:-1] > min(gap, GAP)))
    if cap > 0 and ends[-1] - starts[0] > cap:
        first = starts[begin][np.cumsum(begin) - 1]  # each sample's run's first byte
        piece = (ends - 1 - first) // cap
        begin[1:] |= piece[1:] != piece[:-1]
    if gap > GAP:
        _join(starts, ends, begin, gap, cap)
    return begin.nonzero()[0]


def _join(starts: np.ndarray, ends: np.ndarray, begin: np.ndarray, gap: int, cap: int) -> None:
    """``spans``' runs joined (``begin`` cleared where one joins the span before it), one
    step a run: a hole of at most ``gap``, the span at most twice its samples' bytes (and
    ``BLOCK``), at most ``cap`` bytes. Remote spans only: a GET costs far more than this."""
    first = np.flatnonzero(begin)
    if len(first) < 2:
        return
    last = np.append(first[1:], len(starts)) - 1
    lo, hi = starts[first].tolist(), ends[last].tolist()
    drawn = np.add.reduceat(ends - starts, first).tolist()
    cap = cap if cap > 0 else 1 << 62
    at, top, got = lo[0], hi[0], drawn[0]  # the span being joined: its bytes and drawn bytes
    for r in range(1, len(first)):
        a, b, w = lo[r], hi[r], drawn[r]
        if a - top <= gap and b - at + BLOCK <= 2 * (got + w) and b - at <= cap:
            begin[first[r]] = False
            top, got = b, got + w
        else:
            at, top, got = a, b, w


def _on_side(rec: Record, n: int, sides: ShardSides | None, url: str) -> Record:
    if sides is not None and not sides.on_side(n, rec.key):
        raise sides.error(url, n, rec.key)
    return rec


def _digests_match(got: list, expect: np.ndarray) -> bool:
    """Each record's key hashed as the index stores it (``expect``, big-endian), all compared
    at once."""
    blake, salt = hashlib.blake2b, SPLIT_SALT
    try:
        digests = b"".join(
            [blake(salt + r.key.encode("utf-8", "surrogateescape"), digest_size=8).digest()
             for r in got]
        )  # fmt: skip
    except AttributeError:  # a None: no sample where the index says
        return False
    return digests == expect.tobytes()


def _hash(key: str) -> int:
    """A key's split hash, as the index stores it."""
    raw = SPLIT_SALT + key.encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


def check_sample(shard: ShardInfo, j: int, data, digest: int | None, storage, again=None):
    """``data`` (sample ``j`` of ``shard``, its bytes as its index places them) if its digest is
    ``digest`` (None: an index from before digests, unchecked); else, remote, ``again()`` (the
    same range fetched once more) if that matches; else ``altered``'s error."""
    if digest is None or sample_digest(data) == digest:
        return data
    if again is not None:
        data = again()
        if sample_digest(data) == digest:
            return data
    raise altered(shard, j, storage)


def altered(shard: ShardInfo, j: int, storage) -> Exception:
    """The one-line error for sample ``j`` of ``shard`` whose bytes are not its digest's: local,
    the shard was altered since packing (``ShardFormatError``); remote, the bytes came back
    other than packed twice (``StorageError``). Names the key, from the shard's index (this
    path only: a read that checks keeps no key table)."""
    from .indexes import shard_index

    try:
        index = shard_index(shard, storage)
        key = repr(index.key(j)) if index is not None else "unknown"
    except Exception:  # the message must come out whatever else is wrong
        key = "unknown"
    if is_url(shard.url):
        return StorageError(
            f"{shard.url}: sample {j} (key {key}) came back with other bytes than its sample "
            "index's digest, twice (altered in the store or in transit); check the shard with "
            "`shardkit verify` on the dataset, and upload it again"
        )
    return ShardFormatError(
        f"{shard.url}: sample {j} (key {key}) is not the bytes packed (its digest differs from "
        "its sample index's: the shard was altered since); restore or re-pack it "
        "(`shardkit verify` names every damaged shard)"
    )


#: Datasets (their folder or URL) warned about in this process (``warn_undigested``).
_UNDIGESTED: set[str] = set()


def warn_undigested(url: str, fmt: str) -> None:
    """Warn once per dataset (per process) that a read of part of a shard of it is unchecked:
    its index predates sample digests. Names the fix: ``shardkit index --rehash`` (tar, no
    shard rewritten), or packing again (LMDB: the digests live inside the shard)."""
    where = url.rsplit("/", 1)[0] if "/" in url else "."
    if where in _UNDIGESTED:
        return
    _UNDIGESTED.add(where)
    if fmt == "tar":
        fix = f"`shardkit index --rehash {where}` writes them without rewriting a shard"
    else:
        fix = "pack it again (`shardkit pack`) to add them (they live inside each LMDB shard)"
    warnings.warn(
        f"{where}: its shards have no per-sample digests (sample indexes from an older "
        "shardkit, or none), so reads of part of a shard (splits, subsets, ShardView, ls/show) "
        f"hand out their bytes unchecked; {fix}",
        RuntimeWarning,
        stacklevel=4,
    )
