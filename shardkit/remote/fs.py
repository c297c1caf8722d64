"""fsspec filesystems built for streaming, one set per process, and a resumable byte stream.

Why not ``fsspec.open(url)`` directly: its instance cache is shared across ``fork`` (s3fs and
HTTP hold an asyncio loop and sessions that must not cross a fork), its files read in small ranged
blocks (one request each), and s3fs and botocore retry on their own, hiding attempts from our
policy. Here each process builds its own instances (``skip_instance_cache=True``, keyed by pid),
the library retry layers are switched off unless the user configures them, timeouts are set so a
stalled connection fails instead of hanging, and :func:`open_range` reads an object from any byte
offset with one request, which is what resuming needs.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import fsspec
from fsspec.asyn import sync
from fsspec.utils import tokenize

from ..retry import IncompleteObject

__all__ = [
    "DEFAULT_TIMEOUT",
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
    return {}


def filesystem(
    protocol: str,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> fsspec.AbstractFileSystem:
    """This process's filesystem for ``protocol`` with ``storage_options`` over our defaults."""
    global _pid
    options = _merge(_defaults(protocol, timeout), dict(storage_options or {}))
    key = tokenize(protocol, options)
    with _lock:
        if os.getpid() != _pid:  # forked: the parent's instances hold its loop and sockets
            _inherited.extend(_instances.values())  # kept alive: see _before_fork
            _instances.clear()
            _pid = os.getpid()
        fs = _instances.get(key)
        if fs is None:
            fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
            if protocol in ("s3", "s3a"):
                fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option)
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
    """Any other fsspec filesystem (gcs, azure, memory ...): its file object, seeked to start."""

    def pump(self, write, chunk: int) -> None:
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


def open_range(
    fs: fsspec.AbstractFileSystem,
    url: str,
    start: int = 0,
    on_total: Callable[[int | None], None] | None = None,
) -> RangeReader:
    """A reader of ``url`` from byte ``start`` with one request where the protocol allows."""
    protocol = protocol_of(url)
    if protocol in ("s3", "s3a") and hasattr(fs, "_call_s3"):
        return _S3Reader(fs, strip(fs, url), start, on_total)
    if protocol in ("http", "https") and hasattr(fs, "set_session"):
        return _HttpReader(fs, url, start, on_total)
    return _FileReader(fs, strip(fs, url), start, on_total)
