"""The keys a dataset already holds: what growing it (``pack --append``, ``merge``) must not add
again, since keys are unique within a dataset (FORMAT.md).

The keys are read from the shards themselves, not from a list kept beside them, so they are
right for any dataset (packed, appended, merged, indexed): a tar shard by its headers only (no
image bytes are read), an LMDB shard by its index record (or, packed before it, by the start of
each record). A merge also compares whole datasets by ``identity``: the sha256 over its shards'
digests, the same for a copy of the same shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

from ..formats import get_format
from ..formats.lmdb import lmdb_keys
from ..formats.tar import tally_tar
from ..manifest import Manifest

__all__ = ["dataset_keys", "first_repeat", "identity"]


def shard_keys(path: str, fmt: str) -> Iterable[str]:
    """The keys of one local shard, in order."""
    if fmt == "tar" and not path.endswith((".gz", ".tgz")):
        return tally_tar(path, shard=path, keys=True).keys
    if fmt == "lmdb":
        return lmdb_keys(path, path)
    return (r.key for r in get_format(fmt).iter_records(path, shard=path))


def dataset_keys(folder: str, manifest: Manifest) -> set[str]:
    """Every key of the dataset in ``folder`` (``manifest``: its manifest)."""
    keys: set[str] = set()
    for s in manifest.shards:
        keys.update(shard_keys(os.path.join(folder, s.path), manifest.shard_format))
    return keys


def first_repeat(folder: str, manifest: Manifest, seen: set[str]) -> tuple[int, str | None]:
    """Add the keys of the dataset in ``folder`` to ``seen``: ``(how many were there already,
    the first of them)``."""
    repeats, first = 0, None
    for s in manifest.shards:  # in shard order: the first repeat named is always the same
        for k in shard_keys(os.path.join(folder, s.path), manifest.shard_format):
            if k in seen:
                repeats += 1
                first = first if first is not None else k
            else:
                seen.add(k)
    return repeats, first


def identity(manifest: Manifest) -> str:
    """``sha256:...`` over the shards' sample counts and digests: the same for the same shards,
    wherever they lie (a copy, a symbolic link, a hard-linked merge)."""
    doc = [[s.samples, s.sha256] for s in manifest.shards]
    return "sha256:" + hashlib.sha256(json.dumps(doc).encode()).hexdigest()
