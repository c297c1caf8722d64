"""The keys a dataset already holds: what growing it (``pack --append``, ``merge``, ``index
--append``) must not add again, since keys are unique within a dataset (FORMAT.md).

Growth costs what it adds, not what is there: the keys to add are hashed (the split hash,
``sample_index.key_hashes``: 8 bytes a key, held sorted), and each shard of the dataset is
compared by the key hashes its index already stores (the hash column of a tar's ``.idx``, the
index record of an LMDB shard), one shard at a time; no byte of an old tar is read. Only a shard
where a hash matches has its keys read, to confirm each match on the real key (a 64-bit hash may
collide). A shard without an index (an older pack, a compressed tar) gives its keys from its
headers instead, as before. Memory: the new keys' hashes (a merge: the smaller dataset's of
each pair) and one shard's index. CPU per old sample: its index read whole and sha256-ed
(~90 bytes a sample, which the manifest's ``index_sha256`` covers), its key hashed (in C,
~0.13 us) to check the stored hash, and one lookup in a bit table; per old shard, one open.
The stored hashes are checked by the keys, not only by the manifest's checksums: an edited
column with its checksums computed again would hide a key the dataset holds, and be handed on
to the grown dataset (``_hashes`` refuses it).

A merge also compares whole datasets by ``identity``: the sha256 over its shards' digests, the
same for a copy of the same shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..errors import InputError
from ..formats import get_format
from ..formats.lmdb import lmdb_keys, read_lmdb_index
from ..formats.sample_index import index_path, key_hashes, load_index, read_local, table_hashes
from ..formats.tar import tally_tar
from ..manifest import Manifest, ShardEntry

__all__ = [
    "check_columns",
    "dataset_keys",
    "found_in",
    "held_by",
    "identity",
    "repeats_across",
    "shard_hashes",
]


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

    An index's stored hashes are used only once they are its keys' own (``table_hashes``, in
    C): a manifest's ``index_sha256`` and ``columns_sha256`` vouch for the file, not for the
    column, since anyone editing it can compute them again. A column that is not its keys'
    would hide a key the dataset holds (let in twice) and be handed on to the grown dataset:
    it is an ``InputError`` naming the index (``_unvouched``), and nothing is written. A tar
    index that does not match the manifest serves not at all (a warning names it) and the
    shard's headers do."""
    path = os.path.join(folder, entry.path)
    index = None
    if fmt == "tar" and entry.path.endswith(".tar") and entry.sha256 and entry.samples >= 0:
        idx = index_path(path)
        args = (entry.samples, entry.bytes, entry.sha256, entry.index_sha256)
        index = load_index(read_local(idx), idx, *args)  # ~90 bytes a sample, one shard held
        what = f"{idx}: its"
    elif fmt == "lmdb":
        index = read_lmdb_index(path, path, entry.samples)[0]
        what = f"{path}: its index record's"
    if index is not None:
        hashes = table_hashes(index)
        if not np.array_equal(hashes, index.hashes):
            raise _unvouched(what, int(np.count_nonzero(hashes != index.hashes)), fmt, folder)
        return hashes, index
    table = _Keys(shard_keys(path, fmt))
    return key_hashes(table.keys()), table


def _unvouched(what: str, bad: int, fmt: str, folder: str) -> InputError:
    fix = (
        f"delete the shard's .idx and run `shardkit index {folder}`"
        if fmt == "tar"
        else "re-pack the shard"
    )
    return InputError(
        f"{what} {bad} stored split hash(es) are not their keys' hashes (the index is damaged "
        f"or was edited, its checksums computed again); growing the dataset would hand the "
        f"wrong column on: rebuild it first ({fix})"
    )


def check_columns(folder: str, manifest: Manifest) -> None:
    """Every shard's stored hash column checked against its keys (``_hashes``), where a
    growth makes no key check of its own that would (``allow_duplicates``)."""
    for entry in manifest.shards:
        _hashes(folder, manifest.shard_format, entry)


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


