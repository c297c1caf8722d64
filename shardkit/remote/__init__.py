"""Remote shards: object stores and HTTP through fsspec, with prefetch, retries and a cache.

Optional: needs fsspec plus the backend of the URL's protocol (``pip install shardkit[s3]`` for
``s3://``; ``aiohttp`` for ``https://``). Nothing here is imported for local datasets.

- ``RemoteStorage``: the ``Storage`` that ``ShardDataset`` uses for URL sources.
- ``ShardCache``: the shared on-disk cache behind ``cache_dir=``.
- ``fetch``/``read_bytes``: whole-object reads with retries and resume.
- ``remote_dataset_info``/``remote_verify``: ``shardkit info``/``verify`` for URLs.
- ``upload_file``/``Uploader``/``pack_to_url``: ``shardkit pack SRC s3://bucket/prefix/``.
"""

from .cache import CacheStats, ShardCache
from .fetch import Expected, FetchStats, MissingObjectError, fetch, read_bytes
from .fs import filesystem, is_remote_url
from .inspect import local_copy, read_manifest_url, remote_dataset_info, remote_verify
from .redact import redact
from .retry import RetryPolicy, is_transient
from .storage import RemoteStorage
from .upload import Uploader, join_url, pack_to_url, upload_file

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
