"""Remote shards: object stores and HTTP through fsspec, with prefetch, retries and a cache.

Optional: needs fsspec plus the backend of the URL's protocol (``pip install shardkit[s3]`` for
``s3://``; ``aiohttp`` for ``https://``). Nothing here is imported for local datasets.

- ``RemoteStorage``: the ``Storage`` that ``ShardDataset`` uses for URL sources.
- ``ShardCache``: the shared on-disk cache behind ``cache_dir=``.
- ``fetch``/``read_bytes``: whole-object reads with retries and resume.
- ``read_manifest_url``/``local_copy``: what ``verify``/``dataset_info`` use for URLs.
- ``upload_file``/``Uploader``: what ``ShardWriter`` uses for a URL ``out``.
- ``pack_to_url``/``remote_verify``/``remote_dataset_info``: kept for existing code;
  ``shardkit.pack``, ``verify`` and ``dataset_info`` take URLs themselves.
"""

from ..redact import redact
from ..retry import RetryPolicy, is_transient
from .cache import CacheStats, ShardCache
from .fetch import Expected, FetchStats, MissingObjectError, fetch, read_bytes
from .fs import filesystem, is_remote_url
from .inspect import local_copy, read_manifest_url
from .storage import RemoteStorage
from .upload import Uploader, join_url, upload_file

__all__ = [
    "CacheStats",
    "Expected",
    "FetchStats",
    "MissingObjectError",
    "RemoteStorage",
    "RetryPolicy",
    "ShardCache",
    "Uploader",
    "fetch",
    "filesystem",
    "is_remote_url",
    "is_transient",
    "join_url",
    "local_copy",
    "pack_to_url",
    "read_bytes",
    "read_manifest_url",
    "redact",
    "remote_dataset_info",
    "remote_verify",
    "upload_file",
]


# --- kept for existing code: the library entry points take URLs themselves now --------------


def pack_to_url(src, url: str, *, storage_options=None, work_dir=None, concurrency=4, **kw):
    """``shardkit.pack(src, url)``: every finished shard uploaded at once, the manifest last."""
    from ..write.packer import pack

    return pack(
        src,
        url,
        storage_options=storage_options,
        work_dir=work_dir,
        upload_concurrency=concurrency,
        **kw,
    )


def remote_dataset_info(url: str, storage_options=None) -> dict:
    """``shardkit.write.verify.dataset_info(url)``."""
    from ..write.verify import dataset_info

    return dataset_info(url, storage_options)


def remote_verify(url: str, storage_options=None, *, decode=False, progress=False, work_dir=None):
    """``shardkit.write.verify.verify(url)``."""
    from ..write.verify import verify

    return verify(
        url, decode=decode, progress=progress, storage_options=storage_options, work_dir=work_dir
    )
