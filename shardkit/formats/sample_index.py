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
import stat
import struct
import time
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import xxhash

from ..errors import ShardFormatError

__all__ = [
    "INDEX_SUFFIX",
    "SPLIT_SALT",
    "SampleIndex",
    "SampleIndexError",
    "ShardDigests",
    "ShardSides",
    "on_sides",
    "remember_checked",
    "sides_checked",
    "was_checked",
    "build_index",
    "decode_index",
    "encode_index",
    "index_digests",
    "index_path",
    "key_hash",
    "key_hashes",
    "load_index",
    "sample_digest",
    "sample_digests",
    "sample_offset",
    "table_hashes",
]

#: The index of shard ``X`` is the file ``X + INDEX_SUFFIX`` beside it.
INDEX_SUFFIX = ".idx"
MAGIC = b"SKINDEX\0"
VERSION = 3
#: Versions read: 1 (no members section: code that needs members reads the shard's headers),
#: 2 (no sample digests: partial reads of its shard are unchecked, and say so once).
READS = (1, 2, 3)
#: The first version with a digest column (``sample_digest`` of each sample's bytes).
DIGESTS = 3
#: magic, version, reserved, samples, shard bytes, shard sha256, key-table bytes.
_HEAD = struct.Struct("<8sII QQ 32s Q")
#: The members section's head: members in all, distinct extensions, bytes of their names.
_MEMBERS = struct.Struct("<QII")
_TRAILER = 32  # sha256 of everything before it

#: The split's salt: fixed, not the seed, so a sample's side depends on its key alone
#: (FORMAT.md, "Train/val splits"); changing it would move samples between train and val.
SPLIT_SALT = b"shardkit-split:"


#: The fix a stale index's message names (``--overwrite`` would replace a pack's manifest).
_REBUILD = "rebuild it with `shardkit index` on the dataset (or pack again)"


class SampleIndexError(ShardFormatError):
    """A sample index that is damaged, or belongs to another version of its shard."""


def key_hashes(keys: Sequence[str | bytes], salt: bytes = SPLIT_SALT) -> np.ndarray:
    """uint64 per key: the first 8 bytes, big-endian, of BLAKE2b(``salt`` + the key's UTF-8)."""
    raw = (k if isinstance(k, bytes) else k.encode("utf-8", "surrogateescape") for k in keys)
    digests = [hashlib.blake2b(salt + k, digest_size=8).digest() for k in raw]
    if not digests:
        return np.empty(0, np.uint64)
    return np.frombuffer(b"".join(digests), dtype=">u8").astype(np.uint64)


def table_hashes(table: KeyTable) -> np.ndarray:
    """``key_hashes`` of every key of a key table (a tar index's or an LMDB index record's),
    in C where the extension is built (~0.13 us a key, hashlib's ~0.5): what a stored hash
    column is checked against."""
    try:
        from ..images._native import split_hashes
    except ImportError:  # pragma: no cover - built without libjpeg's headers
        return key_hashes(table.keys())
    ends = np.ascontiguousarray(table.ends, dtype=np.int64)
    return np.frombuffer(split_hashes(table.table, ends, SPLIT_SALT), ">u8").astype(np.uint64)


def key_hash(key: str) -> int:
    """One key's split hash (``key_hashes`` of one key, as an int)."""
    raw = SPLIT_SALT + key.encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


#: A sample's digest: XXH3-64, seed 0, of its stored bytes (FORMAT.md, "Sample index"). Chosen
#: by speed (docs/benchmarks.md): 18 GB/s on a 5 kB sample where BLAKE2b-64 does 0.8; it is a
#: check against damage and wrong bytes, not against someone who also rewrites the index (the
#: manifest's sha256 of the index covers that).
sample_digest = xxhash.xxh3_64_intdigest


def sample_digests(data, offsets) -> np.ndarray:
    """``sample_digest`` of each ``data[offsets[i]:offsets[i + 1]]`` (``data``: a shard's bytes,
    or an mmap of them): the digest column of its index."""
    view, bounds = memoryview(data), np.asarray(offsets, dtype=np.int64).tolist()
    pairs = zip(bounds, bounds[1:], strict=False)
    return np.fromiter((sample_digest(view[a:b]) for a, b in pairs), np.uint64, len(bounds) - 1)


def file_digests(path: str, offsets) -> np.ndarray:
    """``sample_digests`` of the shard file at ``path`` (mapped, not read into memory)."""
    import mmap

    if len(offsets) < 2:
        return np.empty(0, np.uint64)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            return sample_digests(m, offsets)
        finally:
            del m  # no view left over it when it closes


