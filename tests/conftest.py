"""Fixtures and settings shared by the test files."""

from __future__ import annotations

# --- shared fixtures ---
# The loopback servers (moto S3, fake-gcs-server, Azurite, HTTP with Range, the fault proxy) and
# their session fixtures live in remote_servers.py, loaded as a plugin so the remote test files
# just ask for ``s3``/``http``, or ``store`` for each object store in turn. Image trees, packed
# datasets and the CLI runner are built here once.
import contextlib
import gc
import os
import random
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardkit.manifest import read_manifest
from shardkit.write.packer import pack

pytest_plugins = ["remote_servers"]


def image_tree(root: Path, n: int, classes: int = 3, size: tuple[int, int] = (8, 6)) -> Path:
    """``root/class{i % classes}/img{i:03d}.jpg`` for i < n: tiny solid JPEGs, distinct colours."""
    for i in range(n):
        d = root / f"class{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (i * 11 % 256, 40, (255 - i) % 256)).save(d / f"img{i:03d}.jpg")
    return root


def random_tree(root, n: int, seed: int = 0, prefix: str = "") -> str:
    """``n`` 12x12 noise JPEGs in 3 class folders under ``root`` (seeded); its path."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        cls = f"c{i % 3}"
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        arr = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
        Image.fromarray(arr).save(os.path.join(root, cls, f"{prefix}im{i:03d}.jpg"))
    return str(root)


def ranged_pack(root: Path, n: int, shard_size: str, seed: int = 0) -> Path:
    """``root/tar``: ``n`` 24x24 noise JPEGs (3 classes, seeded) packed in shards of
    ``shard_size`` with their sample indexes, so a small subset or split reads byte ranges;
    ``root``."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        os.makedirs(root / "src" / f"c{i % 3}", exist_ok=True)
        arr = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)
        Image.fromarray(arr).save(root / "src" / f"c{i % 3}" / f"im{i:03d}.jpg")
    quiet(pack, str(root / "src"), str(root / "tar"), shard_size=shard_size, progress=False)
    return root


def one_shard_tar(root: Path) -> str:
    """``root/tar``: 80 random images packed into one tar shard (with its sample index)."""
    out = str(Path(root) / "tar")
    quiet(pack, random_tree(Path(root) / "src", 80), out, progress=False)
    assert len(read_manifest(out).shards) == 1
    return out


def split_keys(out: str, split: str, val_fraction: float, **kw) -> list[str]:
    """The keys a ``split`` epoch of ``out`` streams, in order (``kw``: ShardDataset's)."""
    from shardkit import ShardDataset, Source

    ds = ShardDataset(
        Source(out, split=split, val_fraction=val_fraction), decode="raw", with_keys=True, **kw
    )
    return [s[2] for s in ds]


def quiet(fn, *args, **kw):
    """``fn(*args, **kw)`` with its warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


def gnu_tar(root: Path, out: Path, members: Sequence[tuple[str, bytes]], fmt: str = "pax") -> str:
    """``members`` (name, bytes) written under ``root``, then archived in that order by GNU tar
    in ``--format=fmt`` (ustar, gnu, pax): shards made by another tool, as users bring them."""
    for name, data in members:
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    listing = root.parent / f"{root.name}.list"
    listing.write_text("".join(n + "\n" for n, _ in members), encoding="utf-8")
    cmd = ["tar", f"--format={fmt}", "-cf", str(out), "-C", str(root), "--no-recursion"]
    subprocess.run([*cmd, "-T", str(listing)], check=True)
    return str(out)


def lmdb_shard(path, n: int = 40, seed: int = 0) -> list[tuple[str, str, bytes, int]]:
    """A real LMDB shard at ``path`` with inline (small) and overflow-page (large) values: the
    hostile-input tests damage it; returns the (key, ext, data, label) samples written."""
    from shardkit.formats import get_format

    rng = random.Random(seed)
    samples = [
        (f"c{i % 3}/k{i}", "jpg", rng.randbytes(rng.choice([30, 700, 5000])), i % 3)
        for i in range(n)
    ]
    w = get_format("lmdb").open_writer(str(path))
    for s in samples:
        w.add(*s)
    w.close()
    return samples


@pytest.fixture(scope="session")
def resume_shards(tmp_path_factory) -> str:
    """301 tiny JPEGs (prime to 2, 3 and 4: rank and worker parts are all uneven) in three tar
    shards of ~100 samples, each with offset-index entries: the resume tests' data."""
    base = tmp_path_factory.mktemp("resume")
    for i in range(301):
        d = base / "src" / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 6), (i % 256, 7 * i % 256, 9)).save(d / f"i{i:03d}.jpg")
    out = str(base / "tar")
    pack(str(base / "src"), out, shard_size=270_000, format="tar", progress=False)
    manifest = read_manifest(out)
    assert len(manifest.shards) >= 3 and min(s.samples for s in manifest.shards) > 64
    return out


