"""The keys a dataset already holds: what growing it (``pack --append``, ``merge``, ``index
--append``) must not add again, since keys are unique within a dataset (FORMAT.md).

Growth costs what it adds, not what is there: the keys to add are hashed (the split hash,
``sample_index.key_hashes``: 8 bytes a key, held sorted), and each shard of the dataset is
compared by the key hashes its index already stores (the hash column of a tar's ``.idx``, the
index record of an LMDB shard), one shard at a time; no byte of an old tar is read. Only a shard
where a hash matches has its keys read, to confirm each match on the real key (a 64-bit hash may
collide). A shard without an index (an older pack, a compressed tar) gives its keys from its
headers instead, as before. Memory: the new keys' hashes and one shard's column.

A merge also compares whole datasets by ``identity``: the sha256 over its shards' digests, the
same for a copy of the same shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ..formats import get_format
from ..formats.lmdb import lmdb_keys, read_lmdb_index
from ..formats.sample_index import (
    columns_size,
    decode_columns,
    index_path,
    key_hashes,
    load_index,
    read_local,
)
from ..formats.tar import tally_tar
from ..manifest import Manifest, ShardEntry

__all__ = ["dataset_keys", "found_in", "held_by", "identity", "repeats_across", "shard_hashes"]


def shard_keys(path: str, fmt: str) -> Iterable[str]:
    """The keys of one local shard, in order, read from the shard itself."""
    if fmt == "tar" and not path.endswith((".gz", ".tgz")):
        return tally_tar(path, shard=path, keys=True).keys
    if fmt == "lmdb":
        return lmdb_keys(path, path)
    return (r.key for r in get_format(fmt).iter_records(path, shard=path))


def dataset_keys(folder: str, manifest: Manifest) -> set[str]:
    """Every key of the dataset in ``folder`` (``manifest``: its manifest), as a set: what a
    caller that needs the keys themselves gets; growth checks use ``found_in`` instead."""
    keys: set[str] = set()
    for s in manifest.shards:
        keys.update(shard_table(folder, manifest.shard_format, s).keys())
    return keys


class _Keys:
    """A key list with the ``KeyTable`` lookups (``key(i)``, ``keys()``)."""

    def __init__(self, keys: Iterable[str]):
        self._keys = list(keys)

    def key(self, i: int) -> str:
        return self._keys[i]

    def keys(self) -> list[str]:
        return self._keys


def shard_hashes(folder: str, fmt: str, entry: ShardEntry) -> np.ndarray:
    """The key hash of each sample of one local shard, in stored order: the index's stored
    column where the shard has one (16 bytes a sample read: its offsets and hashes), else hashed
    from the keys of the shard itself (an older pack, a compressed tar)."""
    return _hashes(folder, fmt, entry)[0]


def _hashes(folder: str, fmt: str, entry: ShardEntry) -> tuple[np.ndarray, object | None]:
    """``shard_hashes``, and the shard's key table where it was loaded for them (else None).

    A tar index's stored hashes are used as they stand only once the whole file's sha256 is
    the manifest's ``index_sha256`` (the packer's file, the split's rule): a hash column damaged
    with its trailer fixed up would otherwise hide a key the dataset holds and let it in twice.
    Any other index (no ``index_sha256`` listed) has its keys hashed again; one that does not
    match the manifest serves not at all (a warning names it) and the shard's headers do."""
    path = os.path.join(folder, entry.path)
    if fmt == "tar" and entry.path.endswith(".tar") and entry.sha256 and entry.samples >= 0:
        idx = index_path(path)
        data = read_local(idx)  # ~90 bytes a sample: hashed whole, held one shard at a time
        if data is not None:
            if entry.index_sha256 and hashlib.sha256(data).hexdigest() == entry.index_sha256:
                head = data[: columns_size(entry.samples)]
                cols = decode_columns(head, idx, entry.samples, entry.bytes, entry.sha256)
                if cols is not None:  # else a warning named it: its headers serve
                    return cols.hashes.astype(np.uint64), None
            else:
                args = (entry.samples, entry.bytes, entry.sha256, entry.index_sha256)
                index = load_index(data, idx, *args)
                if index is not None:
                    return key_hashes(index.keys()), index
    elif fmt == "lmdb":
        index = read_lmdb_index(path, path, entry.samples)[0]
        if index is not None:
            return index.hashes.astype(np.uint64), index
    table = _Keys(shard_keys(path, fmt))
    return key_hashes(table.keys()), table


