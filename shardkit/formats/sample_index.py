"""The sample index: one small file beside each tar shard, so nothing has to walk its headers.

Subsets, splits, ``ShardView``, ``ls`` and ``show`` need each sample's key and byte range; read
from the shard that is one pass over every header of every shard (seconds per million samples,
and the whole dataset's bytes on object storage). ``shard-000000.tar.idx`` holds them as
fixed-width little-endian columns plus a key table (FORMAT.md, "Sample index"), so a reader
loads one shard's index with one read, and numpy views it without a per-sample Python object.

The file is a pure function of the shard's bytes: the writer produces it as it writes, and
``build_index`` from any tar gives the same bytes. It names the shard's size and sha256 (the
manifest's), and ends with the sha256 of everything before it: a damaged or stale index is
refused by name, and readers fall back to the shard's headers.
"""

from __future__ import annotations

import hashlib
import os
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..errors import ShardFormatError

__all__ = [
    "INDEX_SUFFIX",
    "SPLIT_SALT",
    "SampleIndex",
    "SampleIndexError",
    "build_index",
    "decode_index",
    "encode_index",
    "index_path",
    "key_hashes",
    "load_index",
]

#: The index of shard ``X`` is the file ``X + INDEX_SUFFIX`` beside it.
INDEX_SUFFIX = ".idx"
MAGIC = b"SKINDEX\0"
VERSION = 1
#: magic, version, reserved, samples, shard bytes, shard sha256, key-table bytes.
_HEAD = struct.Struct("<8sII QQ 32s Q")
_TRAILER = 32  # sha256 of everything before it

#: The split's salt: fixed, not the seed, so a sample's side depends on its key alone
#: (FORMAT.md, "Train/val splits"); changing it would move samples between train and val.
SPLIT_SALT = b"shardkit-split:"


class SampleIndexError(ShardFormatError):
    """A sample index that is damaged, or belongs to another version of its shard."""


def key_hashes(keys: Sequence[str | bytes], salt: bytes = SPLIT_SALT) -> np.ndarray:
    """uint64 per key: the first 8 bytes, big-endian, of BLAKE2b(``salt`` + the key's UTF-8)."""
    raw = (k if isinstance(k, bytes) else k.encode("utf-8", "surrogateescape") for k in keys)
    digests = [hashlib.blake2b(salt + k, digest_size=8).digest() for k in raw]
    if not digests:
        return np.empty(0, np.uint64)
    return np.frombuffer(b"".join(digests), dtype=">u8").astype(np.uint64)


def index_path(shard_path: str) -> str:
    return shard_path + INDEX_SUFFIX


def encode_index(
    shard_bytes: int, sha256_hex: str, keys: Sequence[bytes], offsets: Sequence[int]
) -> bytes:
    """The index file's bytes. ``keys``: each sample's key as stored (UTF-8 bytes);
    ``offsets``: the byte offset of each sample's first header, then that of the
    end-of-archive blocks (``len(keys) + 1`` entries)."""
    n = len(keys)
    if len(offsets) != n + 1:
        raise ValueError(f"{n} keys need {n + 1} offsets, got {len(offsets)}")
    table = b"".join(keys)
    ends = np.cumsum(np.fromiter((len(k) for k in keys), np.uint64, n), dtype=np.uint64)
    body = b"".join(
        (
            _HEAD.pack(MAGIC, VERSION, 0, n, shard_bytes, bytes.fromhex(sha256_hex), len(table)),
            np.asarray(offsets, dtype="<u8").tobytes(),
            key_hashes(keys).astype("<u8").tobytes(),
            ends.astype("<u8").tobytes(),
            table,
        )
    )
    return body + hashlib.sha256(body).digest()


