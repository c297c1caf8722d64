"""Runners: where a pack's shard tasks run. ``LocalRunner`` is a process pool on this machine.

A runner is a callable ``runner(tasks) -> receipts`` (``shardkit.write.plan``); ``pack(...,
runner=...)`` plans, hands it the tasks and commits. Tasks are idempotent, so a runner may
retry or even repeat one freely. Cluster engines live in ``shardkit.integrations``; a process
pool needs nothing beyond the standard library, and helps on one machine because
``resize_short`` is CPU-bound (reader threads share one interpreter's GIL for the resize).
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

from ..errors import InputError, ShardkitError, StorageError
from .plan import ShardReceipt, ShardTask, run_task

__all__ = ["RETRYABLE", "LocalRunner", "TaskFailed", "die_with_parent"]

#: Errors a task raises that a retry may cure (a flaky disk or store); anything else (a bad
#: image under on_error="raise", a full disk) stops the pack at once.
RETRYABLE = (OSError, StorageError)


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
    every unfinished task resubmitted (each such task counts an attempt). Workers die with this
    process (``die_with_parent``), and hold no lock on OUT. ``fn`` is what runs a task
    (``run_task``; tests wrap it to inject faults).
    """

    processes: int = 2
    threads: int = 1
    retries: int = 3
    fn: Callable[..., list[ShardReceipt]] = run_task

    def __post_init__(self):
        for name in ("processes", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"invalid {name}={v!r}; use 1 or more")

    def __call__(self, tasks: Sequence[ShardTask]) -> list[ShardReceipt]:
        results: dict[int, list[ShardReceipt]] = {}
        attempts = [0] * len(tasks)
        alone = threading.active_count() == 1
        ctx = multiprocessing.get_context("fork" if alone else "spawn")
        while len(results) < len(tasks):
            todo = [i for i in range(len(tasks)) if i not in results]
            workers = min(self.processes, len(todo))
            with ProcessPoolExecutor(
                workers, mp_context=ctx, initializer=die_with_parent, initargs=(os.getpid(),)
            ) as pool:
                try:
                    self._drain(pool, tasks, todo, attempts, results)
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
        return [r for i in range(len(tasks)) for r in results[i]]

    def _drain(self, pool, tasks, todo, attempts, results) -> None:
        """Run ``todo`` on ``pool`` until each is done; returns early when the pool breaks."""
        running: dict[Future, int] = {pool.submit(self.fn, tasks[i], self.threads): i for i in todo}
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                i = running.pop(f)
                try:
                    results[i] = f.result()
                except BrokenProcessPool as exc:
                    for j in [i, *running.values()]:
                        self._count(j, tasks, attempts, exc)
                    return  # a worker died: a fresh pool runs what is left
                except RETRYABLE as exc:
                    self._count(i, tasks, attempts, exc)
                    running[pool.submit(self.fn, tasks[i], self.threads)] = i

    def _count(self, i: int, tasks, attempts: list[int], exc: BaseException) -> None:
        attempts[i] += 1
        if attempts[i] > self.retries:
            raise TaskFailed(
                f"task {tasks[i]!r} failed {attempts[i]} times (last: {exc}); pack again with "
                "the same options to resume from the shards already done"
            ) from exc
