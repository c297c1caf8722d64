"""LMDB shards: one single-file LMDB per shard, writer and reader side by side.

Why LMDB beside tar: it gives random access by index (a B-tree keyed by zero-padded sample
number) while staying one file that reads sequentially, and readers need no lock file. Values are
a fixed little-endian header plus key, extension and bytes (FORMAT.md), never pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator, Sequence

import lmdb

from ..errors import ShardFormatError
from ..records import Record, ShardStats

__all__ = ["LmdbShardWriter", "iter_lmdb_records", "count_lmdb_samples", "sample_key"]

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
    key = value[body : body + klen].decode("utf-8", "surrogateescape")
    ext = value[body + klen : body + klen + elen].decode("ascii")
    return Record(key, ext, value[body + klen + elen :], label, shard)


def _stored_size(value_len: int) -> int:
    """Pessimistic on-disk cost of one record: overflow pages for large values, leaf space else."""
    node = 8 + 10 + value_len  # node header + key + value
    if node > PAGE // 2 - 16:  # LMDB moves values this large to their own overflow pages
        return (value_len + 16 + PAGE - 1) // PAGE * PAGE + 32
    return node * 2 + 2  # inline: leaf pages may be half full after splits


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
        value_len = _VALUE_HEADER.size + len(key.encode()) + len(ext) + nbytes
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
                with env.begin(write=True) as txn:
                    for k, v in items:
                        # samples append (sorted, fastest); meta and fields sort elsewhere
                        txn.put(k, v, append=k[:1].isdigit())
                break
            except lmdb.MapFullError:
                env.set_mapsize(env.info()["map_size"] * 2)
        self._pending, self._pending_bytes = [], 0
        self._commits += 1

    def close(self) -> ShardStats:
        meta = json.dumps({"format": "shardkit-lmdb", "version": 1, "samples": self.samples})
        self._commit([(META_KEY, meta.encode())])
        env, self._env = self._env, None
        assert env is not None
        env.sync(True)
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


def _remove(path: str) -> None:
    for p in (path, path + "-lock"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _open_env(path: str | os.PathLike) -> lmdb.Environment:
    """Open read-only, refusing a file shorter than its own meta page says.

    LMDB maps the file: touching a page past the end of a truncated copy kills the process with
    SIGBUS (a DataLoader worker would die without a word), so the size is checked first.
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except OSError:
        raise ShardFormatError(
            f"{path}: LMDB shard not found (expected a single-file LMDB)"
        ) from None
    if size < 2 * PAGE:
        raise ShardFormatError(
            f"{path}: truncated LMDB shard ({size} bytes); re-copy or re-pack it"
        )
    try:
        env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_readers=1, max_dbs=0)
    except lmdb.Error as exc:
        raise ShardFormatError(f"{path}: not a readable LMDB shard ({exc}); re-pack it") from None
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    if size < needed:
        env.close()
        raise ShardFormatError(
            f"{path}: truncated LMDB shard ({size} of {needed} bytes); re-copy or re-pack it"
        )
    return env


def iter_lmdb_records(
    source: str | os.PathLike,
    *,
    shard: str = "",
    start: int = 0,
    stop: int | None = None,
    index: Sequence[int] = (),
) -> Iterator[Record]:
    """Yield samples ``[start, stop)``; jumps straight to ``start`` through the B-tree, so it
    needs no offset ``index`` (accepted for a uniform reader signature)."""
    shard = shard or os.fspath(source)
    env = _open_env(source)
    try:
        with env.begin(buffers=False) as txn:
            total = _count(txn, shard)
            end = total if stop is None else min(stop, total)
            if stop is not None and stop > total:
                raise ShardFormatError(
                    f"{shard}: asked for samples up to {stop} but the shard holds {total}"
                )
            cursor = txn.cursor()
            index = start
            if index < end and not cursor.set_key(sample_key(index)):
                raise ShardFormatError(f"{shard}: sample {index} is missing; re-pack the shard")
            while index < end:
                k, v = cursor.item()
                if k != sample_key(index):
                    raise ShardFormatError(f"{shard}: sample {index} is missing; re-pack the shard")
                yield decode_value(v, shard, index)
                index += 1
                cursor.next()
    finally:
        env.close()


def _count(txn: lmdb.Transaction, shard: str) -> int:
    meta = txn.get(META_KEY)
    if meta is None:
        raise ShardFormatError(f"{shard}: no {META_KEY.decode()} record; not a shardkit LMDB shard")
    try:
        return int(json.loads(meta)["samples"])
    except (ValueError, KeyError, TypeError):
        raise ShardFormatError(f"{shard}: unreadable {META_KEY.decode()} record") from None


def count_lmdb_samples(source: str | os.PathLike, *, shard: str = "") -> int:
    env = _open_env(source)
    try:
        with env.begin() as txn:
            return _count(txn, shard or os.fspath(source))
    finally:
        env.close()
