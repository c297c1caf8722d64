"""LMDB shards: one single-file LMDB per shard, writer and reader side by side.

Why LMDB beside tar: it gives random access by index (a B-tree keyed by zero-padded sample
number) while staying one file that reads sequentially, and readers need no lock file. Values are
a fixed little-endian header plus key, extension and bytes (FORMAT.md), never pickle. The
``lmdb`` library writes shards; shardkit reads them with plain reads of the B-tree (below), never
through a mapping, so a shard truncated or rewritten under a reader is an error, not a signal.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import hashlib
import json
import os
import struct
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import lmdb

from ..errors import ShardFormatError
from ..fsutil import open_regular
from ..records import Record, ShardInfo, ShardStats
from .base import ShardFormat
from .lmdb_index import (
    INDEX_KEY,
    LmdbIndex,
    LmdbIndexError,
    decode_lmdb_index,
    encode_lmdb_index,
)
from .lmdb_index import index_record_size as _index_size

__all__ = [
    "LmdbFormat",
    "LmdbShardWriter",
    "count_lmdb_samples",
    "file_stamp",
    "iter_lmdb_records",
    "lmdb_keys",
    "LmdbSampleReader",
    "read_lmdb_index",
    "sample_key",
]

#: label (int32), key length (uint16), extension length (uint8)
_VALUE_HEADER = struct.Struct("<iHB")
#: Sorts after every sample key (digits), so sequential cursors over samples never meet it.
META_KEY = b"__shardkit__"
PAGE = 4096
_FIXED_PAGES = 8  # two meta pages, roots, and slack for the last partial leaf/branch pages
_COMMIT_BYTES = 32 << 20  # fewer commits -> fewer copy-on-write pages left on the free list


def sample_key(index: int) -> bytes:
    """The LMDB key of sample ``index``: ten ASCII digits, so byte order equals sample order."""
    return b"%010d" % index


def field_key(index: int, name: str) -> bytes:
    """Key of extra field ``name`` of sample ``index``: ``+0000000042.json``.

    ``+`` sorts before the digits, so fields never sit between two samples (a cursor reads the
    samples back to back) and sample keys can still be appended.
    """
    return b"+%010d.%s" % (index, name.encode())


def encode_value(key: str, ext: str, data: bytes, label: int) -> bytes:
    kb, eb = key.encode(), ext.encode()
    return _VALUE_HEADER.pack(label, len(kb), len(eb)) + kb + eb + data


def decode_value(value: bytes, shard: str, index: int) -> Record:
    if len(value) < _VALUE_HEADER.size:
        raise ShardFormatError(
            f"{shard}: record {index} is {len(value)} bytes, shorter than its header"
        )
    label, klen, elen = _VALUE_HEADER.unpack_from(value)
    body = _VALUE_HEADER.size
    if body + klen + elen > len(value):
        raise ShardFormatError(f"{shard}: record {index} is shorter than its header says")
    key = value[body : body + klen].decode("utf-8", "surrogateescape")
    try:
        ext = value[body + klen : body + klen + elen].decode("ascii")
    except UnicodeDecodeError:
        raise ShardFormatError(
            f"{shard}: record {index} ({key!r}) has a non-ASCII extension; the shard is damaged"
        ) from None
    return Record(key, ext, value[body + klen + elen :], label, shard)


def _stored_size(value_len: int) -> int:
    """Pessimistic on-disk cost of one record: overflow pages for large values, leaf space else."""
    node = 8 + 10 + value_len  # node header + key + value
    if node > PAGE // 2 - 16:  # LMDB moves values this large to their own overflow pages
        return (value_len + 16 + PAGE - 1) // PAGE * PAGE + 32
    return node * 2 + 2  # inline: leaf pages may be half full after splits


def _index_stored(samples: int, key_bytes: int) -> int:
    """On-disk cost of the index record (``lmdb_index``) of ``samples`` keys."""
    return _stored_size(_index_size(samples, key_bytes))


def _value_len(klen: int, elen: int, nbytes: int) -> int:
    """Length of ``encode_value(key, ext, data, label)``: key, ext and data of these sizes."""
    return _VALUE_HEADER.size + klen + elen + nbytes


class LmdbSizer:
    """An LMDB shard's projected size as samples are added, from their sizes alone: the same
    estimate and commit count as ``LmdbShardWriter`` keeps (a pack is planned with it)."""

    def __init__(self):
        self.samples = 0
        self._estimate = _FIXED_PAGES * PAGE
        self._pending_bytes = 0
        self._commits = 0
        self._key_bytes = 0

    def projected_size(self, klen: int, elen: int, nbytes: int, extra=()) -> int:
        """``klen``/``elen``: bytes of the key and the extension (UTF-8); ``extra``: ``(name
        bytes, value bytes)`` of each extra field."""
        stored = _stored_size(_value_len(klen, elen, nbytes))
        stored += sum(_stored_size(v + n + 2) for n, v in extra)
        index = _index_stored(self.samples + 1, self._key_bytes + klen)
        return self._estimate + stored + index + (self._commits + 2) * 4 * PAGE

    def add(self, klen: int, elen: int, nbytes: int, extra=()) -> None:
        value_len = _value_len(klen, elen, nbytes)
        self._pending_bytes += value_len
        self._estimate += _stored_size(value_len)
        for n, v in extra:  # as LmdbShardWriter.add counts each field
            self._pending_bytes += v
            self._estimate += _stored_size(v + n + 2)
        self.samples += 1
        self._key_bytes += klen
        if self._pending_bytes >= _COMMIT_BYTES:
            self._pending_bytes = 0
            self._commits += 1


class LmdbShardWriter:
    """Writes samples under sequential keys with append=True; grows the map instead of failing.
    ``close()`` adds the meta record and the index record (every key, for readers that need
    keys without reading each sample)."""

    def __init__(self, path: str, map_size: int = 64 << 20):
        self.path = path
        self.samples = 0
        self._keys: list[bytes] = []  # one shard's keys: what the index record holds
        self._key_bytes = 0
        self._estimate = _FIXED_PAGES * PAGE
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._commits = 0
        _remove(path)  # like open("wb"): a fresh shard, never records appended to an old one
        with _as_os_error(path):
            self._env: lmdb.Environment | None = lmdb.open(
                path,
                subdir=False,
                map_size=map_size,
                lock=False,
                sync=False,
                metasync=False,
                readahead=False,
                meminit=True,  # zero unused page space: same input, same bytes
                max_dbs=0,
            )

    def projected_size(
        self, key: str, ext: str, nbytes: int, extra: Sequence[tuple[str, bytes]] = ()
    ) -> int:
        klen = len(key.encode())
        value_len = _value_len(klen, len(ext), nbytes)
        commits = self._commits + 2  # this batch and the meta record's
        fields = sum(_stored_size(len(v) + len(n) + 2) for n, v in extra)
        index = _index_stored(self.samples + 1, self._key_bytes + klen)
        return self._estimate + _stored_size(value_len) + fields + index + commits * 4 * PAGE

    def add(
        self, key: str, ext: str, data: bytes, label: int, extra: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        """The sample under ``sample_key(i)``; extra fields under ``field_key(i, name)``."""
        value = encode_value(key, ext, data, label)
        kb = key.encode()
        self._keys.append(kb)
        self._key_bytes += len(kb)
        self._pending.append((sample_key(self.samples), value))
        self._pending_bytes += len(value)
        self._estimate += _stored_size(len(value))
        for name, field in extra:
            self._pending.append((field_key(self.samples, name), field))
            self._pending_bytes += len(field)
            self._estimate += _stored_size(len(field) + len(name) + 2)
        self.samples += 1
        if self._pending_bytes >= _COMMIT_BYTES:
            self._commit()

    def _commit(self, extra: list[tuple[bytes, bytes]] = ()) -> None:
        items = self._pending + list(extra)
        env = self._env
        assert env is not None, "writer is closed"
        while True:
            try:
                with _as_os_error(self.path), env.begin(write=True) as txn:
                    for k, v in items:
                        # samples append (sorted, fastest); meta and fields sort elsewhere
                        txn.put(k, v, append=k[:1].isdigit())
                break
            except lmdb.MapFullError:
                with _as_os_error(self.path):
                    env.set_mapsize(env.info()["map_size"] * 2)
        self._pending, self._pending_bytes = [], 0
        self._commits += 1

    def close(self) -> ShardStats:
        meta = json.dumps({"format": "shardkit-lmdb", "version": 1, "samples": self.samples})
        self._commit([(META_KEY, meta.encode()), (INDEX_KEY, encode_lmdb_index(self._keys))])
        self._keys = []
        env, self._env = self._env, None
        assert env is not None
        try:
            with _as_os_error(self.path):
                env.sync(True)
        finally:
            env.close()
        digest = hashlib.sha256()
        size = 0
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
        return ShardStats(self.path, self.samples, size, digest.hexdigest())

    def abort(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
        _remove(self.path)


@contextlib.contextmanager
def _as_os_error(path: str) -> Iterator[None]:
    """An ``lmdb.Error`` of a write (disk full, I/O error) as the ``OSError`` writers handle.

    LMDB reports a short ``pwrite`` on a full disk as EIO, so the writer's message also says
    how much room is left (``fsutil.write_error``). ``MapFullError`` passes: the map grows.
    """
    try:
        yield
    except lmdb.MapFullError:
        raise
    except lmdb.Error as exc:
        text = str(exc)
        code = next(
            (c for c in (errno.ENOSPC, errno.EDQUOT, errno.EIO) if os.strerror(c) in text), None
        )
        raise OSError(code, f"LMDB: {text}", path) from None


def _remove(path: str) -> None:
    for p in (path, path + "-lock"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


# --- structural check before reading ----------------------------------------------------------
#
# An LMDB file holds offsets, sizes and page numbers: one flipped byte in a node pointer or an
# overflow size points outside the page or the file (LMDB's own reader would SIGBUS or abort
# there). Before a shard is read, its B-tree is walked with plain reads (bounds-checked) and any
# page that cannot be followed safely is refused, once per file identity; the reader below checks
# each page it reads again. Layout constants are LMDB 0.9's (mdb.c), which FORMAT.md pins.

_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize (at page offset 16)
_DB = struct.Struct(
    "<IHHQQQQQ"
)  # pad (psize for the free DB), flags, depth, branch/leaf/ovf, entries, root
_PAGE_HDR = struct.Struct(
    "<QHHHH"
)  # pgno, pad, flags, lower, upper (upper/lower = pages on overflow)
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_HDR, _NODE_HDR = 16, 8
_MAGIC, _DATA_VERSION = 0xBEEFC0DE, 1
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA = 0x01
_MAX_DEPTH = 32  # 2^32 samples at the smallest fan-out; anything deeper is damage
#: (dev, inode, size, mtime_ns) of files this process already walked: a worker re-opens its shard
#: for every slice, and the walk costs one read per page.
_checked: set[tuple[int, int, int, int]] = set()


class _Damaged(Exception):
    """A structural fault, as text for the ShardFormatError that names the shard."""


def _read_meta(f, off: int) -> tuple[int, int, int, tuple]:
    """(txnid, last_pgno, psize, main DB record) of the meta page at ``off``."""
    raw = os.pread(f, _HDR + 136, off)
    if len(raw) < _HDR + 136:
        raise _Damaged("meta page is short")
    magic, version, _, _ = _META.unpack_from(raw, _HDR)
    if magic != _MAGIC or version != _DATA_VERSION:
        raise _Damaged("meta page has no LMDB magic number")
    free = _DB.unpack_from(raw, _HDR + _META.size)
    main = _DB.unpack_from(raw, _HDR + _META.size + _DB.size)
    last_pgno, txnid = struct.unpack_from("<QQ", raw, _HDR + _META.size + 2 * _DB.size)
    return txnid, last_pgno, free[0], main


def _pick_meta(fd: int, size: int) -> tuple[int, int, int, tuple]:
    """The meta page LMDB will use (the newer transaction), checked against the file size."""
    first = _read_meta(fd, 0)
    psize = first[2]
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise _Damaged(f"meta page gives page size {psize}")
    second = _read_meta(fd, psize)
    if second[2] != psize:
        raise _Damaged("the two meta pages disagree on the page size")
    txnid, last_pgno, _, main = max(first, second, key=lambda m: m[0])  # LMDB: newest txn wins
    if (last_pgno + 1) * psize > size:
        raise _Damaged(f"{size} of {(last_pgno + 1) * psize} bytes", "truncated")
    if main[1] != 0:
        raise _Damaged(f"database flags {main[1]:#x}; shardkit writes none")
    return txnid, last_pgno, psize, main


def _read_page(fd: int, psize: int, last: int, pgno: int, want: int):
    """Page ``pgno``'s bytes and node offsets, after checking its header (type ``want``)."""
    if not 2 <= pgno <= last:
        raise _Damaged(f"page number {pgno} outside 2..{last}")
    raw = os.pread(fd, psize, pgno * psize)
    if len(raw) != psize:
        raise _Damaged(f"page {pgno} is {len(raw)} of {psize} bytes", "truncated")
    got, _, flags, lower, upper = _PAGE_HDR.unpack_from(raw)
    if got != pgno or flags != want:
        raise _Damaged(f"page {pgno} says it is page {got} with flags {flags:#x}")
    if not (_HDR < lower <= upper <= psize) or lower % 2:
        raise _Damaged(f"page {pgno} has bounds {lower}..{upper}")
    ptrs = struct.unpack_from(f"<{(lower - _HDR) // 2}H", raw, _HDR)
    if ptrs and (min(ptrs) < upper or max(ptrs) > psize - _NODE_HDR):
        raise _Damaged(f"page {pgno} has a node outside its free space")
    return raw, ptrs


