"""The sample index of an LMDB shard: one more record inside the shard, ``__shardkit_index__``.

Splits, key subsets, ``ShardView``, ``ls`` and ``show`` need every sample's key; read from the
samples that is one page per sample (the start of each value), O(dataset) reads. This record
holds the keys (a key table and its ends) and their split hashes (``sample_index.key_hashes``,
the values of the tar index: a split is the same in either format) as fixed-width little-endian
columns, so one lookup per shard gives them and numpy views them without a per-sample object.
Version 2 adds each sample's digest (``lmdb_digest``: its value and fields), which a read of
part of the shard checks before it hands the sample out. It ends with the sha256 of everything
before it; being inside the shard, the manifest's sha256 of the shard covers it too.
FORMAT.md, "LMDB shards", specifies the bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from ...errors import ShardFormatError
from ..sample_index import KeyTable, key_hashes

__all__ = [
    "INDEX_KEY",
    "LmdbIndex",
    "LmdbIndexError",
    "decode_lmdb_index",
    "encode_lmdb_index",
    "lmdb_columns_sha256",
    "lmdb_columns_size",
    "lmdb_digest",
    "vouched_lmdb_hashes",
]

#: Sorts after the sample keys (digits) and after ``__shardkit__``: never met by a sample cursor.
INDEX_KEY = b"__shardkit_index__"
MAGIC = b"SKLMDBIX"
VERSION = 2
#: Versions read: 1 (no digests: partial reads are unchecked, and say so once).
READS = (1, 2)
#: magic, version, reserved, samples, key-table bytes.
_HEAD = struct.Struct("<8sII QQ")
_NAME = struct.Struct("<I")
_SIZE = struct.Struct("<Q")


def lmdb_digest(value: bytes, fields=()) -> int:
    """A sample's digest: XXH3-64 (seed 0) of its stored value (``encode_value``'s bytes), then
    for each of its fields in name order (the order of their LMDB keys): the name's UTF-8 length
    (uint32 LE), the name, the value's length (uint64 LE), the value. ``fields``: ``(name,
    bytes)`` pairs. A sample without fields: XXH3-64 of its value alone."""
    if not fields:
        return xxhash.xxh3_64_intdigest(value)
    h = xxhash.xxh3_64(value)
    for name, data in sorted((n.encode("utf-8", "surrogateescape"), d) for n, d in fields):
        h.update(_NAME.pack(len(name)))
        h.update(name)
        h.update(_SIZE.pack(len(data)))
        h.update(data)
    return h.intdigest()


_TRAILER = 32  # sha256 of everything before it


class LmdbIndexError(ShardFormatError):
    """An index record that is damaged or does not describe the samples of its shard."""


def index_record_size(samples: int, key_bytes: int, version: int = VERSION) -> int:
    """Bytes of the record for ``samples`` keys of ``key_bytes`` bytes in all (for the sizer)."""
    return _HEAD.size + (24 if version >= 2 else 16) * samples + key_bytes + _TRAILER


def lmdb_columns_size(samples: int, version: int = VERSION) -> int:
    """Bytes of a record's columns: its head, split hashes and (version 2) digests, the front
    the manifest's ``columns_sha256`` covers and a split reads alone (``get(limit=)``)."""
    return _HEAD.size + (16 if version >= 2 else 8) * samples


def lmdb_columns_sha256(record: bytes) -> str:
    """The manifest's ``columns_sha256`` of an index record whose bytes start ``record``: the
    sha256 of its ``lmdb_columns_size`` front, as many columns as its version has."""
    _, version, _, n, _ = _HEAD.unpack_from(record)
    return hashlib.sha256(memoryview(record)[: lmdb_columns_size(n, version)]).hexdigest()


