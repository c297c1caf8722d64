"""What ``shardkit.verify`` needs for datasets behind a URL: the manifest and local shard copies.

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

from ..errors import ManifestError
from .fetch import MissingObjectError, fetch, read_bytes
from .retry import RetryPolicy
from .upload import check_bucket, join_url, url_name

__all__ = ["read_manifest_url", "local_copy"]

MANIFEST_NAME = "manifest.json"


def read_manifest_url(url: str, storage_options: Mapping[str, Any] | None = None):
    """The manifest at ``url`` (a ``.../manifest.json`` URL or its prefix) and its own URL."""
    from ..manifest import Manifest

    manifest_url = url if url_name(url) == MANIFEST_NAME else join_url(url, MANIFEST_NAME)
    try:
        text = read_bytes(manifest_url, storage_options)
    except MissingObjectError:
        check_bucket(url, storage_options)  # a missing bucket is named as such
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