def shard_table(folder: str, fmt: str, entry: ShardEntry):
    """One local shard's keys with ``key(i)`` and ``keys()``: its index's key table (checked
    against the manifest, one read), else the keys read from the shard."""
    path = os.path.join(folder, entry.path)
    if fmt == "tar" and entry.path.endswith(".tar") and entry.sha256:
        where = index_path(path)
        args = (entry.samples, entry.bytes, entry.sha256, entry.index_sha256)
        index = load_index(read_local(where), where, *args)
        if index is not None:
            return index
    elif fmt == "lmdb":
        index = read_lmdb_index(path, path, entry.samples)[0]
        if index is not None:
            return index
    return _Keys(shard_keys(path, fmt))


def found_in(
    folder: str, manifest: Manifest, hashes: np.ndarray, key_of: Callable[[int], str]
) -> np.ndarray:
    """Which of some keys the dataset in ``folder`` already holds: a bool per key. The keys
    are given as ``hashes`` (``key_hashes`` of each) and ``key_of(i)`` (key ``i`` itself, asked
    only where a stored hash matches: to confirm it). Each shard's stored hashes are compared
    against the sorted ``hashes``; a shard's keys are read only where one matches."""
    hashes = np.asarray(hashes, dtype=np.uint64)
    found = np.zeros(len(hashes), dtype=bool)
    if not len(hashes):
        return found
    order = np.argsort(hashes, kind="stable")
    wanted = hashes[order]
    for entry in manifest.shards:
        stored, table = _hashes(folder, manifest.shard_format, entry)
        at = np.searchsorted(wanted, stored)
        hit = np.flatnonzero(wanted[np.minimum(at, len(wanted) - 1)] == stored)
        if not len(hit):
            continue
        if table is None:
            table = shard_table(folder, manifest.shard_format, entry)
        pairs = []  # (position among the keys given, the stored key its hash matched)
        for p in hit.tolist():
            hi = int(np.searchsorted(wanted, stored[p], side="right"))
            key = table.key(p)
            pairs.extend((q, key) for q in order[int(at[p]) : hi].tolist())
        for q, key in sorted(pairs):  # in order: ``key_of`` reads each shard of theirs once
            if not found[q] and key_of(q) == key:
                found[q] = True
    return found


def held_by(folder: str, manifest: Manifest) -> Callable[[Sequence[str]], np.ndarray]:
    """``keys -> a bool each``: which of them the dataset in ``folder`` holds (``found_in``),
    what ``plan_pack``'s ``existing`` asks of the dataset an append adds to."""

    def held(keys: Sequence[str]) -> np.ndarray:
        return found_in(folder, manifest, key_hashes(keys), keys.__getitem__)

    return held


class DatasetKeys:
    """The keys of one local dataset by position, from its shards' key tables (one shard's
    table held at a time: a merge's confirmations come in shard order)."""

    def __init__(self, folder: str, manifest: Manifest):
        self.folder, self.manifest = folder, manifest
        self.starts = np.cumsum([0, *(s.samples for s in manifest.shards)])
        self._held: tuple[int, object] | None = None

    def hashes(self) -> np.ndarray:
        """Every sample's key hash, in stored order (8 bytes a sample)."""
        fmt = self.manifest.shard_format
        parts = [shard_hashes(self.folder, fmt, s) for s in self.manifest.shards]
        return np.concatenate(parts) if parts else np.empty(0, np.uint64)

    def key(self, i: int) -> str:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        if self._held is None or self._held[0] != k:
            entry = self.manifest.shards[k]
            self._held = (k, shard_table(self.folder, self.manifest.shard_format, entry))
        return self._held[1].key(i - int(self.starts[k]))


def repeats_across(datasets: Sequence[tuple[str, Manifest]], start: int = 1):
    """The first dataset from ``start`` on holding a key of one before it, as ``(its position,
    how many of its keys an earlier one holds, the first of them in stored order)``; None when
    no key repeats across them. Each dataset checked is held as its key hashes (8 bytes a
    sample); those before it are read shard by shard (``found_in``)."""
    for i in range(start, len(datasets)):
        folder, manifest = datasets[i]
        mine = DatasetKeys(folder, manifest)
        hashes = mine.hashes()
        seen = np.zeros(len(hashes), dtype=bool)
        for earlier, m in datasets[:i]:
            seen |= found_in(earlier, m, hashes, mine.key)
        if seen.any():
            return i, int(seen.sum()), mine.key(int(np.argmax(seen)))
    return None


def identity(manifest: Manifest) -> str:
    """``sha256:...`` over the shards' sample counts and digests: the same for the same shards,
    wherever they lie (a copy, a symbolic link, a hard-linked merge)."""
    doc = [[s.samples, s.sha256] for s in manifest.shards]
    return "sha256:" + hashlib.sha256(json.dumps(doc).encode()).hexdigest()
