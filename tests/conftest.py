"""Shared test fixtures."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

# --- thread and process police (H9s) ---
#
# Every test must leave the process as it found it: no new shardkit thread (prefetch, upload ...),
# no new non-daemon thread (it would keep the interpreter alive) and no new child process
# (DataLoader workers, helpers). State that outlives a test leaks into the next one (issue 9:
# a truncated-shard test took 0.5 s alone and 10 s in its file). A leak is fixed in shardkit,
# never exempted here. Module- and session-scoped fixtures are set up before this function-scoped
# check takes its snapshot, so servers they start are not counted; the names below cover servers
# started lazily by a test and kept for the session.

#: Substrings of thread names that session-scoped server fixtures may keep running.
POLICE_ALLOWED_THREADS = ("serve_forever", "S3Server", "HttpServer", "FaultProxy", "moto")
#: Per-interpreter helpers multiprocessing starts once and keeps until exit (spawn contexts).
POLICE_ALLOWED_CHILDREN = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
#: Seconds a leftover thread or child gets to finish before the test fails.
POLICE_GRACE = 5.0


def _children() -> set[int]:
    """Pids of this process's live children (from /proc), but multiprocessing's own helpers."""
    pids: set[int] = set()
    task_dir = f"/proc/{os.getpid()}/task"
    try:
        tasks = os.listdir(task_dir)
    except OSError:  # not Linux: no process census
        return pids
    for task in tasks:
        try:
            with open(f"{task_dir}/{task}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return {p for p in pids if not _allowed_child(p)}


def _allowed_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
    except OSError:  # already gone
        return True
    return any(name in cmdline for name in POLICE_ALLOWED_CHILDREN)


def _suspect(t: threading.Thread) -> bool:
    if any(name in t.name for name in POLICE_ALLOWED_THREADS):
        return False
    return t.name.startswith("shardkit") or not t.daemon


def leftovers(
    threads_before: set[threading.Thread], children_before: set[int], grace: float = POLICE_GRACE
) -> tuple[list[threading.Thread], set[int]]:
    """Threads and children started since the snapshot that are still alive after ``grace``."""
    deadline = time.monotonic() + grace
    while True:
        gc.collect()  # a traceback cycle may hold a DataLoader iterator: its __del__ ends workers
        threads = [
            t
            for t in threading.enumerate()
            if t not in threads_before and t is not threading.current_thread() and _suspect(t)
        ]
        children = _children() - children_before
        if (not threads and not children) or time.monotonic() >= deadline:
            return threads, children
        for t in threads:
            t.join(max(0.0, min(0.2, deadline - time.monotonic())))
        if not threads:
            time.sleep(0.05)


@pytest.fixture(autouse=True)
def thread_and_process_police():
    threads_before = set(threading.enumerate())
    children_before = _children()
    yield
    threads, children = leftovers(threads_before, children_before)
    if threads or children:
        names = ", ".join(f"{t.name} (daemon={t.daemon})" for t in threads)
        pytest.fail(
            f"the test left {len(threads)} thread(s) [{names}] and {len(children)} child "
            f"process(es) {sorted(children)} alive after {POLICE_GRACE:.0f} s: close what it "
            "opened (storage.close(), DataLoader iterators, pools)",
            pytrace=False,
        )
