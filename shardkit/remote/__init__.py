"""Remote shards: object stores and HTTP through fsspec, with prefetch, retries and a cache.

Optional: needs fsspec plus the backend of the URL's protocol (``pip install shardkit[s3]`` for
``s3://``, ``[gcs]`` for ``gs://``, ``[azure]`` for ``az://``/``abfs://``, ``[http]`` for
``https://``). Nothing here is imported for local datasets.

- ``storage``: ``RemoteStorage``, the ``Storage`` that ``ShardDataset`` uses for URL sources
  (configuration only).
- ``fs``: fsspec filesystems built for streaming, one set per process.
- ``deadline``: a no-progress deadline for reads on protocols whose driver takes no timeout.
- ``cache``: ``ShardCache``, the shared on-disk cache behind ``cache_dir=``.
- ``prefetch``: the next shards fetched in the background while one is read.
- ``ranged``: ``RangesAhead``, a subset's or split's ranged GETs kept in flight ahead of the
  reader (``RemoteStorage(ranged_gets=)``), handed over in its order.
- ``fetch``: ``fetch``/``read_bytes``, whole-object reads with retries and resume.
- ``inspect``: ``read_manifest_url``/``local_copy``, what ``verify``/``dataset_info`` use for URLs.
- ``upload``: ``upload_file``/``Uploader``, what ``ShardWriter`` uses for a URL ``out``.

``shardkit.pack``, ``shardkit.write.verify.verify`` and ``dataset_info`` take URLs themselves.
The retry policy and the redaction of secrets in messages are ``shardkit.retry`` and
``shardkit.redact``: the local code paths use them too.
"""

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
    "ShardCache",
    "Uploader",
    "fetch",
    "filesystem",
    "is_remote_url",
    "join_url",
    "local_copy",
    "read_bytes",
    "read_manifest_url",
    "upload_file",
]
