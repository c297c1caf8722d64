"""Downloads that survive flaky links and never hand back wrong bytes: whole objects, and the
byte ranges a sparse epoch, a view or an index read takes.

An object is copied with one request from byte 0; when the link fails mid-way the next attempt asks
for ``bytes=<reached>-`` and appends, so a 1 GB shard dropped at 900 MB costs 100 MB, not 1 GB. Size
and sha256 are checked against the manifest before anyone sees the data.

A range (:func:`fetch_range`, and :func:`fetch_range_async` on the filesystem's event loop for
the GETs kept in flight ahead) follows the same policy: 5xx, throttling, resets, stalls past the
timeout and bodies that end early are retried with the same backoff, from the byte reached; the
bytes handed back are exactly ``stop - start``, never fewer. A 416 (the object ends before the
range) is not retried: :class:`ShortObjectError`.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ..errors import StorageError
from ..redact import redact, secret_values
from ..retry import IncompleteObject, RetryPolicy, describe, is_transient, status_of
from .deadline import bounded, needs_deadline
from .fs import DEFAULT_TIMEOUT, filesystem, open_range, protocol_of, store_of, strip

__all__ = [
    "Expected",
    "FetchStats",
    "MissingObjectError",
    "ShortObjectError",
    "TooLargeError",
    "fetch",
    "fetch_range",
    "fetch_range_async",
    "read_bytes",
    "storage_error",
]

# Bytes handed from the socket to the sink per step: big enough that per-chunk overhead vanishes,
# small enough to keep the event loop responsive for the other downloads in flight.
CHUNK = 1 << 20


#: What an error after the retries tells the user to do.
RETRY_FIX = (
    "check the store and the network, then run again (RemoteStorage(retries=..., timeout=...) "
    "waits longer)"
)


class MissingObjectError(StorageError):
    """The object does not exist (HTTP 404, S3 NoSuchKey): not worth a retry."""


class ShortObjectError(StorageError):
    """The object ends before the range asked for (HTTP 416, or a local file's end): truncated
    or replaced since whatever placed the range was written. ``received``: the bytes of the
    range it does hold (an index head judged by its decoder keeps them)."""

    def __init__(self, message: str, received: bytes = b""):
        super().__init__(message)
        self.received = received


class TooLargeError(StorageError):
    """The object is larger than the caller's ``max_size``: refused before it is all read."""


@dataclass(frozen=True)
class Expected:
    """What the manifest promises about one object; either field may be unknown."""

    size: int | None = None
    sha256: str | None = None


@dataclass
class FetchStats:
    """Counts for tests and benchmarks: attempts made and bytes received, summed over every
    fetch that was handed this object (one object's, or a whole process's: ``RemoteStorage``
    shares one between its prefetch threads, hence the lock)."""

    attempts: int = 0
    bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, attempts: int = 0, nbytes: int = 0) -> None:
        with self._lock:
            self.attempts += attempts
            self.bytes += nbytes


def storage_error(
    url: str,
    what: str,
    exc: BaseException | None = None,
    options: Mapping | None = None,
    cls: type[StorageError] = StorageError,
) -> StorageError:
    """A StorageError naming ``url`` and the cause, with credentials masked."""
    text = f"{url}: {what}" + (f" ({describe(exc)})" if exc is not None else "")
    return cls(redact(text, secret_values(options)))


class _Sink:
    """Appends to ``out`` and counts, so resuming only needs ``pos``.

    It runs on the event loop that serves every download of the process, so it does no more
    than copy: the sha256 is taken afterwards in the fetching thread (:func:`_sha256_of`), where
    hashlib releases the GIL and the loop keeps receiving the other shards meanwhile.
    """

    def __init__(self, out: BinaryIO, url: str, max_size: int | None = None):
        self.out, self.url, self.max_size = out, url, max_size
        self.pos = 0

    def write(self, data: bytes) -> None:
        if self.max_size is not None and self.pos + len(data) > self.max_size:
            raise _too_large(self.url, self.max_size)  # a server that sent no length
        self.out.write(data)
        self.pos += len(data)


