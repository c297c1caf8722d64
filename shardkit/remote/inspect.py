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

from ..errors import ManifestError
from .fetch import MissingObjectError, fetch, read_bytes
from .retry import RetryPolicy
from .upload import join_url, url_name, url_parent

__all__ = ["read_manifest_url", "local_copy", "remote_dataset_info", "remote_verify"]

MANIFEST_NAME = "manifest.json"


def read_manifest_url(url: str, storage_options: Mapping[str, Any] | None = None):
    """The manifest at ``url`` (a ``.../manifest.json`` URL or its prefix) and its own URL."""
    from ..manifest import Manifest

    manifest_url = url if url_name(url) == MANIFEST_NAME else join_url(url, MANIFEST_NAME)
    try:
        text = read_bytes(manifest_url, storage_options)
    except MissingObjectError:
        raise ManifestError(
            f"{manifest_url}: no manifest; pack into this prefix with `shardkit pack SRC {url}`"
        ) from None
    return Manifest.from_json(text, source=manifest_url), manifest_url


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
    base = url_parent(manifest_url)
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
        out=join_url(base, ""),
        shards=len(m.shards),
        samples=m.num_samples,
        bytes=m.total_bytes,
        decoded=decoded,
        bad=bad,
    )
