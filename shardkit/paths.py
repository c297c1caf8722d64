"""What kind of path the user gave, checked before any work: one message per mistake.

A path that does not exist is called that (not "cannot tell the shard format" or "no
manifest"), and a shard given where a dataset (its directory or manifest.json) is expected is
named as a shard, not parsed as JSON.
"""

from __future__ import annotations

import os

from .errors import InputError
from .formats import is_shard_name

__all__ = ["check_dataset_path", "check_exists", "check_source"]


def check_exists(path: str, what: str = "dataset") -> None:
    """InputError naming ``path`` when nothing is there."""
    if not os.path.lexists(path):
        parent = os.path.dirname(os.path.normpath(path)) or "."
        where = "" if os.path.isdir(parent) else f" (nor does {parent}/)"
        raise InputError(f"{path}: no such file or directory{where}; check the {what} path")


def check_source(source: object, storage_options=None) -> None:
    """A ``ShardDataset`` source that names one path (no glob or brace pattern): it must exist,
    and a URL's bucket must exist; checked before the source is resolved."""
    if not isinstance(source, (str, os.PathLike)):
        return
    text = os.fspath(source)
    if not text or any(c in text for c in "*?[") or ("{" in text and "}" in text):
        return
    if "://" in text and not text.startswith("file://"):
        from .remote.fetch import check_bucket

        check_bucket(text, storage_options)
        return
    check_exists(text.removeprefix("file://"))


def check_dataset_path(path: str) -> None:
    """``path`` must be a packed dataset's directory or its manifest.json."""
    check_exists(path)
    if os.path.isdir(path):
        return
    name = os.path.basename(path)
    if is_shard_name(name):
        parent = os.path.dirname(path) or "."
        raise InputError(
            f"{path} is a shard, not a dataset; pass the directory that holds the shards and "
            f"manifest.json ({parent}/) or the manifest itself"
        )
    if not name.endswith(".json"):
        raise InputError(
            f"{path} is a file, not a dataset; pass a shard directory or its manifest.json"
        )
