"""``shardkit info`` and ``shardkit verify`` for datasets behind a URL.

Same reports as the local commands (``shardkit.verify``): the manifest is read over the network,
and each shard is downloaded whole (with retries and resume) to a temporary file, handed to the
local ``verify_shard`` unchanged, and deleted, so at most one shard is on disk at a time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from .fetch import MissingObjectError, fetch
from .retry import RetryPolicy
from .upload import join_url

__all__ = ["read_manifest_url", "local_copy", "remote_dataset_info", "remote_verify"]

def read_manifest_url(url: str, storage_options: Mapping[str, Any] | None = None):
    """The manifest at ``url`` (a ``.../manifest.json`` URL or its prefix) and its own URL.

    A thin wrapper: ``shardkit.manifest.read_manifest`` is the one reader.
    """
    from ..manifest import manifest_location, read_manifest

    return read_manifest(url, storage_options=dict(storage_options or {})), manifest_location(url)


@contextlib.contextmanager
def local_copy(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    dir: str | None = None,
    policy: RetryPolicy | None = None,
) -> Iterator[str]:
    """A temporary local file with the object's bytes, as stored (nothing checked), then gone."""
    fd, path = tempfile.mkstemp(prefix="shardkit-", suffix="-" + url.rpartition("/")[2], dir=dir)
    try:
        with os.fdopen(fd, "w+b") as out:
            fetch(url, out, storage_options=storage_options, policy=policy)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def remote_dataset_info(url: str, storage_options: Mapping[str, Any] | None = None) -> dict:
    """What ``shardkit info URL`` prints: ``shardkit.verify.dataset_info``'s dict, from a URL."""
    from ..verify import manifest_info

    m, manifest_url = read_manifest_url(url, storage_options)
    return manifest_info(m, manifest_url)


def remote_verify(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    decode: bool = False,
    progress: bool = False,
    work_dir: str | None = None,
):
    """``shardkit verify URL``: a ``shardkit.verify.VerifyReport`` for a remote dataset."""
    from tqdm import tqdm

    from ..formats import get_format
    from ..verify import ShardProblem, VerifyReport, verify_shard

    m, manifest_url = read_manifest_url(url, storage_options)
    base = manifest_url.rpartition("/")[0]
    fmt = get_format(m.shard_format)
    bad: list[ShardProblem] = []
    decoded = 0
    bar = tqdm(m.shards, unit="shard", desc="verify", file=sys.stderr, disable=not progress or None)
    for entry in bar:
        try:
            with local_copy(join_url(base, entry.path), storage_options, dir=work_dir) as path:
                problems, n = verify_shard(
                    path, entry, fmt, decode=decode, num_classes=len(m.classes)
                )
        except MissingObjectError:
            problems, n = ["missing"], 0
        decoded += n
        if problems:
            bad.append(ShardProblem(entry.path, problems))
    return VerifyReport(
        out=base + "/",
        shards=len(m.shards),
        samples=m.num_samples,
        bytes=m.total_bytes,
        decoded=decoded,
        bad=bad,
    )
