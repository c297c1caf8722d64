"""ShardLoader's worker processes under faults: every fault is an error or a clean exit, never a
hang, and nothing is left behind (no process, no /dev/shm entry)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from PIL import Image

from shardkit import ShardDataset, ShardLoader, pack
from shardkit.loader.workers import WorkerDied

pytestmark = [
    pytest.mark.slow,  # real signals and child processes
    pytest.mark.filterwarnings("ignore:ShardDataset iterated epoch:RuntimeWarning"),
]

N = 40


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    rng = np.random.default_rng(0)
    for i in range(N):
        d = base / "src" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(d / f"{i}.jpg")
    pack(str(base / "src"), str(base / "tar"), shard_size=20_000, progress=False)
    return str(base / "tar")


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for init counts: it runs nothing and holds no memory)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:\tZ") for line in f)
    except OSError:
        return True


def _wait_gone(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _left_in_shm(before: set[str], pids: list[int]) -> set[str]:
    """New /dev/shm entries named after these processes (torch and multiprocessing put the
    creator's pid in their names; other tests on a shared machine may add their own)."""
    return {n for n in _shm() - before if any(str(p) in n for p in pids)}


def test_a_killed_worker_is_an_error_naming_it_not_a_hang(shards):
    # batch 1 and one batch ahead: each worker is mid-epoch, waiting for a slot, when killed
    loader = ShardLoader(ShardDataset(shards, decode="tensor"), 1, num_workers=2, prefetch_factor=1)
    it = iter(loader)
    next(it)
    victim = loader.worker_pids[0]
    os.kill(victim, signal.SIGKILL)
    started = time.monotonic()
    died = rf"worker 0 \(pid {victim}\) died: killed by signal SIGKILL"
    with pytest.raises(WorkerDied, match=died):
        for _ in it:
            pass
    assert time.monotonic() - started < 20  # reported within the wait, not by a timeout
    assert loader.worker_pids == []  # the other worker was stopped with it
    # the next iteration starts a fresh set of workers
    assert sum(len(x) for x, _ in loader) == N
    loader.close()


_TRAINER = textwrap.dedent(
    """
    import json, sys, time
    from shardkit import ShardDataset, ShardLoader
    loader = ShardLoader(ShardDataset(sys.argv[1], decode="tensor"), 1, num_workers=2,
                         prefetch_factor=1)
    try:
        for i, _ in enumerate(loader):
            if i == 0:
                print(json.dumps(loader.worker_pids), flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    """
)


def _trainer(shards) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, shards],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # SIGINT as a terminal's job has it, even under a runner that ignores it (nohup, &)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        text=True,
        start_new_session=True,  # its own process group, as a terminal's job
    )
    pids = json.loads(proc.stdout.readline())
    assert len(pids) == 2 and not any(_gone(p) for p in pids)
    return proc, pids


def test_workers_of_a_killed_training_process_exit_by_themselves(shards):
    shm = _shm()
    proc, pids = _trainer(shards)
    proc.kill()  # SIGKILL: no atexit, no finalizer runs in the trainer
    proc.communicate(timeout=30)
    assert _wait_gone(pids, 10) == []
    assert _left_in_shm(shm, [proc.pid, *pids]) == set()  # the ring has no name to leave


def test_ctrl_c_stops_every_worker_cleanly(shards):
    shm = _shm()
    proc, pids = _trainer(shards)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole job
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "interrupted" in out
    assert "Traceback" not in err  # workers ignore SIGINT: the trainer alone handles it
    assert _wait_gone(pids, 10) == []
    assert _left_in_shm(shm, [proc.pid, *pids]) == set()


def test_a_worker_killed_between_epochs_is_reported_and_replaced(shards):
    loader = ShardLoader(ShardDataset(shards, decode="tensor"), 4, num_workers=2)
    assert sum(len(x) for x, _ in loader) == N
    victim = loader.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    assert _wait_gone([victim], 10) == []
    with pytest.raises(WorkerDied, match=rf"worker 1 \(pid {victim}\) died"):
        for _ in loader:
            pass
    assert sum(len(x) for x, _ in loader) == N  # new workers
    assert victim not in loader.worker_pids
    loader.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_worker_killed_mid_epoch_is_worker_died_every_time(shards, sig):
    """Killed while the loader holds its slots: handing a slot back must not surface as a bare
    BrokenPipeError."""
    ds = ShardDataset(shards, decode="tensor")
    for _ in range(4):
        loader = ShardLoader(ds, 1, num_workers=2, prefetch_factor=1)
        it = iter(loader)
        next(it), next(it), next(it)
        victim = loader.worker_pids[0]
        os.kill(victim, sig)
        assert _wait_gone([victim], 10) == []
        started = time.monotonic()
        with pytest.raises(WorkerDied, match=rf"worker 0 \(pid {victim}\) died: killed by signal"):
            for _ in it:
                pass
        assert time.monotonic() - started < 20
        loader.close()


def test_a_forked_child_using_a_started_loader_gets_an_error_and_the_parent_goes_on(shards):
    loader = ShardLoader(ShardDataset(shards, decode="tensor"), 4, num_workers=2)
    assert sum(len(x) for x, _ in loader) == N
    pids = loader.worker_pids
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            try:
                n = sum(len(x) for x, _ in loader)
                out = f"ran {n}"
            except Exception as exc:
                out = f"{type(exc).__name__}: {exc}"
            loader.close()  # the parent's workers are not the child's to stop
            os.write(write, out.encode())
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    with os.fdopen(read) as f:
        said = f.read()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert said.startswith("ForeignLoaderError") and "fork" in said
    assert loader.worker_pids == pids and not any(_gone(p) for p in pids)
    assert sum(len(x) for x, _ in loader) == N  # the parent's loader keeps working
    loader.close()