def vouched_lmdb_hashes(front: bytes, samples: int, columns_sha256: str) -> np.ndarray | None:
    """The split hashes of a record's front (``lmdb_columns_size(samples)`` bytes or more, the
    record's start) where its columns' sha256 is ``columns_sha256`` (the manifest's) and its
    head is this shard's (magic, a version read, ``samples``); None otherwise, and the caller
    hashes the keys as for a pack without it. The record's own checksum is not read: it
    covers the key table too, which a split never reads."""
    if len(front) < _HEAD.size or front[:8] != MAGIC:
        return None
    _, version, _, n, _ = _HEAD.unpack_from(front)
    size = lmdb_columns_size(samples, version)
    if version not in READS or n != samples or len(front) < size:
        return None
    if hashlib.sha256(memoryview(front)[:size]).hexdigest() != columns_sha256:
        return None
    return np.frombuffer(front, "<u8", n, _HEAD.size).astype(np.uint64)


def encode_lmdb_index(keys: Sequence[bytes], digests) -> bytes:
    """The record's bytes; ``keys``: each sample's key as its value stores it (UTF-8);
    ``digests``: each sample's ``lmdb_digest``."""
    n = len(keys)
    if len(digests) != n:
        raise ValueError(f"{n} keys need {n} digests")
    table = b"".join(keys)
    ends = np.cumsum(np.fromiter((len(k) for k in keys), np.uint64, n), dtype=np.uint64)
    body = b"".join(
        (
            _HEAD.pack(MAGIC, VERSION, 0, n, len(table)),
            key_hashes(keys).astype("<u8").tobytes(),
            np.asarray(digests, dtype=np.uint64).astype("<u8").tobytes(),
            ends.astype("<u8").tobytes(),
            table,
        )
    )
    return body + hashlib.sha256(body).digest()


@dataclass(frozen=True)
class LmdbIndex(KeyTable):
    """One LMDB shard's keys and split hashes, as numpy views over the record's bytes."""

    samples: int
    #: The split hash of each key (``key_hashes``).
    hashes: np.ndarray
    #: End of each key in ``table`` (key ``i`` is ``table[ends[i-1]:ends[i]]``).
    ends: np.ndarray
    table: bytes
    #: Each sample's ``lmdb_digest``; None in a version-1 record (its reads are unchecked).
    digests: np.ndarray | None = None


def decode_lmdb_index(data: bytes, shard: str, samples: int) -> LmdbIndex:
    """Parse and check the record's bytes against ``samples`` (the shard's count); an
    ``LmdbIndexError`` naming ``shard`` where they do not check out."""
    if len(data) < _HEAD.size + _TRAILER or data[:8] != MAGIC:
        raise _damaged(shard, "not a shardkit index record")
    if hashlib.sha256(data[:-_TRAILER]).digest() != data[-_TRAILER:]:
        raise _damaged(shard, "its checksum does not match its contents")
    _, version, _, n, klen = _HEAD.unpack_from(data)
    if version not in READS:
        raise _damaged(shard, f"version {version}, this shardkit reads {VERSION} and before")
    if len(data) != index_record_size(n, klen, version):
        raise _damaged(shard, "its length does not match its sample count")
    if n != samples:
        raise _damaged(shard, f"it lists {n} samples, the shard holds {samples}")
    pos = _HEAD.size
    hashes = np.frombuffer(data, "<u8", n, pos)
    digests = None
    if version >= 2:
        digests = np.frombuffer(data, "<u8", n, pos + 8 * n)
        pos += 8 * n
    ends = np.frombuffer(data, "<u8", n, pos + 8 * n)
    table = data[pos + 16 * n : len(data) - _TRAILER]
    if n and (int(ends[-1]) != klen or np.any(np.diff(ends.astype(np.int64)) < 0)):
        raise _damaged(shard, "its keys are out of order")
    return LmdbIndex(n, hashes, ends, table, digests)


def _damaged(shard: str, why: str) -> LmdbIndexError:
    return LmdbIndexError(
        f"{shard}: damaged sample index record {INDEX_KEY.decode()} ({why}); re-copy the shard, "
        "or pack again"
    )