def _too_large(url: str, max_size: int) -> TooLargeError:
    return TooLargeError(redact(f"{url}: object is larger than {max_size} bytes"))


def _denied(exc: BaseException) -> bool:
    """Refused for want of credentials: PermissionError (s3fs), HTTP 401/403 however the driver
    words it (gcsfs: ``HttpError`` 401, ``OSError("Forbidden: ...")``; Azure: status_code)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        status = getattr(cur, "status_code", None) or getattr(cur, "status", None)
        if status is None and type(cur).__name__ == "HttpError":  # gcsfs's, by its ``code``
            status = getattr(cur, "code", None)
        if isinstance(cur, PermissionError) or status in (401, 403):
            return True
        if type(cur) is OSError and str(cur).startswith("Forbidden"):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


#: the drivers' "found no credentials at all" errors (botocore, google-auth, azure-identity): said
#: as such, with the store's variables, not as a failed read the user would retry
_NO_CREDENTIALS = frozenset(
    {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError",
     "CredentialUnavailableError"}
)  # fmt: skip


def _uncredentialed(exc: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if type(cur).__name__ in _NO_CREDENTIALS:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _denied_hint(url: str, exc: BaseException | None = None) -> str:
    store = store_of(protocol_of(url))
    where = store.credentials if store is not None else "storage_options or the environment"
    if exc is not None and _uncredentialed(exc):
        return f"no credentials found; set {where}"
    return f"access denied; check the credentials: {where}"


def _sha256_of(out: BinaryIO) -> str:
    """sha256 of everything written to ``out`` (an in-memory buffer, or a file just written)."""
    h = hashlib.sha256()
    getbuffer = getattr(out, "getbuffer", None)
    if getbuffer is not None:
        with getbuffer() as view:
            h.update(view)
        return h.hexdigest()
    out.flush()
    fd = out.fileno()
    offset, step = 0, 8 << 20
    while data := os.pread(fd, step, offset):  # the page cache still holds it
        h.update(data)
        offset += len(data)
    return h.hexdigest()


def fetch(  # noqa: C901 (one retry loop with its error cases inline)
    url: str,
    out: BinaryIO,
    *,
    storage_options: Mapping[str, Any] | None = None,
    expected: Expected | None = None,
    policy: RetryPolicy | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    chunk: int = CHUNK,
    stats: FetchStats | None = None,
    sleep: Callable[[float], None] = time.sleep,
    max_size: int | None = None,
) -> int:
    """Copy the whole object at ``url`` into ``out`` (empty; a file must be open for reading too,
    ``w+b``, when ``expected.sha256`` is set); return its size.

    Raises :class:`StorageError` for a missing object, a refused one, a size or sha256 that
    disagrees with ``expected``, or transient failures beyond ``policy``'s budget;
    :class:`TooLargeError` as soon as the object shows more than ``max_size`` bytes (by its
    declared length, or by the bytes received), so a hostile object costs no more memory.
    """
    policy = policy or RetryPolicy()
    expected = expected or Expected()
    stats = stats if stats is not None else FetchStats()
    fs = filesystem(protocol_of(url), storage_options, timeout)
    sink = _Sink(out, url, max_size)

    def check_total(total: int | None) -> None:
        if total is not None and max_size is not None and total > max_size:
            raise _too_large(url, max_size)
        if total is not None and expected.size is not None and total != expected.size:
            raise storage_error(
                url,
                f"object is {total} bytes but the manifest says {expected.size}: it was truncated "
                "or replaced after packing; re-upload the shard or re-pack the dataset",
                options=storage_options,
            )

    failures = attempts = 0  # this URL's; ``stats`` may be shared by every fetch of a process
    counted = 0  # of sink.pos, already added to stats.bytes

    def count() -> None:
        nonlocal counted
        stats.add(nbytes=sink.pos - counted)
        counted = sink.pos

    while True:
        before = sink.pos
        attempts += 1
        stats.add(attempts=1)
        try:
            open_range(fs, url, sink.pos, check_total, timeout).pump(sink.write, chunk)
            break
        except StorageError:
            raise
        except FileNotFoundError as exc:
            raise storage_error(
                url,
                "no such object; check the URL and that the upload finished",
                exc,
                storage_options,
                MissingObjectError,
            ) from None
        except Exception as exc:
            count()
            if _denied(exc) or _uncredentialed(exc):
                raise storage_error(url, _denied_hint(url, exc), exc, storage_options) from None
            if not is_transient(exc):
                raise storage_error(url, "read failed", exc, storage_options) from None
            failures = 1 if sink.pos > before else failures + 1
            if failures > policy.retries:
                raise storage_error(
                    url,
                    f"gave up after {attempts} attempts ({policy.retries} retries in a row "
                    f"without progress, {sink.pos} bytes received); {RETRY_FIX}",
                    exc,
                    storage_options,
                ) from None
            sleep(policy.delay(failures))
    count()
    if expected.size is not None and sink.pos != expected.size:
        raise storage_error(
            url,
            f"got {sink.pos} bytes but the manifest says {expected.size}: the object is "
            "truncated; re-upload the shard",
            options=storage_options,
        )
    if expected.sha256 is not None:
        got = _sha256_of(out)
        if got != expected.sha256:
            raise storage_error(
                url,
                f"sha256 {got[:16]}... does not match the manifest's {expected.sha256[:16]}...: "
                "the object is corrupt or was replaced after packing; re-upload the shard or "
                "re-pack the dataset",
                options=storage_options,
            )
    return sink.pos


def read_bytes(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    expected: Expected | None = None,
    policy: RetryPolicy | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    max_size: int | None = None,
) -> bytes:
    """The whole object at ``url`` (a manifest, a shard for ``verify``), fetched with retries;
    more than ``max_size`` bytes raise ``TooLargeError``."""
    buf = io.BytesIO()
    fetch(
        url,
        buf,
        storage_options=storage_options,
        expected=expected,
        policy=policy,
        timeout=timeout,
        max_size=max_size,
    )
    return buf.getvalue()


# Object stores where a URL's first path component is a bucket that must exist before a write.
_BUCKETED = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}


def check_bucket(url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """StorageError naming the bucket when it does not exist: found before any work is done,
    not after the first shard is packed (pack) or as a missing manifest (info, verify, stream)."""
    protocol = protocol_of(url)
    if protocol not in _BUCKETED:
        return
    store = store_of(protocol)
    fs = filesystem(protocol, storage_options)
    bucket = strip(fs, url).split("/", 1)[0]
    term = store.bucket if store is not None else "bucket"
    try:
        found = fs.exists(bucket)
    except Exception as exc:
        raise storage_error(url, f"cannot reach the {term}", exc, storage_options) from None
    if not found:
        where = f"the endpoint ({store.endpoint})" if store is not None else "the endpoint"
        raise StorageError(
            f"{protocol}://{bucket}/: no such {term} (from {url}); create it first, or check "
            f"the URL and {where}"
        )


class _Range:
    """One range's attempts under a ``RetryPolicy``, as ``fetch`` counts them: the bytes received
    so far (a body that ends early keeps what it brought, the next attempt asks for the rest),
    and what each outcome leads to: done, a wait before the next attempt, or the error."""

    def __init__(self, url, start, stop, policy, options, local=False):
        self.url, self.start, self.stop = url, start, stop
        self.policy, self.options, self.local = policy or RetryPolicy(), options, local
        self.parts: list[bytes] = []
        self.pos = start
        self.failures = self.attempts = 0

    def where(self) -> str:
        return f"bytes {self.start}-{self.stop}"

    def data(self) -> bytes:
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)

    def took(self, data: bytes) -> float | None:
        """An attempt's body: None when the range is whole, else the wait before asking for
        the rest (a body that ends early is a fault like a reset: never handed on)."""
        self.attempts += 1
        want = self.stop - self.pos
        if len(data) > want:
            raise storage_error(
                self.url,
                f"{self.where()}: the server sent {len(data)} bytes for a range of {want} (does "
                "it ignore Range requests?); serve the shards from a store that honours them",
                options=self.options,
            )
        if data:
            self.parts.append(bytes(data))
            self.pos += len(data)
        if self.pos == self.stop:
            return None
        if self.local:  # a file's end is its end: no later attempt finds more
            raise self.short()
        cause = IncompleteObject(f"the body ended {self.stop - self.pos} bytes short")
        return self._again(cause, progressed=bool(data))

    def failed(self, exc: BaseException) -> float:
        """An attempt's exception: the wait before the next attempt, or the error to raise."""
        self.attempts += 1
        if isinstance(exc, FileNotFoundError):
            raise storage_error(
                self.url,
                "no such object; check the URL and that the upload finished",
                exc,
                self.options,
                MissingObjectError,
            ) from None
        if _denied(exc) or _uncredentialed(exc):
            raise storage_error(self.url, _denied_hint(self.url, exc), exc, self.options) from None
        if status_of(exc) == 416:
            raise self.short() from None
        if not is_transient(exc):
            raise storage_error(
                self.url, f"{self.where()}: read failed; {RETRY_FIX}", exc, self.options
            ) from None
        return self._again(exc, progressed=False)

    def short(self) -> ShortObjectError:
        text = redact(
            f"{self.url}: the object ends before byte {self.pos} ({self.where()} asked for): "
            "truncated or replaced",
            secret_values(self.options),
        )
        return ShortObjectError(text, self.data())

    def _again(self, exc: BaseException, progressed: bool) -> float:
        self.failures = 1 if progressed else self.failures + 1
        if self.failures > self.policy.retries:
            raise storage_error(
                self.url,
                f"{self.where()}: gave up after {self.attempts} attempts ({self.policy.retries} "
                f"retries in a row without progress, {self.pos - self.start} of "
                f"{self.stop - self.start} bytes received); {RETRY_FIX}",
                exc,
                self.options,
            ) from None
        return self.policy.delay(self.failures)