def test_forkserver_workers_survive_a_long_pause_and_exit_with_their_trainer(shards):
    loader = ShardLoader(
        ShardDataset(shards, decode="tensor"), 1, num_workers=2, start_method="forkserver"
    )
    it = iter(loader)
    seen = len(next(it)[0])
    time.sleep(2.5)  # a long training step: idle workers must not take it for a dead trainer
    seen += sum(len(x) for x, _ in it)
    assert seen == N
    loader.close()
    code = _TRAINER.replace("num_workers=2,", 'num_workers=2, start_method="forkserver",')
    proc = subprocess.Popen([sys.executable, "-c", code, shards], stdout=subprocess.PIPE, text=True)
    pids = json.loads(proc.stdout.readline())
    proc.kill()
    proc.communicate(timeout=30)
    assert _wait_gone(pids, 10) == []


def _ring_fds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += "shardkit-ring" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return n


def _ring_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("shardkit-ring" in line for line in f)


def test_closing_a_loader_frees_its_ring_while_other_loaders_workers_live(shards):
    ds = ShardDataset(shards, decode="tensor")
    a = ShardLoader(ds, 4, num_workers=2)
    assert sum(len(x) for x, _ in a) == N  # a's ring is mapped in this process
    b = ShardLoader(ds, 4, num_workers=2)
    it = iter(b)  # b's workers are forked now: they must not hold a's ring (nor each other's)
    next(it)
    slots = b._res.ring.slots
    a.close()
    for pid in b.worker_pids:
        assert _ring_fds(pid) == slots
        assert _ring_maps(pid) <= slots
    assert sum(len(x) for x, _ in it) == N - 4
    b.close()


def test_processes_forked_beside_a_loader_hold_none_of_its_ring(shards):
    """A DataLoader's fork workers (or any fork of the training process) started while a
    ShardLoader lives close its ring's descriptors: closing the loader returns the ring's memory
    while they run. A ShardLoader started after it keeps exactly its own slots."""
    from torch.utils.data import DataLoader

    ds = ShardDataset(shards, decode="tensor")
    a = ShardLoader(ds, 4, num_workers=2)
    it_a = iter(a)
    next(it_a)  # a's workers and its ring are live
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    it_dl = iter(dl)
    next(it_dl)
    b = ShardLoader(ds, 4, num_workers=1)
    it_b = iter(b)
    next(it_b)
    a.close()
    for pid in [w.pid for w in it_dl._workers]:
        assert _ring_fds(pid) == 0
    assert [_ring_fds(pid) for pid in b.worker_pids] == [b._res.ring.slots]
    assert sum(1 for _ in it_dl) == N - 1
    assert sum(len(x) for x, _ in it_b) == N - 4
    b.close()


def _ring_inodes(pid: int) -> list[int]:
    """The inode of every ring file ``pid`` holds a descriptor of, one entry per descriptor."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "shardkit-ring" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                found.append(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    return found


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_after_close_no_process_holds_a_descriptor_of_the_ring(shards, method):
    """A loader B started while A runs, both handing out batches their caller keeps (each slot
    then gets a new file): once A is closed neither the trainer nor B's workers hold any of A's
    ring files, and each B worker holds its own slots' and no more. A spawned or fork-server
    worker kept the old file of every replaced slot open (and its memory alive)."""
    ds = ShardDataset(shards, decode="tensor")
    a = ShardLoader(ds, 4, num_workers=2)
    kept_a = list(a)  # every slot replaced once
    it_a = iter(a)
    kept_a.append(next(it_a))
    b = ShardLoader(ds, 4, num_workers=2, start_method=method)
    kept_b = list(b)  # every slot of b replaced: a new file sent to its workers
    kept_b += list(b)
    it_b = iter(b)
    kept_b.append(next(it_b))
    files_a = {os.fstat(fd).st_ino for fds in a._res.ring._fds for fd in fds}
    a.close()
    assert not files_a & set(_ring_inodes(os.getpid()))
    for pid in b.worker_pids:
        held = _ring_inodes(pid)
        assert len(held) == b._res.ring.slots and not files_a & set(held)
    assert sum(len(x) for x, _ in it_b) == N - 4
    b.close()
    assert _ring_inodes(os.getpid()) == []
    assert len(kept_a) == 11 and len(kept_b) == 21


def test_a_stopped_worker_is_warned_about_with_its_pid_and_state(shards, monkeypatch):
    from shardkit.loader import workers

    monkeypatch.setattr(workers, "STALL_WARN_S", 0.5)
    loader = ShardLoader(ShardDataset(shards, decode="tensor"), 1, num_workers=2, prefetch_factor=1)
    it = iter(loader)
    next(it)
    pids = loader.worker_pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(3.0, lambda: [os.kill(p, signal.SIGCONT) for p in pids])
    resume.start()
    try:
        with pytest.warns(RuntimeWarning, match=r"worker \d \(pid \d+, state T \(stopped\)\)"):
            rest = sum(len(x) for x, _ in it)
    finally:
        resume.join()
    assert rest == N - 1  # it went on once the workers were continued
    loader.close()