class _Wanted:
    """Some keys' hashes, sorted, with a bit table in front: each stored hash of a shard is
    tested against the table (one array lookup), and only the few that pass (the keys wanted,
    and about 1 in 32 others) are searched for among the sorted hashes. Memory: 48 bytes a key
    at most (its hash, its position, the table at 32 entries a key), none per stored sample."""

    #: The bit table holds at least this many and at most ``MAX_TABLE`` entries.
    MIN_TABLE, MAX_TABLE = 1 << 12, 1 << 24

    def __init__(self, hashes: np.ndarray):
        hashes = np.asarray(hashes, dtype=np.uint64)
        self.order = np.argsort(hashes, kind="stable")
        self.sorted = hashes[self.order]
        size = min(self.MAX_TABLE, max(self.MIN_TABLE, 32 * len(hashes)))
        bits = int(size - 1).bit_length()
        self.shift = np.uint64(64 - bits)
        self.table = np.zeros(1 << bits, dtype=bool)
        self.table[self.sorted >> self.shift] = True

    def __len__(self) -> int:
        return len(self.sorted)

    def hits(self, stored: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The positions in ``stored`` whose hash is wanted, and for each the range
        ``lo .. hi`` of ``order`` (the wanted keys with that hash)."""
        at = np.flatnonzero(self.table[stored >> self.shift])
        if not len(at):
            return at, at, at
        some = stored[at]
        lo = np.searchsorted(self.sorted, some, side="left")
        hi = np.searchsorted(self.sorted, some, side="right")
        keep = hi > lo
        return at[keep], lo[keep], hi[keep]


def _matches(
    folder: str, manifest: Manifest, wanted: _Wanted, key_of: Callable[[int], str]
) -> Iterator[tuple[int, int, int]]:
    """``(shard, position in it, position among the wanted keys)`` of each sample of the
    dataset in ``folder`` whose key is one of ``wanted``: each shard's stored hashes tested
    against ``wanted`` (one shard's column held at a time), a match confirmed on the real keys
    (the shard's key, and ``key_of(q)`` for wanted key ``q``, asked in order of ``q``)."""
    if not len(wanted):
        return
    for k, entry in enumerate(manifest.shards):
        pairs = _pairs(folder, manifest.shard_format, entry, wanted)  # its index dropped after
        for q, p, key in pairs:  # in order: ``key_of`` reads each shard of theirs once
            if key_of(q) == key:
                yield k, p, q


def _pairs(folder: str, fmt: str, entry: ShardEntry, wanted: _Wanted) -> list[tuple]:
    """``(wanted position, position in the shard, the stored key its hash matched)`` of one
    shard, sorted; nothing of the shard's index is held once it returns."""
    stored, table = _hashes(folder, fmt, entry)
    at, lo, hi = wanted.hits(stored)
    if not len(at):
        return []
    if table is None:
        table = shard_table(folder, fmt, entry)
    pairs = []
    for p, a, b in zip(at.tolist(), lo.tolist(), hi.tolist(), strict=True):
        key = table.key(p)
        pairs.extend((q, p, key) for q in wanted.order[a:b].tolist())
    return sorted(pairs)


def found_in(
    folder: str, manifest: Manifest, hashes: np.ndarray, key_of: Callable[[int], str]
) -> np.ndarray:
    """Which of some keys the dataset in ``folder`` already holds: a bool per key. The keys
    are given as ``hashes`` (``key_hashes`` of each) and ``key_of(i)`` (key ``i`` itself, asked
    only where a stored hash matches: to confirm it). Each shard's stored hashes are compared
    against the sorted ``hashes`` (``_Wanted``); a shard's keys are read only where one matches."""
    found = np.zeros(len(hashes), dtype=bool)
    for _, _, q in _matches(folder, manifest, _Wanted(hashes), key_of):
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
    no key repeats across them.

    Each pair is compared by holding the smaller dataset's key hashes (8 bytes a sample, and
    ``_Wanted``'s table) and reading the larger one's shard by shard (``_matches``): a merge of
    a few new samples with a large dataset holds the few, in whichever order they are named."""
    for i in range(start, len(datasets)):
        folder, manifest = datasets[i]
        mine = DatasetKeys(folder, manifest)
        held: _Wanted | None = None  # this dataset's hashes, once one earlier is larger
        found: list[int] = []  # positions of this dataset's keys an earlier one holds
        for earlier, m in datasets[:i]:
            if _count(m) >= _count(manifest):  # hold mine, read theirs
                if held is None:
                    held = _Wanted(mine.hashes())
                found.extend(q for _, _, q in _matches(earlier, m, held, mine.key))
            else:  # hold theirs, read mine
                theirs = DatasetKeys(earlier, m)
                matches = _matches(folder, manifest, _Wanted(theirs.hashes()), theirs.key)
                found.extend(int(mine.starts[k]) + p for k, p, _ in matches)
        if found:
            first = min(found)
            return i, len(set(found)), mine.key(first)
    return None


def _count(manifest: Manifest) -> int:
    """Samples of a dataset, as far as its manifest knows them (a shard of unknown count: 0)."""
    return sum(max(0, s.samples) for s in manifest.shards)


def identity(manifest: Manifest) -> str:
    """``sha256:...`` over the shards' sample counts and digests: the same for the same shards,
    wherever they lie (a copy, a symbolic link, a hard-linked merge)."""
    doc = [[s.samples, s.sha256] for s in manifest.shards]
    return "sha256:" + hashlib.sha256(json.dumps(doc).encode()).hexdigest()
