"""The bytes of a dataset's key file, ``manifest.keys`` (FORMAT.md, "Key file"): its head, the
sha256 its manifest lists, and its columns memory-mapped. Written by growth
(``write.keyfile``) and read by growth and by a view's ``get(key)`` (``stream.lookup``): both
sides of the format in one place, below both."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import numpy as np

__all__ = [
    "HEAD",
    "KEYS_NAME",
    "MAGIC",
    "counts_below",
    "file_digest",
    "first_at_least",
    "shard_counts",
    "key_file_sha256",
    "mapped",
    "problem",
    "shards_digest",
]

#: The key file's name beside the manifest.
KEYS_NAME = "manifest.keys"
MAGIC = b"SHKKEYS1"
#: Bytes before the hashes: magic, count, shards, the shards' identity (FORMAT.md).
HEAD = 56


def shards_digest(shards: Sequence) -> bytes:
    """The 32 bytes naming the shards a key file describes: ``keys.identity``'s sha256."""
    if hasattr(shards, "sha256"):  # a parsed manifest's columns: no object a shard
        doc = [
            list(x) for x in zip(np.asarray(shards.samples).tolist(), shards.sha256, strict=True)
        ]
    else:
        doc = [[s.samples, s.sha256] for s in shards]
    return hashlib.sha256(json.dumps(doc).encode()).digest()


def file_digest(hashes, shards) -> str:
    """The listed sha256 from the two running sha256s, of the head and hashes and of the shards."""
    return hashlib.sha256(hashes.digest() + shards.digest()).hexdigest()


def key_file_sha256(path: str, n: int) -> str:
    """What the manifest lists as a key file's ``sha256`` (FORMAT.md): the sha256 of two
    sha256s, of its head and hashes and of its shard column, so a writer computes it as it
    writes the two in order (no read back); read here in 64 KiB pieces into one buffer."""
    parts, buf = [hashlib.sha256(), hashlib.sha256()], bytearray(1 << 16)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        for part, size in ((parts[0], HEAD + 8 * n), (parts[1], None)):
            while size is None or size > 0:  # the head and the hashes, then the shards
                got = f.readinto(view[: len(buf) if size is None else min(len(buf), size)])
                if not got:
                    break
                part.update(view[:got])
                size = None if size is None else size - got
    return file_digest(*parts)


def problem(path: str, listed: dict, n: int, shards: Sequence, whole: bool = True) -> str:
    """Why the key file at ``path`` is not the one the manifest lists (``listed``: its
    ``keys``) for its ``n`` samples in ``shards``; "" where it is. ``whole``: its sha256 is
    checked (12 bytes a sample read) and its head's identity of the shards (their list hashed:
    ~0.6 us a shard); else only its size and its head's counts (one read of 56 bytes), what a
    reader that confirms every answer on the real key needs to use it, the rest left to when
    an answer is missing."""
    try:
        if os.path.getsize(path) != HEAD + 12 * n or listed["bytes"] != HEAD + 12 * n:
            return f"not the {HEAD + 12 * n} bytes of {n} samples"
        if whole and key_file_sha256(path, n) != listed["sha256"]:
            return "its sha256 is not the manifest's"
        with open(path, "rb") as f:
            head = f.read(HEAD)
        if (
            head[:8] != MAGIC
            or int.from_bytes(head[8:16], "little") != n
            or int.from_bytes(head[16:24], "little") != len(shards)
            or (whole and head[24:56] != shards_digest(shards))
        ):
            return "its head does not name this manifest's shards"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return ""


def mapped(path: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The key file's two columns, memory-mapped (read-only, nothing in the heap): the hashes
    (``uint64``, ascending) and each one's shard (``uint32``)."""
    if not n:
        return np.empty(0, np.uint64), np.empty(0, np.uint32)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    return mm[HEAD : HEAD + 8 * n].view("<u8"), mm[HEAD + 8 * n :].view("<u4")


def counts_below(cols, threshold: int, num_shards: int) -> np.ndarray:
    """Each shard's count of keys whose hash is below ``threshold`` (int64, ``num_shards``
    long), from key columns (``hashes`` ascending, ``shards``, and ``offset`` added to each
    shard where a merge numbers them on: a ``write.keyfile.KeyColumns`` or a memory-map of a
    key file). With ``threshold`` a split's, ``ceil(val_fraction * 2**64)``, these are each
    shard's "val" samples: the hashes below it are a prefix of the sorted column, so what is
    read is a binary search and that prefix's shard column (4 bytes a val sample), never a
    shard's index. Counts of several sorted runs of one dataset add up."""
    end = int(np.searchsorted(cols.hashes, np.uint64(threshold), side="left"))
    return shard_counts(cols.shards[:end], num_shards, int(getattr(cols, "offset", 0)))


def shard_counts(shards, num_shards: int, offset: int = 0) -> np.ndarray:
    """How many of ``shards`` (a key file's shard column, or part of it) name each of
    ``num_shards`` shards, each numbered on by ``offset``; ValueError for one past them."""
    got = np.bincount(np.asarray(shards), minlength=0).astype(np.int64)
    if offset + len(got) > num_shards:
        raise ValueError(f"a key's shard is past the {num_shards} shards")
    out = np.zeros(num_shards, np.int64)
    out[offset : offset + len(got)] = got
    return out


def first_at_least(fd: int, n: int, threshold: int) -> int:
    """The rank of the first hash >= ``threshold`` in the key file open at ``fd`` (``n``
    samples): a binary search by ``os.pread``, one 8-byte read a step (~log2 n reads)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        raw = os.pread(fd, 8, HEAD + 8 * mid)
        if len(raw) != 8:
            raise ValueError("cut short")
        if int.from_bytes(raw, "little") < threshold:
            lo = mid + 1
        else:
            hi = mid
    return lo