class _Walker:
    """Visits every branch, leaf and overflow page of the tree, counting them as it goes.

    Each page is visited at most once: a tree reaches every page by one path, so a page met
    twice (branch pages of a crafted file all naming one child) is damage, and the walk is
    bounded by the file's page count instead of the fan-out to the power of the depth."""

    def __init__(self, fd: int, psize: int, last_pgno: int):
        self.fd, self.psize, self.last = fd, psize, last_pgno
        self.seen = [0, 0, 0, 0]  # branch pages, leaf pages, overflow pages, entries
        self.visited: set[int] = set()

    def page(self, pgno: int, want: int) -> tuple[bytes, tuple[int, ...]]:
        if pgno in self.visited:
            raise _Damaged(f"page {pgno} is reached twice (a tree reaches each page once)")
        self.visited.add(pgno)
        return _read_page(self.fd, self.psize, self.last, pgno, want)

    def walk(self, pgno: int, level: int) -> None:
        raw, ptrs = self.page(pgno, _P_LEAF if level == 1 else _P_BRANCH)
        self.seen[0 if level > 1 else 1] += 1
        for ptr in ptrs:
            lo, hi, nflags, ksize = _NODE.unpack_from(raw, ptr)
            end = ptr + _NODE_HDR + ksize
            if level == 1:
                self.leaf_node(raw, pgno, end, lo | hi << 16, nflags)
            elif end > self.psize:
                raise _Damaged(f"page {pgno} has a key running past the page")
            else:  # branch node: lo/hi/flags are the child's page number
                self.walk(lo | hi << 16 | nflags << 32, level - 1)

    def leaf_node(self, raw: bytes, pgno: int, end: int, dsize: int, nflags: int) -> None:
        self.seen[3] += 1
        if nflags not in (0, _F_BIGDATA):
            raise _Damaged(f"page {pgno} has node flags {nflags:#x}; shardkit writes none")
        if end + (8 if nflags else dsize) > self.psize:
            raise _Damaged(f"page {pgno} has a value running past the page")
        if not nflags:
            return
        (opg,) = struct.unpack_from("<Q", raw, end)
        pages = (_HDR - 1 + dsize) // self.psize + 1
        if not 2 <= opg <= self.last + 1 - pages:
            raise _Damaged(f"page {pgno} points to overflow pages {opg}+{pages}")
        got, _, oflags, opages = struct.unpack("<QHHI", os.pread(self.fd, _HDR, opg * self.psize))
        if got != opg or oflags != _P_OVERFLOW or opages != pages:
            raise _Damaged(f"overflow page {opg} does not match its {dsize}-byte value")
        self.seen[2] += pages


