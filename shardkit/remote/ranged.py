"""Ranged GETs kept in flight ahead of the reader: the remote half of a sparse epoch.

A subset or split epoch reads each run of wanted samples with one ranged GET
(``shardkit.stream.ranges``). One at a time, every GET waits out the store's first-byte latency
(about 20 ms same-region), so a 1% subset epoch of 1.28M samples spent ~12,700 x 21 ms waiting.
:class:`RangesAhead` is told the GETs the reader will make, in its order (the next runs of the
same shard, then the next shards' runs), keeps up to ``requests`` of them in flight, and hands
each one's bytes over when the reader asks for it, in that same order: the same requests, the
same samples in the same order, only their waits overlap.

How: coroutines on the filesystem's own event loop (fsspec's IO thread, which ``remote.fs``
builds per process, so a forked DataLoader worker makes its own after the fork), not threads of
ours. ``close()`` cancels what is in flight (aiohttp closes those connections) and waits for the
cancellations, so nothing of a read outlives it. A filesystem without an async API (``file://``,
and other sync fsspec backends) is read one GET at a time in the caller, as before.

Memory: at most ``requests`` GETs in flight or fetched and not yet taken, holding at most
``max_bytes`` between them (one is always allowed, however large).

Errors: each GET is retried under the storage's policy and timeout, as a whole shard is
(``remote.fetch.fetch_range_async``: 5xx, resets, stalls and bodies that end early, from the
byte reached, its waits on the loop); what still fails raises its ``StorageError`` in the caller
when its turn comes, where the sequential read would have raised it. The filesystems' own retry
layers stay off (``remote.fs``): the attempts are ours, counted and backed off.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

from fsspec.asyn import sync

from .fetch import MissingObjectError, ShortObjectError, fetch_range_async
from .storage import RemoteStorage, remote_of

__all__ = ["RangedFile", "RangesAhead"]

#: The fewest bytes a ``RangedFile`` GET takes (clipped to the object's size), and the most a
#: GET that goes on reading where the last one ended grows to (doubling each time).
WINDOW = 64 << 10
MOST = 8 << 20

#: Seconds ``close()`` waits for cancelled GETs to end (a cancellation takes a loop turn).
CLOSE_WAIT = 10.0


class _Get:
    """One planned GET: where, which bytes, and (once started) its task and its result."""

    __slots__ = ("url", "start", "stop", "fs", "storage", "task", "result")

    def __init__(self, url: str, start: int, stop: int, fs, storage: RemoteStorage) -> None:
        self.url, self.start, self.stop, self.fs, self.storage = url, start, stop, fs, storage
        self.task: asyncio.Task | None = None  # set on the loop
        self.result: Future = Future()


class RangesAhead:
    """``take(url, start, stop)`` returns those bytes, fetched ahead where they were planned.

    ``plan(ranges)``: the (url, start, stop) the caller will take, in order (an iterator, read
    lazily as room frees up). Single consumer: ``plan``, ``take`` and ``close`` are called from
    one thread. A ``take`` that is not the next planned range (a reader that changed its mind)
    drops the plan and reads that range now: never wrong bytes, only no longer ahead.
    ``storage``: the ``RemoteStorage`` whose options, retry policy and timeout the GETs follow
    (another storage, or None: its options and the default policy, ``remote_of``).
    """

    def __init__(self, storage, requests: int, max_bytes: int):
        self.storage = remote_of(storage)
        self.requests = max(1, int(requests))
        self.max_bytes = max(0, int(max_bytes))
        self._plan: Iterator[tuple[str, int, int]] = iter(())
        self._next: tuple[str, int, int] | None = None
        self._queue: deque[_Get] = deque()
        self._bytes = 0  # of the GETs in the queue
        self._ready: set[int] = set()  # id() of the filesystems whose session is made
        #: GETs started ahead, and the most in flight or waiting at once (tests, benchmarks).
        self.started = 0
        self.most = 0

    def plan(self, ranges: Iterable[tuple[str, int, int]]) -> None:
        self.close()
        self._plan, self._next = iter(ranges), None

    def take(self, url: str, start: int, stop: int) -> bytes:
        self._fill()
        head = self._queue[0] if self._queue else None
        if head is None or (head.url, head.start, head.stop) != (url, start, stop):
            if head is not None:
                self.close()  # off the plan: what is ahead is not what comes next
                self._plan = iter(())
            return self.storage.read_range(url, start, stop)
        self._queue.popleft()  # its room is refilled at the next take: it may still be in flight
        self._bytes -= head.stop - head.start
        return head.result.result()

    def _fill(self) -> None:
        while len(self._queue) < self.requests:
            if self._next is None:
                self._next = next(self._plan, None)
                if self._next is None:
                    return
            url, start, stop = self._next
            size = stop - start
            if self._queue and self._bytes + size > self.max_bytes:
                return
            fs = self.storage.filesystem(url)
            if not (getattr(fs, "async_impl", False) and hasattr(fs, "_cat_file")):
                return  # a sync filesystem: the caller reads this range itself, when it comes
            self._session(fs)
            get = _Get(url, start, stop, fs, self.storage)
            fs.loop.call_soon_threadsafe(_start, get)
            self._queue.append(get)
            self._bytes += size
            self._next = None
            self.started += 1
            self.most = max(self.most, len(self._queue))

    def _session(self, fs) -> None:
        """Make the filesystem's HTTP session once, before GETs race to make one each."""
        if id(fs) in self._ready:
            return
        make = getattr(fs, "set_session", None)
        if make is not None and inspect.iscoroutinefunction(make):
            sync(fs.loop, make)
        self._ready.add(id(fs))

    def close(self) -> None:
        """Cancel the GETs ahead and wait until they have ended (their connections closed).

        Safe to call twice and after a failure; the plan stays (``take`` refills from it)."""
        gets, self._queue, self._bytes = list(self._queue), deque(), 0
        for get in gets:
            get.result.cancel()
        loops = {id(g.fs.loop): g.fs.loop for g in gets}
        for loop in loops.values():
            mine = [g for g in gets if g.fs.loop is loop]
            if _running() is loop:  # closed on the loop itself (a generator collected there)
                for g in mine:
                    if g.task is not None:
                        g.task.cancel()
                continue
            with contextlib.suppress(Exception):  # a loop already stopped has nothing running
                sync(loop, _cancel, mine, timeout=CLOSE_WAIT)


