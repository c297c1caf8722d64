"""The dataset's key file, ``manifest.keys`` (FORMAT.md, "Key file"): every sample's key hash
(the split hash, ``sample_index.key_hashes``), sorted, with the position of the shard holding
it. Growth (``pack --append``, ``merge``) reads it to find the keys a dataset already holds,
in place of every old shard's index: one file of 12 bytes a sample, memory-mapped, and one
``sha256`` over it, against the index heads of 40,000 shards opened and their keys hashed.

It is written by every local pack, append and merge beside the shards, before the manifest
that lists its sha256 (``Manifest.keys``), and published with them (``fsutil.publish``): an
interrupted growth leaves the old dataset and its key file, or the new ones. Its head names
the shards it describes (the sha256 of their counts and digests, ``keys.identity``), so a key
file that is missing, damaged, edited or another dataset's serves not at all: growth then
reads every shard's index as before (``built``), with a warning, and writes the file anew. A
dataset made before the key file has none, and is read the old way once.

A hash is never a key: a stored hash that one of the new keys' matches is confirmed on the
key itself, read from the one shard the file names (``held_in``, ``shared_keys``).

Memory: the file is memory-mapped, never read into the heap; the new keys' hashes; and while
the grown dataset's file is written, pieces of ``CHUNK`` samples (merged in order from the
sorted old file and the new keys: ``_two_way``).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..formats.key_file import (
    HEAD,
    KEYS_NAME,
    MAGIC,
    mapped,
    problem,
    shards_digest,
)
from ..formats.key_file import file_digest as _digest
from ..formats.sample_index import key_hashes
from ..manifest import Manifest, ShardEntry
from .keys import shard_hashes, shard_table

__all__ = [
    "KEYS_NAME",
    "KeyColumns",
    "KeyFileWarning",
    "built",
    "dataset_columns",
    "held_in",
    "new_columns",
    "shared_keys",
    "write_key_file",
]

#: Samples a piece while a key file is merged and written, or read to check it.
CHUNK = 1 << 18


class KeyFileWarning(UserWarning):
    """A key file the manifest lists that does not serve: growth reads every shard's index."""


@dataclass(frozen=True)
class KeyColumns:
    """Every sample's key hash (``uint64``, ascending) and its shard's position in the
    manifest (``uint32``; equal hashes by shard): a memory-map of a key file, or built."""

    hashes: np.ndarray
    shards: np.ndarray
    #: Added to ``shards`` where these columns are written into a larger dataset's (a merge).
    offset: int = 0

    def __len__(self) -> int:
        return len(self.hashes)

    def at(self, i: int, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``i .. j`` as written: their hashes, and their shards plus ``offset``."""
        shards = np.asarray(self.shards[i:j])
        if self.offset:
            shards = shards + np.uint32(self.offset)
        return np.asarray(self.hashes[i:j]), shards


def read_key_file(folder: str, manifest: Manifest) -> KeyColumns | None:
    """The key file the manifest lists, memory-mapped once its sha256, size and head are the
    manifest's; None where it lists none, or (with a ``KeyFileWarning``) where it does not serve."""
    listed = manifest.keys
    if not listed:
        return None
    path = os.path.join(folder, listed["path"])
    why = problem(path, listed, manifest.num_samples, manifest.shards)
    if why:
        warnings.warn(
            f"{path}: {why}; growth reads every shard's index instead, and writes the key file "
            "anew",
            KeyFileWarning,
            stacklevel=4,
        )
        return None
    return KeyColumns(*mapped(path, manifest.num_samples))


def built(folder: str, manifest: Manifest) -> KeyColumns:
    """The key columns of the dataset from each shard's index (its stored hashes, checked by
    its keys: ``keys.shard_hashes``), or its keys: what a dataset without a key file costs."""
    return new_columns(folder, manifest.shard_format, manifest.shards, 0)


def new_columns(root: str, fmt: str, entries: Sequence[ShardEntry], first: int) -> KeyColumns:
    """The key columns of the shards ``entries`` in ``root``, numbered from ``first``."""
    parts, where = [], []
    for k, entry in enumerate(entries, start=first):
        parts.append(shard_hashes(root, fmt, entry))
        where.append(np.full(len(parts[-1]), k, np.uint32))
    if not parts:
        return KeyColumns(np.empty(0, np.uint64), np.empty(0, np.uint32))
    hashes, shards = np.concatenate(parts), np.concatenate(where)
    order = np.lexsort((shards, hashes))
    return KeyColumns(hashes[order], shards[order])


def _starts(manifest: Manifest) -> np.ndarray:
    """Each shard's first sample's position in the dataset."""
    shards = manifest.shards
    counts = shards.samples if hasattr(shards, "samples") else [s.samples for s in shards]
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])