def _check_structure(fd: int, size: int) -> tuple[int, int, int, tuple]:
    """Walk the main B-tree of the meta LMDB will pick; raise _Damaged at the first unsafe field.

    Returns (txnid, last_pgno, psize, main DB record) so the caller can confirm LMDB chose the
    same meta page after opening.
    """
    txnid, last_pgno, psize, main = _pick_meta(fd, size)
    _, _, depth, n_branch, n_leaf, n_over, entries, root = main
    walker = _Walker(fd, psize, last_pgno)
    if depth == 0:
        if entries != 0 or root != 2**64 - 1:
            raise _Damaged("empty tree with entries")
    elif depth > _MAX_DEPTH:
        raise _Damaged(f"tree depth {depth}")
    else:
        walker.walk(root, depth)
    seen = walker.seen
    if seen != [n_branch, n_leaf, n_over, entries]:
        raise _Damaged(
            f"tree holds {seen[0]}/{seen[1]}/{seen[2]} branch/leaf/overflow pages and {seen[3]} "
            f"entries, the meta page says {n_branch}/{n_leaf}/{n_over} and {entries}"
        )
    return txnid, last_pgno, psize, main


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


def _key_at(raw: bytes, ptr: int, psize: int) -> bytes:
    (ksize,) = struct.unpack_from("<H", raw, ptr + 6)
    if ptr + _NODE_HDR + ksize > psize:
        raise _Damaged(f"a key at offset {ptr} runs past the page")
    return raw[ptr + _NODE_HDR : ptr + _NODE_HDR + ksize]


