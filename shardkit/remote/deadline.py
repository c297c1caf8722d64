"""A deadline for reads on filesystems whose driver takes no timeout from us.

fsspec has no common timeout option. shardkit sets each known driver's own (``remote/fs.py``:
s3, http, gs, az/abfs) and runs every read on any other remote filesystem (``hf://``,
``sftp://``, a user's own) in a daemon thread that must show progress every ``timeout``
seconds. A read that stalls past that is abandoned, not joined: its thread stays blocked in the
driver until the driver gives up on its own, whatever it delivers later is dropped, and the
caller gets a ``TimeoutError``, which the retry policy counts as a stall like any other. So a
read ends within about ``timeout x (retries + 1)`` on every protocol, as on S3.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["DRIVER_TIMED", "needs_deadline", "bounded"]

T = TypeVar("T")

#: protocols whose driver takes shardkit's connect and read timeouts (``remote.fs._defaults``),
#: or that cannot stall (local files, memory): their reads run inline, at no cost
DRIVER_TIMED = frozenset(
    {"s3", "s3a", "http", "https", "gs", "gcs", "az", "abfs", "abfss"}
    | {"file", "local", "memory", ""}
)


def needs_deadline(protocol: str) -> bool:
    """True for a protocol whose reads shardkit cannot time out through its driver."""
    return protocol not in DRIVER_TIMED


class _Abandoned(Exception):
    """Raised in an abandoned read's thread at its next write, so it stops there."""


class _Watch(Generic[T]):
    """One read in its thread: its result or error, and when it last made progress."""

    def __init__(self, write: Callable[[bytes], object] | None):
        self.cond = threading.Condition()
        self.write = write
        self.beat = time.monotonic()
        self.done = self.abandoned = False
        self.result: T | None = None
        self.error: BaseException | None = None

    def guarded(self, data: bytes) -> None:
        with self.cond:
            if self.abandoned:
                raise _Abandoned
            if self.write is not None:
                self.write(data)
            self.beat = time.monotonic()

    def run(self, read: Callable[[Callable[[bytes], None]], T]) -> None:
        try:
            result, error = read(self.guarded), None
        except BaseException as exc:  # handed to the waiting caller, never lost in the thread
            result, error = None, exc
        with self.cond:
            self.result, self.error, self.done = result, error, True
            self.cond.notify_all()


def bounded(
    read: Callable[[Callable[[bytes], None]], T],
    timeout: float,
    what: str,
    write: Callable[[bytes], object] | None = None,
) -> T:
    """``read(write)``'s result, or ``TimeoutError`` once ``timeout`` seconds pass with neither
    a result nor a byte handed to ``write`` (a read that returns its bytes at the end, such as
    ``cat_file``, must finish within ``timeout``). ``what`` names the read in the message."""
    watch: _Watch[T] = _Watch(write)
    threading.Thread(
        target=watch.run, args=(read,), daemon=True, name="shardkit-read-deadline"
    ).start()
    with watch.cond:
        while not watch.done:
            left = watch.beat + timeout - time.monotonic()
            if left <= 0:
                watch.abandoned = True
                raise TimeoutError(f"{what}: no progress for {timeout:g} s")
            watch.cond.wait(left)
    if watch.error is not None:
        raise watch.error
    return watch.result  # type: ignore[return-value]