def fetch_range(
    url: str,
    start: int,
    stop: int,
    *,
    storage_options: Mapping[str, Any] | None = None,
    policy: RetryPolicy | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    sleep: Callable[[float], None] = time.sleep,
) -> bytes:
    """Bytes ``[start, stop)`` of the object at ``url``: one ranged GET, retried under ``policy``
    as ``fetch`` retries (``timeout``: seconds without progress before an attempt counts as
    stalled). Exactly ``stop - start`` bytes, or :class:`StorageError` (after the retries:
    naming the URL, the range and the fix), :class:`MissingObjectError`,
    :class:`ShortObjectError`."""
    protocol = protocol_of(url)
    fs = filesystem(protocol, storage_options, timeout)
    got = _Range(url, start, stop, policy, storage_options, local=protocol == "file")
    path = strip(fs, url)

    def cat(_write=None) -> bytes:
        return fs.cat_file(path, start=got.pos, end=stop)

    watched = needs_deadline(protocol)  # a driver that takes no timeout of ours: remote.deadline
    while True:
        try:
            data = bounded(cat, timeout, f"{url} {got.where()}") if watched else cat()
            wait = got.took(data)
        except StorageError:
            raise
        except Exception as exc:
            wait = got.failed(exc)
        if wait is None:
            return got.data()
        sleep(wait)


async def fetch_range_async(
    fs,
    url: str,
    start: int,
    stop: int,
    policy: RetryPolicy | None = None,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> bytes:
    """``fetch_range`` as a coroutine on ``fs``'s event loop (an async filesystem, built with the
    timeout wanted): the same attempts and errors, its waits ``asyncio.sleep``, so the other
    GETs in flight go on meanwhile and a cancellation ends it at once."""
    got = _Range(url, start, stop, policy, storage_options)
    path = strip(fs, url)
    while True:
        try:
            read = fs._cat_file(path, start=got.pos, end=stop)
            if timeout is not None and needs_deadline(protocol_of(url)):  # no driver timeout
                read = asyncio.wait_for(read, timeout)
            wait = got.took(await read)
        except StorageError:
            raise
        except Exception as exc:
            wait = got.failed(exc)
        if wait is None:
            return got.data()
        await asyncio.sleep(wait)
