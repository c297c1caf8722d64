"""Fetch the next shards in the background while the current one is read.

A :class:`Prefetcher` keeps up to ``depth`` upcoming objects in flight or ready, each on its own
daemon thread (so the downloads overlap each other's first-byte latency), and hands a ready result
to the consumer the moment it asks. Daemon threads, not ``concurrent.futures``' pool: a DataLoader
worker that exits mid-epoch must not wait for a download nobody will read.

Memory: a result is whatever ``fetch`` returns (a file descriptor when there is a cache, the shard
bytes otherwise), so without a cache one worker holds at most ``depth`` shards ahead plus the one
being read: ``(depth + 1) x shard size``.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

__all__ = ["Prefetcher"]

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """``want(urls)`` says what comes next; ``take(url)`` returns its result, fetching if needed.

    Single consumer: ``want`` and ``take`` are called from one thread (the dataset's iterator).
    """

    def __init__(
        self,
        fetch: Callable[[str], T],
        depth: int,
        discard: Callable[[T], None] | None = None,
    ):
        self._fetch = fetch
        self.depth = max(0, int(depth))
        self._discard = discard
        self._pending: OrderedDict[str, Future] = OrderedDict()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self.started = 0  # background fetches begun (for tests and benchmarks)

    def _worker(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            url, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self._fetch(url))
            except BaseException as exc:
                fut.set_exception(exc)

    def _submit(self, url: str) -> None:
        if len(self._threads) < self.depth:
            t = threading.Thread(target=self._worker, name="shardkit-prefetch", daemon=True)
            t.start()
            self._threads.append(t)
        fut: Future = Future()
        self._pending[url] = fut
        self.started += 1
        self._jobs.put((url, fut))

    def want(self, urls: Sequence[str]) -> None:
        """Start fetching the first ``depth`` of ``urls`` that are not already under way."""
        if not self.depth:
            return
        wanted: list[str] = []
        for u in urls:
            if u not in wanted:
                wanted.append(u)
                if len(wanted) == self.depth:
                    break
        for u in wanted:
            if u not in self._pending:
                self._submit(u)
        # The plan changed (a new epoch, an abandoned iterator): forget the oldest results that
        # are no longer wanted. One extra is allowed: the shard about to be taken.
        for u in list(self._pending):
            if len(self._pending) <= self.depth + 1:
                break
            if u not in wanted:
                self._drop(self._pending.pop(u))

    def _drop(self, fut: Future) -> None:
        if fut.cancel() or self._discard is None:
            return
        fut.add_done_callback(
            lambda f: self._discard(f.result()) if f.exception() is None else None
        )

    def take(self, url: str) -> T:
        """The result for ``url``: prefetched, awaited, or fetched now in the caller's thread."""
        fut = self._pending.pop(url, None)
        if fut is None or fut.cancel():
            return self._fetch(url)  # not queued behind the prefetches: the consumer needs it now
        return fut.result()

    def close(self) -> None:
        """Forget everything pending; idle threads exit."""
        for fut in self._pending.values():
            self._drop(fut)
        self._pending.clear()
        for _ in self._threads:
            self._jobs.put(None)
        self._threads.clear()
