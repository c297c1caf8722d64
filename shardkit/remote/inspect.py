"""What ``shardkit.write.verify`` needs for datasets behind a URL: the manifest and local shard
copies.

``verify``/``dataset_info`` read the manifest over the network with ``read_manifest_url``, and
download each shard whole (with retries and resume) with ``local_copy`` to a temporary file that
is deleted after, so at most one shard is on disk at a time.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from ..retry import RetryPolicy
from ..urls import url_name
from .fetch import fetch

__all__ = ["read_manifest_url", "local_copy"]


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
    fd, path = tempfile.mkstemp(prefix="shardkit-", suffix="-" + url_name(url), dir=dir)
    try:
        with os.fdopen(fd, "w+b") as out:
            fetch(url, out, storage_options=storage_options, policy=policy)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