def dataset_columns(folder: str, manifest: Manifest) -> KeyColumns:
    """The dataset's key columns: its key file where it serves, else ``built`` from its shards."""
    cols = read_key_file(folder, manifest)
    return cols if cols is not None else built(folder, manifest)


def _candidates(cols: KeyColumns, hashes: np.ndarray) -> dict[int, list[int]]:
    """``shard -> positions in hashes`` of each of ``hashes`` the columns hold, by the shards
    holding it."""
    lo = np.searchsorted(cols.hashes, hashes, side="left")
    hi = np.searchsorted(cols.hashes, hashes, side="right")
    by: dict[int, list[int]] = {}
    for q in np.flatnonzero(hi > lo).tolist():
        for s in sorted(set(cols.shards[lo[q] : hi[q]].tolist())):
            by.setdefault(s, []).append(q)
    return by


def held_in(
    folder: str, manifest: Manifest, cols: KeyColumns
) -> Callable[[Sequence[str]], np.ndarray]:
    """``keys -> a bool each``: which of them the dataset holds (``plan_pack``'s ``existing``).
    Their hashes are looked up in ``cols``; a match is confirmed on the keys of the one shard
    holding that hash (its index's key table), so a collision never leaves a key out."""
    fmt = manifest.shard_format

    def held(keys: Sequence[str]) -> np.ndarray:
        found = np.zeros(len(keys), dtype=bool)
        for s, qs in sorted(_candidates(cols, key_hashes(keys)).items()):
            there = set(shard_table(folder, fmt, manifest.shards[s]).keys())
            for q in qs:
                found[q] |= keys[q] in there
        return found

    return held


def _keys_with(folder: str, manifest: Manifest, cols: KeyColumns, common: np.ndarray):
    """``{key: its first position in the dataset}`` of the samples whose hash is in ``common``
    (sorted): only the shards ``cols`` names for them are read."""
    fmt = manifest.shard_format
    starts = _starts(manifest)
    out: dict[str, int] = {}
    for s in sorted(_candidates(cols, common)):
        keys = list(shard_table(folder, fmt, manifest.shards[s]).keys())
        hashes = key_hashes(keys)
        for p in np.flatnonzero(np.isin(hashes, common)).tolist():
            out.setdefault(keys[p], int(starts[s]) + p)
    return out


def shared_keys(
    mine: tuple[str, Manifest, KeyColumns], theirs: tuple[str, Manifest, KeyColumns]
) -> list[tuple[int, str]]:
    """``(position in mine, key)`` of each of ``mine``'s keys that ``theirs`` holds too: the
    hashes both hold (the smaller's looked up in the larger's, a ``CHUNK`` at a time), each
    confirmed on the real keys of the shards holding it on both sides."""
    a, b = mine[2], theirs[2]
    small, large = (a, b) if len(a) <= len(b) else (b, a)
    common = []
    for i in range(0, len(small), CHUNK):
        piece = np.asarray(small.hashes[i : i + CHUNK])
        at = np.searchsorted(large.hashes, piece).clip(0, max(len(large) - 1, 0))
        if len(large):
            common.append(np.unique(piece[large.hashes[at] == piece]))
    common = np.unique(np.concatenate(common)) if common else np.empty(0, np.uint64)
    if not len(common):
        return []
    there = _keys_with(theirs[0], theirs[1], b, common)
    here = _keys_with(mine[0], mine[1], a, common)
    return sorted((p, k) for k, p in here.items() if k in there)


