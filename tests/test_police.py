"""The thread and process police in conftest: it must fail a test that leaves a thread or a child
behind, forgive what only garbage still holds, and cost nothing (no ``gc.collect()``) when a test
leaves nothing."""

from __future__ import annotations

import gc
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from conftest import _children, police_verdict


@contextmanager
def _collections_counted() -> Iterator[list[str]]:
    """Automatic collection off; yields the list of collections run meanwhile (by anyone)."""
    seen: list[str] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(phase)

    was_enabled = gc.isenabled()
    gc.disable()
    gc.callbacks.append(count)
    try:
        yield seen
    finally:
        gc.callbacks.remove(count)
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize(
    "name, daemon", [("shardkit-leak-probe", True), ("plain-non-daemon-probe", False)]
)
def test_a_thread_left_running_fails_the_test(name, daemon):
    before, children = set(threading.enumerate()), _children()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name=name, daemon=daemon)
    t.start()
    try:
        verdict = police_verdict(before, children, grace=0.3)
        assert verdict is not None and name in verdict and "1 thread(s)" in verdict
    finally:
        stop.set()
        t.join()
    assert police_verdict(before, children, grace=0.3) is None


def test_a_child_process_left_running_fails_the_test():
    before, children = set(threading.enumerate()), _children()
    child = subprocess.Popen(["sleep", "60"])
    try:
        verdict = police_verdict(before, children, grace=0.3)
        assert verdict is not None and str(child.pid) in verdict and "1 child" in verdict
    finally:
        child.kill()
        child.wait()
    assert police_verdict(before, children, grace=0.3) is None


class _Holder:
    """A thread that stops when its owner is finalized: kept alive only by a reference cycle."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.stop.wait, name="shardkit-held-by-garbage")
        self.thread.start()
        self.cycle = self

    def __del__(self) -> None:
        self.stop.set()
        self.thread.join()


def test_a_thread_only_garbage_holds_is_collected_then_forgiven():
    before, children = set(threading.enumerate()), _children()
    with _collections_counted() as collections:
        holder = _Holder()
        thread = holder.thread
        del holder
        assert thread.is_alive()  # only a collection can end it now
        assert police_verdict(before, children, grace=0.3) is None
        assert collections  # the police saw the thread and collected
    assert not thread.is_alive()


def test_a_test_that_leaves_nothing_costs_no_collection():
    before, children = set(threading.enumerate()), _children()
    with _collections_counted() as collections:
        assert police_verdict(before, children) is None
    assert collections == []
