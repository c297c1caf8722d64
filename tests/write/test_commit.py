"""Crash-safe commit, one writer per output, and the FIFO a folder reader must never open.

Kills are real: a child process packs with a hook that SIGKILLs itself exactly at the step
under test (before the commit point, or after it in the middle of moving shards into place).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from PIL import Image

from shardkit import ShardDataset, ShardWriter, pack
from shardkit.errors import ManifestError, OutputError
from shardkit.fsutil import JOURNAL_NAME, STAGING_PREFIX, DirLock, remove_stale_staging
from shardkit.manifest import read_manifest
from shardkit.write.verify import dataset_info, verify


def make_tree(root, classes: dict[str, int], seed=0):
    rng = np.random.default_rng(seed)
    for cls, count in classes.items():
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        for i in range(count):
            buf = io.BytesIO()
            arr = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
            Image.fromarray(arr).save(buf, "JPEG", quality=85)
            with open(os.path.join(root, cls, f"{cls}_{i:04d}.jpg"), "wb") as f:
                f.write(buf.getvalue())


def quiet_pack(src, out, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pack(str(src), str(out), progress=False, **kw)


def snapshot(out) -> dict[str, bytes]:
    return {n: (out / n).read_bytes() for n in sorted(os.listdir(out)) if not n.startswith(".")}


@pytest.fixture
def trees(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_tree(a, {"x": 8, "y": 8}, seed=1)
    make_tree(b, {"p": 10, "q": 10, "r": 5}, seed=2)
    quiet_pack(b, tmp_path / "ref_b", shard_size=4096)  # what B looks like when complete
    return a, b


_KILL_AT = textwrap.dedent(
    """
    import os, signal, sys
    import shardkit.fsutil as fsutil
    from shardkit import pack

    src, out, when = sys.argv[1:4]
    real_write, real_replace, moved = fsutil.atomic_write_bytes, os.replace, []

    def write(path, data):  # 'before': die as the journal (the commit point) is about to land
        if when == "before" and path.endswith(fsutil.JOURNAL_NAME):
            os.kill(os.getpid(), signal.SIGKILL)
        real_write(path, data)

    def replace(a, b):  # 'after': die after moving two shards into place (staging -> OUT)
        if when == "after" and fsutil.STAGING_PREFIX in a and os.path.dirname(b) == out:
            if len(moved) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            moved.append(b)
        real_replace(a, b)

    fsutil.atomic_write_bytes, os.replace = write, replace
    pack(src, out, shard_size=4096, progress=False, overwrite=True)
    """
)


def _killed_pack(src, out, when: str) -> None:
    r = subprocess.run(
        [sys.executable, "-c", _KILL_AT, str(src), str(out), when],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == -signal.SIGKILL, r.stderr


def _refused_by_every_reader(out):
    with pytest.raises(ManifestError, match="interrupted while committing"):
        ShardDataset(str(out))
    with pytest.raises(ManifestError, match="interrupted while committing"):
        dataset_info(str(out))
    with pytest.raises(ManifestError, match="interrupted while committing"):
        verify(str(out))
    r = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "info", str(out)], capture_output=True, text=True
    )
    assert r.returncode == 1 and "interrupted while committing" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow  # a child process SIGKILLed
def test_kill_after_the_commit_point_of_a_fresh_pack(trees, tmp_path):
    """Shards under final names, no manifest: readers refuse; the next writer completes it."""
    _, b = trees
    out = tmp_path / "out"
    _killed_pack(b, out, "after")
    names = os.listdir(out)
    assert JOURNAL_NAME in names and "manifest.json" not in names
    assert len([n for n in names if n.startswith("shard-")]) == 2  # moved before the kill
    _refused_by_every_reader(out)
    with pytest.raises(OutputError, match="not empty"):  # finishing it made a complete dataset
        quiet_pack(b, out)
    assert snapshot(out) == snapshot(tmp_path / "ref_b")
    assert verify(str(out)).ok
    assert not [n for n in os.listdir(out) if n.startswith(".")]


@pytest.mark.slow  # a child process SIGKILLed
def test_overwrite_killed_before_the_commit_point_keeps_the_old_dataset(trees, tmp_path):
    a, b = trees
    out = tmp_path / "out"
    quiet_pack(a, out, shard_size=4096)
    old = snapshot(out)
    _killed_pack(b, out, "before")
    assert snapshot(out) == old  # not one byte of the old dataset changed
    assert len(ShardDataset(str(out))) == 16 and verify(str(out)).ok
    quiet_pack(b, out, shard_size=4096, overwrite=True)  # dead staging removed on the way
    assert snapshot(out) == snapshot(tmp_path / "ref_b")
    assert not [n for n in os.listdir(out) if n.startswith(".")]


@pytest.mark.slow  # a child process SIGKILLed
def test_overwrite_killed_after_the_commit_point_is_finished_not_mixed(trees, tmp_path):
    a, b = trees
    out = tmp_path / "out"
    quiet_pack(a, out, shard_size=4096)
    _killed_pack(b, out, "after")
    assert "manifest.json" not in os.listdir(out)  # the old manifest left before any shard moved
    _refused_by_every_reader(out)
    w = ShardWriter(out, overwrite=True)  # any writer into out finishes the commit first ...
    assert snapshot(out) == snapshot(tmp_path / "ref_b")  # ... to exactly the new dataset
    w.abort()  # this writer gives up: the finished B stays
    assert snapshot(out) == snapshot(tmp_path / "ref_b") and verify(str(out)).ok
    assert not [n for n in os.listdir(out) if n.startswith(".")]


def test_overwrite_deletes_only_what_shardkit_wrote(trees, tmp_path):
    a, b = trees
    out = tmp_path / "out"
    quiet_pack(b, out, shard_size=4096)
    outside = tmp_path / "precious.tar"
    outside.write_bytes(b"not ours")
    (out / "notes.txt").write_text("keep me")
    doc = json.loads((out / "manifest.json").read_text())
    doc["shards"] += [  # a hand-edited manifest listing files shardkit never wrote
        {"path": str(outside), "samples": 1, "bytes": 8, "sha256": "0" * 64},
        {"path": "../precious.tar", "samples": 1, "bytes": 8, "sha256": "0" * 64},
        {"path": "notes.txt", "samples": 1, "bytes": 7, "sha256": "0" * 64},
    ]
    doc["num_samples"] += 3
    (out / "manifest.json").write_text(json.dumps(doc))
    quiet_pack(a, out, shard_size=1 << 20, overwrite=True)  # one shard replaces several
    assert outside.read_bytes() == b"not ours" and (out / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(out)) == [
        "manifest.json",
        "manifest.keys",
        "notes.txt",
        "shard-000000.tar",
        "shard-000000.tar.idx",
    ]


@pytest.mark.slow  # the CLI in a child process
def test_second_pack_into_the_same_out_is_refused_at_once(trees, tmp_path):
    a, _ = trees
    out = tmp_path / "out"
    with ShardWriter(out) as w:
        r = subprocess.run(
            [sys.executable, "-m", "shardkit.cli", "pack", str(a), str(out), "-q"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.splitlines() == [
            f"error: output {str(out)!r} is in use by another shardkit writer (pack or "
            "ShardWriter); wait for it to finish or choose another output"
        ]
        staging = [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]
        assert len(staging) == 1  # the live writer's staging is untouched
        w.write("k", (a / "x" / "x_0000.jpg").read_bytes(), 0)
    assert read_manifest(str(out)).num_samples == 1


@pytest.mark.slow  # a live child process
def test_stale_staging_is_removed_only_when_its_owner_is_dead(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f"{STAGING_PREFIX}{sleeper.pid}-abc"
        dead = tmp_path / f"{STAGING_PREFIX}999999999-abc"  # above any pid_max
        for d in (live, dead):
            d.mkdir()
            (d / "shard-000000.tar").write_bytes(b"x")
        with DirLock(str(tmp_path)):
            assert remove_stale_staging(str(tmp_path)) == [dead.name]
        assert live.is_dir() and not dead.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.timeout(60)
def test_folder_dataset_skips_a_fifo_named_like_an_image(tmp_path):
    """A FIFO named like an image must not hang FolderDataset: it is listed as pack lists it."""
    from shardkit.stream.dataset import FolderDataset

    src = tmp_path / "src"
    make_tree(src, {"a": 3, "b": 2})
    os.mkfifo(src / "a" / "pipe.jpg")
    os.symlink("missing.jpg", src / "b" / "dangling.jpg")
    make_tree(tmp_path / "shared", {"s": 2}, seed=7)
    for cls in ("a", "b"):  # one directory linked into two classes: read once, by the first
        os.symlink(tmp_path / "shared" / "s", src / cls / "shared")
    with pytest.warns(UserWarning, match="skipped 2 unreadable image entries"):
        ds = FolderDataset(str(src), decode="raw", with_keys=True)
    items = [ds[i] for i in range(len(ds))]  # would block forever on the FIFO
    report = quiet_pack(src, tmp_path / "out", shuffle=False)
    assert len(ds) == report.samples == 7
    packed = {(r.key, r.label) for r in _records(tmp_path / "out")}
    assert {(k.rsplit(".", 1)[0], y) for _, y, k in items} == packed  # same labels, by construction


def _records(out):
    from shardkit.formats import get_format

    m = read_manifest(str(out))
    fmt = get_format(m.shard_format)
    return [r for s in m.shards for r in fmt.iter_records(os.path.join(str(out), s.path))]
