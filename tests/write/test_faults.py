"""Hostile names and faults on the writing side: names that are not UTF-8, disk full, FIFOs.

Names are real bytes on disk (``os.fsencode`` paths that are not UTF-8); disk full is a real
small tmpfs where this process may mount one (root), and otherwise, and always for the exact
step under test, an ``ENOSPC`` raised by the os-level ``fsync`` of the file being written.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
from PIL import Image

from shardkit import FolderDataset, Order, ShardDataset, ShardWriter, pack
from shardkit.errors import InputError, ManifestError, OutputError, ShardkitError
from shardkit.formats import decode_key, encode_key, get_format
from shardkit.manifest import read_manifest
from shardkit.write.verify import dataset_info, verify


def _jpeg(seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=80)
    return buf.getvalue()


def _quiet_pack(src, out, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pack(src, out, progress=False, **kw)


# --- names that are not UTF-8 ---------------------------------------------------------------------

#: (class folder, file) as raw bytes: Latin-1 e-acute, a stray 0xff, a truncated UTF-8 sequence,
#: and a name that is valid UTF-8 beside one that differs from it only by an invalid byte.
_BYTE_NAMES = [
    (b"caf\xe9", b"menu.jpg"),
    (b"caf\xe9", b"\xff\xfe.jpg"),
    (b"plain", b"ok.jpg"),
    (b"plain", b"trunc\xc3.jpg"),
    (b"plain", "caf\u00e9.jpg".encode()),
    (b"plain", b"caf\xe9.jpg"),
]


@pytest.fixture
def byte_tree(tmp_path):
    root = os.fsencode(tmp_path / "src")
    for i, (cls, name) in enumerate(_BYTE_NAMES):
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        with open(os.path.join(root, cls, name), "wb") as f:
            f.write(_jpeg(i))
    with open(os.path.join(root, b"plain", b"notes\xfe.txt"), "wb") as f:
        f.write(b"not an image")
    os.symlink(b"/nonexistent", os.path.join(root, b"plain", b"gone\xfe.jpg"))
    return root


def test_encode_key_escapes_undecodable_bytes_and_decode_key_restores_them():
    for raw in [b"caf\xe9/x", b"\xff\xfe", b"trunc\xc3", "caf\u00e9".encode(), b"a%E9.b\xe9"]:
        name = os.fsdecode(raw)
        key = encode_key(name)
        key.encode("utf-8")  # always storable text
        assert "." not in key
        assert decode_key(key) == name
        assert os.fsencode(decode_key(key)) == raw
    assert encode_key(os.fsdecode(b"caf\xe9")) == "caf%E9"
    assert encode_key("caf\u00e9") == "caf\u00e9"  # valid UTF-8 stays as it is


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_names_that_are_not_utf8_are_packed_under_escaped_keys(byte_tree, tmp_path, fmt):
    out = str(tmp_path / fmt)
    report = _quiet_pack(os.fsdecode(byte_tree), out, format=fmt)
    assert report.samples == len(_BYTE_NAMES)
    manifest = read_manifest(out)
    assert manifest.classes == ["caf\\xe9", "plain"]  # shown as Python shows the bytes
    skipped = {s.path: s.reason for s in manifest.skipped}
    assert skipped == {
        "plain/gone\\xfe.jpg": "unreadable: broken symbolic link",
        "plain/notes\\xfe.txt": "not an image",
    }
    with open(os.path.join(out, "manifest.json"), "rb") as f:
        json.loads(f.read().decode("utf-8"))  # strict UTF-8 JSON, readable by any tool
    got = {
        key: label
        for _, label, key in ShardDataset(out, order=Order(shuffle=False), with_keys=True)
    }
    want = {
        encode_key(os.fsdecode(cls + b"/" + os.path.splitext(name)[0])): int(cls == b"plain")
        for cls, name in _BYTE_NAMES
    }
    assert got == want
    for key in got:  # every key leads back to its file on disk
        assert os.path.isfile(os.path.join(byte_tree, os.fsencode(decode_key(key)) + b".jpg"))
    assert verify(out).ok
    with pytest.warns(UserWarning, match=r"skipped 1 unreadable image entries \(first: plain/gone"):
        folder = FolderDataset(os.fsdecode(byte_tree), with_keys=True)
    assert folder.classes == manifest.classes  # same names, by construction


def test_tar_shard_of_undecodable_names_reads_in_tarfile(byte_tree, tmp_path):
    import tarfile

    out = tmp_path / "tar"
    _quiet_pack(os.fsdecode(byte_tree), str(out))
    with tarfile.open(out / "shard-000000.tar") as tf:
        names = tf.getnames()
    assert "caf%E9/%FF%FE.jpg" in names and "plain/caf\u00e9.jpg" in names
    assert "plain/caf%E9.jpg" in names  # distinct from the UTF-8 name it resembles


def test_writer_refuses_a_key_that_is_not_unicode_text(tmp_path):
    with ShardWriter(str(tmp_path / "o")) as w:
        with pytest.raises(InputError, match="encode_key"):
            w.write(os.fsdecode(b"caf\xe9"), _jpeg(0), 0)
        w.write(encode_key(os.fsdecode(b"caf\xe9")), _jpeg(0), 0)


# --- disk full ------------------------------------------------------------------------------------

_PAGE = 4096


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MB tmpfs (root only); skipped where it cannot be mounted: the fsync-injection
    tests below cover the same steps everywhere."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
            check=True,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot mount a tmpfs here (needs root); ENOSPC injection covers this")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


def _fill(disk, leave: int = 0) -> None:
    """Fill ``disk`` until the kernel says ENOSPC, then give back ``leave`` bytes (pages)."""
    path = disk / "filler"
    with open(path, "ab") as f:
        try:
            while True:
                f.write(b"\x01" * (1 << 16))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            f.truncate(f.tell())  # whatever the failed flush left pending
    size = os.path.getsize(path)
    os.truncate(path, max(0, size // _PAGE * _PAGE - leave))


@pytest.fixture(scope="module")
def big_tree(tmp_path_factory):
    """~3 MB of incompressible JPEGs: more than the small disk holds."""
    root = tmp_path_factory.mktemp("big") / "src"
    rng = np.random.default_rng(7)
    for i in range(90):
        d = root / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        arr = rng.integers(0, 256, (160, 200, 3), dtype=np.uint8)
        Image.fromarray(arr).save(d / f"{i:03d}.jpg", quality=95)
    return root


@pytest.fixture(scope="module")
def small_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("small") / "src"
    for i in range(6):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"c{i % 2}" / f"{i}.jpg").write_bytes(_jpeg(i))
    return root


def _snapshot(out) -> dict[str, bytes]:
    return {n: (out / n).read_bytes() for n in sorted(os.listdir(out))}


def _left_as_before(out, before: dict[str, bytes]) -> None:
    assert _snapshot(out) == before  # no staging, no journal, no half shard: all as before
    if before:
        assert verify(str(out)).ok
        assert len(list(ShardDataset(str(out), order=Order(shuffle=False)))) == 6


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
@pytest.mark.parametrize("old", [False, True], ids=["fresh", "overwrite"])
def test_disk_full_while_writing_shards_is_one_error(small_disk, big_tree, small_tree, fmt, old):
    out = small_disk / "out"
    if old:
        _quiet_pack(str(small_tree), str(out), format=fmt)
    before = _snapshot(out) if old else {}
    with pytest.raises(OutputError) as err:
        _quiet_pack(str(big_tree), str(out), format=fmt, shard_size="1MB", overwrite=old)
    msg = str(err.value)
    assert f"cannot write shards in {str(out)!r}" in msg and "free space" in msg
    assert "\n" not in msg
    _left_as_before(out, before)


@pytest.mark.parametrize("step", ["manifest", "journal"])
@pytest.mark.parametrize("old", [False, True], ids=["fresh", "overwrite"])
def test_disk_full_at_the_manifest_or_the_journal(small_disk, small_tree, step, old):
    """The disk fills up after the last shard: the manifest (in staging) or, with a page
    left for the key file and one for the manifest, the commit journal cannot be written."""
    out = small_disk / "out"
    if old:
        _quiet_pack(str(small_tree), str(out))
    before = _snapshot(out) if old else {}

    def fill(path):
        _fill(small_disk, leave=2 * _PAGE if step == "journal" else 0)

    with pytest.raises(OutputError) as err:
        _quiet_pack(str(small_tree), str(out), overwrite=old, on_shard=fill)
    what = "manifest.json" if step == "manifest" else "the commit journal .shardkit-commit.json"
    assert f"cannot write {what} in {str(out)!r}: No space left on device" in str(err.value)
    os.unlink(small_disk / "filler")
    _left_as_before(out, before)
    _quiet_pack(str(small_tree), str(out), overwrite=True)  # with room again, it just works
    assert verify(str(out)).ok


@pytest.mark.parametrize("target", ["shard-", "manifest.json", ".shardkit-commit.json"])
def test_enospc_injected_at_fsync_of_each_file(small_tree, tmp_path, monkeypatch, target):
    """Where no tmpfs can be mounted: the os-level ``fsync`` of the shard, the manifest or the
    journal fails with ENOSPC (as it does on a full disk with delayed allocation)."""
    out = tmp_path / "out"
    _quiet_pack(str(small_tree), str(out))
    before = _snapshot(out)
    real = os.fsync

    def fsync(fd):
        if target in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OutputError, match="No space left on device.*free space") as err:
        _quiet_pack(str(small_tree), str(out), overwrite=True, seed=3)
    what = {"shard-": "shards", "manifest.json": "manifest.json"}.get(target, "the commit journal")
    assert f"cannot write {what}" in str(err.value)
    monkeypatch.undo()
    _left_as_before(out, before)


_FSIZE_CHILD = """
import resource, signal, sys, warnings
from shardkit import pack
from shardkit.errors import OutputError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
warnings.simplefilter("ignore")
try:
    pack(sys.argv[1], sys.argv[2], format=sys.argv[3], progress=False)
