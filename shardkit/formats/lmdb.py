"""LMDB shards: one single-file LMDB per shard, writer and reader side by side.

Why LMDB beside tar: it gives random access by index (a B-tree keyed by zero-padded sample
number) while staying one file that reads sequentially, and readers need no lock file. Values are
a fixed little-endian header plus key, extension and bytes (FORMAT.md), never pickle.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import lmdb

from ..errors import ShardFormatError
from ..fsutil import open_regular
from ..records import Record, ShardInfo, ShardStats
from .base import ShardFormat

__all__ = [
    "LmdbFormat",
    "LmdbShardWriter",
    "count_lmdb_samples",
    "iter_lmdb_records",
    "LmdbSampleReader",
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

    def projected_size(self, klen: int, elen: int, nbytes: int, extra=()) -> int:
        """``klen``/``elen``: bytes of the key and the extension (UTF-8); ``extra``: ``(name
        bytes, value bytes)`` of each extra field."""
        stored = _stored_size(_value_len(klen, elen, nbytes))
        stored += sum(_stored_size(v + n + 2) for n, v in extra)
        return self._estimate + stored + (self._commits + 2) * 4 * PAGE

    def add(self, klen: int, elen: int, nbytes: int, extra=()) -> None:
        value_len = _value_len(klen, elen, nbytes)
        self._pending_bytes += value_len
        self._estimate += _stored_size(value_len)
        for n, v in extra:  # as LmdbShardWriter.add counts each field
            self._pending_bytes += v
            self._estimate += _stored_size(v + n + 2)
        self.samples += 1
        if self._pending_bytes >= _COMMIT_BYTES:
            self._pending_bytes = 0
            self._commits += 1


class LmdbShardWriter:
    """Writes samples under sequential keys with append=True; grows the map instead of failing."""

    def __init__(self, path: str, map_size: int = 64 << 20):
        self.path = path
        self.samples = 0
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
        value_len = _value_len(len(key.encode()), len(ext), nbytes)
        commits = self._commits + 2  # this batch and the meta record's
        fields = sum(_stored_size(len(v) + len(n) + 2) for n, v in extra)
        return self._estimate + _stored_size(value_len) + fields + commits * 4 * PAGE

    def add(
        self, key: str, ext: str, data: bytes, label: int, extra: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        """The sample under ``sample_key(i)``; extra fields under ``field_key(i, name)``."""
        value = encode_value(key, ext, data, label)
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
        self._commit([(META_KEY, meta.encode())])
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


# --- structural check before mapping ----------------------------------------------------------
#
# LMDB trusts every offset, size and page number it finds in the file: one flipped byte in a node
# pointer or an overflow size makes it read outside the page (SIGBUS past the end of the file, or
# another process's worth of garbage), and a child pointer to a page of the wrong type trips an
# assert() that aborts the process. Neither can be caught in Python, so before LMDB maps a shard we
# walk the B-tree ourselves with plain reads (bounds-checked, never mapped) and refuse any page
# LMDB could not follow safely. Layout constants are LMDB 0.9's (mdb.c), which FORMAT.md pins.

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


class _Walker:
    """Visits every branch, leaf and overflow page of the tree, counting them as it goes."""

    def __init__(self, fd: int, psize: int, last_pgno: int):
        self.fd, self.psize, self.last = fd, psize, last_pgno
        self.seen = [0, 0, 0, 0]  # branch pages, leaf pages, overflow pages, entries

    def page(self, pgno: int, want: int) -> tuple[bytes, tuple[int, ...]]:
        """The page's bytes and node offsets, after checking its header."""
        if not 2 <= pgno <= self.last:
            raise _Damaged(f"page number {pgno} outside 2..{self.last}")
        raw = os.pread(self.fd, self.psize, pgno * self.psize)
        got, _, flags, lower, upper = _PAGE_HDR.unpack_from(raw)
        if got != pgno or flags != want:
            raise _Damaged(f"page {pgno} says it is page {got} with flags {flags:#x}")
        if not (_HDR < lower <= upper <= self.psize) or lower % 2:
            raise _Damaged(f"page {pgno} has bounds {lower}..{upper}")
        ptrs = struct.unpack_from(f"<{(lower - _HDR) // 2}H", raw, _HDR)
        if any(not upper <= p <= self.psize - _NODE_HDR for p in ptrs):
            raise _Damaged(f"page {pgno} has a node outside its free space")
        return raw, ptrs

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


