"""Which failures are worth another try, and how long to wait before it.

One retry layer, ours: the filesystems we build have their own (s3fs, botocore) switched off, so
``retries=`` means what it says and every attempt is counted, backed off and resumable.
"""

from __future__ import annotations

import asyncio
import errno
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["RetryPolicy", "IncompleteObject", "is_transient", "describe", "status_of"]

# HTTP statuses a later attempt may not see: timeouts, throttling, server-side failures.
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
# S3-style error codes with the same meaning (moto, MinIO, R2, GCS's XML API all use them).
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
    }
)
_TRANSIENT_ERRNO = frozenset(
    {errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE, errno.ETIMEDOUT}
)
# Exception class names from optional libraries, matched by name so we import none of them.
_TRANSIENT_NAMES = frozenset(
    {
        # aiohttp
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "ClientConnectorError",
        "ClientOSError",
        "ServerTimeoutError",
        "SocketTimeoutError",
        "ConnectionTimeoutError",
        # botocore / urllib3
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "HTTPClientError",
        "ProtocolError",
        # fsspec
        "FSTimeoutError",
    }
)


class IncompleteObject(Exception):
    """The server ended a response before the bytes it announced: resume from where it stopped."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter.

    ``retries`` counts failed attempts in a row that brought no new bytes; an attempt that moved
    the download forward resets the count, so a flaky link that drops every few megabytes still
    finishes, while a dead one gives up after ``retries`` backed-off tries. The sleep before
    retry *n* is uniform in ``[d/2, d]`` with ``d = min(max_backoff, backoff * 2**(n-1))``: the
    jitter spreads the retries of many workers hit by one outage.
    """

    retries: int = 6
    backoff: float = 0.25
    max_backoff: float = 10.0

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        d = min(self.max_backoff, self.backoff * 2 ** max(0, failures - 1))
        return (rng or random).uniform(d / 2, d)

    def delays(self) -> Iterator[float]:
        """Sleeps before each retry of an operation that cannot resume (uploads, listings)."""
        for n in range(1, self.retries + 1):
            yield self.delay(n)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError
    code = None
    response = getattr(exc, "response", None)  # botocore.exceptions.ClientError
    if isinstance(response, dict):
        code = (response.get("Error") or {}).get("Code")
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode", status)
    return (status if isinstance(status, int) else None), (str(code) if code else None)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc`` or any exception it came from (None: no HTTP answer):
    a 416 to a ranged GET says the object ends before the range, which no retry changes."""
    for e in _chain(exc):
        status, _ = _status_and_code(e)
        if status is not None:
            return status
    return None


def is_transient(exc: BaseException) -> bool:
    """True for failures another attempt may not meet: resets, timeouts, 5xx, throttling."""
    for e in _chain(exc):
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
            return False
        if isinstance(e, (IncompleteObject, TimeoutError, socket.timeout, asyncio.TimeoutError)):
            return True
        if isinstance(e, (ConnectionError,)):
            return True
        if type(e).__name__ in _TRANSIENT_NAMES:
            return True
        status, code = _status_and_code(e)
        if code in TRANSIENT_CODES or status in TRANSIENT_STATUS:
            return True
        if status is not None or code is not None:
            return False  # an HTTP answer that is not transient: 400, 403, 404, 416 ...
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNO:
            return True
    return False


def describe(exc: BaseException) -> str:
    """A one-line cause: the exception class plus its message, HTTP status or S3 code."""
    status, code = None, None
    for e in _chain(exc):
        status, code = _status_and_code(e)
        if status or code:
            break
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    extra = " ".join(x for x in (f"HTTP {status}" if status else "", code or "") if x)
    name = type(exc).__name__
    parts = [name + (f" ({extra})" if extra and extra not in text else "")]
    if text:
        parts.append(text)
    return ": ".join(parts)
