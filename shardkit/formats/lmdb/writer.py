"""Writing LMDB shards, and the value layout their samples are stored in.

The ``lmdb`` library writes a shard: one single-file LMDB, each sample under its zero-padded
number (``sample_key``), extra fields beside it (``field_key``), the ``__shardkit__`` record
(``META_KEY``: the sample count) and the index record (``index``) last. A value is a fixed
little-endian header plus key, extension and bytes (``encode_value``; FORMAT.md), never pickle.
``LmdbSizer`` projects a shard's size so the packer rolls shards before they pass their budget.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
from collections.abc import Iterator, Sequence

import lmdb

from ...errors import ShardFormatError
from ...records import Record, ShardStats
from .index import INDEX_KEY, encode_lmdb_index, lmdb_columns_sha256, lmdb_digest
from .index import index_record_size as _index_size

__all__ = [
    "META_KEY",
    "PAGE",
    "VALUE_HEADER",
    "LmdbShardWriter",
    "LmdbSizer",
    "decode_value",
    "encode_value",
    "field_key",
    "sample_key",
]

#: label (int32), key length (uint16), extension length (uint8)
VALUE_HEADER = struct.Struct("<iHB")
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
    return VALUE_HEADER.pack(label, len(kb), len(eb)) + kb + eb + data


def decode_value(value: bytes, shard: str, index: int) -> Record:
    if len(value) < VALUE_HEADER.size:
        raise ShardFormatError(
            f"{shard}: record {index} is {len(value)} bytes, shorter than its header"
        )
    label, klen, elen = VALUE_HEADER.unpack_from(value)
    body = VALUE_HEADER.size
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
    """On-disk cost of the index record (``index``) of ``samples`` keys."""
    return _stored_size(_index_size(samples, key_bytes))


def _value_len(klen: int, elen: int, nbytes: int) -> int:
    """Length of ``encode_value(key, ext, data, label)``: key, ext and data of these sizes."""
    return VALUE_HEADER.size + klen + elen + nbytes


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
        self._digests: list[int] = []  # and each sample's digest (value and fields)
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
        self._digests.append(lmdb_digest(value, extra))
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
        index = encode_lmdb_index(self._keys, self._digests)
        columns = lmdb_columns_sha256(index)  # the manifest vouches for the split hashes
        self._commit([(META_KEY, meta.encode()), (INDEX_KEY, index)])
        self._keys, self._digests = [], []
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
        return ShardStats(self.path, self.samples, size, digest.hexdigest(), columns_sha256=columns)

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
