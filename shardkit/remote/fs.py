"""fsspec filesystems built for streaming, one set per process, and a resumable byte stream.

Why not ``fsspec.open(url)`` directly: its instance cache is shared across ``fork`` (s3fs and
HTTP hold an asyncio loop and sessions that must not cross a fork), its files read in small ranged
blocks (one request each), and s3fs and botocore retry on their own, hiding attempts from our
policy. Here each process builds its own instances (``skip_instance_cache=True``, keyed by pid),
the library retry layers are switched off unless the user configures them, timeouts are set so a
stalled connection fails instead of hanging, and :func:`open_range` reads an object from any byte
offset with one request, which is what resuming needs.

Every store gets the same treatment, not only S3: gcsfs's request loop (six tries, up to 32 s
apart) and the Azure SDK's retry policy are switched off and their connect and read timeouts set,
so an unreachable endpoint ends in one line within seconds and a stalled one within about
``timeout x (retries + 1)``. :data:`STORES` says, per store, which extra holds its driver and
where its credentials, endpoint and buckets (Azure: containers) come from, for the messages.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.asyn import sync
from fsspec.utils import tokenize

from ..errors import MissingExtraError, StorageError
from ..retry import IncompleteObject
from .deadline import bounded, needs_deadline

__all__ = [
    "DEFAULT_TIMEOUT",
    "STORES",
    "Store",
    "store_of",
    "is_remote_url",
    "protocol_of",
    "filesystem",
    "strip",
    "open_range",
    "RangeReader",
]

# Seconds without progress (connect, or between two reads) before an attempt counts as stalled.
DEFAULT_TIMEOUT = 60.0
_LOCAL = {"file", "local", ""}
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")

_lock = threading.Lock()
_pid = os.getpid()
_instances: dict[str, Any] = {}
# Filesystems a forked child inherited: held forever, never used, never garbage collected there.
_inherited: list[Any] = []
_fork_keepalive: list[Any] = []


def _before_fork() -> None:
    """Pin every fsspec instance across ``fork``; see the note below."""
    try:
        from fsspec.spec import _registered_classes
    except ImportError:  # pragma: no cover - a future fsspec without it
        return
    _fork_keepalive[:] = [i for cls in list(_registered_classes) for i in cls._cache.values()]


# The fork hazard this guards against: fsspec empties its instance cache in a forked child, so an
# s3fs/HTTP filesystem the parent made (e.g. while resolving the dataset's URLs) is garbage
# collected in the DataLoader worker; its finalizer then closes the aiohttp connector, which
# unregisters the parent's sockets from the epoll instance that parent and child share. The
# parent's next request on that filesystem then waits forever for a reply that has arrived. Any
# reference that survives into the child stops it; the child never uses those instances.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork)


def protocol_of(url: str) -> str:
    """``s3`` for ``s3://b/k``; ``file`` for plain paths. Chained URLs (``simplecache::s3://``)
    report their first protocol."""
    m = _URL.match(url)
    return m.group(1).lower() if m else "file"


def is_remote_url(source: object) -> bool:
    """True for a string URL whose protocol is not the local filesystem."""
    return isinstance(source, str) and protocol_of(source) not in _LOCAL and "://" in source


@dataclass(frozen=True)
class Store:
    """What a message tells a user about one kind of store: the extra that installs its driver,
    what the first component of its URLs is called there, and where its credentials and endpoint
    come from (environment variables and ``storage_options`` keys, as the driver reads them)."""

    name: str
    extra: str
    driver: str
    bucket: str
    credentials: str
    endpoint: str


STORES: dict[str, Store] = {
    "s3": Store(
        "S3",
        "s3",
        "s3fs",
        "bucket",
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials), or "
        'storage_options "key" and "secret"',
        'AWS_ENDPOINT_URL, or storage_options "endpoint_url"',
    ),
    "gs": Store(
        "GCS",
        "gcs",
        "gcsfs",
        "bucket",
        "GOOGLE_APPLICATION_CREDENTIALS (or gcloud auth application-default login), or "
        'storage_options "token" (a service-account JSON file; "anon" for public buckets '
        "and emulators)",
        'STORAGE_EMULATOR_HOST, or storage_options "endpoint_url"',
    ),
    "az": Store(
        "Azure Blob",
        "azure",
        "adlfs",
        "container",
        "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
        "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, or storage_options "
        '"connection_string", or "account_name" with "account_key", "sas_token" or "credential"',
        "the account and BlobEndpoint of AZURE_STORAGE_CONNECTION_STRING, or storage_options "
        '"account_name" and "account_host"',
    ),
    "http": Store("HTTP", "http", "aiohttp", "host", "the URL (a signed query string)", "the URL"),
}
_ALIASES = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az", "https": "http"}


def store_of(protocol: str) -> Store | None:
    """The :class:`Store` of ``protocol`` (``gcs`` is ``gs``, ``abfs`` is ``az`` ...), or None."""
    return STORES.get(_ALIASES.get(protocol, protocol))


class _GcsfsNoise(logging.Filter):
    """Drops gcsfs's fallback warning when a bucket's layout cannot be looked up (an emulator, a
    key without the storage-control permission): it logs it on every call, dozens of lines per
    ``verify``, and the plain GCS path it falls back to is the one shardkit uses anyway. Every
    other record of the logger passes."""

    _NOISE = ("Could not determine bucket type", "Error: Bucket ")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and str(record.msg).startswith(self._NOISE))


_GCSFS_FILTER = _GcsfsNoise()


def _merge(base: dict, override: Mapping) -> dict:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _defaults(protocol: str, timeout: float) -> dict:
    if protocol in ("s3", "s3a"):
        return {
            # botocore's retry loop: one attempt, ours decides (s3fs's loop: see filesystem()).
            "config_kwargs": {
                "retries": {"total_max_attempts": 1, "mode": "standard"},
                "connect_timeout": timeout,
                "read_timeout": timeout,
            },
        }
    if protocol in ("http", "https"):
        import aiohttp

        return {
            "client_kwargs": {
                "timeout": aiohttp.ClientTimeout(
                    total=None, sock_connect=timeout, sock_read=timeout
                )
            }
        }
    if protocol in ("gs", "gcs"):
        import aiohttp

        # gcsfs hands this to every aiohttp request it makes (its ``timeout=`` bounds whole calls).
        return {
            "requests_timeout": aiohttp.ClientTimeout(
                total=None, sock_connect=timeout, sock_read=timeout
            )
        }
    if protocol in ("az", "abfs", "abfss"):
        # adlfs passes these to its uploads and downloads; _quiet_azure sets them on the client.
        return {"connection_timeout": timeout, "read_timeout": timeout}
    return {}


def _quiet_gcsfs(fs: Any) -> None:
    """One attempt per gcsfs request: its ``_request`` is wrapped in a loop of six tries with
    backoff of up to 32 s (a decorator bound at class creation, not an option), which hides
    attempts from our policy and made an unreachable endpoint take minutes. The instance gets
    the undecorated method; and the bucket-layout warning is filtered (:class:`_GcsfsNoise`)."""
    request = getattr(type(fs)._request, "__wrapped__", None)
    if request is not None:
        fs._request = request.__get__(fs, type(fs))
    logger = logging.getLogger("gcsfs")
    if _GCSFS_FILTER not in logger.filters:
        logger.addFilter(_GCSFS_FILTER)


def _quiet_azure(fs: Any, timeout: float) -> None:
    """The Azure SDK retries on its own (3 times, 15 s backoff growing threefold) with a 300 s
    read timeout, for every call adlfs makes: its client is rebuilt with no retries and our
    timeouts, from the same account URL and credential adlfs chose."""
    client = getattr(fs, "service_client", None)
    if client is None:  # pragma: no cover - an adlfs that connects lazily
        return
    kw = {"retry_total": 0, "connection_timeout": timeout, "read_timeout": timeout}
    if getattr(fs, "connection_string", None):
        fs.service_client = type(client).from_connection_string(fs.connection_string, **kw)
    else:
        fs.service_client = type(client)(client.url, credential=client.credential, **kw)


def _zonal_opt_in() -> bool:
    """gcsfs's default filesystem since 2025 first asks the storage-control API (gRPC) for each
    bucket's layout, for zonal buckets; against an emulator or a custom endpoint that lookup
    fails only after gRPC's own retries (minutes), and it is retried on every call. shardkit
    reads GCS through gcsfs's JSON-API filesystem, which every other bucket uses anyway, unless
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` is set to ``true`` by the user."""
    return os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "").lower() in ("true", "1")


def _missing_driver(protocol: str, exc: ImportError) -> MissingExtraError:
    store = store_of(protocol)
    if store is not None:
        return MissingExtraError(
            f"{protocol}:// URLs need {store.driver}, which is not installed: "
            f"pip install 'shardkit[{store.extra}]'"
        )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return MissingExtraError(f"{protocol}:// URLs need a driver fsspec names: {first}")


def _build(protocol: str, options: dict, timeout: float) -> fsspec.AbstractFileSystem:
    """``fsspec.filesystem`` with its failures told in one line: a missing driver names the
    extra to install, missing Azure credentials the variables and keys that give them."""
    store = store_of(protocol)
    try:
        if protocol in ("gs", "gcs") and not _zonal_opt_in():
            from gcsfs.core import GCSFileSystem

            fs = GCSFileSystem(skip_instance_cache=True, **options)
        else:
            fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
    except ImportError as exc:
        raise _missing_driver(protocol, exc) from None
    except ValueError as exc:
        if store is not None and store.extra == "azure" and "connection_string" in str(exc):
            raise StorageError(
                f"{protocol}:// needs Azure credentials: set {store.credentials}"
            ) from None
        raise
    if protocol in ("s3", "s3a"):
        fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option)
    elif protocol in ("gs", "gcs"):
        _quiet_gcsfs(fs)
    elif protocol in ("az", "abfs", "abfss"):
        _quiet_azure(fs, timeout)
    return fs


def filesystem(
    protocol: str,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> fsspec.AbstractFileSystem:
    """This process's filesystem for ``protocol`` with ``storage_options`` over our defaults."""
    global _pid
    try:
        defaults = _defaults(protocol, timeout)
    except ImportError as exc:  # aiohttp, for http and gs
        raise _missing_driver(protocol, exc) from None
    options = _merge(defaults, dict(storage_options or {}))
    key = tokenize(protocol, options)
    with _lock:
        if os.getpid() != _pid:  # forked: the parent's instances hold its loop and sockets
            _inherited.extend(_instances.values())  # kept alive: see _before_fork
            _instances.clear()
            _pid = os.getpid()
        fs = _instances.get(key)
        if fs is None:
            fs = _build(protocol, options, timeout)
            _instances[key] = fs
        return fs


def strip(fs: fsspec.AbstractFileSystem, url: str) -> str:
    """The path ``fs`` expects for ``url`` (``bucket/key`` for s3, the whole URL for http)."""
    return fs._strip_protocol(url)


class RangeReader:
    """One attempt's byte stream from ``start`` to the end of an object.

    ``pump(write, chunk)`` copies every remaining byte into ``write`` and raises
    :class:`IncompleteObject` if the server stops before the size it announced. ``on_total(size)``
    runs once the object's full size is known (S3 and HTTP say it in the response headers), before
    any byte is copied, so a size that disagrees with the manifest fails at once.
    """

    def __init__(self, fs, path: str, start: int, on_total: Callable[[int | None], None] | None):
        self.fs, self.path, self.start = fs, path, start
        self.total: int | None = None
        self._on_total = on_total

    def _set_total(self, total: int | None) -> None:
        self.total = total
        if self._on_total is not None:
            self._on_total(total)

    def pump(self, write: Callable[[bytes], object], chunk: int) -> None:
        raise NotImplementedError  # pragma: no cover


def _total_from_headers(content_range: str | None, length: int | None, start: int) -> int | None:
    if content_range and "/" in content_range:
        tail = content_range.rsplit("/", 1)[1].strip()
        if tail.isdigit():
            return int(tail)
    return None if length is None else start + int(length)


class _S3Reader(RangeReader):
    """One ``GetObject`` with ``Range: bytes=start-``, read chunk by chunk on s3fs's loop."""

    async def _run(self, write, chunk: int) -> None:
        bucket, key, version = self.fs.split_path(self.path)
        kw: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if version:
            kw["VersionId"] = version
        if self.start:
            kw["Range"] = f"bytes={self.start}-"
        resp = await self.fs._call_s3("get_object", **kw)
        body = resp["Body"]
        try:
            remaining = resp.get("ContentLength")
            self._set_total(_total_from_headers(resp.get("ContentRange"), remaining, self.start))
            got = 0
            while True:
                data = await body.read(chunk)
                if not data:
                    break
                got += len(data)
                write(data)
            if remaining is not None and got < remaining:
                raise IncompleteObject(f"connection closed after {self.start + got} bytes")
        finally:
            body.close()

    def pump(self, write, chunk: int) -> None:
        sync(self.fs.loop, self._run, write, chunk)


class _HttpReader(RangeReader):
    """One GET with a ``Range`` header; a server that ignores it (200) has the prefix skipped."""

    async def _run(self, write, chunk: int) -> None:
        session = await self.fs.set_session()
        kw = dict(self.fs.kwargs)
        headers = dict(kw.pop("headers", None) or {})
        if self.start:
            headers["Range"] = f"bytes={self.start}-"
        async with session.get(self.fs.encode_url(self.path), headers=headers, **kw) as r:
            if r.status == 404:
                raise FileNotFoundError(self.path)
            r.raise_for_status()
            skip = self.start if (self.start and r.status == 200) else 0
            self._set_total(
                _total_from_headers(
                    r.headers.get("Content-Range"), r.content_length, self.start - skip
                )
            )
            got = 0
            async for data in r.content.iter_chunked(chunk):
                if skip:
                    if len(data) <= skip:
                        skip -= len(data)
                        continue
                    data, skip = data[skip:], 0
                got += len(data)
                write(data)
            if self.total is not None and self.start + got < self.total:
                raise IncompleteObject(f"connection closed after {self.start + got} bytes")

    def pump(self, write, chunk: int) -> None:
        sync(self.fs.loop, self._run, write, chunk)


class _FileReader(RangeReader):
    """Any other fsspec filesystem (gcs, azure, memory ...): its file object, seeked to start.
    On a protocol whose driver takes no timeout from us (``hf://``, ``sftp://`` ...), the read
    runs under ``remote.deadline``: no byte for ``timeout`` seconds is a stall, as on S3."""

    timeout: float | None = None

    def pump(self, write, chunk: int) -> None:
        protocol = protocol_of(self.path) if "://" in self.path else _protocol_name(self.fs)
        if self.timeout is None or not needs_deadline(protocol):
            return self._pump(write, chunk)
        what = f"{protocol}://{self.path}" if "://" not in self.path else self.path
        bounded(lambda w: self._pump(w, chunk), self.timeout, what, write)

    def _pump(self, write, chunk: int) -> None:
        with self.fs.open(self.path, "rb", block_size=max(chunk, 8 << 20)) as f:
            self._set_total(getattr(f, "size", None))
            if self.start:
                f.seek(self.start)
            pos = self.start
            while True:
                data = f.read(chunk)
                if not data:
                    break
                pos += len(data)
                write(data)
            if self.total is not None and pos < self.total:
                raise IncompleteObject(f"stream ended after {pos} bytes")


def _protocol_name(fs: fsspec.AbstractFileSystem) -> str:
    protocol = fs.protocol
    return protocol if isinstance(protocol, str) else protocol[0]


def open_range(
    fs: fsspec.AbstractFileSystem,
    url: str,
    start: int = 0,
    on_total: Callable[[int | None], None] | None = None,
    timeout: float | None = None,
) -> RangeReader:
    """A reader of ``url`` from byte ``start`` with one request where the protocol allows;
    ``timeout``: seconds without progress, for drivers that take none of their own."""
    protocol = protocol_of(url)
    if protocol in ("s3", "s3a") and hasattr(fs, "_call_s3"):
        return _S3Reader(fs, strip(fs, url), start, on_total)
    if protocol in ("http", "https") and hasattr(fs, "set_session"):
        return _HttpReader(fs, url, start, on_total)
    reader = _FileReader(fs, strip(fs, url), start, on_total)
    reader.timeout = timeout
    return reader
