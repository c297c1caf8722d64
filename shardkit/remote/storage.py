"""``RemoteStorage``: the ``shardkit.stream.storage.Storage`` protocol over object stores and HTTP.

What a DataLoader worker gets from it: the shard it asks for, fetched whole with one large
sequential read (retried and resumed on failure), verified against the manifest's size and sha256,
while the next ``prefetch`` shards of its plan download in the background; with ``cache_dir``, from
a machine-wide cache that every worker and rank shares. What to verify against comes with each
request: a ``ShardInfo`` carries the manifest's size and sha256 (a plain URL is fetched unchecked).

Lifecycle: ``close()`` stops the prefetch threads and drops shards fetched ahead that nobody took;
the read path calls it whenever a read ends or is abandoned. The storage stays usable: the next
call builds a fresh runtime.

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
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ..errors import InputError, check_int, check_number
from ..records import ShardInfo
from ..retry import RetryPolicy
from ..sizes import parse_size
from ..urls import url_name
from .cache import ShardCache
from .fetch import CHUNK, Expected, FetchStats, fetch, fetch_range, read_bytes
from .fs import DEFAULT_TIMEOUT, filesystem, protocol_of
from .prefetch import Prefetcher

__all__ = ["RemoteStorage", "remote_of"]

#: Ranged GETs in flight per worker by default: at 20 ms first-byte latency and ~1 ms of
#: reading per GET, 16 keep the reader busy (``benchmarks/bench_remote.py --sparse``).
RANGED_GETS = 16
#: The most the GETs ahead hold at once: 16 runs of a few samples are far below it.
RANGED_BYTES = 64 << 20
#: Drawn samples with at most this many bytes between them share one ranged GET, the hole
#: read and passed over, while the GET reads at most twice its drawn bytes
#: (``stream.ranges.spans``): at ~20 ms first-byte latency a GET costs more than reading a
#: megabyte more on the connection already open.
RANGED_GAP = 1 << 20


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
    #: URL -> the ShardInfo it was last asked for by (what prefetch threads verify against).
    infos: dict[str, ShardInfo] = field(default_factory=dict)
    fetch_stats: FetchStats = field(default_factory=FetchStats)
    fetched: int = 0
    prefetched: int = 0  # background fetches begun by prefetchers already closed
    scratch: str | None = None  # private dir for LMDB shards when there is no cache
    scratch_finalizer: multiprocessing.util.Finalize | None = None
    local_files: list[str] = field(default_factory=list)


class RemoteStorage:
    """Shards behind URLs (``s3://``, ``gs://``, ``https://``, ``file://`` ... any fsspec URL).

    ``storage_options``: fsspec options (credentials, ``endpoint_url`` for S3-compatible stores,
    ``client_kwargs``); credentials otherwise come from the environment and config files as the
    backend (s3fs, gcsfs, adlfs) looks them up. ``cache_dir``/``cache_limit`` (bytes or a size
    string such as "10GB"): the shared shard cache (see ``shardkit.remote.cache``). ``prefetch``:
    shards fetched ahead per worker (0 turns it off). ``retries``/``backoff``: the retry budget
    (see ``RetryPolicy``). ``timeout``: seconds without progress before an attempt counts as
    stalled. ``verify=False`` skips the size and sha256 checks a ``ShardInfo`` asks for.
    ``ranged_gets``: a subset's or split's ranged GETs (a few samples of a shard each, see
    ``shardkit.stream.ranges``) kept in flight per worker, ahead of the reader, across runs and
    shards (1: one at a time); ``ranged_bytes`` (bytes or a size string): the most those hold
    at once. The samples and their order are the same either way (``shardkit.remote.ranged``).
    ``ranged_gap`` (bytes or a size string; 0: only adjacent samples): drawn samples of a
    shard at most this far apart share one GET (the hole read and passed over) while the GET
    reads at most twice its drawn bytes, so a subset epoch makes one GET a run of nearby
    samples and reads at most twice the bytes it draws; a GET asks for at most 8 MiB plus a
    sample.
    Those ranged GETs, and the reads of the shards' sample indexes, follow the same
    ``retries``/``backoff``/``timeout`` as whole shards (``read_range``, ``read_object``).
    A source of local paths is read by ``LocalStorage`` even under ``storage=RemoteStorage(...)``
    (``urls_only``): one object configures a mixture of local and remote sources.
    """

    #: configures URL sources only; ShardDataset reads local paths with LocalStorage
    urls_only = True

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_limit: int | str | None = None,
        prefetch: int = 2,
        *,
        retries: int = RetryPolicy.retries,
        backoff: float = RetryPolicy.backoff,
        max_backoff: float = RetryPolicy.max_backoff,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool = True,
        chunk: int = CHUNK,
        ranged_gets: int = RANGED_GETS,
        ranged_bytes: int | str = RANGED_BYTES,
        ranged_gap: int | str = RANGED_GAP,
    ):
        if cache_limit is not None and cache_dir is None:
            raise InputError("cache_limit needs cache_dir: pass cache_dir= too, or drop the limit")
        if cache_limit is not None:
            cache_limit = parse_size(cache_limit, "cache_limit", minimum=0)
        # Every number checked here, once: a NaN timeout or a zero chunk would otherwise make
        # every fetch "give up after N attempts" against a working server, blaming the network.
        self.depth = check_int("prefetch", prefetch, 0, hint=" (0: no prefetch)")
        retries = check_int("retries", retries, 0)
        backoff = check_number("backoff", backoff, 0.0, hint=" (seconds)")
        max_backoff = check_number("max_backoff", max_backoff, 0.0, hint=" (seconds)")
        self.timeout = check_number("timeout", timeout, 0.0, above=True, hint=" (seconds)")
        self.chunk = check_int("chunk", chunk, 1, hint=" (bytes a read asks for)")
        self.ranged_gets = check_int("ranged_gets", ranged_gets, 1, hint=" (1: one at a time)")
        self.ranged_bytes = parse_size(ranged_bytes, "ranged_bytes", minimum=0)
        self.ranged_gap = parse_size(ranged_gap, "ranged_gap", minimum=0)
        if not isinstance(verify, bool):
            raise InputError(f"verify={verify!r} must be True or False")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise InputError(
                f"storage_options={storage_options!r}: give a dict of fsspec options (or None)"
            )
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise InputError(f"cache_dir={cache_dir!r}: give a directory path (or None)")
        self.storage_options = dict(storage_options or {})
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self.cache_limit = None if cache_limit is None else int(cache_limit)
        self.policy = RetryPolicy(retries, backoff, max_backoff)
        self.verify = verify
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
            rt = _Runtime(pid=os.getpid(), prefetcher=None, cache=cache)  # type: ignore[arg-type]
            rt.prefetcher = self._prefetcher(rt)
            self._rt = rt
        return rt

    def _prefetcher(self, rt: _Runtime) -> Prefetcher:
        return Prefetcher(lambda url: self._get(rt, url), self.depth, discard=_close_shard)

    def close(self) -> None:
        """Stop prefetching, drop fetched shards nobody took and private LMDB copies.

        Prefetch threads exit once the download they are in (if any) ends; its result is
        discarded. Safe to call twice, from ``finally`` blocks, and in a process that never used
        the storage; the next ``prefetch`` starts new threads. The cache and counters stay.
        """
        rt = self._rt
        if rt is None or rt.pid != os.getpid():
            return
        old, rt.prefetcher = rt.prefetcher, self._prefetcher(rt)
        rt.prefetched += old.started
        old.close()
        for path in rt.local_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        rt.local_files.clear()
        if rt.scratch_finalizer is not None:
            rt.scratch_finalizer()  # removes the private directory now, not at exit
            rt.scratch = rt.scratch_finalizer = None

    def stats(self) -> dict[str, int]:
        """This process's counters: fetches, attempts, bytes, cache hits/misses/evictions."""
        rt = self._runtime()
        out = {
            "fetched": rt.fetched,
            "attempts": rt.fetch_stats.attempts,
            "bytes": rt.fetch_stats.bytes,
            "prefetched": rt.prefetched + rt.prefetcher.started,
        }
        if rt.cache is not None:
            out |= {
                "cache_hits": rt.cache.stats.hits,
                "cache_misses": rt.cache.stats.misses,
                "cache_evicted": rt.cache.stats.evicted,
            }
        return out

    # --- Storage protocol ----------------------------------------------------------------------

    def open(self, shard: ShardInfo | str) -> BinaryIO:
        """The whole shard as a readable stream (bytes in memory, or a cache file)."""
        rt = self._runtime()
        return rt.prefetcher.take(self._remember(rt, shard)).file

    def local_path(self, shard: ShardInfo | str) -> str:
        """A local file with the shard's bytes (for LMDB), private to this process.

        With a cache, the entry pinned (``ShardCache.pin``: a hard link eviction never removes,
        since any process adding an entry, a prefetch thread of ours included, may evict the
        entry itself before the caller opens its path); without, a private copy. Either lives
        until two more ``local_path`` calls have been made (or ``close()``), then is deleted; an
        open LMDB environment keeps reading it after that (POSIX unlink semantics).
        """
        rt = self._runtime()
        url = self._remember(rt, shard)
        got = rt.prefetcher.take(url)
        if got.path is not None and rt.cache is not None:
            with got.file:  # open until pinned: the bytes stay reachable if evicted meanwhile
                path = rt.cache.pin(got.file, got.path)
        else:
            path = self._private_copy(rt, url, got)
        rt.local_files.append(path)
        while len(rt.local_files) > 2:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(rt.local_files.pop(0))
        return path

    def prefetch(self, shards: Sequence[ShardInfo | str]) -> None:
        """Start fetching the first ``prefetch`` of ``shards``; they are opened next, in order.

        Prefetched shards are held in memory (or in the cache); a format that reads
        files at random offsets (LMDB) asks ``local_path``, which then copies the bytes to a
        private file.
        """
        if not self.depth:
            return
        rt = self._runtime()
        wanted: list[str] = []
        for shard in shards:  # a plan may name a shard twice in a row: look past repeats
            url = self._remember(rt, shard)
            if url not in wanted:
                wanted.append(url)
                if len(wanted) == self.depth:
                    break
        rt.prefetcher.want(wanted)

    @staticmethod
    def _remember(rt: _Runtime, shard: ShardInfo | str) -> str:
        """The URL of ``shard``, noting what it should hold for the fetch that follows."""
        if isinstance(shard, str):
            url = shard
            shard = rt.infos.get(url) or ShardInfo(url)
        else:
            url = shard.url
        rt.infos[url] = shard
        return url

    # --- ranges and small objects ---------------------------------------------------------------

    def read_range(self, url: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of ``url`` (samples a sparse epoch or a view reads, an
        index's head): one ranged GET under this storage's retry policy and timeout, exactly
        ``stop - start`` bytes or a ``StorageError`` (``remote.fetch.fetch_range``)."""
        return fetch_range(
            url,
            start,
            stop,
            storage_options=self.storage_options,
            policy=self.policy,
            timeout=self.timeout,
        )

    def read_object(self, url: str) -> bytes:
        """The whole object at ``url`` (a sample index), read as a shard is: retried and
        resumed under this storage's policy; ``MissingObjectError`` where there is none."""
        return read_bytes(url, self.storage_options, policy=self.policy, timeout=self.timeout)

    def filesystem(self, url: str):
        """This process's filesystem for ``url``, its timeouts this storage's."""
        return filesystem(protocol_of(url), self.storage_options, self.timeout)

    # --- fetching ------------------------------------------------------------------------------

    def _expected(self, rt: _Runtime, url: str) -> Expected:
        info = rt.infos.get(url)
        if info is None or not self.verify:
            return Expected()
        return Expected(info.bytes if info.bytes >= 0 else None, info.sha256 or None)

    def _fetch_into(self, rt: _Runtime, url: str, out: BinaryIO, expected: Expected) -> None:
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

    def _get(self, rt: _Runtime, url: str) -> _Shard:
        """Fetch one shard (on a prefetch thread, or in the consumer when not prefetched).

        ``rt`` is the runtime that asked: a thread finishing after ``close()`` fills a runtime
        nobody uses any more, never a new one.
        """
        exp = self._expected(rt, url)
        if rt.cache is not None:
            f, path = rt.cache.get(
                url,
                lambda out: self._fetch_into(rt, url, out, exp),
                sha256=exp.sha256,
                size=exp.size,
            )
            return _Shard(f, path)
        buf = io.BytesIO()
        self._fetch_into(rt, url, buf, exp)
        buf.seek(0)
        return _Shard(buf)

    def _private_copy(self, rt: _Runtime, url: str, got: _Shard) -> str:
        """Write a shard fetched into memory to a private file (no cache; for LMDB)."""
        if rt.scratch is None:
            rt.scratch = tempfile.mkdtemp(prefix="shardkit-remote-")
            # Finalize, not atexit: forked DataLoader workers leave through os._exit.
            rt.scratch_finalizer = multiprocessing.util.Finalize(
                self,
                shutil.rmtree,
                args=(rt.scratch,),
                kwargs={"ignore_errors": True},
                exitpriority=10,
            )
        fd, path = tempfile.mkstemp(dir=rt.scratch, suffix="-" + url_name(url))
        try:
            with os.fdopen(fd, "wb") as out, got.file as src:
                shutil.copyfileobj(src, out, self.chunk)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return path


def remote_of(storage) -> RemoteStorage:
    """The ``RemoteStorage`` whose policy a URL's ranged and index reads follow: ``storage``
    itself, else (another ``Storage``, or None) one with its ``storage_options`` and the
    default retries and timeout."""
    if isinstance(storage, RemoteStorage):
        return storage
    return RemoteStorage(getattr(storage, "storage_options", None), prefetch=0)


def _close_shard(shard: _Shard) -> None:
    shard.file.close()
