"""Runners: where a pack's shard tasks run. ``LocalRunner`` is a process pool on this machine.

A runner is a callable ``runner(tasks) -> receipts`` (``shardkit.write.task``); ``pack(...,
runner=...)`` plans, hands it the tasks and commits. Tasks are idempotent, so a runner may
retry or even repeat one freely. A runner may also offer ``map_chunks(fn, chunks)``
(``[fn(*c) for c in chunks]``, run where it runs tasks, retried alike): the plan then hands it
its per-file ``stat`` calls, ``plan_chunk`` files per call, and a table's scan, ``plan_chunk``
rows per span (``scan.table.scan_span``), so a source on a network filesystem is not stat-ed
file by file, nor a table's rows resolved one by one, from the driver alone. Cluster engines live in
``shardkit.integrations``; a process pool needs nothing beyond the standard library, and
helps on one machine because ``resize_short`` is CPU-bound (reader threads share one
interpreter's GIL for the resize).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TypeVar

from ..errors import InputError, ShardkitError, StorageError
from .plan import ShardReceipt, ShardTask
from .task import run_task

__all__ = ["PLAN_CHUNK", "RETRYABLE", "LocalRunner", "TaskFailed", "die_with_parent"]

#: Errors a task raises that a retry may cure (a flaky disk or store); anything else (a bad
#: image under on_error="raise", a full disk) stops the pack at once.
RETRYABLE = (OSError, StorageError)

#: Files a planning call (``map_chunks``) stats: its answer is one (n, 2) int64 array
#: (1 MiB), and a 10^8-file source makes ~1,500 calls.
PLAN_CHUNK = 1 << 16

T = TypeVar("T")

#: Items (tasks, planning chunks) submitted to the pool at a time, per process.
IN_FLIGHT = 2


def die_with_parent(parent: int) -> None:
    """A pool worker's initializer: the kernel kills it when its driver dies (Linux's
    ``PR_SET_PDEATHSIG``), so a SIGKILLed ``pack --engine local`` leaves no worker writing
    into OUT behind it, and the same command run again resumes at once. ``parent``: the
    driver's pid, checked after the call in case it died before."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)  # the driver is gone already


class TaskFailed(ShardkitError):
    """A task still failed after its retries (the last error is its ``__cause__``)."""


@dataclass
class LocalRunner:
    """Run tasks on ``processes`` worker processes, each reading with ``threads`` reader threads.

    Workers are forked when this process runs no other thread (cheap: shardkit is already
    imported), else spawned (a fresh interpreter each: forking beside a live thread can copy a
    held lock).

    A task that raises a ``RETRYABLE`` error is run again, up to ``retries`` times; a worker
    that dies (killed, out of memory, ``os._exit``) breaks the pool, which is started again and
    every unfinished task resubmitted (each task then in flight counts an attempt); at most
    ``IN_FLIGHT`` tasks a process are in flight, each made as it is submitted. Workers die with this
    process (``die_with_parent``), and hold no lock on OUT. ``fn`` is what runs a task
    (``run_task``; tests wrap it to inject faults). ``map_chunks`` runs the plan's per-file
    ``stat`` calls on the same pool, ``plan_chunk`` files a call.
    """

    processes: int = 2
    threads: int = 1
    retries: int = 3
    fn: Callable[..., list[ShardReceipt]] = run_task
    plan_chunk: int = PLAN_CHUNK

    def __post_init__(self):
        for name in ("processes", "threads", "plan_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"invalid {name}={v!r}; use 1 or more")

    def __call__(self, tasks: Sequence[ShardTask]) -> list[ShardReceipt]:
        done = self._map(self.fn, tasks, (self.threads,))
        return [r for receipts in done for r in receipts]

    def map_chunks(self, fn: Callable[..., T], chunks: Sequence[tuple]) -> list[T]:
        """``[fn(*chunk) for chunk in chunks]`` on the pool, in order, retried as tasks are."""
        return self._map(fn, chunks, None)

    def _map(self, fn: Callable, items: Sequence, extra: tuple | None) -> list:
        """``fn(item, *extra)`` (``extra`` None: ``fn(*item)``) for each item, on the pool."""
        results: dict[int, object] = {}
        attempts = [0] * len(items)
        alone = threading.active_count() == 1
        ctx = multiprocessing.get_context("fork" if alone else "spawn")
        while len(results) < len(items):
            todo = [i for i in range(len(items)) if i not in results]
            workers = min(self.processes, len(todo))
            with ProcessPoolExecutor(
                workers, mp_context=ctx, initializer=die_with_parent, initargs=(os.getpid(),)
            ) as pool:
                try:
                    self._drain(pool, fn, items, extra, todo, attempts, results)
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
        return [results[i] for i in range(len(items))]

    def _drain(self, pool, fn, items, extra, todo, attempts, results) -> None:
        """Run ``todo`` on ``pool`` until each is done; returns early when the pool breaks.
        At most ``IN_FLIGHT`` items a process are submitted at a time: an item (a task and its
        rows) is made as it is submitted, so the driver holds the tasks in flight, not every
        task's rows (the pool keeps each submitted item until its result is back)."""

        def submit(i: int) -> Future:
            args = items[i] if extra is None else (items[i], *extra)
            return pool.submit(fn, *args)

        waiting = iter(todo)
        running: dict[Future, int] = {}

        def fill() -> None:
            while len(running) < IN_FLIGHT * self.processes:
                i = next(waiting, None)
                if i is None:
                    return
                running[submit(i)] = i

        fill()
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                i = running.pop(f)
                try:
                    results[i] = f.result()
                except BrokenProcessPool as exc:
                    for j in [i, *running.values()]:
                        self._count(j, items, attempts, exc)
                    return  # a worker died: a fresh pool runs what is left
                except RETRYABLE as exc:
                    self._count(i, items, attempts, exc)
                    running[submit(i)] = i
            fill()

    def _count(self, i: int, items, attempts: list[int], exc: BaseException) -> None:
        attempts[i] += 1
        if attempts[i] > self.retries:
            raise TaskFailed(
                f"task {_describe(items[i])} failed {attempts[i]} times (last: {exc}); pack "
                "again with the same options to resume from the shards already done"
            ) from exc


def _describe(item) -> str:
    """A task as its repr; a planning chunk ``(root, files, ...)`` by its root and file count."""
    if isinstance(item, tuple) and len(item) >= 2 and isinstance(item[0], str):
        return f"stat of {len(item[1])} files under {item[0]!r}"
    if isinstance(item, tuple) and item and not isinstance(item[0], str):
        return f"the scan of {item[0]!r}"  # a table span (``scan.spans.TableSpan``)
    return repr(item)