@dataclass(frozen=True)
class ShardSides:
    """What a split's reader checks each sample of one shard against: the side the split put
    it on (bit ``base + n`` of ``bits``, ``np.packbits`` of every sample's "is val" over the
    source, the most significant bit first) and the side its own key's hash puts it on (below
    ``threshold``, ``ceil(val_fraction * 2**64)``: val). Where the split's bits came from a
    hash column, the column is vouched for by nothing but the keys (a manifest's checksums can
    be computed again from an edited file), so every sample read is checked by its key."""

    bits: np.ndarray
    base: int
    threshold: int

    def val(self, n: int) -> bool:
        """Whether the split put sample ``n`` of the shard in val."""
        p = self.base + n
        return bool(self.bits[p >> 3] >> (7 - (p & 7)) & 1)

    def on_side(self, n: int, key: str | bytes) -> bool:
        """Whether sample ``n``'s own key puts it where the split did."""
        raw = key if isinstance(key, bytes) else key.encode("utf-8", "surrogateescape")
        h = int.from_bytes(hashlib.blake2b(SPLIT_SALT + raw, digest_size=8).digest(), "big")
        return (h < self.threshold) == self.val(n)

    def error(self, url: str, n: int, key: str) -> ShardFormatError:
        """The one-line error of sample ``n`` found on the other side by its key."""
        side, other = ("val", "train") if self.val(n) else ("train", "val")
        return ShardFormatError(
            f"{url}: sample {n} (key {key!r}) is a {other} sample by its key, but its index's "
            f"split hash put it in {side}: the index is damaged or not this shard's; rebuild it "
            "(delete the .idx and run `shardkit index` on the dataset, or re-pack the shard)"
        )


@dataclass(frozen=True)
class ShardDigests:
    """What a partial read that streams a tar shard checks each sample it hands out against:
    the shard's index digests (``sample_digest`` of each sample's bytes, uint64) and its N + 1
    sample offsets (int64), from the index the manifest's checksums vouch for."""

    digests: np.ndarray
    offsets: np.ndarray

    def ok(self, f, n: int) -> bool:
        """Whether sample ``n``'s bytes in the open shard file ``f``, read by its index's range,
        hash to its digest (the check of a sample the C parser left to Python)."""
        if not 0 <= n < len(self.digests) or n + 1 >= len(self.offsets):
            return False
        lo, hi = int(self.offsets[n]), int(self.offsets[n + 1])
        try:
            data = os.pread(f.fileno(), hi - lo, lo)
        except (AttributeError, OSError, ValueError):
            return False
        return len(data) == hi - lo and sample_digest(data) == int(self.digests[n])


#: Streamed slices whose every sample a split's reader has checked by its key in this process
#: (``sides_checked``): (file identity, slice, the split's bits over it, threshold), the least
#: recently used dropped past ``CHECKED`` entries. The answer of each key check is a function of
#: the shard's bytes and the split's bits alone, so reading the same unchanged file under the same
#: bits again gives the same answers: a later epoch skips the check (BLAKE2b of each key, about a
#: tenth of a streamed tar sample's CPU) instead of repeating it. The first read of a slice in a
#: process always checks (a DataLoader worker without ``persistent_workers`` is a new process
#: each epoch, so it checks every epoch).
_CHECKED: OrderedDict[tuple, None] = OrderedDict()
CHECKED = 1 << 16
#: A file changed this recently (its ctime, which no user call sets back) is not remembered: a
#: write within the clock's granularity of the read could leave the same stat (git's "racy" rule).
RACY_NS = 2_000_000_000


def sides_checked(f, start: int, stop: int, sides: ShardSides, at=None) -> tuple | None:
    """The identity of the slice ``[start, stop)`` of the local file ``f`` (open; ``at``: the
    byte its read starts at, None: from the shard's start) read under ``sides``: device, inode,
    size, mtime and ctime (any write, rename or ``utime`` changes one of them), the bits the
    split gives its samples and the threshold. None where it cannot be told (no file
    descriptor, changed within ``RACY_NS``). Pass it to ``was_checked`` before the read and to
    ``remember_checked`` once every sample of the slice was read and checked."""
    try:
        st = os.fstat(f.fileno())
    except (AttributeError, OSError, ValueError):
        return None
    if time.time_ns() - st.st_ctime_ns < RACY_NS or not stat.S_ISREG(st.st_mode):
        return None
    a, b = sides.base + start, sides.base + stop
    bits = np.asarray(sides.bits[a >> 3 : (b + 7) >> 3]).tobytes()
    who = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return (who, start, at, a & 7, b - a, bits, sides.threshold)