except OutputError as exc:
    print(exc)
    sys.exit(3)
"""


@pytest.mark.slow  # a child process under RLIMIT_FSIZE
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_file_size_limit_hit_by_the_shard_writer_is_one_error(big_tree, tmp_path, fmt):
    """No root needed: ``RLIMIT_FSIZE`` makes the kernel refuse the shard's write (EFBIG)."""
    out = tmp_path / "out"
    child = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(big_tree), str(out), fmt],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 3, child.stderr
    assert f"cannot write shards in {str(out)!r}" in child.stdout
    assert os.listdir(out) == []


# --- decisions: links that lead outside SRC ----------------------------------------------------


def test_links_outside_the_source_are_followed_and_warned_about_once(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "more").mkdir(parents=True)
    for i in range(3):
        (elsewhere / "more" / f"{i}.jpg").write_bytes(_jpeg(i))
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "own.jpg").write_bytes(_jpeg(9))
    (src / "a" / "inside.jpg").symlink_to(src / "a" / "own.jpg")  # inside SRC: not counted
    (src / "a" / "file.jpg").symlink_to(elsewhere / "more" / "0.jpg")
    (src / "b").symlink_to(elsewhere / "more", target_is_directory=True)
    with pytest.warns(UserWarning, match=r"^2 symbolic link\(s\) under .* lead outside it") as rec:
        report = pack(str(src), str(tmp_path / "out"), progress=False)
    assert sum("lead outside" in str(w.message) for w in rec) == 1
    # own and the three behind the folder link; inside.jpg and file.jpg link to files that are
    # samples already (own.jpg, b/0.jpg): listed as skipped, not packed twice
    assert report.samples == 4
    assert {"a/inside.jpg", "a/file.jpg"} <= {s.path for s in report.skipped}
    assert read_manifest(str(tmp_path / "out")).pack["links_outside_source"] == 2