@dataclass(frozen=True)
class SampleIndex:
    """One shard's index, as numpy views over the file's bytes (no per-sample objects)."""

    samples: int
    shard_bytes: int
    sha256: str
    #: Byte offset of each sample's first header, then of the end-of-archive blocks: sample
    #: ``i`` is the byte range ``offsets[i] .. offsets[i + 1]``.
    offsets: np.ndarray
    #: The split hash of each key (``key_hashes``).
    hashes: np.ndarray
    #: End of each key in ``table`` (key ``i`` is ``table[ends[i-1]:ends[i]]``).
    ends: np.ndarray
    table: bytes

    def key(self, i: int) -> str:
        lo = int(self.ends[i - 1]) if i else 0
        return self.table[lo : int(self.ends[i])].decode("utf-8", "surrogateescape")

    def keys(self) -> list[str]:
        text = self.table.decode("utf-8", "surrogateescape")
        if text.isascii():  # one decode, then slices: a character is a byte
            bounds = [0, *self.ends.tolist()]
            return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        return [self.key(i) for i in range(self.samples)]

    def position(self, key: str) -> int | None:
        """Where ``key`` is in the shard (the first, should it repeat); None if absent. A
        search of the key table (C speed), not a dict of every key: one lookup stays cheap."""
        raw = key.encode("utf-8", "surrogateescape")
        if not raw:
            return None
        at = self.table.find(raw)
        while at >= 0:
            i = int(np.searchsorted(self.ends, at, side="right"))  # the key holding byte `at`
            start = int(self.ends[i - 1]) if i else 0
            if start == at and int(self.ends[i]) == at + len(raw):
                return i
            at = self.table.find(raw, at + 1)
        return None


def decode_index(data: bytes, where: str) -> SampleIndex:
    """Parse and check an index file's bytes; ``SampleIndexError`` naming ``where`` if damaged."""
    if len(data) < _HEAD.size + 8 + _TRAILER or data[:8] != MAGIC:
        raise _damaged(where, "not a shardkit sample index")
    if hashlib.sha256(data[:-_TRAILER]).digest() != data[-_TRAILER:]:
        raise _damaged(where, "its checksum does not match its contents")
    magic, version, _, n, size, sha, klen = _HEAD.unpack_from(data)
    if version != VERSION:
        raise _damaged(where, f"version {version}, this shardkit reads {VERSION}")
    pos = _HEAD.size
    if len(data) != pos + 8 * (n + 1) + 16 * n + klen + _TRAILER:
        raise _damaged(where, "its length does not match its sample count")
    offsets = np.frombuffer(data, "<u8", n + 1, pos)
    hashes = np.frombuffer(data, "<u8", n, pos + 8 * (n + 1))
    ends = np.frombuffer(data, "<u8", n, pos + 8 * (n + 1) + 8 * n)
    table = data[pos + 8 * (n + 1) + 16 * n : len(data) - _TRAILER]
    if n and (int(ends[-1]) != klen or np.any(np.diff(offsets.astype(np.int64)) <= 0)):
        raise _damaged(where, "its offsets or keys are out of order")
    return SampleIndex(n, size, sha.hex(), offsets, hashes, ends, table)


def _damaged(where: str, why: str) -> SampleIndexError:
    return SampleIndexError(
        f"{where}: damaged sample index ({why}); delete it and run `shardkit index` on the "
        "shards (or pack again) to rebuild it"
    )


def build_index(path: str, shard_bytes: int, sha256_hex: str) -> bytes:
    """A tar shard's index from its headers (data hopped over): the writer's bytes exactly."""
    from .tar.tally import tally_tar

    tally = tally_tar(path, every=1, keys=True)
    keys = [k.encode("utf-8", "surrogateescape") for k in tally.keys]
    return encode_index(shard_bytes, sha256_hex, keys, [*tally.index, tally.end])


def load_index(
    data: bytes | None, where: str, samples: int, size: int, sha256: str, index_sha256: str = ""
):
    """The index of a shard the manifest describes as (``samples``, ``size``, ``sha256``, and
    the index file's own ``index_sha256`` where it lists one), or None with a warning naming
    it when it is damaged or belongs to another version of the shard (readers then walk the
    shard's headers, as without an index)."""
    if data is None or not sha256:
        return None
    try:
        index = decode_index(data, where)
        if (index.samples, index.shard_bytes, index.sha256) != (samples, size, sha256):
            raise SampleIndexError(
                f"{where}: stale sample index (it describes another version of its shard: "
                f"{index.samples} samples, {index.shard_bytes} bytes, where the manifest says "
                f"{samples} and {size}); run `shardkit index --overwrite` or pack again"
            )
        if index_sha256 and hashlib.sha256(data).hexdigest() != index_sha256:
            raise SampleIndexError(
                f"{where}: stale sample index (its sha256 differs from the manifest's "
                "index_sha256); run `shardkit index --overwrite` or pack again"
            )
    except SampleIndexError as exc:
        warnings.warn(f"{exc}; reading the shard's headers instead", RuntimeWarning, stacklevel=3)
        return None
    return index


