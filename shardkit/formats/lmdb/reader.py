"""Reading LMDB shards with ``pread`` on a descriptor of the reader's own, never a mapping.

``_Shard`` is one open shard: its tree walked once per file identity (``btree.check_structure``),
lookups and cursors that keep the upper branch pages, and an identity check after every read.
``iter_lmdb_records`` streams a range of samples, ``LmdbSampleReader`` reads one by index, and
``read_lmdb_index``/``lmdb_keys`` give a shard's keys from its index record (one lookup).
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import warnings
from collections.abc import Iterator, Sequence

import numpy as np

from ...errors import ShardFormatError
from ...fsutil import open_regular
from ...records import Record
from .btree import (
    F_BIGDATA,
    HDR,
    NODE,
    NODE_HDR,
    P_BRANCH,
    P_LEAF,
    P_OVERFLOW,
    Damaged,
    check_structure,
    child,
    key_at,
    lower_bound,
    pick_meta,
    read_page,
)
from .index import (
    INDEX_KEY,
    LmdbIndex,
    LmdbIndexError,
    decode_lmdb_index,
    lmdb_columns_size,
    lmdb_digest,
)
from .writer import META_KEY, PAGE, VALUE_HEADER, decode_value, sample_key

__all__ = [
    "LmdbSampleReader",
    "count_lmdb_samples",
    "file_stamp",
    "iter_lmdb_records",
    "lmdb_keys",
    "read_lmdb_index",
]

#: (dev, inode, size, mtime_ns) of files this process already walked: a worker re-opens its shard
#: for every slice, and the walk costs one read per page.
_checked: set[tuple[int, int, int, int]] = set()

# --- reading: plain reads of the B-tree, never a mapping ------------------------------------------
#
# LMDB's own reader maps the file and trusts it for as long as it is open: a shard truncated under
# a reader kills the process with SIGBUS, a shard rewritten in place is read as whatever it now
# holds, and py-lmdb refuses a file that an environment inherited through fork still names. So
# shardkit reads its shards with ``pread`` on a descriptor of the reader's own: a short read is a
# truncation, a page that is not what its parent says is damage, and the file's identity is
# checked after every read (``_Shard.check``), so a shard that changes under a reader is named,
# never read as other samples. A descriptor has no shared offset under ``pread``: one inherited
# by a forked process reads as well as a fresh one.

#: Branch pages a reader keeps (the upper levels of its tree: a few pages even for a large shard).
_BRANCHES_KEPT = 16
#: Bytes of a value read to learn its key (``keys()``): the header plus a key of usual length.
_KEY_PREFIX = 512


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    """A file's identity: device, inode, size, modification time (ns)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def file_stamp(path: str | os.PathLike) -> tuple[int, int, int, int]:
    """The identity of the file at ``path`` as ``LmdbSampleReader.stamp`` gives it."""
    return _stamp(os.stat(path))


