"""The keys a dataset already holds: what growing it (``pack --append``, ``merge``, ``index
--append``) must not add again, since keys are unique within a dataset (FORMAT.md).

Growth reads the dataset's key file (``write.keyfile``); this module reads one shard's keys:
its key hashes (``shard_hashes``: the hash column of a tar's ``.idx`` or of an LMDB shard's
index record, 16 bytes a sample read) and its keys (``shard_table``), what a key file is built
from where a dataset has none, and what confirms a hash the key file matched. No byte of an old
tar is read. A shard without an index (an older pack, a compressed tar) gives its keys from its
headers instead. The stored hashes are checked by the keys, not only by the manifest's
checksums: an edited column with its checksums computed again would hide a key the dataset
holds, and be handed on to the grown dataset (``_hashes`` refuses it).

A merge also compares whole datasets by ``identity``: the sha256 over its shards' digests, the
same for a copy of the same shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

import numpy as np

from ..errors import InputError
from ..formats import get_format
from ..formats.lmdb import lmdb_keys, read_lmdb_index
from ..formats.sample_index import index_path, key_hashes, load_index, read_local, table_hashes
from ..formats.tar import tally_tar
from ..manifest import Manifest, ShardEntry

__all__ = ["dataset_keys", "identity", "shard_hashes", "shard_table"]


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


def identity(manifest: Manifest) -> str:
    """``sha256:...`` over the shards' sample counts and digests: the same for the same shards,
    wherever they lie (a copy, a symbolic link, a hard-linked merge)."""
    doc = [[s.samples, s.sha256] for s in manifest.shards]
    return "sha256:" + hashlib.sha256(json.dumps(doc).encode()).hexdigest()