def was_checked(seen: tuple | None) -> bool:
    """Whether ``sides_checked``'s slice was read and every key checked before, in this process."""
    if seen is None or seen not in _CHECKED:
        return False
    _CHECKED.move_to_end(seen)
    return True


def remember_checked(seen: tuple | None) -> None:
    """Records that every sample of ``sides_checked``'s slice was checked by its key."""
    if seen is None:
        return
    _CHECKED[seen] = None
    while len(_CHECKED) > CHECKED:
        _CHECKED.popitem(last=False)


def on_sides(records, start: int, sides: ShardSides, url: str):
    """``records`` (samples ``start``, ``start + 1``, ... of the shard ``url``), each checked by
    its own key against ``sides`` (one BLAKE2b of a few bytes a sample): where a reader parses
    no key in C (LMDB, whose values each hold their key)."""
    try:
        for n, rec in enumerate(records, start):
            if not sides.on_side(n, rec.key):
                raise sides.error(url, n, rec.key)
            yield rec
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()


def index_path(shard_path: str) -> str:
    return shard_path + INDEX_SUFFIX


def _encode_members(log) -> bytes:
    """The members section (FORMAT.md, "Sample index") of a ``tally.MemberLog``: extensions
    as uint16 ids into a table of the distinct ones, in order of first appearance."""
    ids: dict[bytes, int] = {}
    for ext in log.exts:
        ids.setdefault(ext, len(ids))
    if len(ids) > 1 << 16:
        raise ValueError(f"{len(ids)} distinct member extensions in one shard (max 65536)")
    names = b"".join(ids)
    name_ends = np.cumsum(np.fromiter(map(len, ids), np.uint64, len(ids)), dtype=np.uint64)
    m = len(log.exts)
    return b"".join(
        (
            _MEMBERS.pack(m, len(ids), len(names)),
            np.asarray(log.labels, dtype="<i8").tobytes(),
            np.asarray(log.starts, dtype="<u8").tobytes(),
            np.asarray(log.offsets, dtype="<u8").tobytes(),
            np.asarray(log.sizes, dtype="<u8").tobytes(),
            name_ends.astype("<u8").tobytes(),
            np.fromiter((ids[e] for e in log.exts), "<u2", m).tobytes(),
            names,
        )
    )


def encode_index(
    shard_bytes: int,
    sha256_hex: str,
    keys: Sequence[bytes],
    offsets: Sequence[int],
    members,
    digests: Sequence[int] | np.ndarray,
) -> bytes:
    """The index file's bytes. ``keys``: each sample's key as stored (UTF-8 bytes);
    ``offsets``: the byte offset of each sample's first header, then that of the
    end-of-archive blocks (``len(keys) + 1`` entries); ``members``: each sample's label and
    members (a ``formats.tar.tally.MemberLog``); ``digests``: each sample's ``sample_digest``
    (of its bytes ``offsets[i] .. offsets[i + 1]``)."""
    n = len(keys)
    if len(offsets) != n + 1 or len(members.labels) != n or len(digests) != n:
        raise ValueError(f"{n} keys need {n + 1} offsets and {n} samples' members and digests")
    table = b"".join(keys)
    ends = np.cumsum(np.fromiter((len(k) for k in keys), np.uint64, n), dtype=np.uint64)
    body = b"".join(
        (
            _HEAD.pack(MAGIC, VERSION, 0, n, shard_bytes, bytes.fromhex(sha256_hex), len(table)),
            np.asarray(offsets, dtype="<u8").tobytes(),
            key_hashes(keys).astype("<u8").tobytes(),
            np.asarray(digests, dtype=np.uint64).astype("<u8").tobytes(),
            ends.astype("<u8").tobytes(),
            table,
            bytes(-len(table) % 8),  # the members' columns start 8-aligned
            _encode_members(members),
        )
    )
    return body + hashlib.sha256(body).digest()