def _lower_bound(raw: bytes, ptrs: tuple[int, ...], key: bytes, psize: int) -> int:
    """The first node of a leaf page whose key is not below ``key``."""
    lo, hi = 0, len(ptrs)
    while lo < hi:
        mid = (lo + hi) // 2
        if _key_at(raw, ptrs[mid], psize) < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _child(raw: bytes, ptr: int) -> int:
    """The page number a branch node points to (48 bits in its lo, hi and flags fields)."""
    lo, hi, flags, _ = _NODE.unpack_from(raw, ptr)
    return lo | hi << 16 | flags << 32


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
            _, self.last, self.psize, main = _pick_meta(self.fd, st.st_size)
        except (_Damaged, OSError, struct.error) as exc:
            raise self.error(exc) from None
        self.depth, self.root = main[2], main[7]
        if walk:
            self.walk()

    def walk(self) -> None:
        """Check the whole tree once per file identity (``_check_structure``): before samples
        are read. A reader that only looks up the index record skips it: each page it reads is
        checked as it is read, and the record carries its own checksum."""
        if self.walked:
            return
        if self.stamp not in _checked:
            try:
                _check_structure(self.fd, self.stamp[2])
            except (_Damaged, OSError, struct.error) as exc:
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
        """The ``ShardFormatError`` for a fault met while reading (``_Damaged``, ``OSError``)."""
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
            raise _Damaged(f"{len(data)} of {n} bytes at offset {offset}", "truncated")
        return data

    def _page(self, pgno: int, want: int) -> tuple[bytes, tuple[int, ...]]:
        self.unchecked = True
        return _read_page(self.fd, self.psize, self.last, pgno, want)

    def _branch(self, pgno: int) -> tuple[bytes, tuple[int, ...], list[bytes]]:
        """A branch page, its node offsets and keys: kept (a few), as every lookup passes the
        same upper pages; the identity check after each read covers them too."""
        hit = self._branches.get(pgno)
        if hit is None:
            raw, ptrs = self._page(pgno, _P_BRANCH)
            if len(self._branches) >= _BRANCHES_KEPT:
                self._branches.clear()
            keys = [_key_at(raw, p, self.psize) for p in ptrs]
            hit = self._branches[pgno] = (raw, ptrs, keys)
        return hit

    def _item(self, raw: bytes, ptr: int, limit: int | None) -> tuple[bytes, bytes]:
        """A leaf node's key and value (its first ``limit`` bytes, if given)."""
        lo, hi, flags, ksize = _NODE.unpack_from(raw, ptr)
        dsize, end = lo | hi << 16, ptr + _NODE_HDR + ksize
        n = dsize if limit is None else min(dsize, limit)
        if flags == 0:
            if end + dsize > self.psize:
                raise _Damaged(f"a value at offset {ptr} runs past its page")
            return raw[ptr + _NODE_HDR : end], raw[end : end + n]
        if flags != _F_BIGDATA or end + 8 > self.psize:
            raise _Damaged(f"a node with flags {flags:#x}; shardkit writes none")
        (first,) = struct.unpack_from("<Q", raw, end)
        pages = (_HDR - 1 + dsize) // self.psize + 1
        if not 2 <= first <= self.last + 1 - pages:
            raise _Damaged(f"a value on overflow pages {first}+{pages}")
        return raw[ptr + _NODE_HDR : end], self._pread(n, first * self.psize + _HDR)

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
            pgno = _child(raw, ptrs[i])
        raw, ptrs = self._page(pgno, _P_LEAF)
        i = _lower_bound(raw, ptrs, first, self.psize)
        while True:
            for ptr in ptrs[i:]:
                yield self._item(raw, ptr, limit)
            while stack and stack[-1][2] + 1 >= len(stack[-1][1]):
                stack.pop()
            if not stack:
                return
            top = stack[-1]
            top[2] += 1
            pgno = _child(top[0], top[1][top[2]])
            while len(stack) < self.depth - 1:
                raw, ptrs, _ = self._branch(pgno)
                stack.append([raw, ptrs, 0])
                pgno = _child(raw, ptrs[0])
            raw, ptrs = self._page(pgno, _P_LEAF)
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


