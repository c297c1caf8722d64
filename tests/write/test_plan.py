"""Plan, shard tasks, commit: byte identity with ``pack`` on any runner, faults, resume.

Real files, real worker processes (spawned), real SIGKILLs. Faults are injected by wrapping
``run_task`` in a module-level function the spawned workers import by name.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from shardkit.cli import main
from shardkit.errors import InputError, OutputError
from shardkit.formats import get_format
from shardkit.fsutil import HOST, STAGING_PREFIX, DirLock, remove_stale_staging
from shardkit.manifest import read_manifest
from shardkit.write.commit import check_cluster_lock, commit_pack
from shardkit.write.engines import LocalRunner, TaskFailed
from shardkit.write.packer import PackOptions, pack
from shardkit.write.plan import JOB_PREFIX, plan_pack
from shardkit.write.read import source_stats, span_stats
from shardkit.write.task import run_task


def make_tree(root, classes=("a", "b", "c"), per_class=14, seed=0, bad=True):
    """Noise JPEGs of varied sizes; with ``bad``, one corrupt and one empty image too."""
    rng = np.random.default_rng(seed)
    for cls in classes:
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        for i in range(per_class):
            w, h = int(rng.integers(16, 60)), int(rng.integers(16, 60))
            arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(arr).save(os.path.join(root, cls, f"{cls}_{i:03d}.jpg"), quality=90)
    if bad:
        with open(os.path.join(root, "a", "broken.jpg"), "wb") as f:
            f.write(b"\xff\xd8\xff\xe0 not really a jpeg")
        open(os.path.join(root, "b", "empty.jpg"), "wb").close()
    return str(root)


def quiet(fn, *args, **kw):
    if fn is not plan_pack:  # the planner's progress is its options' (``_PLAN``: off)
        kw.setdefault("progress", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


def digest(out) -> dict[str, str]:
    """sha256 of every file in ``out`` (hidden ones too: nothing may be left behind)."""
    return {
        n: hashlib.sha256(open(os.path.join(out, n), "rb").read()).hexdigest()
        for n in sorted(os.listdir(out))
    }


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("plan") / "src")


@pytest.fixture(scope="module")
def refs(src, tmp_path_factory):
    """``pack`` in this process, the reference every runner must equal, per format."""
    base = tmp_path_factory.mktemp("refs")
    out = {}
    for fmt in ("tar", "lmdb"):
        out[fmt] = str(base / fmt)
        quiet(pack, src, out[fmt], format=fmt, shard_size="12kB")
    return out


# --- module-level, so spawned workers can import them -------------------------------------


def faulty_task(marker_dir: str, mode: str, task, threads=1):
    """``run_task``, but the first attempt of the task holding shard 1 fails once its first
    shard is complete: ``raise`` (an OSError, retried) or ``exit`` (the worker dies)."""

    def hook(path):
        flag = os.path.join(marker_dir, f"{mode}-{task.first}")
        if 1 in task.shards and not os.path.exists(flag):
            open(flag, "w").close()
            if mode == "raise":
                raise OSError(5, "injected I/O error")
            os._exit(3)

    return run_task(task, threads, on_shard=hook)


def faulty_stats(marker_dir: str, mode: str, root, files, sidecars):
    """``span_stats``, but the first attempt of the chunk starting at ``b/b_000.jpg`` fails:
    ``raise`` (an OSError, retried) or ``exit`` (the worker dies)."""
    flag = os.path.join(marker_dir, f"stat-{mode}")
    if files[0] == "b/b_000.jpg" and not os.path.exists(flag):
        open(flag, "w").close()
        if mode == "raise":
            raise OSError(5, "injected I/O error")
        os._exit(3)
    return span_stats(root, files, sidecars)


class CountingRunner(LocalRunner):
    """A process pool that records the length of each planning chunk it is handed."""

    spans = 0  # a table's spans it scanned

    def map_chunks(self, fn, chunks):
        if chunks and not isinstance(chunks[0][0], str):  # a table's spans
            self.spans += len(chunks)
        else:
            self.chunks = [len(c[1]) for c in chunks]
        return super().map_chunks(fn, chunks)


#: The planner takes the pack's options whole, as ``pack`` hands them on.
_PLAN = PackOptions(
    shard_size="12kB",
    format="tar",
    shuffle=True,
    seed=0,
    validate="header",
    resize_short=None,
    on_error="skip",
    progress=False,
)


# --- byte identity ---------------------------------------------------------------------------


def test_the_plan_fixes_every_shard_before_any_read(src, refs):
    plan = quiet(
        plan_pack,
        src,
        "unused",
        _PLAN,
    )
    manifest = read_manifest(refs["tar"])
    # the broken file keeps its slot (found when read), the empty one is left out by the scan:
    # the plan has the shards pack wrote, in order
    assert [s.path for s in manifest.shards] == [
        f"shard-{i:06d}.tar" for i in range(plan.num_shards)
    ]
    sizes = np.diff(plan.starts).tolist()
    assert sum(sizes) == manifest.num_samples + 1 and len(manifest.skipped) == 2
    assert [len(t.order) for t in plan.tasks(3)] == [
        sum(sizes[i : i + 3]) for i in range(0, len(sizes), 3)
    ]


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_the_sizer_projects_what_the_writer_does(tmp_path, fmt):
    rng = np.random.default_rng(1)
    f = get_format(fmt)
    writer, sizer = f.open_writer(str(tmp_path / f"s{f.suffix}")), f.sizer()
    for i in range(300):
        key, ext = f"cls/key{i}" + "x" * int(rng.integers(0, 120)), ["jpg", "jpeg", "png"][i % 3]
        data = rng.bytes(int(rng.integers(0, 9000)))
        assert sizer.projected_size(len(key), len(ext), len(data)) == writer.projected_size(
            key, ext, len(data)
        )
        writer.add(key, ext, data, i % 5)
        sizer.add(len(key), len(ext), len(data))
    writer.abort()


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("fmt, k", [("tar", 1), ("tar", 3), ("lmdb", 2)])
def test_a_process_pool_writes_the_same_bytes_as_pack(src, refs, tmp_path, fmt, k):
    out = str(tmp_path / "out")
    report = quiet(
        pack, src, out, format=fmt, shard_size="12kB", runner=LocalRunner(2), shards_per_task=k
    )
    assert digest(out) == digest(refs[fmt])  # shards, manifest, and nothing else
    assert report.errors == 2 and report.shards == len(read_manifest(out).shards)


def _fields_tree(root):
    """``make_tree`` with a caption beside every other image (field files to stat too)."""
    make_tree(root, per_class=10, bad=False)
    for cls in ("a", "b", "c"):
        for i in range(0, 10, 2):
            with open(os.path.join(root, cls, f"{cls}_{i:03d}.txt"), "w") as f:
                f.write("a caption " * i)
    return str(root)


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("fields", [False, True])
def test_an_engine_stats_the_plan_in_chunks_and_plans_the_same(src, tmp_path, fields):
    """The engine's chunks, concatenated in order, are the driver's arrays: the same order,
    shard boundaries and fingerprint (which names the job, and so every shard's bytes)."""
    source = _fields_tree(tmp_path / "f") if fields else src
    alone = quiet(plan_pack, source, str(tmp_path / "o"), _PLAN)
    runner = CountingRunner(2, plan_chunk=13)
    engine = quiet(plan_pack, source, str(tmp_path / "o"), _PLAN, engine=runner)
    n = len(alone.scan.files)
    assert runner.chunks == [13] * (n // 13) + [n % 13] and len(runner.chunks) >= 3
    assert engine.fingerprint == alone.fingerprint and engine.job == alone.job
    assert np.array_equal(engine.order, alone.order)
    assert np.array_equal(engine.starts, alone.starts)
    mine, theirs = source_stats(engine.scan, runner), source_stats(alone.scan)
    for name in ("files", "field_offsets", "fields"):
        assert np.array_equal(getattr(mine, name), getattr(theirs, name)), name
    assert len(mine.fields) == (15 if fields else 0)


class InProcess:
    """A runner that maps planning chunks here, in order (a user's own runner may be this);
    ``lose``: it drops the last chunk's answer, as a broken runner might."""

    def __init__(self, plan_chunk: int, lose: bool = False):
        self.plan_chunk, self.lose, self.calls = plan_chunk, lose, 0

    def map_chunks(self, fn, chunks):
        self.calls += len(chunks)
        out = [fn(*c) for c in chunks]
        return out[:-1] if self.lose else out


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_stats_of_any_size_are_the_drivers_and_a_lost_chunk_is_refused(tmp_path, chunk):
    source = _fields_tree(tmp_path / "f")
    alone = quiet(plan_pack, source, str(tmp_path / "o"), _PLAN)
    runner = InProcess(chunk)
    mine = quiet(plan_pack, source, str(tmp_path / "o"), _PLAN, engine=runner)
    assert runner.calls == -(-len(alone.scan.files) // chunk)
    assert (mine.fingerprint, mine.starts.tolist()) == (alone.fingerprint, alone.starts.tolist())
    with pytest.raises(ValueError, match="the plan's stats cover"):
        source_stats(alone.scan, InProcess(chunk, lose=True))


@pytest.mark.slow  # worker processes
def test_a_pack_whose_plan_ran_on_the_pool_writes_the_same_bytes(src, refs, tmp_path):
    out = str(tmp_path / "out")
    runner = CountingRunner(2, plan_chunk=16)
    quiet(pack, src, out, format="lmdb", shard_size="12kB", runner=runner, shards_per_task=2)
    assert len(runner.chunks) == 3
    assert digest(out) == digest(refs["lmdb"])
    runner.chunks = []  # the up-to-date check stats on the pool too, and finds it current
    assert quiet(pack, src, out, format="lmdb", shard_size="12kB", runner=runner).up_to_date
    assert len(runner.chunks) == 3


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_a_planning_chunk_that_fails_once_is_retried_and_the_stats_are_the_same(
    src, tmp_path, mode
):
    scan = quiet(plan_pack, src, str(tmp_path / "o"), _PLAN).scan
    root, n = os.path.abspath(scan.root), len(scan.files)
    chunks = [(root, scan.files.span(a, min(a + 15, n)), ()) for a in range(0, n, 15)]
    assert scan.files[15] == "b/b_000.jpg"  # the second chunk is the one that fails
    fn = functools.partial(faulty_stats, str(tmp_path), mode)
    got = LocalRunner(2).map_chunks(fn, chunks)
    assert os.path.exists(tmp_path / f"stat-{mode}")  # it did fail once
    assert np.array_equal(np.concatenate([g.files for g in got]), source_stats(scan).files)
    os.unlink(tmp_path / f"stat-{mode}")
    # a dead worker breaks the pool: every chunk in flight counts an attempt, and names itself
    with pytest.raises(TaskFailed, match=rf"stat of 1[35] files under {re.escape(repr(root))} fa"):
        LocalRunner(1, retries=0).map_chunks(fn, chunks)


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_file_gone_before_its_stat_is_named_as_without_an_engine(tmp_path, monkeypatch, on_error):
    """A file listed by the scan and gone before the plan's stat: the same one-line error (or
    the same skipped entry) with the stat on the engine as on the driver."""
    import shardkit.write.plan as plan_mod

    copy = make_tree(tmp_path / "src", bad=False)
    kept = shutil.copy2(os.path.join(copy, "b", "b_003.jpg"), tmp_path / "b_003.jpg")
    real_scan = plan_mod.scan_source

    def scan_then_lose_one(*args, **kw):
        scan = real_scan(*args, **kw)
        os.unlink(os.path.join(copy, "b", "b_003.jpg"))
        return scan

    monkeypatch.setattr(plan_mod, "scan_source", scan_then_lose_one)
    seen = []
    for runner in (None, LocalRunner(2, plan_chunk=16)):
        shutil.copy2(kept, os.path.join(copy, "b", "b_003.jpg"))
        out = str(tmp_path / f"out-{len(seen)}")
        kw = dict(shard_size="12kB", runner=runner, on_error=on_error)
        if on_error == "raise":
            with pytest.raises(InputError) as exc:
                quiet(pack, copy, out, **kw)
            seen.append(str(exc.value))
        else:
            seen.append([(s.path, s.reason) for s in quiet(pack, copy, out, **kw).skipped])
    assert seen[0] == seen[1]
    if on_error == "raise":
        assert "\n" not in seen[0] and seen[0].startswith(os.path.join(copy, "b", "b_003.jpg"))
    else:
        assert ("b/b_003.jpg", "unreadable: No such file or directory") in seen[0]


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_a_task_that_fails_once_is_retried_and_the_bytes_are_the_same(src, refs, tmp_path, mode):
    out = str(tmp_path / "out")
    runner = LocalRunner(2, fn=functools.partial(faulty_task, str(tmp_path), mode))
    quiet(pack, src, out, format="lmdb", shard_size="12kB", runner=runner, shards_per_task=2)
    assert os.listdir(tmp_path).count(f"{mode}-0") == 1  # it did fail once
    assert digest(out) == digest(refs["lmdb"])


@pytest.mark.slow  # worker processes
def test_a_task_failing_past_its_retries_stops_the_pack_and_a_rerun_resumes(src, refs, tmp_path):
    out = str(tmp_path / "out")
    runner = LocalRunner(1, retries=0, fn=functools.partial(faulty_task, str(tmp_path), "raise"))
    with pytest.raises(TaskFailed, match="injected I/O error.*pack again with the same options"):
        quiet(pack, src, out, shard_size="12kB", runner=runner, shards_per_task=2)
    (job,) = [n for n in os.listdir(out) if n.startswith(JOB_PREFIX)]  # kept: resumable
    assert "manifest.json" not in os.listdir(out)
    first = os.stat(os.path.join(out, job, "shard-000000.tar")).st_ino
    quiet(pack, src, out, shard_size="12kB", runner=LocalRunner(1), shards_per_task=2)
    assert digest(out) == digest(refs["tar"])
    assert os.stat(os.path.join(out, "shard-000000.tar")).st_ino == first  # not rewritten


def test_a_duplicated_task_rewrites_identical_bytes_and_the_commit_counts_each_shard_once(
    src, refs, tmp_path
):
    out = str(tmp_path / "out")
    os.mkdir(out)
    plan = quiet(
        plan_pack,
        src,
        out,
        _PLAN,
    )
    tasks = plan.tasks(2)
    receipts = [r for t in tasks for r in run_task(t)]
    os.remove(os.path.join(plan.job, "shard-000002.json"))  # forces a real rewrite of shard 2
    again = run_task(tasks[1])  # a speculative or retried copy of task 1
    assert again == receipts[2:4]
    with pytest.raises(OutputError, match=r"more than one receipt for shard\(s\) 2, 3;"):
        commit_pack(plan, receipts + again)
    with pytest.raises(OutputError, match=r"no receipt for shard\(s\) 0, 1;"):
        commit_pack(plan, receipts[2:])
    with DirLock(out):
        commit_pack(plan, receipts)
    assert digest(out) == digest(refs["tar"])


_KILLED_DRIVER = textwrap.dedent(
    """
    import os, signal, sys, warnings
    from shardkit import pack
    warnings.simplefilter("ignore")
    done = []

    def on_shard(path):  # the driver dies once three shards are complete
        done.append(path)
        if len(done) == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    pack(sys.argv[1], sys.argv[2], shard_size="12kB", progress=False, on_shard=on_shard)
    """
)


@pytest.mark.slow  # a child process SIGKILLed
def test_a_killed_pack_resumes_from_its_receipts_and_finishes_identical(src, refs, tmp_path):
    out = str(tmp_path / "out")
    r = subprocess.run([sys.executable, "-c", _KILLED_DRIVER, src, out], timeout=120)
    assert r.returncode == -signal.SIGKILL
    (job,) = os.listdir(out)
    assert job.startswith(JOB_PREFIX)
    names = sorted(os.listdir(os.path.join(out, job)))
    done = [f"shard-00000{i}.{e}" for i in range(3) for e in ("json", "tar", "tar.idx")]
    assert names[:9] == done  # each done shard with its receipt and sample index
    inodes = [os.stat(os.path.join(out, job, f"shard-00000{i}.tar")).st_ino for i in range(3)]
    # another plan (other options) never uses these receipts; its commit removes them
    quiet(pack, src, str(tmp_path / "other"), shard_size="12kB", seed=1)
    quiet(pack, src, out, shard_size="12kB")
    assert digest(out) == digest(refs["tar"])
    assert [os.stat(os.path.join(out, f"shard-00000{i}.tar")).st_ino for i in range(3)] == inodes
    quiet(pack, src, out, shard_size="12kB", seed=1, overwrite=True)
    assert digest(out) == digest(str(tmp_path / "other"))


@pytest.mark.slow  # a child process SIGKILLed
def test_a_job_of_another_plan_is_ignored_and_removed(src, refs, tmp_path):
    out = str(tmp_path / "out")
    subprocess.run([sys.executable, "-c", _KILLED_DRIVER, src, out], timeout=120)
    (old,) = os.listdir(out)
    quiet(pack, src, out, shard_size="20kB")  # other options: another plan
    assert old not in os.listdir(out)
    assert not [n for n in os.listdir(out) if n.startswith(".")]


# --- staging across machines, locks --------------------------------------------------------


def test_staging_of_another_host_is_never_removed_as_stale(tmp_path):
    dead_here = tmp_path / f"{STAGING_PREFIX}{HOST}-999999999-abc"
    elsewhere = tmp_path / f"{STAGING_PREFIX}otherhost-999999999-abc"
    job = tmp_path / f"{JOB_PREFIX}0123456789abcdef"
    for d in (dead_here, elsewhere, job):
        d.mkdir()
    with DirLock(str(tmp_path)):
        assert remove_stale_staging(str(tmp_path)) == [dead_here.name]
    assert elsewhere.is_dir() and job.is_dir()


def test_an_engine_refuses_an_output_on_a_fuse_mount(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(
        f"/dev/sda1 / ext4 rw 0 0\ns3fs {tmp_path}/bucket fuse.s3fs rw 0 0\n", encoding="utf-8"
    )
    check_cluster_lock(str(tmp_path / "local"), str(mounts))
    with pytest.raises(OutputError, match=r"fuse\.s3fs mount .* cluster-wide flock"):
        check_cluster_lock(str(tmp_path / "bucket" / "out"), str(mounts))


# --- the CLI ---------------------------------------------------------------------------------


@pytest.mark.slow  # worker processes
def test_cli_engine_local_packs_the_same_bytes(src, refs, tmp_path):
    out = str(tmp_path / "out")
    args = ["pack", src, out, "-q", "--shard-size", "12kB", "--format", "lmdb"]
    r = CliRunner().invoke(main, [*args, "--engine", "local", "--processes", "2"])
    assert r.exit_code == 0, r.output
    assert digest(out) == digest(refs["lmdb"])


def test_cli_ray_address_needs_the_ray_engine(src, tmp_path):
    r = CliRunner().invoke(main, ["pack", src, str(tmp_path / "o"), "--ray-address", "auto"])
    assert r.exit_code == 2 and "--ray-address needs --engine ray" in r.output


# --- Ray -------------------------------------------------------------------------------------

_RAY_CASES = textwrap.dedent(
    """
    import functools, hashlib, json, os, sys, time, warnings
    warnings.simplefilter("ignore")
    import numpy as np
    import ray
    from shardkit.cli import main
    from shardkit.integrations.ray import RayRunner
    from shardkit.scan import scan_source
    from shardkit.write.engines import PLAN_CHUNK
    from shardkit.write.packer import PackOptions, pack
    from shardkit.write.task import run_task
    from shardkit.write.read import source_stats, span_stats

    src, base, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

    def faulty(marker_dir, mode, task, threads=1):  # as faulty_task in the test module
        def hook(path):
            flag = os.path.join(marker_dir, f"{mode}-{task.first}")
            if 1 in task.shards and not os.path.exists(flag):
                open(flag, "w").close()
                if mode == "raise":
                    raise OSError(5, "injected I/O error")
                os._exit(3)
        return run_task(task, threads, on_shard=hook)

    def faulty_stats(marker_dir, mode, root, files, sidecars):  # as in the test module
        flag = os.path.join(marker_dir, f"stat-{mode}")
        if files[0] == "b/b_000.jpg" and not os.path.exists(flag):
            open(flag, "w").close()
            if mode == "raise":
                raise OSError(5, "injected I/O error")
            os._exit(3)
        return span_stats(root, files, sidecars)

    class Counting(RayRunner):
        chunks = 0
        def map_chunks(self, fn, chunks):
            Counting.chunks += len(chunks)
            return super().map_chunks(fn, chunks)

    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    for name, fmt, k, cpus, mode in cases:
        out = os.path.join(base, name)
        if mode == "cli":  # the command line, on the cluster already running
            main(["pack", src, out, "-q", "--shard-size", "12kB", "--format", fmt,
                  "--engine", "ray", "--shards-per-task", str(k)], standalone_mode=False)
            continue
        fn = functools.partial(faulty, base, mode) if mode in ("raise", "exit") else run_task
        chunk = 16 if mode == "chunks" else PLAN_CHUNK  # 44 files: 3 planning tasks
        runner = Counting(fn=fn, cpus_per_task=cpus, plan_chunk=chunk)
        pack(src, out, format=fmt, shard_size="12kB", shards_per_task=k, progress=False,
             runner=runner)
    # planning chunks that fail once (an OSError, a dead worker): retried, the same arrays
    scan = scan_source(src)
    root, n = os.path.abspath(src), len(scan.files)
    chunks = [(root, scan.files.span(a, min(a + 15, n)), ()) for a in range(0, n, 15)]
    for mode in ("raise", "exit"):
        fn = functools.partial(faulty_stats, base, mode)
        got = RayRunner(plan_chunk=15).map_chunks(fn, chunks)
        assert np.array_equal(np.concatenate([g.files for g in got]), source_stats(scan).files)
    ray.shutdown()
    # a runner that starts its own cluster: once, for the stats and the tasks, stopped after
    inits, real_init = [], ray.init
    ray.init = lambda *a, **kw: inits.append(1) or real_init(*a, **kw)
    runner = RayRunner(num_cpus=1, plan_chunk=16, init={"_node_ip_address": "127.0.0.1"})
    pack(src, os.path.join(base, "own-cluster"), format="tar", shard_size="12kB",
         progress=False, runner=runner)
    assert len(inits) == 1 and not ray.is_initialized(), inits
    print(json.dumps(Counting.chunks))
    """
)


@pytest.mark.slow  # a child interpreter running a local Ray cluster
def test_ray_tasks_write_the_same_bytes_as_pack_after_errors_and_dead_workers(src, refs, tmp_path):
    """One cluster for every case: 1 and 2 CPUs per task (one task at a time, or two), 1-3
    shards per task, a task raising once and a worker dying once, the plan's stats in three
    Ray tasks, and the CLI; then planning tasks raising once and dying once; then a runner
    starting its own cluster, once for the plan and the tasks."""
    pytest.importorskip("ray", reason="the ray extra: pip install 'shardkit[ray]'")
    cases = [
        ("tar-k1", "tar", 1, 1, None),
        ("tar-k3-raise", "tar", 3, 1, "raise"),
        ("lmdb-k2-exit", "lmdb", 2, 2, "exit"),
        ("lmdb-k2-chunks", "lmdb", 2, 1, "chunks"),
        ("lmdb-k3-cli", "lmdb", 3, 1, "cli"),
    ]
    scratch = tempfile.mkdtemp(prefix="sk-ray-", dir="/tmp")  # short: Ray's socket paths
    try:
        env = {**os.environ, "HOME": scratch, "TMPDIR": scratch, "RAY_TMPDIR": scratch}
        base = tmp_path / "out"
        base.mkdir()
        r = subprocess.run(
            [sys.executable, "-c", _RAY_CASES, src, str(base), json.dumps(cases)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        leftover = subprocess.run(["pgrep", "-f", scratch], capture_output=True, text=True)
        assert leftover.stdout == "", "Ray processes outlived the driver"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # one planning task per pack, three for the one with plan_chunk=16 (44 files)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == 3 + 3
    assert sorted(os.listdir(base)) == sorted(
        [c[0] for c in cases] + ["raise-0", "exit-0", "stat-raise", "stat-exit", "own-cluster"]
    )  # each fault happened once, and was retried
    for name, fmt, *_ in [*cases, ("own-cluster", "tar")]:
        assert digest(str(base / name)) == digest(refs[fmt]), name


def test_a_plan_file_runs_task_by_task_then_the_same_command_commits(src, refs, tmp_path):
    """The batch-scheduler path (a SLURM array): --plan-only, pack-task per task, commit."""
    out, plan = str(tmp_path / "out"), str(tmp_path / "plan.json")
    args = ["pack", src, out, "-q", "--shard-size", "12kB"]
    r = CliRunner().invoke(main, [*args, "--plan-only", plan, "--shards-per-task", "4"])
    assert r.exit_code == 0, r.output
    n = int(r.output.split(" task(s)")[0].rsplit(" ", 1)[1])
    assert n > 1 and f"for I = 0..{n - 1}" in r.output
    assert not [f for f in os.listdir(out) if not f.startswith(".")]  # nothing written yet
    for i in reversed(range(n)):  # any order, any machine
        r = CliRunner().invoke(main, ["pack-task", plan, "--task", str(i)])
        assert r.exit_code == 0 and r.output.startswith(f"Task {i} of {n}: shards "), r.output
    r = CliRunner().invoke(main, ["pack-task", plan, "--task", str(n)])
    assert r.exit_code == 2 and f"no task {n}; it holds tasks 0..{n - 1}" in r.output
    job = next(f for f in os.listdir(out) if f.startswith(JOB_PREFIX))
    written = {
        f: os.stat(os.path.join(out, job, f)).st_ino for f in os.listdir(os.path.join(out, job))
    }
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert digest(out) == digest(refs["tar"])
    assert all(
        os.stat(os.path.join(out, f)).st_ino == ino
        for f, ino in written.items()
        if f.endswith(".tar")
    )  # the commit moved the tasks' shards, it did not write them again


@pytest.mark.slow  # the S3 server
def test_a_pack_into_s3_uploads_the_same_bytes_as_a_local_pack(s3, src, refs):
    """Same plan, same tasks: the shards go to their final keys as they complete, the key
    file after them, the manifest last, and every object equals a local pack's file (skipped
    files included, the key file the same bytes)."""
    s3.client().create_bucket(Bucket="planned")
    quiet(
        pack,
        src,
        "s3://planned/set/",
        shard_size="12kB",
        format="lmdb",
        storage_options=s3.options(s3.endpoint),
    )
    c = s3.client()
    keys = [o["Key"] for o in c.list_objects_v2(Bucket="planned", Prefix="set/")["Contents"]]
    bodies = {
        k.removeprefix("set/"): c.get_object(Bucket="planned", Key=k)["Body"].read() for k in keys
    }
    uploaded = {k: hashlib.sha256(v).hexdigest() for k, v in bodies.items()}
    local = digest(refs["lmdb"])
    assert uploaded == local
    doc = json.loads(open(os.path.join(refs["lmdb"], "manifest.json")).read())
    assert json.loads(bodies["manifest.json"]) == doc
    puts = [path for method, path, _ in s3.log.entries if method == "PUT" and "/set/" in path]
    assert puts[-1].endswith("/set/manifest.json")  # the manifest last


_DASK_RECIPE = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.simplefilter("ignore")
    from dask.distributed import Client, LocalCluster
    from shardkit.write.packer import PackOptions, pack
    from shardkit.write.task import run_task

    src, out, marker = sys.argv[1:4]

    def dying_once(task, threads=1):  # the first attempt of shard 1's task kills its worker
        if 1 in task.shards and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)
        return run_task(task, threads)

    if __name__ == "__main__":
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address=None) as cluster, Client(cluster) as client:

            def dask_runner(tasks):  # the documented recipe
                futures = client.map(dying_once, tasks, retries=3, pure=False)
                return [r for rs in client.gather(futures) for r in rs]

            pack(src, out, shard_size="12kB", format="lmdb", progress=False, runner=dask_runner,
                 shards_per_task=2)
    """
)


@pytest.mark.slow  # a child interpreter running a local Dask cluster
def test_the_dask_recipe_writes_the_same_bytes_after_a_dead_worker(src, refs, tmp_path):
    pytest.importorskip("distributed", reason="the Dask recipe's own dependency")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out, marker = tmp_path / "out", tmp_path / "died"
    script = tmp_path / "recipe.py"  # a file: Dask's worker processes import __main__ from it
    script.write_text(_DASK_RECIPE)
    r = subprocess.run(
        [sys.executable, str(script), src, str(out), str(marker)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(scratch), "HOME": str(scratch)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert marker.exists()  # a worker did die, and its task ran again
    assert digest(str(out)) == digest(refs["lmdb"])


_KILLED_POOL_DRIVER = textwrap.dedent(
    """
    import os, signal, sys, time, warnings
    from shardkit import pack
    from shardkit.write.engines import LocalRunner
    from shardkit.write.task import run_task
    warnings.simplefilter("ignore")
    src, out, pids = sys.argv[1:4]

    def task(t, threads=1):  # the task of shard 0 kills the driver; the others take their time
        with open(os.path.join(pids, str(os.getpid())), "w"):
            pass
        if t.first == 0:
            done = run_task(t, threads)
            os.kill(os.getppid(), signal.SIGKILL)
            return done
        time.sleep(60)
        return run_task(t, threads)

    pack(src, out, shard_size="12kB", progress=False, runner=LocalRunner(2, fn=task))
    """
)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie is dead
    except FileNotFoundError:
        return True


@pytest.mark.slow  # a process pool whose driver is SIGKILLed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, PR_SET_PDEATHSIG")
def test_a_killed_pool_driver_takes_its_workers_along_and_the_same_command_resumes(
    src, refs, tmp_path
):
    out, pids = tmp_path / "out", tmp_path / "pids"
    pids.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", _KILLED_POOL_DRIVER, src, str(out), str(pids)], timeout=120
    )
    assert r.returncode == -signal.SIGKILL
    workers = [int(p) for p in os.listdir(pids)]
    assert workers
    deadline = time.monotonic() + 30  # a bound on the wait, not a measurement
    while not all(_gone(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in workers)  # no worker lives on, writing into OUT
    args = ["pack", src, str(out), "-q", "--shard-size", "12kB", "--engine", "local"]
    r = CliRunner().invoke(main, args)  # the documented way out: the same command again
    assert r.exit_code == 0, r.output
    assert digest(out) == digest(refs["tar"])


def _json_plan(plan_path, tasks, command="commit"):
    """A plan file of the first version (JSON, a list per column), as shardkit wrote it."""
    doc = {"format": "shardkit-pack-plan", "version": 1, "commit": command}
    doc["tasks"] = [t.to_dict() for t in tasks]
    with open(plan_path, "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize("version", [1, 2])
def test_a_tampered_plan_file_reads_and_writes_nothing_outside_its_source_and_job(
    src, tmp_path, version
):
    """An edited plan (its checksums made to match again, or JSON of the first version) that
    would read outside the source or write outside the job is refused before any work."""
    import dataclasses

    from shardkit.scan import StrTable
    from shardkit.write.planfile import load_task, save_tasks

    out, plan = str(tmp_path / "out"), str(tmp_path / "plan")
    r = CliRunner().invoke(
        main, ["pack", src, out, "-q", "--shard-size", "12kB", "--plan-only", plan]
    )
    assert r.exit_code == 0, r.output
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "secret.jpg").write_bytes(open(os.path.join(src, "a", "a_000.jpg"), "rb").read())
    good, _ = load_task(plan, 0)
    tampered = {
        "job": str(victim),
        "root": "src",  # relative
        "files": StrTable(["../secret.jpg", *list(good.files)[1:]]),
    }
    for field, value in tampered.items():
        task = dataclasses.replace(good, **{field: value})
        if version == 2:
            save_tasks([task], plan, "commit")
        else:
            _json_plan(plan, [task])
        r = CliRunner().invoke(main, ["pack-task", plan, "--task", "0"])
        assert r.exit_code == 2, r.output
        assert f"{plan}: task 0 " in r.output and "the file was edited" in r.output
        assert os.listdir(victim) == [] and not [
            n for n in os.listdir(out) if n.startswith(JOB_PREFIX)
        ]


def _task_rows(task) -> dict:
    """A task as plain values, sample by sample in its order."""
    rows = np.asarray(task.order).tolist()
    cols = {
        name: [getattr(task, name)[i] for i in rows] if len(getattr(task, name)) else []
        for name in ("files", "keys", "exts", "sidecars", "inline")
    }
    cols["labels"] = [int(task.labels[i]) for i in rows]
    for name in ("job", "root", "format", "validate", "resize_short", "on_error", "first"):
        cols[name] = getattr(task, name)
    cols["starts"] = list(task.starts)
    return cols


@pytest.mark.parametrize("source", ["table", "fields"])
def test_a_plan_file_round_trips_every_task(tmp_path, source):
    """Every task read back from the plan file is the task the plan made: its samples (paths,
    keys, extensions, labels, field files, a table's fields) and its shards."""
    from shardkit.write.planfile import load_task, save_tasks

    where = _golden_table(tmp_path) if source == "table" else _fields_tree(tmp_path / "f")
    out = tmp_path / "out"
    out.mkdir()
    plan = quiet(plan_pack, str(where), str(out), replace(_PLAN, shard_size="4KB"))
    tasks = plan.tasks(3)
    assert len(tasks) > 2
    path = str(tmp_path / "plan")
    save_tasks(tasks, path, "commit")
    assert open(path, "rb").read(8) == b"SKPLAN2\n"
    for i, task in enumerate(tasks):
        back, total = load_task(path, i)
        assert total == len(tasks)
        assert _task_rows(back) == _task_rows(task), i
    got = _task_rows(load_task(path, 0)[0])
    assert got["inline" if source == "table" else "sidecars"]  # the fields went through


def test_a_first_version_json_plan_file_still_runs_and_packs_the_same(src, refs, tmp_path):
    out, plan = str(tmp_path / "out"), str(tmp_path / "plan.json")
    os.makedirs(out)
    made = quiet(plan_pack, src, out, _PLAN)
    _json_plan(plan, made.tasks(4))
    for i in range(len(made.tasks(4))):
        r = CliRunner().invoke(main, ["pack-task", plan, "--task", str(i)])
        assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["pack", src, out, "-q", "--shard-size", "12kB"])
    assert r.exit_code == 0, r.output
    assert digest(out) == digest(refs["tar"])


@pytest.mark.parametrize("where", ["section", "footer", "cut", "other"])
def test_a_plan_file_changed_or_cut_short_is_refused_naming_it(src, tmp_path, where):
    out, plan = str(tmp_path / "out"), str(tmp_path / "plan")
    r = CliRunner().invoke(
        main, ["pack", src, out, "-q", "--shard-size", "12kB", "--plan-only", plan]
    )
    assert r.exit_code == 0, r.output
    data = bytearray(open(plan, "rb").read())
    if where == "section":
        data[20] ^= 1  # a byte of task 0's paths
    elif where == "footer":
        data[-60] ^= 1
    elif where == "cut":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"PK\x03\x04 a zip, say")
    open(plan, "wb").write(bytes(data))
    r = CliRunner().invoke(main, ["pack-task", plan, "--task", "0"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert f"{plan}: not a readable shardkit plan (" in r.output, r.output
    why = {"section": "task 0's samples do not match their sha256", "footer": "footer does not"}
    why |= {"cut": "cut short", "other": "not a shardkit plan file"}
    assert why[where] in r.output, r.output
    assert not [n for n in os.listdir(out) if n.startswith(JOB_PREFIX)]


# --- tables at scale: the same bytes, memory by the row ------------------------------------------


def _golden_table(tmp):
    """A table with every key rule in it: two spellings of one stem, names ending in ~2, a row
    naming an image again, quotes, percent signs and non-ASCII; fixed bytes and mtimes."""
    img = tmp / "img"
    (img / "sub").mkdir(parents=True)
    names = ["a.jpg", "a.png", "a~2.jpg", "b.jpg", "b~2.jpg", "sub/x.jpg", "sub/x.JPEG"]
    names += ["we.ird%n.jpg", "ü.jpg"] + [f"sub/m{k}.jpg" for k in range(40)]
    for k, name in enumerate(names):
        (img / name).write_bytes(b"\xff\xd8" + bytes([k]) * (50 + 7 * k))
        os.utime(img / name, ns=(10**18, 10**18 + k))
    rows = [f"img/{n},caption {k},c{k % 3}" for k, n in enumerate(names)]
    rows += ["img/a.jpg,again,c0", "img/b.jpg,b again,c1", '"img/sub/m3.jpg","q ""x"", y",c2']
    table = tmp / "t.csv"
    lines = "".join(f"{r},e{i}\n" for i, r in enumerate(rows))
    table.write_text("image,caption,label,extra\n" + lines, encoding="utf-8")
    return table


@pytest.mark.parametrize(
    "allow, shards, digest",
    [
        (False, 49, "f08afa47ffb6b7d80780f569e545dd88f2365d3570327f0b8df46bd916aabc2a"),
        (True, 52, "bfa2082f34bb6b1bf713f45a02996f0bd680b5e9ce539f375abe48676d0f80a0"),
    ],
)
def test_a_table_packs_to_the_bytes_and_fingerprint_it_always_had(tmp_path, allow, shards, digest):
    # The digests are of shardkit's table scan as it was before it moved to arrays (keys and
    # repeated rows as Python lists): every shard's bytes and the up-to-date fingerprint.
    table = _golden_table(tmp_path)
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pack(table, out, validate="none", shard_size="4KB", allow_duplicates=allow, progress=False)
    assert _pack_digest(out) == (shards, digest)


def _pack_digest(out) -> tuple[int, str]:
    m = read_manifest(str(out))
    h = hashlib.sha256(m.pack["source_fingerprint"].encode())
    for e in m.shards:
        h.update(hashlib.sha256((out / e.path).read_bytes()).digest())
    return len(m.shards), h.hexdigest()


def _golden_plan_file(table, out, path, engine=None) -> bytes:
    from shardkit.write.planfile import save_tasks

    options = replace(_PLAN, shard_size="4KB", validate="none")
    plan = quiet(plan_pack, str(table), str(out), options, engine=engine)
    save_tasks(plan.tasks(3), str(path), "commit")
    return open(path, "rb").read()


@pytest.mark.slow  # worker processes
def test_a_table_scanned_in_spans_on_the_pool_packs_the_bytes_it_always_had(tmp_path):
    """The scan of the golden table in spans of 5 rows on a process pool: the same shards and
    fingerprint as the scan of one process, and the same plan file, byte for byte."""
    table = _golden_table(tmp_path)
    runner = CountingRunner(2, plan_chunk=5)
    out = tmp_path / "out"
    quiet(pack, table, out, validate="none", shard_size="4KB", runner=runner, shards_per_task=7)
    assert runner.spans == 11  # 52 rows
    assert _pack_digest(out) == (
        49,
        "f08afa47ffb6b7d80780f569e545dd88f2365d3570327f0b8df46bd916aabc2a",
    )
    alone = _golden_plan_file(table, tmp_path / "o", tmp_path / "a.plan")
    spanned = _golden_plan_file(
        table, tmp_path / "o", tmp_path / "b.plan", LocalRunner(2, plan_chunk=5)
    )
    assert alone == spanned


_RAY_TABLE = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    import ray
    from shardkit.integrations.ray import RayRunner
    from shardkit.write.packer import PackOptions, pack
    from shardkit.write.plan import plan_pack
    from shardkit.write.planfile import save_tasks

    table, base = sys.argv[1], sys.argv[2]
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    spans = []

    class Counting(RayRunner):
        def map_chunks(self, fn, chunks):
            if chunks and not isinstance(chunks[0][0], str):
                spans.append(len(chunks))
            return super().map_chunks(fn, chunks)

    pack(table, os.path.join(base, "out"), validate="none", shard_size="4KB", progress=False,
         runner=Counting(plan_chunk=5), shards_per_task=7)
    kw = PackOptions(shard_size="4KB", format="tar", shuffle=True, seed=0, validate="none",
                     resize_short=None, on_error="skip", progress=False)
    plan = plan_pack(table, os.path.join(base, "o"), kw, engine=Counting(plan_chunk=5))
    save_tasks(plan.tasks(3), os.path.join(base, "b.plan"), "commit")
    ray.shutdown()
    print(json.dumps(spans))
    """
)


@pytest.mark.slow  # a child interpreter running a local Ray cluster
def test_a_table_scanned_in_spans_as_ray_tasks_packs_the_bytes_it_always_had(tmp_path):
    pytest.importorskip("ray", reason="the ray extra: pip install 'shardkit[ray]'")
    table = _golden_table(tmp_path)
    scratch = tempfile.mkdtemp(prefix="sk-ray-", dir="/tmp")  # short: Ray's socket paths
    try:
        env = {**os.environ, "HOME": scratch, "TMPDIR": scratch, "RAY_TMPDIR": scratch}
        r = subprocess.run(
            [sys.executable, "-c", _RAY_TABLE, str(table), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [11, 11]  # 52 rows, 5 a span
    golden = "f08afa47ffb6b7d80780f569e545dd88f2365d3570327f0b8df46bd916aabc2a"
    assert _pack_digest(tmp_path / "out") == (49, golden)
    alone = _golden_plan_file(table, tmp_path / "o", tmp_path / "a.plan")
    assert alone == (tmp_path / "b.plan").read_bytes()


def _linked_table(tmp, rows):
    """A table of ``rows`` distinct paths, hard links to one tiny JPEG (no disk per row)."""
    seed = tmp / "seed.jpg"
    Image.new("RGB", (8, 8), (1, 2, 3)).save(seed)
    folder = tmp / f"img{rows}"
    folder.mkdir()
    lines = ["image,caption,label"]
    for i in range(rows):
        os.link(seed, folder / f"{i:07d}.jpg")
        lines.append(f"{folder.name}/{i:07d}.jpg,a photo of thing {i},class{i % 50}")
    table = tmp / f"t{rows}.csv"
    table.write_text("\n".join(lines) + "\n")
    return table


def _plan_peak(table, out) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        plan = plan_pack(
            str(table),
            str(out),
            replace(_PLAN, shard_size="1MB"),
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(plan.order) == int(table.name[1:-4])
    return peak


@pytest.mark.slow
def test_planning_a_table_holds_arrays_not_python_objects_per_row(tmp_path):
    # Both tables are longer than a scan chunk, so what a chunk holds cancels out.
    small, big = _linked_table(tmp_path, 9000), _linked_table(tmp_path, 30000)
    per_row = (_plan_peak(big, tmp_path / "o2") - _plan_peak(small, tmp_path / "o1")) / 21000
    # The rows' text is ~70 bytes (path, caption as JSON, key, extension) plus 8-byte offsets,
    # labels, order, (size, mtime) and transient hashes: ~300 bytes a row in arrays under
    # tracemalloc; per-row Python lists and sets were ~620.
    assert per_row < 400, per_row


def test_tasks_carry_their_samples_as_tables_not_lists(tmp_path):
    from shardkit.scan import StrTable

    table = _golden_table(tmp_path)
    plan = plan_pack(
        str(table),
        str(tmp_path / "out"),
        replace(_PLAN, shard_size="4KB", seed=3, validate="none"),
    )
    tasks = plan.tasks(4)
    scan = plan.scan
    for task in tasks:
        a, b = plan.starts[task.first], plan.starts[task.shards.stop]
        rows = plan.order[a:b].tolist()
        for mine, whole in ((task.files, scan.files), (task.keys, scan.keys)):
            assert isinstance(mine, StrTable)
            assert list(mine) == [whole[i] for i in rows]
        assert list(task.inline) == [scan.inline[i] for i in rows]
    assert sum(len(t.order) for t in tasks) == len(plan.order)


def _plan_file_peak(table, out, path) -> int:
    import tracemalloc

    from shardkit.write.planfile import save_tasks

    plan = quiet(plan_pack, str(table), str(out), replace(_PLAN, shard_size="1MB"))
    tracemalloc.start()
    try:
        save_tasks(plan.tasks(1), str(path), "commit")
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_writing_a_plan_file_holds_one_task_not_every_row(tmp_path):
    small, big = _linked_table(tmp_path, 9000), _linked_table(tmp_path, 30000)
    a = _plan_file_peak(small, tmp_path / "o1", tmp_path / "p1")
    b = _plan_file_peak(big, tmp_path / "o2", tmp_path / "p2")
    # Tasks of one 1 MB shard each (~500 rows): what writing holds does not grow with the rows;
    # a file built whole (JSON lists of every row) held ~500 bytes a row more.
    assert (b - a) / 21000 < 20, (a, b)