@dataclass(frozen=True)
class Members:
    """The members section of an index, as numpy views (version 2)."""

    #: Each sample's label as a reader gives it (-1: none).
    labels: np.ndarray
    #: Sample ``i``'s members are ``starts[i] .. starts[i + 1]`` of the columns below.
    starts: np.ndarray
    #: Each member's first data byte in the shard, its data size and its extension's id.
    offsets: np.ndarray
    sizes: np.ndarray
    ids: np.ndarray
    #: The distinct extensions (lowercased), by id.
    names: tuple[str, ...]

    def of(self, i: int) -> list[tuple[str, int, int]]:
        """Sample ``i``'s members as ``(extension, data offset, data size)``, stored order."""
        lo, hi = int(self.starts[i]), int(self.starts[i + 1])
        names = self.names
        return [
            (names[e], o, s)
            for e, o, s in zip(
                self.ids[lo:hi].tolist(),
                self.offsets[lo:hi].tolist(),
                self.sizes[lo:hi].tolist(),
                strict=True,
            )
        ]


class KeyTable:
    """Lookups over a key table (``table``: every key's bytes concatenated; ``ends``: where
    each ends; ``samples``): the tar index and LMDB's index record keep their keys alike."""

    samples: int
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


@dataclass(frozen=True)
class SampleIndex(KeyTable):
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
    #: Each sample's label and members; None in a version-1 index (read the headers).
    members: Members | None = None
    #: Each sample's ``sample_digest``; None before version 3 (its reads are unchecked).
    digests: np.ndarray | None = None


def decode_index(data: bytes, where: str, trailer: bool = True) -> SampleIndex:
    """Parse and check an index file's bytes; ``SampleIndexError`` naming ``where`` if damaged.
    ``trailer=False``: the caller has checked the whole file's sha256 (the manifest's
    ``index_sha256``), which covers the trailing one."""
    if len(data) < _HEAD.size + 8 + _TRAILER or data[:8] != MAGIC:
        raise _damaged(where, "not a shardkit sample index")
    if trailer and hashlib.sha256(memoryview(data)[:-_TRAILER]).digest() != data[-_TRAILER:]:
        raise _damaged(where, "its checksum does not match its contents")
    magic, version, _, n, size, sha, klen = _HEAD.unpack_from(data)
    if version not in READS:
        raise _damaged(where, f"version {version}, this shardkit reads {READS[-1]} and before")
    pos = _HEAD.size
    keys_at = columns_size(n, version) + 8 * n  # the key ends after the columns
    if len(data) < keys_at + klen + _TRAILER or (
        version == 1 and len(data) != keys_at + klen + _TRAILER
    ):
        raise _damaged(where, "its length does not match its sample count")
    offsets = np.frombuffer(data, "<u8", n + 1, pos)
    hashes = np.frombuffer(data, "<u8", n, pos + 8 * (n + 1))
    digests = None
    if version >= DIGESTS:
        digests = np.frombuffer(data, "<u8", n, pos + 8 * (n + 1) + 8 * n)
    ends = np.frombuffer(data, "<u8", n, keys_at - 8 * n)
    table = data[keys_at : keys_at + klen]
    if n and (int(ends[-1]) != klen or np.any(np.diff(offsets.astype(np.int64)) <= 0)):
        raise _damaged(where, "its offsets or keys are out of order")
    members = None
    if version >= 2:
        members = _decode_members(data, keys_at + klen + (-klen % 8), n, offsets, where)
    return SampleIndex(n, size, sha.hex(), offsets, hashes, ends, table, members, digests)


def _decode_members(data: bytes, at: int, n: int, sample_at: np.ndarray, where: str) -> Members:
    """The members section from byte ``at``, its lengths and ranges checked (vectorized)."""
    if len(data) < at + _MEMBERS.size + _TRAILER:
        raise _damaged(where, "its length does not match its sample count")
    m, e, x = _MEMBERS.unpack_from(data, at)
    at += _MEMBERS.size
    if len(data) != at + 8 * n + 8 * (n + 1) + 16 * m + 8 * e + 2 * m + x + _TRAILER:
        raise _damaged(where, "its length does not match its member count")
    labels = np.frombuffer(data, "<i8", n, at)
    starts = np.frombuffer(data, "<u8", n + 1, at + 8 * n)
    at += 8 * n + 8 * (n + 1)
    offsets = np.frombuffer(data, "<u8", m, at)
    sizes = np.frombuffer(data, "<u8", m, at + 8 * m)
    name_ends = np.frombuffer(data, "<u8", e, at + 16 * m)
    ids = np.frombuffer(data, "<u2", m, at + 16 * m + 8 * e)
    names = data[at + 16 * m + 8 * e + 2 * m : at + 16 * m + 8 * e + 2 * m + x]
    counts = np.diff(starts.astype(np.int64))
    if int(starts[0]) != 0 or int(starts[-1]) != m or np.any(counts < 1):
        raise _damaged(where, "its member table does not fit its samples")
    if (e and int(name_ends[-1]) != x) or np.any(np.diff(name_ends.astype(np.int64)) < 0):
        raise _damaged(where, "its member names are out of order")
    if m and int(ids.max()) >= e:
        raise _damaged(where, "a member names an extension it does not list")
    owner = np.repeat(np.arange(n), counts)  # each member's sample
    lo, hi = sample_at[owner], sample_at[owner + 1]
    if np.any(offsets < lo + 512) or np.any(offsets + sizes > hi):  # a header before each
        raise _damaged(where, "a member lies outside its sample's byte range")
    bounds = [0, *name_ends.tolist()]
    pairs = zip(bounds, bounds[1:], strict=False)
    text = tuple(names[a:b].decode("utf-8", "surrogateescape") for a, b in pairs)
    return Members(labels, starts, offsets, sizes, ids, text)