def _runs_past(prefix: bytes) -> bool:
    """Whether the key and extension of the value starting with ``prefix`` run past it."""
    _, klen, elen = _VALUE_HEADER.unpack_from(prefix)
    return _VALUE_HEADER.size + klen + elen > len(prefix)


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
) -> Iterator[Record]:
    """Yield samples ``[start, stop)``; jumps straight to ``start`` through the B-tree, so it
    needs no offset ``index`` (accepted for a uniform reader signature). ``fields``: extra
    fields to carry in ``Record.fields`` (one lookup each: they sit apart from the samples)."""
    names = _names(fields)
    reader = _Shard(source, shard)
    shard = reader.shard
    at = start
    try:
        total = reader.count()
        end = total if stop is None else min(stop, total)
        if stop is not None and stop > total:
            raise ShardFormatError(
                f"{shard}: asked for samples up to {stop} but the shard holds {total}"
            )
        items = reader.items(sample_key(at)) if at < end else iter(())
        for key, value in items:
            if key != sample_key(at):
                break
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
    except (_Damaged, OSError, struct.error) as exc:
        raise reader.error(exc, at) from None
    finally:
        reader.close()


def count_lmdb_samples(source: str | os.PathLike, *, shard: str = "") -> int:
    reader = _Shard(source, shard)
    try:
        return reader.count()
    except (_Damaged, OSError, struct.error) as exc:
        raise reader.error(exc) from None
    finally:
        reader.close()