class _Shard:
    """One LMDB shard read through ``pread`` (see above); ``close()`` closes its descriptor."""

    def __init__(self, path: str | os.PathLike, shard: str = "", walk: bool = True):
        path = os.fspath(path)
        self.shard = shard or path
        self.walked = False
        try:
            self._file = open_regular(path, buffering=0)  # a FIFO must not block the reader
        except FileNotFoundError:
            raise ShardFormatError(
                f"{self.shard}: LMDB shard not found (expected a single-file LMDB)"
            ) from None
        except OSError as exc:
            raise ShardFormatError(
                f"{self.shard}: cannot open LMDB shard ({exc.strerror})"
            ) from None
        self.fd = self._file.fileno()
        self._branches: dict[int, tuple] = {}
        self.unchecked = False  # read since the last identity check
        try:
            self._open(walk)
        except BaseException:
            self.close()
            raise

    def _open(self, walk: bool) -> None:
        st = os.fstat(self.fd)
        self.stamp = _stamp(st)
        if st.st_size < 2 * PAGE:
            raise ShardFormatError(
                f"{self.shard}: truncated LMDB shard ({st.st_size} bytes); re-copy or re-pack it"
            )
        try:
            _, self.last, self.psize, main = pick_meta(self.fd, st.st_size)
        except (Damaged, OSError, struct.error) as exc:
            raise self.error(exc) from None
        self.depth, self.root = main[2], main[7]
        if walk:
            self.walk()

    def walk(self) -> None:
        """Check the whole tree once per file identity (``check_structure``): before samples
        are read. A reader that only looks up the index record skips it: each page it reads is
        checked as it is read, and the record carries its own checksum."""
        if self.walked:
            return
        if self.stamp not in _checked:
            try:
                check_structure(self.fd, self.stamp[2])
            except (Damaged, OSError, struct.error) as exc:
                raise self.error(exc) from None
            self.check()  # the walk saw one file from start to end
            _checked.add(self.stamp)
        self.walked = True

    def changed(self) -> str:
        """How the file differs from when it was opened ("" while it does not)."""
        try:
            st = os.fstat(self.fd)
        except OSError as exc:
            return f"it cannot be checked: {exc.strerror}"
        if _stamp(st) == self.stamp:
            return ""
        if st.st_size < self.stamp[2]:
            return f"truncated to {st.st_size} of {self.stamp[2]} bytes"
        return "rewritten in place: its size or modification time changed"

    def check(self, index: int | None = None, *, after_reads: bool = False) -> None:
        """Raise unless the file is still the one opened: called after reading, so bytes read
        before a change are never handed out as the file's. ``after_reads``: only if something
        was read since the last check (records of one leaf page share its check)."""
        if after_reads and not self.unchecked:
            return
        self.unchecked = False
        how = self.changed()
        if how:
            at = "" if index is None else f" at sample {index}"
            raise ShardFormatError(
                f"{self.shard}: the LMDB shard changed while it was read{at} ({how}); a shard "
                "must not be re-packed or re-copied under a reader: read it again once it is whole"
            )

    def error(self, exc: BaseException, index: int | None = None) -> ShardFormatError:
        """The ``ShardFormatError`` for a fault met while reading (``Damaged``, ``OSError``)."""
        self.check(index)  # a file changed under the reader says so, not "damaged"
        if isinstance(exc, OSError):
            what, detail = "unreadable", f"read failed: {exc.strerror}"
        else:
            what = exc.args[1] if len(exc.args) > 1 else "damaged"
            detail = exc.args[0] if exc.args else type(exc).__name__
        at = "" if index is None else f" at sample {index}"
        return ShardFormatError(
            f"{self.shard}: {what} LMDB shard{at} ({detail}); re-copy it, or re-pack it from "
            "the source images"
        )

    def _pread(self, n: int, offset: int) -> bytes:
        self.unchecked = True
        data = os.pread(self.fd, n, offset)
        if len(data) != n:
            raise Damaged(f"{len(data)} of {n} bytes at offset {offset}", "truncated")
        return data

    def _page(self, pgno: int, want: int) -> tuple[bytes, tuple[int, ...]]:
        self.unchecked = True
        return read_page(self.fd, self.psize, self.last, pgno, want)

    def _branch(self, pgno: int) -> tuple[bytes, tuple[int, ...], list[bytes]]:
        """A branch page, its node offsets and keys: kept (a few), as every lookup passes the
        same upper pages; the identity check after each read covers them too."""
        hit = self._branches.get(pgno)
        if hit is None:
            raw, ptrs = self._page(pgno, P_BRANCH)
            if len(self._branches) >= _BRANCHES_KEPT:
                self._branches.clear()
            keys = [key_at(raw, p, self.psize) for p in ptrs]
            hit = self._branches[pgno] = (raw, ptrs, keys)
        return hit

    def _item(self, raw: bytes, ptr: int, limit: int | None) -> tuple[bytes, bytes]:
        """A leaf node's key and value (its first ``limit`` bytes, if given)."""
        lo, hi, flags, ksize = NODE.unpack_from(raw, ptr)
        dsize, end = lo | hi << 16, ptr + NODE_HDR + ksize
        n = dsize if limit is None else min(dsize, limit)
        if flags == 0:
            if end + dsize > self.psize:
                raise Damaged(f"a value at offset {ptr} runs past its page")
            return raw[ptr + NODE_HDR : end], raw[end : end + n]
        if flags != F_BIGDATA or end + 8 > self.psize:
            raise Damaged(f"a node with flags {flags:#x}; shardkit writes none")
        (first,) = struct.unpack_from("<Q", raw, end)
        pages = (HDR - 1 + dsize) // self.psize + 1
        if not 2 <= first <= self.last + 1 - pages:
            raise Damaged(f"a value on overflow pages {first}+{pages}")
        if self.walked:  # the walk has checked every overflow page's header
            return raw[ptr + NODE_HDR : end], self._pread(n, first * self.psize + HDR)
        data = self._pread(HDR + n, first * self.psize)  # its header read and checked with it
        got, _, oflags, opages = struct.unpack_from("<QHHI", data)
        if got != first or oflags != P_OVERFLOW or opages != pages:
            raise Damaged(f"overflow page {first} does not match its {dsize}-byte value")
        return raw[ptr + NODE_HDR : end], data[HDR:]

    def items(self, first: bytes, limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        """``(key, value)`` in key order from the first key not below ``first``: a cursor that
        keeps the branch pages above its leaf."""
        if self.depth == 0:
            return
        stack: list[list] = []  # [page, node offsets, node followed] per branch level
        pgno = self.root
        while len(stack) < self.depth - 1:
            raw, ptrs, keys = self._branch(pgno)
            i = bisect.bisect_right(keys, first, 1) - 1  # node 0 holds the lowest keys
            stack.append([raw, ptrs, i])
            pgno = child(raw, ptrs[i])
        raw, ptrs = self._page(pgno, P_LEAF)
        i = lower_bound(raw, ptrs, first, self.psize)
        while True:
            for ptr in ptrs[i:]:
                yield self._item(raw, ptr, limit)
            while stack and stack[-1][2] + 1 >= len(stack[-1][1]):
                stack.pop()
            if not stack:
                return
            top = stack[-1]
            top[2] += 1
            pgno = child(top[0], top[1][top[2]])
            while len(stack) < self.depth - 1:
                raw, ptrs, _ = self._branch(pgno)
                stack.append([raw, ptrs, 0])
                pgno = child(raw, ptrs[0])
            raw, ptrs = self._page(pgno, P_LEAF)
            i = 0

    def get(self, key: bytes, limit: int | None = None) -> bytes | None:
        """The value of ``key`` (its first ``limit`` bytes), None if there is none."""
        for got, value in self.items(key, limit):
            return value if got == key else None
        return None

    def fields(self, index: int, names=None) -> dict[str, bytes]:
        """Sample ``index``'s fields by name: those of ``names`` (pairs of the name and its
        bytes) that it has, or every one it has (``names`` None: one scan, in name order)."""
        if names is not None:
            out = {}
            for name, raw in names:
                value = self.get(b"+%010d.%s" % (index, raw))
                if value is not None:
                    out[name] = value
            return out
        prefix = b"+%010d." % index
        out = {}
        for key, value in self.items(prefix):
            if not key.startswith(prefix):
                break
            out[key[len(prefix) :].decode("utf-8", "surrogateescape")] = value
        return out

    def verify(self, index: int, value: bytes, every: dict[str, bytes], digest: int) -> None:
        """Raise unless sample ``index`` (its ``value`` and ``every`` field it has) hashes to
        ``digest``, its index record's ``lmdb_digest``: the check of every read of part of the
        shard (a lookup, a streamed slice) before it hands the sample out. A file changed under
        the reader says so first (``check``), not "altered"."""
        if lmdb_digest(value, every.items()) == digest:
            return
        self.check(index, after_reads=True)
        try:
            key = repr(decode_value(value, self.shard, index).key)
        except ShardFormatError:
            key = "unreadable"
        raise ShardFormatError(
            f"{self.shard}: sample {index} (key {key}) is not the bytes packed (its digest "
            "differs from its index record's: the shard was altered since); restore or re-pack "
            "it (`shardkit verify` names every damaged shard)"
        )

    def count(self) -> int:
        """The sample count of the ``__shardkit__`` record."""
        meta = self.get(META_KEY)
        if meta is None:
            raise ShardFormatError(
                f"{self.shard}: no {META_KEY.decode()} record; not a shardkit LMDB shard"
            )
        try:
            n = json.loads(meta)["samples"]
        except (ValueError, KeyError, TypeError):
            raise ShardFormatError(f"{self.shard}: unreadable {META_KEY.decode()} record") from None
        if type(n) is not int or n < 0:
            raise ShardFormatError(f"{self.shard}: {META_KEY.decode()} record gives {n!r} samples")
        return n

    def close(self) -> None:
        self._file.close()


class _FieldCursor:
    """Every field of samples ``start``, ``start + 1``, ... in turn (``take``), read by one
    cursor beside the samples' own: fields sort before every sample (``field_key``), in sample
    order, so a streamed read that checks each sample's digest (which covers its fields) pays
    no descent of the tree a sample, and nothing at all where the shard has no fields."""

    def __init__(self, shard: _Shard, start: int):
        self._items = shard.items(b"+%010d." % start)
        self._next = next(self._items, None)

    def take(self, index: int) -> dict[str, bytes]:
        """Sample ``index``'s fields by name (every one it has); the samples before it passed."""
        out: dict[str, bytes] = {}
        if self._next is None:  # past the last field (or a shard without any)
            return out
        prefix = b"+%010d." % index
        while self._next is not None:
            key, value = self._next
            if not key.startswith(b"+"):  # the samples: no fields after them
                self._next = None
                break
            if key.startswith(prefix):
                out[key[len(prefix) :].decode("utf-8", "surrogateescape")] = value
            elif key > prefix:
                break
            self._next = next(self._items, None)
        return out


def _picked(every: dict[str, bytes], names: Sequence[tuple[str, bytes]]) -> dict[str, bytes]:
    """The fields of ``names`` (``_names``) a sample has, of ``every`` one it has."""
    return {n: every[n] for n, _ in names if n in every}


def _runs_past(prefix: bytes) -> bool:
    """Whether the key and extension of the value starting with ``prefix`` run past it."""
    _, klen, elen = VALUE_HEADER.unpack_from(prefix)
    return VALUE_HEADER.size + klen + elen > len(prefix)


def _names(fields: Sequence[str]) -> list[tuple[str, bytes]]:
    return [(f.lower(), f.lower().encode()) for f in fields]


def iter_lmdb_records(
    source: str | os.PathLike,
    *,
    shard: str = "",
    start: int = 0,
    stop: int | None = None,
    index: Sequence[int] = (),
    fields: Sequence[str] = (),
    digests: np.ndarray | None = None,
) -> Iterator[Record]:
    """Yield samples ``[start, stop)``; jumps straight to ``start`` through the B-tree, so it
    needs no offset ``index`` (accepted for a uniform reader signature). ``fields``: extra
    fields to carry in ``Record.fields`` (one lookup each: they sit apart from the samples).
    ``digests``: each sample's digest from the shard's index record (``LmdbIndex.digests``),
    for a slice of a read of part of the dataset (a split, a subset): each sample is checked
    against it (``_Shard.verify``, its fields read by a second cursor) before it is handed
    out. None: a whole-shard epoch, which the shard's sha256 (``verify``) vouches for."""
    names = _names(fields)
    reader = _Shard(source, shard)
    shard = reader.shard
    at = start
    sums = cursor = None
    try:
        total = reader.count()
        end = total if stop is None else min(stop, total)
        if stop is not None and stop > total:
            raise ShardFormatError(
                f"{shard}: asked for samples up to {stop} but the shard holds {total}"
            )
        items = reader.items(sample_key(at)) if at < end else iter(())
        if digests is not None and at < end:
            sums, cursor = digests[start:end].tolist(), _FieldCursor(reader, start)
        for key, value in items:
            if key != sample_key(at):
                break
            if cursor is not None:
                every = cursor.take(at)
                reader.verify(at, value, every, sums[at - start])
                extra = _picked(every, names) if names else None
            else:
                extra = reader.fields(at, names) if names else None
            reader.check(at, after_reads=True)  # the bytes read are the opened file's
            rec = decode_value(value, shard, at)
            rec.fields = extra
            yield rec
            at += 1
            if at == end:
                break
        if at < end:
            reader.check(at)
            raise ShardFormatError(f"{shard}: sample {at} is missing; re-pack the shard")
    except (Damaged, OSError, struct.error) as exc:
        raise reader.error(exc, at) from None
    finally:
        reader.close()


def count_lmdb_samples(source: str | os.PathLike, *, shard: str = "") -> int:
    reader = _Shard(source, shard)
    try:
        return reader.count()
    except (Damaged, OSError, struct.error) as exc:
        raise reader.error(exc) from None
    finally:
        reader.close()


class LmdbSampleReader:
    """Random access to one LMDB shard: ``get(i)`` is one B-tree descent on a descriptor opened
    (and structure-checked) once. ``stamp`` is the file's identity (device, inode, size, mtime)
    when it was opened, for a caller that indexed it earlier. ``walk=False``: the structure is
    checked when a sample is first read, not before ``index()``. ``walk=None``: never walked,
    for a reader that looks up a few samples of a large shard (a subset's, a split's): the walk
    reads every page, O(shard), while each lookup already checks every page it reads (header,
    bounds, depth; a value's overflow header in the same read). ``close()`` closes it."""

    def __init__(self, path: str | os.PathLike, shard: str = "", *, walk: bool | None = True):
        self._reader = _Shard(path, shard, bool(walk))
        self._walk = walk is not None
        self.shard, self.stamp = self._reader.shard, self._reader.stamp
        try:
            self.samples = self._reader.count()
        except (Damaged, OSError, struct.error) as exc:
            self.close()
            raise self._reader.error(exc) from None
        except BaseException:
            self.close()
            raise

    def get(
        self, index: int, fields: Sequence[str] | None = (), digest: int | None = None
    ) -> Record:
        """Sample ``index``, with the ``fields`` it has in ``Record.fields`` (if any asked;
        ``None``: every field it has). ``digest``: the index record's digest of the sample
        (``lmdb_digest``), checked before the sample is handed out (its fields are read whole
        for it: the digest covers them), a ``ShardFormatError`` naming it where it differs."""
        if self._walk:
            self._reader.walk()
        try:
            value = self._reader.get(sample_key(index))
            extra = None
            if value is not None and digest is not None:
                every = self._reader.fields(index, None)
                self._reader.verify(index, value, every, digest)
                if fields is None:
                    extra = every
                elif fields:
                    extra = _picked(every, _names(fields))
            elif value is not None and (fields is None or fields):
                extra = self._reader.fields(index, None if fields is None else _names(fields))
        except (Damaged, OSError, struct.error) as exc:
            raise self._reader.error(exc, index) from None
        self._reader.check(index, after_reads=True)
        if value is None:
            raise ShardFormatError(f"{self.shard}: sample {index} is missing; re-pack the shard")
        rec = decode_value(value, self.shard, index)
        rec.fields = extra
        return rec

    def index(self, samples: int = -1, strict: bool = False) -> LmdbIndex | None:
        """The shard's index record (every key and split hash: one lookup), checked against
        the meta record's count and ``samples`` (the manifest's; -1: none). None where the
        shard has none (packed before it existed); where it does not check out, a warning names
        it and None (``strict``: the ``LmdbIndexError``), so the caller reads the keys instead.
        A shard whose count is not the manifest's is a ``ShardFormatError``."""
        try:
            data = self._reader.get(INDEX_KEY)
        except (Damaged, OSError, struct.error) as exc:
            raise self._reader.error(exc) from None
        self._reader.check(after_reads=True)
        if samples >= 0 and samples != self.samples:
            raise ShardFormatError(
                f"{self.shard}: holds {self.samples} samples, its manifest says {samples}; "
                "the manifest belongs to another version of the shard: re-pack it"
            )
        if data is None:
            return None
        try:
            return decode_lmdb_index(data, self.shard, self.samples)
        except LmdbIndexError as exc:
            if strict:
                raise
            warnings.warn(f"{exc}; reading each sample's key instead", RuntimeWarning, 2)
            return None

    def index_front(self, samples: int) -> bytes:
        """The first ``lmdb_columns_size(samples)`` bytes of the index record (its head, split
        hashes and digests, not its key table: what a split reads), unchecked: the caller
        checks them against the manifest's ``columns_sha256`` (``vouched_lmdb_hashes``). b""
        where the shard has no record; a shard whose count is not ``samples`` (the
        manifest's) is a ``ShardFormatError``, as in ``index()``."""
        try:
            data = self._reader.get(INDEX_KEY, lmdb_columns_size(samples))
        except (Damaged, OSError, struct.error) as exc:
            raise self._reader.error(exc) from None
        self._reader.check(after_reads=True)
        if samples != self.samples:
            raise ShardFormatError(
                f"{self.shard}: holds {self.samples} samples, its manifest says {samples}; "
                "the manifest belongs to another version of the shard: re-pack it"
            )
        return data or b""

    def keys(self) -> list[str]:
        """Every sample's key, in order (reads the start of each value; ``index()`` is one
        read)."""
        self._reader.walk()
        out: list[str] = []
        try:
            for key, value in self._reader.items(sample_key(0), _KEY_PREFIX):
                if len(out) == self.samples or key != sample_key(len(out)):
                    break
                if len(value) == _KEY_PREFIX and _runs_past(value):  # a long key
                    value = self._reader.get(key)
                out.append(decode_value(value, self.shard, len(out)).key)
        except (Damaged, OSError, struct.error) as exc:
            raise self._reader.error(exc, len(out)) from None
        self._reader.check()
        if len(out) < self.samples:
            raise ShardFormatError(f"{self.shard}: sample {len(out)} is missing; re-pack the shard")
        return out

    def close(self) -> None:
        self._reader.close()


def read_lmdb_index(
    path: str | os.PathLike, shard: str = "", samples: int = -1
) -> tuple[LmdbIndex | None, tuple]:
    """``LmdbSampleReader.index()`` of the shard at ``path``, with the file's identity when it
    was read; the tree is not walked (O(1) reads per shard)."""
    reader = LmdbSampleReader(path, shard, walk=False)
    try:
        return reader.index(samples), reader.stamp
    finally:
        reader.close()


def lmdb_index_front(path: str | os.PathLike, shard: str, samples: int) -> bytes:
    """``LmdbSampleReader.index_front(samples)`` of the shard at ``path`` (the tree not
    walked: a few pages read, each checked as it is read)."""
    reader = LmdbSampleReader(path, shard, walk=False)
    try:
        return reader.index_front(samples)
    finally:
        reader.close()


def lmdb_keys(path: str | os.PathLike, shard: str = "") -> list[str]:
    """Every key of the shard at ``path``, in order: from its index record where it has one
    (one lookup), else from the start of every value."""
    reader = LmdbSampleReader(path, shard, walk=False)
    try:
        index = reader.index()
        return reader.keys() if index is None else index.keys()
    finally:
        reader.close()