@pytest.fixture(scope="session")
def packed_tree(tmp_path_factory) -> Callable[..., dict[str, str]]:
    """Factory: an ``image_tree`` of ``n`` images packed once per format.

    ``packed_tree(22, 3, {"tar": 12000, "lmdb": 12000})`` -> ``{"src": ..., "tar": ...,
    "lmdb": ...}`` (paths as str); each format maps to its shard size in bytes, or give a list
    of formats and one ``shard_size``. Every call makes a fresh directory.
    """
    from shardkit.write.packer import pack

    def make(
        n: int,
        classes: int = 3,
        formats: Sequence[str] | dict[str, int] = ("tar", "lmdb"),
        shard_size: int = 12000,
        size: tuple[int, int] = (8, 6),
    ) -> dict[str, str]:
        base = tmp_path_factory.mktemp("packed")
        src = image_tree(base / "src", n, classes, size)
        sizes = formats if isinstance(formats, dict) else dict.fromkeys(formats, shard_size)
        out = {"src": str(src)}
        for fmt, limit in sizes.items():
            out[fmt] = str(base / fmt)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pack(str(src), out[fmt], format=fmt, shard_size=limit, progress=False)
        return out

    return make


def run_cli(*args, **kw) -> subprocess.CompletedProcess:
    """``shardkit ARGS`` in a child process: the real exit code, stderr and signal handling.

    The one subprocess runner (``from conftest import run_cli``); in-process tests that only
    check output use click's ``CliRunner``, which needs no fresh interpreter per call.
    """
    return subprocess.run(
        [sys.executable, "-m", "shardkit.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=kw.pop("timeout", 120),
        **kw,
    )


# --- thread and process police ---
#
# Every test must leave the process as it found it: no new shardkit thread (prefetch, upload ...),
# no new non-daemon thread (it would keep the interpreter alive) and no new child process
# (DataLoader workers, helpers). State that outlives a test leaks into the next one (once,
# a truncated-shard test took 0.5 s alone and 10 s in its file). A leak is fixed in shardkit,
# never exempted here. Module- and session-scoped fixtures are set up before this function-scoped
# check takes its snapshot, so servers they start are not counted; the names below cover servers
# started lazily by a test and kept for the session.

#: Substrings of thread names that session-scoped server fixtures may keep running.
POLICE_ALLOWED_THREADS = ("serve_forever", "S3Server", "HttpServer", "FaultProxy", "moto")
#: Per-interpreter helpers multiprocessing starts once and keeps until exit (spawn contexts).
#: And the store emulators the session's fixtures start on first use (remote_servers.py).
POLICE_ALLOWED_CHILDREN = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "fake-gcs-server",
    "azurite",
)
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


def _suspects(
    threads_before: set[threading.Thread], children_before: set[int]
) -> tuple[list[threading.Thread], set[int]]:
    threads = [
        t
        for t in threading.enumerate()
        if t not in threads_before and t is not threading.current_thread() and _suspect(t)
    ]
    return threads, _children() - children_before