class LmdbSampleReader:
    """Random access to one LMDB shard: ``get(i)`` is one B-tree descent on a descriptor opened
    (and structure-checked) once. ``stamp`` is the file's identity (device, inode, size, mtime)
    when it was opened, for a caller that indexed it earlier. ``walk=False``: the structure is
    checked when a sample is first read, not before ``index()``. ``close()`` closes it."""

    def __init__(self, path: str | os.PathLike, shard: str = "", *, walk: bool = True):
        self._reader = _Shard(path, shard, walk)
        self.shard, self.stamp = self._reader.shard, self._reader.stamp
        try:
            self.samples = self._reader.count()
        except (_Damaged, OSError, struct.error) as exc:
            self.close()
            raise self._reader.error(exc) from None
        except BaseException:
            self.close()
            raise

    def get(self, index: int, fields: Sequence[str] | None = ()) -> Record:
        """Sample ``index``, with the ``fields`` it has in ``Record.fields`` (if any asked;
        ``None``: every field it has)."""
        self._reader.walk()
        try:
            value = self._reader.get(sample_key(index))
            extra = None
            if value is not None and (fields is None or fields):
                extra = self._reader.fields(index, None if fields is None else _names(fields))
        except (_Damaged, OSError, struct.error) as exc:
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
        except (_Damaged, OSError, struct.error) as exc:
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
        except (_Damaged, OSError, struct.error) as exc:
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


def lmdb_keys(path: str | os.PathLike, shard: str = "") -> list[str]:
    """Every key of the shard at ``path``, in order: from its index record where it has one
    (one lookup), else from the start of every value."""
    reader = LmdbSampleReader(path, shard, walk=False)
    try:
        index = reader.index()
        return reader.keys() if index is None else index.keys()
    finally:
        reader.close()


class LmdbFormat(ShardFormat):
    """LMDB shards as a ``ShardFormat``: the reader reads a whole file at random offsets, so a
    shard is reached through ``storage.local_path()``."""

    name = "lmdb"
    suffix = ".lmdb"
    maps_file = True

    def open_writer(self, path: str) -> LmdbShardWriter:
        return LmdbShardWriter(path)

    def sizer(self) -> LmdbSizer:
        return LmdbSizer()

    def iter_records(
        self,
        source: Any,
        *,
        shard: str = "",
        start: int = 0,
        stop: int | None = None,
        index: Sequence[int] = (),
        fields: Sequence[str] = (),
    ) -> Iterator[Record]:
        return iter_lmdb_records(
            source, shard=shard, start=start, stop=stop, index=index, fields=fields
        )

    def records(
        self,
        storage: Any,
        shard: ShardInfo,
        start: int = 0,
        stop: int | None = None,
        fields: Sequence[str] = (),
    ) -> Iterator[Record]:
        path = storage.local_path(shard)  # now, not on the first sample: a missing file is named
        return self.iter_records(
            path, shard=shard.url, start=start, stop=stop, index=shard.index, fields=fields
        )

    def count(self, storage: Any, shard: ShardInfo) -> int:
        return count_lmdb_samples(storage.local_path(shard), shard=shard.url)