def _two_way(a: KeyColumns, b: KeyColumns) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The samples of ``a`` and ``b`` (each in key-file order, ``a``'s shards before ``b``'s)
    in key-file order (hash, then shard), in pieces of about ``CHUNK`` of the larger: cut
    where its hash changes, the smaller's below the cut added (hashes are uniform, so a piece
    of one is about as many of the other, pro rata). Each piece is ``a``'s part then ``b``'s,
    sorted stably by hash: two sorted runs merged, equal hashes left in shard order."""
    x, y = (a, b) if len(a) >= len(b) else (b, a)
    nx, x0, y0 = len(x), 0, 0
    while x0 < nx:
        x1 = min(x0 + CHUNK, nx)
        if x1 < nx:  # never between two equal hashes of x: y's equal ones go with them
            v = x.hashes[x1]
            cut = int(np.searchsorted(x.hashes, v, side="left"))
            x1 = cut if cut > x0 else int(np.searchsorted(x.hashes, v, side="right"))
        y1 = int(np.searchsorted(y.hashes, x.hashes[x1], side="left")) if x1 < nx else len(y)
        pieces = (x.at(x0, x1), y.at(y0, y1))
        (ha, sa), (hb, sb) = pieces if x is a else pieces[::-1]
        h, s = np.concatenate([ha, hb]), np.concatenate([sa, sb])
        order = np.argsort(h, kind="stable")
        yield h[order], s[order]
        x0, y0 = x1, y1
    for i in range(y0, len(y), CHUNK):
        yield y.at(i, i + CHUNK)


def _write(path: str, parts: Sequence[KeyColumns], digest: bytes, shards: int) -> str:
    """``parts`` (each sorted) merged into one key file at ``path``: two at a time, the
    first ones through a temporary file beside it."""
    if len(parts) > 2:
        tmp = path + ".part"
        try:
            _write(tmp, parts[:-1], bytes(32), shards)
            n = sum(len(p) for p in parts[:-1])
            mm = np.memmap(tmp, dtype=np.uint8, mode="r")
            joined = KeyColumns(mm[HEAD : HEAD + 8 * n].view("<u8"), mm[HEAD + 8 * n :].view("<u4"))
            done = _write(path, [joined, parts[-1]], digest, shards)
            del joined, mm
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return done
    n = sum(len(p) for p in parts)
    if len(parts) == 2:
        pieces = _two_way(*parts)
    else:
        one = parts[0] if parts else KeyColumns(np.empty(0, np.uint64), np.empty(0, np.uint32))
        pieces = (one.at(i, i + CHUNK) for i in range(0, n, CHUNK))
    head = MAGIC + n.to_bytes(8, "little") + shards.to_bytes(8, "little") + digest
    sha_h, sha_s = hashlib.sha256(head), hashlib.sha256()
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(HEAD + 12 * n)
        fd, at = f.fileno(), 0
        for h, s in pieces:  # in order: both columns' bytes digested as they are written
            hb, sb = h.astype("<u8").tobytes(), s.astype("<u4").tobytes()
            os.pwrite(fd, hb, HEAD + 8 * at)
            os.pwrite(fd, sb, HEAD + 8 * n + 4 * at)
            sha_h.update(hb)
            sha_s.update(sb)
            at += len(h)
        f.flush()
        os.fsync(fd)
    if at != n:  # pragma: no cover - a bug, never a user's
        raise AssertionError(f"{path}: wrote {at} of {n} key hashes")
    return _digest(sha_h, sha_s)


def write_key_file(staging: str, parts: Sequence[KeyColumns], shards: Sequence[ShardEntry]) -> dict:
    """The key file of the dataset whose manifest lists ``shards``, written into ``staging``
    from ``parts`` (each sorted, their shard positions the manifest's); returns what the
    manifest lists of it (``Manifest.keys``)."""
    path = os.path.join(staging, KEYS_NAME)
    sha = _write(path, list(parts), shards_digest(shards), len(shards))
    return {"path": KEYS_NAME, "sha256": sha, "bytes": HEAD + 12 * sum(len(p) for p in parts)}
