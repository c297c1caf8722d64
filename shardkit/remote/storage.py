"""``RemoteStorage``: the ``shardkit.storage.Storage`` protocol over object stores and HTTP.

What a DataLoader worker gets from it: the shard it asks for, fetched whole with one large
sequential read (retried and resumed on failure), verified against the manifest's size and sha256,
while the next ``prefetch`` shards of its plan download in the background; with ``cache_dir``, from
a machine-wide cache that every worker and rank shares.

Process model: the object holds configuration only. Filesystems, threads and the cache handle are
built lazily in the process that uses them and rebuilt when the pid changes, so the object pickles
cheaply into spawned workers and survives ``fork`` (fsspec's event loop and sessions never cross
it). No network call happens before the first ``open``/``local_path``/``prefetch``.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing.util
import os
import posixpath
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ..errors import InputError
from .cache import ShardCache
from .fetch import CHUNK, Expected, FetchStats, MissingObjectError, fetch, read_bytes
from .fs import DEFAULT_TIMEOUT
from .prefetch import Prefetcher
from .retry import RetryPolicy

__all__ = ["RemoteStorage", "expected_from_manifest"]

MANIFEST_NAME = "manifest.json"


def expected_from_manifest(manifest: Any, manifest_url: str) -> dict[str, Expected]:
    """URL -> (size, sha256) for every shard of a ``shardkit.manifest.Manifest`` at that URL."""
    base = manifest_url.rsplit("/", 1)[0]
    return {
        posixpath.join(base, e.path) if "://" not in e.path else e.path: Expected(
            int(e.bytes), str(e.sha256) or None
        )
        for e in manifest.shards
    }


@dataclass
class _Shard:
    """A fetched object: an open file to read, and its path when it lives on disk."""

    file: BinaryIO
    path: str | None = None


@dataclass
class _Runtime:
    """Everything that must not cross a process boundary."""

    pid: int
    prefetcher: Prefetcher
    cache: ShardCache | None
    manifests: dict[str, dict[str, Expected]] = field(default_factory=dict)
    manifest_lock: threading.Lock = field(default_factory=threading.Lock)
    fetch_stats: FetchStats = field(default_factory=FetchStats)
    fetched: int = 0
    scratch: str | None = None  # private dir for LMDB shards when there is no cache
    local_files: list[str] = field(default_factory=list)


class RemoteStorage:
    """Shards behind URLs (``s3://``, ``gs://``, ``https://``, ``file://`` ... any fsspec URL).

    ``storage_options``: fsspec options (credentials, ``endpoint_url`` for S3-compatible stores,
    ``client_kwargs``); credentials otherwise come from the environment and config files as the
    backend (s3fs, gcsfs, adlfs) looks them up. ``cache_dir``/``cache_limit`` (bytes): the shared
    shard cache (see ``shardkit.remote.cache``). ``prefetch``: shards fetched ahead per worker
    (0 turns it off). ``retries``/``backoff``: the retry budget (see ``RetryPolicy``).
    ``timeout``: seconds without progress before an attempt counts as stalled. ``expected``: URL ->
    ``Expected(size, sha256)``; without it (and with ``verify=True``) each directory's
    ``manifest.json`` is read once per process, when present, to verify its shards.
    """

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_limit: int | None = None,
        prefetch: int = 2,
        *,
        retries: int = RetryPolicy.retries,
        backoff: float = RetryPolicy.backoff,
        max_backoff: float = RetryPolicy.max_backoff,
        timeout: float = DEFAULT_TIMEOUT,
        expected: Mapping[str, Expected] | None = None,
        verify: bool = True,
        chunk: int = CHUNK,
    ):
        if cache_limit is not None and cache_dir is None:
            raise InputError("cache_limit needs cache_dir: pass cache_dir= too, or drop the limit")
        if cache_limit is not None and int(cache_limit) < 0:
            raise InputError(f"cache_limit={cache_limit} must be >= 0 bytes")
        if int(prefetch) < 0:
            raise InputError(f"prefetch={prefetch} must be >= 0 (0: no prefetch)")
        if int(retries) < 0:
            raise InputError(f"retries={retries} must be >= 0")
        self.storage_options = dict(storage_options or {})
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self.cache_limit = None if cache_limit is None else int(cache_limit)
        self.depth = int(prefetch)
        self.policy = RetryPolicy(int(retries), float(backoff), float(max_backoff))
        self.timeout = float(timeout)
        self.expected = dict(expected or {})
        self.verify = bool(verify)
        self.chunk = int(chunk)
        self._rt: _Runtime | None = None

    def __repr__(self) -> str:
        cache = f", cache_dir={self.cache_dir!r}, cache_limit={self.cache_limit}"
        return f"RemoteStorage(prefetch={self.depth}{cache if self.cache_dir else ''})"

    # --- process-local state ----------------------------------------------------------------------

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_rt"] = None  # threads, sockets and file handles stay in the process that made them
        return state

    def _runtime(self) -> _Runtime:
        rt = self._rt
        if rt is None or rt.pid != os.getpid():
            cache = ShardCache(self.cache_dir, self.cache_limit) if self.cache_dir else None
            rt = _Runtime(
                pid=os.getpid(),
                prefetcher=Prefetcher(self._get, self.depth, discard=_close_shard),
                cache=cache,
            )
            self._rt = rt
        return rt

    def close(self) -> None:
        """Stop prefetching and drop fetched shards nobody took (threads exit when idle)."""
        rt = self._rt
        if rt is not None and rt.pid == os.getpid():
            rt.prefetcher.close()

    def stats(self) -> dict[str, int]:
        """This process's counters: fetches, attempts, bytes, cache hits/misses/evictions."""
        rt = self._runtime()
        out = {
            "fetched": rt.fetched,
            "attempts": rt.fetch_stats.attempts,
            "bytes": rt.fetch_stats.bytes,
            "prefetched": rt.prefetcher.started,
        }
        if rt.cache is not None:
            out |= {
                "cache_hits": rt.cache.stats.hits,
                "cache_misses": rt.cache.stats.misses,
                "cache_evicted": rt.cache.stats.evicted,
            }
        return out

    # --- Storage protocol ----------------------------------------------------------------------

    def open(self, url: str) -> BinaryIO:
        """The whole shard as a readable stream (bytes in memory, or a cache file)."""
        return self._runtime().prefetcher.take(url).file

    def local_path(self, url: str) -> str:
        """A local file with the shard's bytes (for LMDB): the cache entry, or a private copy.

        A private copy (no cache) lives until two more ``local_path`` calls have been made, then
        is deleted; an open LMDB environment keeps reading it after that (POSIX unlink semantics).
        """
        rt = self._runtime()
        shard = rt.prefetcher.take(url)
        shard.file.close()
        assert shard.path is not None
        if rt.cache is None:
            rt.local_files.append(shard.path)
            while len(rt.local_files) > 2:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(rt.local_files.pop(0))
        return shard.path

    def prefetch(self, urls: Sequence[str]) -> None:
        """Start fetching the first ``prefetch`` of ``urls``; they are opened next, in order."""
        if self.depth:
            self._runtime().prefetcher.want(urls)

    # --- fetching ------------------------------------------------------------------------------

    def expected_for(self, url: str) -> Expected:
        """What the manifest says about ``url``: given at construction, or found beside it."""
        known = self.expected.get(url)
        if known is not None or not self.verify:
            return known or Expected()
        rt = self._runtime()
        base, _, name = url.rpartition("/")
        with rt.manifest_lock:  # prefetch threads ask at once: one request per directory
            if base not in rt.manifests:
                rt.manifests[base] = self._load_manifest(f"{base}/{MANIFEST_NAME}")
        return rt.manifests[base].get(name, Expected())

    def _load_manifest(self, manifest_url: str) -> dict[str, Expected]:
        from ..manifest import Manifest

        try:
            text = read_bytes(
                manifest_url, self.storage_options, policy=self.policy, timeout=self.timeout
            )
        except MissingObjectError:
            return {}  # shards without a manifest (e.g. a brace pattern): nothing to check against
        manifest = Manifest.from_json(text, source=manifest_url)
        return {
            url.rpartition("/")[2]: exp
            for url, exp in expected_from_manifest(manifest, manifest_url).items()
        }

    def _fetch_into(self, url: str, out: BinaryIO, expected: Expected) -> None:
        rt = self._runtime()
        fetch(
            url,
            out,
            storage_options=self.storage_options,
            expected=expected,
            policy=self.policy,
            timeout=self.timeout,
            chunk=self.chunk,
            stats=rt.fetch_stats,
        )
        rt.fetched += 1

    def _get(self, url: str) -> _Shard:
        """Fetch one shard (runs on a prefetch thread, or in the consumer when not prefetched)."""
        rt = self._runtime()
        exp = self.expected_for(url)
        if rt.cache is not None:
            f, path = rt.cache.get(
                url, lambda out: self._fetch_into(url, out, exp), sha256=exp.sha256, size=exp.size
            )
            return _Shard(f, path)
        if _needs_local_file(url):
            if rt.scratch is None:
                rt.scratch = tempfile.mkdtemp(prefix="shardkit-remote-")
                # Finalize, not atexit: forked DataLoader workers leave through os._exit.
                multiprocessing.util.Finalize(
                    self,
                    shutil.rmtree,
                    args=(rt.scratch,),
                    kwargs={"ignore_errors": True},
                    exitpriority=10,
                )
            fd, path = tempfile.mkstemp(dir=rt.scratch, suffix="-" + url.rpartition("/")[2])
            os.close(fd)
            try:
                with open(path, "w+b") as out:
                    self._fetch_into(url, out, exp)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                raise
            return _Shard(open(path, "rb", buffering=0), path)
        buf = io.BytesIO()
        self._fetch_into(url, buf, exp)
        buf.seek(0)
        return _Shard(buf)


def _close_shard(shard: _Shard) -> None:
    shard.file.close()


def _needs_local_file(url: str) -> bool:
    from ..formats import format_for_path

    try:
        return format_for_path(url).needs_local_file
    except Exception:
        return False