def _damaged(where: str, why: str) -> SampleIndexError:
    return SampleIndexError(
        f"{where}: damaged sample index ({why}); delete it and run `shardkit index` on the "
        "shards (or pack again) to rebuild it"
    )


def build_index(path: str, shard_bytes: int, sha256_hex: str) -> bytes:
    """A tar shard's index from its headers, then its samples' digests (one pass over its
    bytes, mapped): the writer's bytes exactly."""
    from .tar.tally import tally_tar

    tally = tally_tar(path, every=1, keys=True, members=True)
    return encode_tally(tally, shard_bytes, sha256_hex, path)


def encode_tally(tally, shard_bytes: int, sha256_hex: str, path: str) -> bytes:
    """The index of the shard at ``path`` from its ``tally_tar(..., every=1, keys=True,
    members=True)``; the samples' digests are read from ``path``."""
    keys = [k.encode("utf-8", "surrogateescape") for k in tally.keys]
    offsets = [*tally.index, tally.end]
    digests = file_digests(path, offsets)
    return encode_index(shard_bytes, sha256_hex, keys, offsets, tally.members, digests)


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
        listed = bool(index_sha256) and hashlib.sha256(data).hexdigest() == index_sha256
        index = decode_index(data, where, trailer=not listed)
        if (index.samples, index.shard_bytes, index.sha256) != (samples, size, sha256):
            raise SampleIndexError(
                f"{where}: stale sample index (it describes another version of its shard: "
                f"{index.samples} samples, {index.shard_bytes} bytes, where the manifest says "
                f"{samples} and {size}); {_REBUILD}"
            )
        if index_sha256 and not listed:
            raise SampleIndexError(
                f"{where}: stale sample index (its sha256 differs from the manifest's "
                f"index_sha256); {_REBUILD}"
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


def ensure_indexes(directory: str, entries: list) -> list:
    """Give every tar shard of ``entries`` (``ShardEntry``) in ``directory`` a valid index
    beside it, building what is missing or wrong from the shard's headers (a resumed pack's
    earlier shards, merged shards). Returns the entries with ``index_sha256`` set to the sha256
    of the index beside each plain tar shard, and ``columns_sha256`` to that of its columns
    (``index_digests``), for the manifest."""
    out = []
    for e in entries:
        if not e.path.endswith(".tar"):
            out.append(e)  # compressed tars cannot seek; LMDB looks keys up itself
            continue
        shard = os.path.join(directory, e.path)
        data = read_local(index_path(shard))
        try:  # a version-1 index (no members) is rebuilt as the current version
            ok = data is not None and _matches(decode_index(data, shard), e)
        except SampleIndexError:
            ok = False
        if not ok:
            data = build_index(shard, e.bytes, e.sha256)
            write_index_file(shard, data)
        out.append(replace(e, **index_digests(data, e.samples)))
    return out


def index_digests(data: bytes, samples: int) -> dict[str, str]:
    """A manifest entry's digests of its shard's index file ``data``: ``index_sha256`` (the
    whole file) and ``columns_sha256`` (its columns, ``columns_of``: the head, offsets, key
    hashes and sample digests, which epochs and a growth check read without the rest)."""
    return {
        "index_sha256": hashlib.sha256(data).hexdigest(),
        "columns_sha256": hashlib.sha256(columns_of(data, samples)).hexdigest(),
    }


def _matches(index: SampleIndex, e) -> bool:
    return index.digests is not None and (index.samples, index.shard_bytes, index.sha256) == (
        e.samples,
        e.bytes,
        e.sha256,
    )


@dataclass(frozen=True)
class IndexColumns:
    """The fixed-width head of an index: byte ranges, split hashes and sample digests, without
    the key table (an epoch that reads a few samples of each shard needs no more: 24 bytes a
    sample)."""

    offsets: np.ndarray
    hashes: np.ndarray
    #: Each sample's ``sample_digest``; None before version 3.
    digests: np.ndarray | None = None


def columns_size(samples: int, version: int = VERSION) -> int:
    """Bytes of an index's header, offsets, hashes and (version 3) digests: what
    ``decode_columns`` reads. Readers read the current version's size whatever the file's
    version (an older file is longer than that: its key ends follow) and take
    ``columns_of`` of it."""
    return _HEAD.size + 8 * (samples + 1) + (16 if version >= DIGESTS else 8) * samples


def columns_of(data: bytes, samples: int) -> memoryview:
    """The columns of an index whose bytes start ``data`` (at least ``columns_size(samples)``
    of them): as many as its version has, which ``columns_sha256`` covers."""
    version = _HEAD.unpack_from(data)[1] if len(data) >= _HEAD.size else VERSION
    return memoryview(data)[: columns_size(samples, version)]


def decode_columns(
    data: bytes, where: str, samples: int, size: int, sha256: str, listed: bool = False
) -> IndexColumns | None:
    """The head of an index (``columns_size`` bytes) for the shard the manifest describes; None
    with a warning naming it when it is not that shard's. The trailing checksum is not read:
    each sample read through it is checked against its stored key hash instead. ``listed``:
    the caller found these bytes' sha256 to be the manifest's ``columns_sha256``, so the
    offsets are the writer's, and their order is not checked again (a pass over every one)."""
    try:
        if len(data) < _HEAD.size or data[:8] != MAGIC:
            raise _damaged(where, "not a shardkit sample index")
        _, version, _, n, nbytes, sha, _ = _HEAD.unpack_from(data)
        if version not in READS:  # the head is the same in every version read
            raise _damaged(where, f"version {version}, this shardkit reads {READS[-1]} and before")
        if len(data) < columns_size(samples, version):
            raise _damaged(where, "not a shardkit sample index")
        if (n, nbytes, sha.hex()) != (samples, size, sha256):
            raise SampleIndexError(
                f"{where}: stale sample index (it describes another version of its shard); "
                + _REBUILD
            )
        offsets = np.frombuffer(data, "<u8", n + 1, _HEAD.size)
        if (
            n
            and not listed
            and (np.any(np.diff(offsets.astype(np.int64)) <= 0) or int(offsets[-1]) > size)
        ):
            raise _damaged(where, "its offsets are out of order")
        hashes = np.frombuffer(data, "<u8", n, _HEAD.size + 8 * (n + 1))
        digests = None
        if version >= DIGESTS:
            digests = np.frombuffer(data, "<u8", n, _HEAD.size + 8 * (n + 1) + 8 * n)
    except SampleIndexError as exc:
        warnings.warn(f"{exc}; reading the shard's headers instead", RuntimeWarning, stacklevel=3)
        return None
    return IndexColumns(offsets, hashes, digests)


def sample_offset(
    path: str, i: int, samples: int, size: int, sha256: str, index_sha256: str
) -> int | None:
    """The byte offset of sample ``i`` of the local tar shard ``path`` (``samples``, ``size``
    and ``sha256`` as its manifest entry gives them), from the index beside it: where a reader
    starting mid-shard seeks, instead of reading every byte before it.

    Used only once the whole index file's sha256 is the entry's ``index_sha256`` (the offsets
    are bytes this reader did not just read: one flipped byte would start the slice at another
    sample), and its head names the shard; None otherwise (no index, another one, damaged: a
    warning names a damaged or stale one), and the reader reads the shard from its start. One
    read of the file (16 to 40 bytes a sample) and its sha256, per slice: never more than the
    samples it saves reading."""
    if not index_sha256 or not 0 <= i < samples:
        return None
    where = index_path(path)
    data = read_local(where)
    if data is None:
        return None
    if hashlib.sha256(data).hexdigest() != index_sha256:
        warnings.warn(
            f"{where}: stale or damaged sample index (its sha256 differs from the manifest's "
            f"index_sha256); reading the shard from its start instead; {_REBUILD}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    cols = decode_columns(data[: columns_size(samples)], where, samples, size, sha256)
    return None if cols is None else int(cols.offsets[i])