def read_local(path: str) -> bytes | None:
    """The bytes of a local index file, or None where there is none."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        warnings.warn(f"{path}: cannot read the sample index ({exc})", RuntimeWarning, stacklevel=2)
        return None


def write_index_file(shard_path: str, data: bytes) -> str:
    """Write ``shard_path``'s index (temporary name, then rename), without an fsync of its own:
    an index is derived data, checked by its checksum wherever it is read, so one lost to a
    crash is rebuilt at the commit or read around, never trusted. (Two fsyncs per shard cost a
    pack of small images 40% of its time.)"""
    from ..fsutil import temp_name

    path = index_path(shard_path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return path


def exists_for(shard_path: str) -> bool:
    return os.path.isfile(index_path(shard_path))


def ensure_indexes(directory: str, entries: list) -> list:
    """Give every tar shard of ``entries`` (``ShardEntry``) in ``directory`` a valid index
    beside it, building what is missing or wrong from the shard's headers (a resumed pack's
    earlier shards, merged shards). Returns the entries with ``index_sha256`` set to the sha256
    of the index beside each plain tar shard, for the manifest."""
    out = []
    for e in entries:
        if not e.path.endswith(".tar"):
            out.append(e)  # compressed tars cannot seek; LMDB looks keys up itself
            continue
        shard = os.path.join(directory, e.path)
        data = read_local(index_path(shard))
        try:
            ok = data is not None and _matches(decode_index(data, shard), e)
        except SampleIndexError:
            ok = False
        if not ok:
            data = build_index(shard, e.bytes, e.sha256)
            write_index_file(shard, data)
        out.append(replace(e, index_sha256=hashlib.sha256(data).hexdigest()))
    return out


def _matches(index: SampleIndex, e) -> bool:
    return (index.samples, index.shard_bytes, index.sha256) == (e.samples, e.bytes, e.sha256)


@dataclass(frozen=True)
class IndexColumns:
    """The fixed-width head of an index: byte ranges and split hashes, without the key table
    (an epoch that reads a few samples of each shard needs no more: 16 bytes a sample)."""

    offsets: np.ndarray
    hashes: np.ndarray


def columns_size(samples: int) -> int:
    """Bytes of an index's header, offsets and hashes: what ``decode_columns`` reads."""
    return _HEAD.size + 8 * (samples + 1) + 8 * samples


def decode_columns(
    data: bytes, where: str, samples: int, size: int, sha256: str
) -> IndexColumns | None:
    """The head of an index (``columns_size`` bytes) for the shard the manifest describes; None
    with a warning naming it when it is not that shard's. The trailing checksum is not read:
    each sample read through it is checked against its stored key hash instead."""
    try:
        if len(data) != columns_size(samples) or data[:8] != MAGIC:
            raise _damaged(where, "not a shardkit sample index")
        _, version, _, n, nbytes, sha, _ = _HEAD.unpack_from(data)
        if version != VERSION:
            raise _damaged(where, f"version {version}, this shardkit reads {VERSION}")
        if (n, nbytes, sha.hex()) != (samples, size, sha256):
            raise SampleIndexError(
                f"{where}: stale sample index (it describes another version of its shard); "
                "run `shardkit index --overwrite` or pack again"
            )
        offsets = np.frombuffer(data, "<u8", n + 1, _HEAD.size)
        if n and (np.any(np.diff(offsets.astype(np.int64)) <= 0) or int(offsets[-1]) > size):
            raise _damaged(where, "its offsets are out of order")
        hashes = np.frombuffer(data, "<u8", n, _HEAD.size + 8 * (n + 1))
    except SampleIndexError as exc:
        warnings.warn(f"{exc}; reading the shard's headers instead", RuntimeWarning, stacklevel=3)
        return None
    return IndexColumns(offsets, hashes)