def leftovers(
    threads_before: set[threading.Thread], children_before: set[int], grace: float = POLICE_GRACE
) -> tuple[list[threading.Thread], set[int]]:
    """Threads and children started since the snapshot that are still alive after ``grace``.

    Garbage is collected only once something is seen (a full ``gc.collect()`` costs ~110 ms
    with torch loaded, and most tests leave nothing): a traceback cycle may hold a DataLoader
    iterator or a storage whose ``__del__`` ends the workers or threads, so the census is
    taken again after each collection before anything is called a leftover.
    """
    deadline = time.monotonic() + grace
    threads, children = _suspects(threads_before, children_before)
    if not threads and not children:
        return [], set()
    if children:
        _shut_down_abandoned_loader_iterators()
    while True:
        gc.collect()
        threads, children = _suspects(threads_before, children_before)
        if (not threads and not children) or time.monotonic() >= deadline:
            return threads, children
        for t in threads:
            t.join(max(0.0, min(0.2, deadline - time.monotonic())))
        if not threads:
            time.sleep(0.05)


def police_verdict(
    threads_before: set[threading.Thread], children_before: set[int], grace: float = POLICE_GRACE
) -> str | None:
    """The police's failure message for what outlived the snapshot, or None when nothing did."""
    threads, children = leftovers(threads_before, children_before, grace)
    if not threads and not children:
        return None
    names = ", ".join(f"{t.name} (daemon={t.daemon})" for t in threads)
    return (
        f"the test left {len(threads)} thread(s) [{names}] and {len(children)} child "
        f"process(es) {sorted(children)} alive after {grace:g} s: close what it "
        "opened (storage.close(), DataLoader iterators, pools)"
    )


def _shut_down_abandoned_loader_iterators() -> None:
    """Stop the workers of DataLoader iterators that only a traceback still holds.

    Left to ``gc``, such an iterator costs 5 s per worker: the collector closes its index queues
    (their weakref finalizers run first) before ``__del__`` sends each worker its stop message,
    so the message never leaves and ``_shutdown_workers`` waits out its join timeout. Shutting
    them down while the queues still work is what ``__del__`` would do, minus the wait.
    """
    dataloader = sys.modules.get("torch.utils.data.dataloader")
    if dataloader is None:  # never imported: no iterator to stop, and no torch import to pay
        return
    for obj in gc.get_objects():
        # type(): no __class__ lookups
        if issubclass(type(obj), dataloader._MultiProcessingDataLoaderIter):
            obj._shutdown_workers()


@pytest.fixture(autouse=True)
def thread_and_process_police():
    threads_before = set(threading.enumerate())
    children_before = _children()
    yield
    verdict = police_verdict(threads_before, children_before)
    if verdict:
        pytest.fail(verdict, pytrace=False)


class DecodeCount:
    """A transform counting the images ShardLoader's workers decode (one byte each in a file,
    as workers are other processes): it shows when they filled batches of the next epoch."""

    def __init__(self, path):
        self.path = path
        path.write_bytes(b"")

    def __call__(self, img):
        with open(self.path, "ab") as f:
            f.write(b".")
        return img

    def seen(self) -> int:
        return self.path.stat().st_size

    def reaches(self, n: int, exact: bool = True) -> int:
        """Wait until ``n`` images were decoded (a generous limit only so a failure ends);
        ``exact``: and not one more."""
        import time

        deadline = time.monotonic() + 60
        while self.seen() < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.seen() == n if exact else self.seen() >= n
        return self.seen()


# --- sample indexes as the previous release wrote them ---


def without_key_file(src: str, dst: str) -> str:
    """A copy of ``src`` as packed before the key file: no ``manifest.keys``, no ``keys``."""
    import json
    import shutil

    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "manifest.keys"))
    path = os.path.join(dst, "manifest.json")
    with open(path) as f:
        doc = json.load(f)
    del doc["keys"]
    with open(path, "w") as f:
        json.dump(doc, f)
    return dst