# --- FIFOs (and other non-files) where a reader expects a file ------------------------------------


@pytest.fixture
def packed(tmp_path, small_tree):
    return {
        fmt: str(_quiet_pack(str(small_tree), str(tmp_path / fmt), format=fmt, shard_size=3000).out)
        for fmt in ("tar", "lmdb")
    }


def _fifo_in_place_of(path: str) -> None:
    os.unlink(path)
    os.mkfifo(path)


@pytest.mark.slow  # the CLI in a child process
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_fifo_named_like_a_shard_is_refused_by_every_reader(packed, fmt):
    from conftest import run_cli

    out = packed[fmt]
    shard = os.path.join(out, f"shard-000001.{fmt}")
    _fifo_in_place_of(shard)
    with pytest.raises(ShardkitError, match=r"shard-000001.*not a regular file \(a FIFO\)"):
        list(ShardDataset(out, order=Order(shuffle=False)))
    report = verify(out)
    assert [b.path for b in report.bad] == [f"shard-000001.{fmt}"]
    assert "not a regular file (a FIFO)" in str(report.bad[0].problems)
    with pytest.raises(ShardkitError, match="not a regular file"):
        list(get_format(fmt).iter_records(shard))
    done = run_cli("verify", out, timeout=60)
    assert done.returncode != 0 and "shard-000001" in done.stdout + done.stderr
    with pytest.raises(ShardkitError, match="not a regular file"):  # a dir without manifest
        os.unlink(os.path.join(out, "manifest.json"))
        list(ShardDataset(out, order=Order(shuffle=False)))


@pytest.mark.slow  # the CLI in a child process
@pytest.mark.timeout(60)
def test_a_fifo_named_manifest_json_is_refused_by_every_reader(packed, tmp_path, small_tree):
    from conftest import run_cli

    out = packed["tar"]
    _fifo_in_place_of(os.path.join(out, "manifest.json"))
    for call in (read_manifest, ShardDataset, verify, dataset_info):
        with pytest.raises(ManifestError, match=r"manifest\.json.*not a regular file \(a FIFO\)"):
            call(out)
    for cmd in ("info", "verify"):
        done = run_cli(cmd, out, timeout=60)
        assert done.returncode != 0
        assert "not a regular file (a FIFO)" in done.stderr and "Traceback" not in done.stderr
    # an overwrite reads the old manifest to know what it may delete: no hang there either
    _quiet_pack(str(small_tree), out, overwrite=True)
    assert verify(out).ok


@pytest.mark.timeout(60)
def test_index_refuses_a_fifo_and_reports_a_full_disk(packed, tmp_path, monkeypatch):
    from shardkit.write.index import index_shards

    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "a.tar")
    with pytest.raises(InputError, match=r"a\.tar: cannot read \(not a regular file \(a FIFO\)"):
        index_shards([str(fifo_dir)], progress=False)  # listed from its directory
    with pytest.raises(InputError, match=r"a\.tar: not a regular file"):
        index_shards([str(fifo_dir / "a.tar")], progress=False)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    shutil.copy(os.path.join(packed["tar"], "shard-000000.tar"), foreign / "x.tar")
    real = os.fsync

    def fsync(fd):
        if "manifest.json" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OutputError, match="cannot write manifest.json in .*No space left"):
        index_shards([str(foreign / "x.tar")], progress=False)
    assert os.listdir(foreign) == ["x.tar"]