def _open_env(path: str | os.PathLike, shard: str = "") -> lmdb.Environment:
    """Open read-only, after checking every page LMDB could touch lies inside the file.

    LMDB maps the file and trusts it: touching a page past the end of a truncated copy, or
    following a damaged offset, kills the process with SIGBUS (a DataLoader worker dies without a
    word) or aborts it; so the file is walked first (``_check_structure``) and refused with a
    ``ShardFormatError`` naming the shard.
    """
    path = os.fspath(path)
    shard = shard or path
    try:
        f = open_regular(path, buffering=0)  # lmdb.open of a FIFO would block forever
    except FileNotFoundError:
        raise ShardFormatError(
            f"{shard}: LMDB shard not found (expected a single-file LMDB)"
        ) from None
    except OSError as exc:
        raise ShardFormatError(f"{shard}: cannot open LMDB shard ({exc.strerror})") from None
    with f:
        fd = f.fileno()
        st = os.fstat(fd)
        if st.st_size < 2 * PAGE:
            raise ShardFormatError(
                f"{shard}: truncated LMDB shard ({st.st_size} bytes); re-copy or re-pack it"
            )
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        expect = None
        if stamp not in _checked:
            try:
                expect = _check_structure(fd, st.st_size)
            except (_Damaged, OSError, struct.error) as exc:
                what = exc.args[1] if len(exc.args) > 1 else "damaged"
                raise ShardFormatError(
                    f"{shard}: {what} LMDB shard ({exc.args[0]}); re-copy it, or re-pack it "
                    "from the source images"
                ) from None
    try:
        env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_readers=1, max_dbs=0)
    except lmdb.Error as exc:
        raise ShardFormatError(f"{shard}: not a readable LMDB shard ({exc}); re-pack it") from None
    if expect is not None:
        info, stat = env.info(), env.stat()
        txnid, last_pgno, psize, main = expect
        seen = (
            info["last_txnid"],
            info["last_pgno"],
            stat["psize"],
            stat["depth"],
            stat["entries"],
        )
        if seen != (txnid, last_pgno, psize, main[2], main[6]):
            env.close()  # LMDB picked another meta page than the one we walked: trust neither
            raise ShardFormatError(f"{shard}: damaged LMDB shard (meta pages disagree); re-pack it")
        _checked.add(stamp)
    return env


#: This process's open read-only environments, one per file, with their number of users: LMDB
#: refuses to open a file twice in one process, and a mixture (two subsets of one dataset) or a
#: view beside a stream may read the same shard from two places at once.
_shared: dict[tuple[int, int, int, int], list] = {}
_shared_pid = os.getpid()
# Re-entrant: the garbage collector may run an abandoned reader's ``_release`` inside an
# ``_acquire`` on the same thread (an allocation there collects); a plain Lock deadlocked.
_shared_lock = threading.RLock()


def _acquire(path: str | os.PathLike, shard: str = "") -> lmdb.Environment:
    """``_open_env``, shared with the other readers of the same file in this process."""
    global _shared_pid
    try:
        st = os.stat(path)
    except OSError:
        return _open_env(path, shard)  # it names the problem (missing, unreadable)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _shared_lock:
        if os.getpid() != _shared_pid:  # forked: the parent's environments are not ours to use
            _shared.clear()
            _shared_pid = os.getpid()
        entry = _shared.get(key)
        if entry is None:
            entry = _shared[key] = [_open_env(path, shard), 0]
        entry[1] += 1
        return entry[0]


