"""How datasets reach bytes: a small ``Storage`` protocol and its local implementation.

Datasets never call ``open()`` on a shard or image themselves; they ask a ``Storage``. That is the
seam where remote object stores plug in (``shardkit.remote.RemoteStorage``, chosen by
``storage_for`` for URLs), and where the benchmarks inject latency to show that a folder of files
pays a storage round trip per image while shards pay it once per shard.

A storage has a lifecycle: ``close()`` ends whatever it runs in the background (prefetch threads,
fetched shards nobody took). The read path (``shardkit.stream.stages.read_slices``) calls it when a
read ends or is abandoned, so nothing outlives an iteration; the storage stays usable afterwards.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import BinaryIO, Protocol, runtime_checkable

from ..errors import InputError, ShardFormatError, StorageError
from ..fsutil import open_regular
from ..records import UNKNOWN, ShardInfo
from ..urls import is_url

__all__ = ["Storage", "LocalStorage", "storage_for", "is_url", "url_of"]  # is_url: from .urls

#: Read buffer for local shards: large sequential reads, few syscalls per shard.
DEFAULT_BUFFER = 1 << 20


@runtime_checkable
class Storage(Protocol):
    """What a dataset needs from wherever the shards live.

    Implementations must be picklable without open handles (DataLoader workers may be spawned),
    and safe to use from several worker processes at once. Objects are named by a ``ShardInfo``
    (what the manifest says about a shard: size and sha256 to verify against) or a plain URL/path.
    """

    def open(self, shard: ShardInfo | str) -> BinaryIO:
        """A readable binary stream over the whole object, read front to back."""
        ...

    def local_path(self, shard: ShardInfo | str) -> str:
        """A path on this machine with the object's bytes (LMDB can only open local files)."""
        ...

    def prefetch(self, shards: Sequence[ShardInfo | str]) -> None:
        """A hint: these objects will be opened next, in this order. May do nothing."""
        ...

    def close(self) -> None:
        """Stop background work and drop what was fetched ahead; later calls start afresh."""
        ...


def url_of(shard: ShardInfo | str) -> str:
    """The URL or path of a ``ShardInfo`` or of a plain string."""
    return shard if isinstance(shard, str) else shard.url


class LocalStorage:
    """Files on this machine.

    ``latency_ms`` sleeps on every ``open()`` and ``local_path()``: a simulation knob for the
    benchmarks, standing in for an object store's time to first byte. A folder dataset pays it per
    image, a shard dataset per shard. Keep it 0 for real work.
    """

    def __init__(self, latency_ms: float = 0.0, buffer_size: int = DEFAULT_BUFFER):
        if latency_ms < 0:
            raise InputError(f"latency_ms={latency_ms} must be >= 0")
        self.latency_ms = float(latency_ms)
        self.buffer_size = int(buffer_size)

    def __repr__(self) -> str:
        return f"LocalStorage(latency_ms={self.latency_ms})"

    def _wait(self) -> None:
        if self.latency_ms:
            time.sleep(self.latency_ms / 1000.0)

    def open(self, shard: ShardInfo | str) -> BinaryIO:
        self._wait()
        path = _strip_file_scheme(url_of(shard))
        try:
            f = open_regular(path, buffering=self.buffer_size)  # a FIFO: refused
        except FileNotFoundError:
            raise StorageError(
                f"{path}: no such file (was it moved or deleted after the dataset was built?)"
            ) from None
        except OSError as exc:
            raise StorageError(f"{path}: cannot open: {exc.strerror or exc}") from None
        expected = shard.bytes if isinstance(shard, ShardInfo) else UNKNOWN
        if expected != UNKNOWN and (size := os.fstat(f.fileno()).st_size) != expected:
            # one fstat per shard: a shard replaced by another pack mid-epoch would otherwise
            # be read at the old plan's offsets, giving duplicates and misses without an error
            f.close()
            how = "shorter" if size < expected else "longer"
            raise ShardFormatError(
                f"{path}: {size} bytes, {how} than its manifest says ({expected}): the shard "
                "changed after packing (replaced, truncated, or re-packed while training?); "
                "re-pack it, or build the ShardDataset again"
            )
        return f

    def local_path(self, shard: ShardInfo | str) -> str:
        self._wait()
        path = _strip_file_scheme(url_of(shard))
        if not os.path.exists(path):
            raise StorageError(
                f"{path}: no such file (was it moved or deleted after the dataset was built?)"
            )
        return path

    def prefetch(self, shards: Sequence[ShardInfo | str]) -> None:
        """Local files need no prefetch; the page cache and read-ahead do that job."""

    def close(self) -> None:
        """Nothing runs in the background: nothing to stop."""


def _strip_file_scheme(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def storage_for(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    storage_options: dict | None = None,
    cache_dir: str | None = None,
    cache_limit: int | str | None = None,
    prefetch: int = 2,
) -> Storage:
    """The storage a source needs: ``LocalStorage`` for paths, ``RemoteStorage`` for URLs.

    ``storage_options`` (fsspec options, e.g. credentials or endpoint), ``cache_dir`` and
    ``cache_limit`` (bytes or a size string like "10GB") and ``prefetch`` (shards fetched ahead)
    only matter for URLs; they are handed to ``shardkit.remote.RemoteStorage``, imported only when
    needed so local use never touches network libraries.
    """
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not any(is_url(os.fspath(s)) for s in items):
        return LocalStorage()
    from ..remote.storage import RemoteStorage

    return RemoteStorage(
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit=cache_limit,
        prefetch=prefetch,
    )
