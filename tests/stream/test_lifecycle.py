"""Abandoned reads leave nothing behind: no shardkit thread, no child process, no descriptor.

Local and remote (moto S3 on loopback) datasets, tar and LMDB, are iterated part way and then
abandoned three ways: ``break``, an exception in the consumer, and a DataLoader with two worker
processes dropped mid-epoch. A census of threads, children (/proc) and open file descriptors
(/proc/self/fd) is taken before and after.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import uuid

import pytest
from conftest import _children, leftovers
from PIL import Image
from torch.utils.data import DataLoader

from shardkit import Order
from shardkit.remote.storage import RemoteStorage
from shardkit.stream.dataset import ShardDataset
from shardkit.write.packer import pack

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:ShardDataset iterated epoch:RuntimeWarning"),  # on purpose
]

N = 60


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """60 tiny JPEGs packed as ~6 tar shards and ~3 LMDB shards."""
    base = tmp_path_factory.mktemp("lifecycle")
    src = base / "src"
    for i in range(N):
        d = src / f"class{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 6), (i * 4, 40, 255 - i)).save(d / f"img{i:03d}.jpg")
    out = {"tar": base / "tar", "lmdb": base / "lmdb"}
    pack(str(src), str(out["tar"]), shard_size=8000, progress=False)
    pack(str(src), str(out["lmdb"]), shard_size=40000, format="lmdb", progress=False)
    return out


@pytest.fixture(scope="module")
def s3_bucket(packed):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from remote_servers import S3Server

    with S3Server() as server:
        name = f"life-{uuid.uuid4().hex[:10]}"
        for fmt, folder in packed.items():
            server.upload_dir(name, fmt, folder)
        yield server, name


def _fds() -> dict[int, str]:
    """Open descriptors of this process: files, pipes, shared memory. Not sockets and event-loop
    inodes: fsspec and aiohttp keep one loop and one pool of keep-alive connections per process
    and filesystem, reused by every read and collected by the GC on its own schedule."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used
            continue
        if not target.startswith(("socket:", "anon_inode:")):
            out[int(fd)] = target
    return out


def _fds_left(before: dict[int, str], grace: float = 5.0) -> dict[int, str]:
    """Descriptors open now that were not open ``before`` (empty once none is left, or what is
    left after ``grace`` seconds): a worker's last batch (shared memory) is released when the
    loader's queues are collected. Descriptors that closed meanwhile (an earlier test's pipes
    collected during this one) are not this test's leak and do not count."""
    deadline = time.monotonic() + grace
    while True:
        gc.collect()
        left = {fd: t for fd, t in _fds().items() if before.get(fd) != t}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _dataset(kind: str, fmt: str, packed, request, cache_dir=None) -> ShardDataset:
    if kind == "local":
        return ShardDataset(str(packed[fmt]), decode="raw", order=Order(buffer_size=4))
    server, bucket = request.getfixturevalue("s3_bucket")
    from remote_servers import S3Server

    return ShardDataset(
        f"s3://{bucket}/{fmt}",
        decode="raw",
        order=Order(buffer_size=4),
        storage=RemoteStorage(
            storage_options=S3Server.options(server.endpoint), cache_dir=cache_dir, prefetch=2
        ),
    )


def _break(ds):
    for n, _ in enumerate(ds):
        if n == 7:
            break


def _raise(ds):
    class Stop(Exception):
        pass

    with pytest.raises(Stop):
        for n, _ in enumerate(ds):
            if n == 7:
                raise Stop


def _workers(ds):
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    for n, _ in enumerate(loader):
        if n == 2:
            break


ABANDON = {"break": _break, "exception": _raise, "workers": _workers}


@pytest.mark.parametrize("how", list(ABANDON))
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
@pytest.mark.parametrize("kind", ["local", pytest.param("remote", marks=pytest.mark.slow)])
def test_abandoned_iteration_leaves_no_thread_process_or_descriptor(
    kind, fmt, how, packed, request
):
    ds = _dataset(kind, fmt, packed, request)
    assert sum(1 for _ in ds) == len(ds)
    ABANDON[how](ds)  # warm-up: per-process pools and event loops exist from here on
    gc.collect()
    threads, children, fds = set(threading.enumerate()), _children(), _fds()

    for _ in range(3):
        ABANDON[how](ds)
    gc.collect()

    left_threads, left_children = leftovers(threads, children)
    shardkit_threads = [t.name for t in threading.enumerate() if t.name.startswith("shardkit")]
    assert shardkit_threads == [] and left_threads == []
    assert left_children == set()
    assert _fds_left(fds) == {}


@pytest.mark.slow  # a moto S3 server
def test_abandoned_remote_reads_with_a_cache_close_their_cache_files(packed, request, tmp_path):
    ds = _dataset("remote", "tar", packed, request, cache_dir=str(tmp_path / "cache"))
    assert sum(1 for _ in ds) == len(ds)
    threads, children, fds = set(threading.enumerate()), _children(), _fds()
    for _ in range(3):
        _break(ds)
    gc.collect()
    assert leftovers(threads, children) == ([], set())
    assert not [t for t in threading.enumerate() if t.name.startswith("shardkit")]
    assert _fds_left(fds) == {}  # no cache entry or lock file left open
    assert os.listdir(tmp_path / "cache")  # the reads did go through the cache


@pytest.mark.slow  # a moto S3 server
def test_remote_datasets_abandoned_and_deleted_leak_no_prefetch_thread_or_shard(packed, request):
    """12 remote datasets, each read part way with ``break`` and deleted, once left 2 prefetch
    threads and a prefetched shard apiece (threads 1 -> 26, RSS +130 MB)."""
    from shardkit.remote.storage import _Shard

    threads, children = set(threading.enumerate()), _children()
    for _ in range(12):
        ds = _dataset("remote", "tar", packed, request)
        _break(ds)
        del ds
    gc.collect()
    assert leftovers(threads, children) == ([], set())
    assert [t.name for t in threading.enumerate() if t.name.startswith("shardkit")] == []
    gc.collect()
    assert [o for o in gc.get_objects() if type(o) is _Shard] == []  # no shard held