def without_index_sha256(out) -> None:
    """``out``'s manifest as the previous release wrote it: no ``index_sha256``."""
    import json

    path = os.path.join(out, "manifest.json")
    with open(path) as f:
        doc = json.load(f)
    for s in doc["shards"]:
        s.pop("index_sha256", None)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def encode_v1_index(shard_bytes: int, sha256_hex: str, keys: list[bytes], offsets: list[int]):
    """A version-1 sample index, byte for byte as the previous release wrote it (no members)."""
    import hashlib
    import struct

    from shardkit.formats.sample_index import key_hashes

    table = b"".join(keys)
    ends = np.cumsum([len(k) for k in keys], dtype=np.uint64)
    sha = bytes.fromhex(sha256_hex)
    head = struct.pack(
        "<8sII QQ 32s Q", b"SKINDEX\0", 1, 0, len(keys), shard_bytes, sha, len(table)
    )
    body = b"".join(
        (
            head,
            np.asarray(offsets, "<u8").tobytes(),
            key_hashes(keys).astype("<u8").tobytes(),
            ends.astype("<u8").tobytes(),
            table,
        )
    )
    return body + hashlib.sha256(body).digest()


def as_previous_release(out) -> None:
    """The pack ``out`` as the previous release left it: version-1 indexes, no index_sha256."""
    from shardkit.formats.sample_index import index_path
    from shardkit.formats.tar.tally import tally_tar
    from shardkit.manifest import read_manifest

    for e in read_manifest(str(out)).shards:
        shard = os.path.join(out, e.path)
        tally = tally_tar(shard, every=1, keys=True)
        keys = [k.encode("utf-8", "surrogateescape") for k in tally.keys]
        with open(index_path(shard), "wb") as f:
            f.write(encode_v1_index(e.bytes, e.sha256, keys, [*tally.index, tally.end]))
    without_index_sha256(out)


def gradient_photo(i: int, w: int = 120, h: int = 90):
    """Smooth gradients with some texture (seeded by ``i``): resize filters differ on it as on
    photos, so a decoder or resize that is off shows in the pixels."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(i)
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], -1)
    noisy = base + rng.normal(0, 12, base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def import_target(node, here: str) -> str:
    """The module a ``from ... import`` statement ``node`` names, its dots resolved against the
    package ``here`` (the import-walking tests: the layers, the commands that load no torch)."""
    base = here
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    target = node.module or ""
    if node.level:
        target = f"{base}.{target}" if target else base
    return target


@contextlib.contextmanager
def gloo_rank(rank: int, port: int, world_size: int):
    """Join a real gloo group on loopback as ``rank`` (inside a spawned rank), and leave it however
    the body ends. The 60 s timeout makes a rank with an extra collective fail, never hang."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], nprocs: int, *args, limit_s: float = 150.0) -> None:
    """Run ``fn(rank, port, *args)`` in ``nprocs`` spawned processes on a free loopback port and
    wait for all of them; a rank that fails fails the test, and no rank outlives it (one still
    running after ``limit_s`` is killed and the test fails)."""
    import torch.multiprocessing as mp
    from remote_servers import free_port

    ctx = mp.start_processes(
        fn, args=(free_port(), *args), nprocs=nprocs, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + limit_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"{nprocs} ranks did not finish within {limit_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


class ReversedSpans:
    """An engine's ``map_chunks`` run here, the last span first (as if it finished first), the
    answers handed back in order; ``spans``: how many it ran."""

    def __init__(self, plan_chunk: int):
        self.plan_chunk, self.spans = plan_chunk, 0

    def map_chunks(self, fn, chunks):
        self.spans += len(chunks)
        return [fn(*c) for c in chunks[::-1]][::-1]


def assert_same_scan(a, b):
    """Two ``SourceScan``s hold the same samples, stats, errors and labels."""
    for name in ("files", "keys", "exts", "inline", "sidecars"):
        assert list(getattr(a, name)) == list(getattr(b, name)), name
    assert a.labels.tolist() == b.labels.tolist()
    assert a.stats.tolist() == b.stats.tolist()
    for name in ("classes", "errors", "ignored", "field_counts", "keyed", "failed_downloads"):
        assert getattr(a, name) == getattr(b, name), name
    assert (a.again is None) == (b.again is None)
    assert a.again is None or np.array_equal(a.again, b.again)
