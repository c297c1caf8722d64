"""Page-cache eviction checked with mincore, never with timings."""

from __future__ import annotations

import os

import pytest

from shardkit.bench.pagecache import evict, iter_files, resident_fraction


def _fs_type(path) -> str:
    """The filesystem type holding ``path``, from the longest matching mount point."""
    path = os.path.realpath(path)
    best, kind = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _dev, mnt, fstype, *_ = line.split()
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, fstype
    return kind


@pytest.fixture
def disk_dir(tmp_path):
    if _fs_type(tmp_path) in ("tmpfs", "ramfs", "overlay"):
        pytest.skip(f"{tmp_path} is on {_fs_type(tmp_path)}, whose pages cannot be evicted")
    return tmp_path


def _write(path, size: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(size))


def _read(path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass


def test_evict_file_drops_its_pages(disk_dir):
    path = disk_dir / "f.bin"
    _write(path, 3 << 20)
    _read(path)
    assert resident_fraction(path) > 0.9
    assert evict(str(path)) == 1
    assert resident_fraction(path) == 0.0
    _read(path)
    assert resident_fraction(path) > 0.9


def test_evict_directory_recursively(disk_dir):
    files = [disk_dir / "tree" / rel for rel in ("a.bin", "x/b.bin", "x/y/c.bin")]
    for f in files:
        _write(f, 256 << 10)
        _read(f)
    outside = disk_dir / "other.bin"
    _write(outside, 256 << 10)
    _read(outside)
    os.symlink("..", disk_dir / "tree" / "x" / "loop")  # must not loop forever
    assert resident_fraction(disk_dir / "tree") > 0.9
    assert evict(disk_dir / "tree") == 3
    assert resident_fraction(disk_dir / "tree") == 0.0
    assert all(resident_fraction(f) == 0.0 for f in files)
    assert resident_fraction(outside) > 0.9  # only what was named is evicted


def test_evict_accepts_a_list_and_partial_reads_show(disk_dir):
    a, b = disk_dir / "a.bin", disk_dir / "b.bin"
    _write(a, 1 << 20)
    _write(b, 1 << 20)
    evict([a, b])
    with open(a, "rb") as f:
        f.read(4096)
    assert 0.0 < resident_fraction(a) < 1.0
    assert resident_fraction(b) == 0.0


def test_empty_files_fifos_and_missing_paths(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    os.mkfifo(tmp_path / "pipe")
    assert resident_fraction(tmp_path / "empty") == 0.0
    assert list(iter_files(tmp_path)) == [str(tmp_path / "empty")]
    assert evict([tmp_path, tmp_path / "missing"]) == 1  # no hang on the FIFO, no error