def _running():
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _start(get: _Get) -> None:
    """On the loop: start the GET, unless it was cancelled before its turn came."""
    if get.result.cancelled():
        return
    opts, policy = get.storage.storage_options, get.storage.policy
    get.task = asyncio.ensure_future(
        fetch_range_async(get.fs, get.url, get.start, get.stop, policy, opts, get.storage.timeout)
    )
    get.task.add_done_callback(lambda task: _settle(get, task))


def _settle(get: _Get, task: asyncio.Task) -> None:
    exc = asyncio.CancelledError() if task.cancelled() else task.exception()  # retrieved
    if not get.result.set_running_or_notify_cancel():
        return  # cancelled by close(): nobody takes it
    if exc is not None:
        get.result.set_exception(exc)
    else:
        get.result.set_result(task.result())


async def _cancel(gets: list[_Get]) -> None:
    """On the loop, after every ``_start`` queued before it (the loop runs them in order)."""
    tasks = [g.task for g in gets if g.task is not None and not g.task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=CLOSE_WAIT)


class RangedFile:
    """An object read as a file is by ``os.pread``: ``pread(n, offset)``, by ranged GETs under
    ``storage``'s retry policy, timeout and deadline (``RemoteStorage.read_range``): what a URL
    dataset's key file is read through (``formats.key_file.read_at``), so a remote split reads
    its runs' head, block table and val-prefix blocks where a local one reads the file.

    ``size``: the object's bytes as the manifest lists them; no GET asks past them. Each GET
    takes at least ``window`` bytes, twice the last one's where it goes on reading where that
    one ended (a column read on, as a split reads its val prefix: up to ``most``), and the last
    ``keep`` are held, so a run's small reads (a block's hashes, then its shards, from two
    columns) cost a GET a window, not two a block of 512 samples, and a prefix of ``m`` bytes
    about ``log2(m / window)`` GETs, reading at most twice its bytes: at most ``keep * most``
    bytes held (or one read's, where larger). A read the object is too short for
    hands back what it holds (``read_at`` calls it cut short); a missing object is a
    ``FileNotFoundError`` naming it (the caller's "does not serve"); a store that keeps
    failing, the ``StorageError`` naming the URL, after the retries. ``gets``, ``bytes``:
    what it fetched."""

    def __init__(
        self, url: str, storage, size: int, window: int = WINDOW, keep: int = 2, most: int = MOST
    ):
        self.url, self.storage, self.size = url, remote_of(storage), int(size)
        self.window, self.keep = max(1, int(window)), max(1, int(keep))
        self.most = max(self.window, int(most))
        self._held: deque[tuple[int, bytes]] = deque()
        self.gets = self.bytes = 0

    def pread(self, n: int, offset: int) -> bytes:
        for i, (at, data) in enumerate(self._held):
            if at <= offset and offset + n <= at + len(data):
                del self._held[i]  # the most recently used last
                self._held.append((at, data))
                return data[offset - at : offset - at + n]
        grow = [len(d) for at, d in self._held if at <= offset <= at + len(d)]  # read on
        want = min(2 * max(grow), self.most) if grow else self.window
        stop = max(offset + n, min(offset + max(want, self.window), self.size))
        try:
            data = self.storage.read_range(self.url, offset, stop)
        except ShortObjectError as exc:
            data = exc.received
        except MissingObjectError as exc:
            raise FileNotFoundError(str(exc)) from None
        finally:
            self.gets += 1
        self.bytes += len(data)
        self._held.append((offset, data))
        while len(self._held) > self.keep:
            self._held.popleft()
        return data[:n]