def _release(env: lmdb.Environment) -> None:
    """One user fewer; the last closes the environment."""
    with _shared_lock:
        for key, entry in list(_shared.items()):  # a nested release may change the dict
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] == 0:
                    del _shared[key]
                    env.close()
                return
    env.close()  # opened before a fork, or not shared: ours alone


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
    shard = shard or os.fspath(source)
    names = [(f.lower(), f.lower().encode()) for f in fields]
    env = _acquire(source, shard)
    index = start
    try:
        with env.begin(buffers=False) as txn:
            total = _count(txn, shard)
            end = total if stop is None else min(stop, total)
            if stop is not None and stop > total:
                raise ShardFormatError(
                    f"{shard}: asked for samples up to {stop} but the shard holds {total}"
                )
            cursor = txn.cursor()
            if index < end and not cursor.set_key(sample_key(index)):
                raise ShardFormatError(f"{shard}: sample {index} is missing; re-pack the shard")
            while index < end:
                k, v = cursor.item()
                if k != sample_key(index):
                    raise ShardFormatError(f"{shard}: sample {index} is missing; re-pack the shard")
                rec = decode_value(v, shard, index)
                if names:
                    rec.fields = _fields(txn, index, names)
                yield rec
                index += 1
                cursor.next()
    except lmdb.Error as exc:
        raise ShardFormatError(
            f"{shard}: sample {index} unreadable, the LMDB shard is damaged ({exc}); re-copy "
            "or re-pack it"
        ) from None
    finally:
        _release(env)


def _fields(txn: lmdb.Transaction, index: int, names) -> dict[str, bytes]:
    """The fields of sample ``index`` that it has, by name."""
    out = {}
    for name, raw in names:
        value = txn.get(b"+%010d.%s" % (index, raw))
        if value is not None:
            out[name] = value
    return out


def _count(txn: lmdb.Transaction, shard: str) -> int:
    meta = txn.get(META_KEY)
    if meta is None:
        raise ShardFormatError(f"{shard}: no {META_KEY.decode()} record; not a shardkit LMDB shard")
    try:
        n = json.loads(meta)["samples"]
    except (ValueError, KeyError, TypeError):
        raise ShardFormatError(f"{shard}: unreadable {META_KEY.decode()} record") from None
    if type(n) is not int or n < 0:
        raise ShardFormatError(f"{shard}: {META_KEY.decode()} record gives {n!r} samples")
    return n


def count_lmdb_samples(source: str | os.PathLike, *, shard: str = "") -> int:
    shard = shard or os.fspath(source)
    env = _acquire(source, shard)
    try:
        with env.begin() as txn:
            return _count(txn, shard)
    except lmdb.Error as exc:
        raise ShardFormatError(
            f"{shard}: damaged LMDB shard ({exc}); re-copy or re-pack it"
        ) from None
    finally:
        _release(env)


class LmdbSampleReader:
    """Random access to one LMDB shard: ``get(i)`` is one B-tree lookup on an environment
    opened (and structure-checked) once. ``close()`` releases it."""

    def __init__(self, path: str | os.PathLike, shard: str = ""):
        self.shard = shard or os.fspath(path)
        self.env = _acquire(path, self.shard)
        try:
            with self.env.begin() as txn:
                self.samples = _count(txn, self.shard)
        except BaseException:
            _release(self.env)
            raise

    def get(self, index: int, fields: Sequence[str] = ()) -> Record:
        """Sample ``index``, with the ``fields`` it has in ``Record.fields`` (if any asked)."""
        names = [(f.lower(), f.lower().encode()) for f in fields]
        try:
            with self.env.begin(buffers=False) as txn:
                value = txn.get(sample_key(index))
                extra = _fields(txn, index, names) if names and value is not None else None
        except lmdb.Error as exc:
            raise ShardFormatError(
                f"{self.shard}: sample {index} unreadable, the LMDB shard is damaged ({exc}); "
                "re-copy or re-pack it"
            ) from None
        if value is None:
            raise ShardFormatError(f"{self.shard}: sample {index} is missing; re-pack the shard")
        rec = decode_value(value, self.shard, index)
        rec.fields = extra
        return rec

    def keys(self) -> list[str]:
        """Every sample's key, in order (reads each value's header)."""
        return [self.get(i).key for i in range(self.samples)]

    def close(self) -> None:
        if self.env is not None:
            _release(self.env)
            self.env = None


class LmdbFormat(ShardFormat):
    """LMDB shards as a ``ShardFormat``: the reader maps a whole file, so a shard is reached
    through ``storage.local_path()``."""

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
