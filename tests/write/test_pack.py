"""shardkit pack: real image trees built with PIL, real shards, real subprocesses and signals."""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import warnings

import lmdb
import numpy as np
import pytest
from conftest import run_cli
from PIL import Image

from shardkit.errors import InputError, OutputError
from shardkit.formats import get_format
from shardkit.fsutil import STAGING_PREFIX
from shardkit.images.checks import check_image_bytes
from shardkit.manifest import read_manifest
from shardkit.scan import scan_source
from shardkit.sizes import parse_size
from shardkit.write.packer import PackWarning, pack

# --- helpers ---------------------------------------------------------------------------------


def image_bytes(rng: np.random.Generator, size=(24, 32), fmt="JPEG") -> bytes:
    buf = io.BytesIO()
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr).save(buf, fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    return buf.getvalue()


def make_tree(root, classes: dict[str, int], *, size=(24, 32), seed=0, ext="jpg") -> dict:
    """SRC/<class>/<class>_NNNN.<ext> with noise images; returns {relative path: bytes}."""
    rng = np.random.default_rng(seed)
    files = {}
    for cls, count in classes.items():
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        for i in range(count):
            rel = f"{cls}/{cls}_{i:04d}.{ext}"
            data = image_bytes(rng, size, "PNG" if ext.lower() == "png" else "JPEG")
            with open(os.path.join(root, rel), "wb") as f:
                f.write(data)
            files[rel] = data
    return files


def quiet_pack(src, out, **kw):
    kw.setdefault("progress", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = pack(str(src), str(out), **kw)
    return report, [str(w.message) for w in caught if issubclass(w.category, PackWarning)]


def tar_members(path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]


def shard_samples(out) -> list[tuple[str, str, bytes, int]]:
    """Every (key, ext, data, label) in shard order, through our reader."""
    m = read_manifest(str(out))
    fmt = get_format(m.shard_format)
    return [
        (r.key, r.ext, r.data, r.label)
        for s in m.shards
        for r in fmt.iter_records(os.path.join(str(out), s.path))
    ]


def shard_files(out) -> dict[str, bytes]:
    return {
        n: open(os.path.join(out, n), "rb").read()
        for n in sorted(os.listdir(out))
        if n.startswith("shard-")
    }


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    files = make_tree(src, {"dog": 6, "cat": 5, "bird": 4})
    return src, files


# --- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("256MB", 256_000_000),
        ("64MiB", 64 * 2**20),
        ("1G", 10**9),
        ("1GB", 10**9),
        ("1.5GiB", 3 * 2**29),
        ("1024", 1024),
        ("100kb", 100_000),
        ("2KiB", 2048),
        (" 7 B ", 7),
        (4096, 4096),
    ],
)
def test_parse_size_accepts_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MB", "12XB", "-5MB", "1.2.3G", "0", "0.0001", "ten", "1iB"])
def test_parse_size_rejects_with_value_and_example(text):
    with pytest.raises(InputError) as err:
        parse_size(text)
    assert repr(text) in str(err.value) and "256MB" in str(err.value)


@pytest.mark.slow  # the CLI in a child process
def test_invalid_shard_size_cli_exit_code(tree, tmp_path):
    src, _ = tree
    r = run_cli("pack", src, tmp_path / "out", "--shard-size", "12XB")
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "error: Invalid value for '--shard-size': '12XB' is not a size; use e.g. 256MB, 64MiB, 1G "
        "or a plain number of bytes; see 'python -m shardkit.cli pack -h'"
    )
    assert not (tmp_path / "out").exists()


# --- scanning and labels ---------------------------------------------------------------------


def test_labels_are_sorted_folder_indices_and_keys_are_paths(tree, tmp_path):
    src, files = tree
    report, warns = quiet_pack(src, tmp_path / "out")
    m = read_manifest(str(tmp_path / "out"))
    assert m.classes == ["bird", "cat", "dog"]
    assert report.samples == m.num_samples == len(files) == 15
    assert warns == []
    got = {key: (ext, data, label) for key, ext, data, label in shard_samples(tmp_path / "out")}
    assert len(got) == 15
    for rel, data in files.items():
        cls = rel.split("/")[0]
        key = rel[: -len(".jpg")]
        assert got[key] == ("jpg", data, m.classes.index(cls))


def test_extensions_case_insensitive_and_same_stem_keys(tmp_path):
    src = tmp_path / "src"
    rng = np.random.default_rng(1)
    os.makedirs(src / "a")
    blobs = {
        "a/x.jpg": image_bytes(rng),
        "a/x.png": image_bytes(rng, fmt="PNG"),
        "a/UPPER.JPEG": image_bytes(rng),
        "a/y.v2.Png": image_bytes(rng, fmt="PNG"),
        "a/notes.txt": b"not an image",
    }
    for rel, data in blobs.items():
        (src / rel).write_bytes(data)
    report, warns = quiet_pack(src, tmp_path / "out")
    assert report.samples == 4 and report.not_images == 1
    got = {key: (ext, data) for key, ext, data, _ in shard_samples(tmp_path / "out")}
    assert got == {
        "a/x%2Ejpg": ("jpg", blobs["a/x.jpg"]),
        "a/x%2Epng": ("png", blobs["a/x.png"]),
        "a/UPPER": ("jpeg", blobs["a/UPPER.JPEG"]),
        "a/y%2Ev2": ("png", blobs["a/y.v2.Png"]),
    }
    skipped = read_manifest(str(tmp_path / "out")).skipped
    assert [(s.path, s.reason) for s in skipped] == [("a/notes.txt", "not an image")]


def test_nested_unicode_and_long_names_read_by_every_tar_reader(tmp_path):
    src = tmp_path / "src"
    rng = np.random.default_rng(2)
    long_dir = "d" * 90
    rels = ["José/café.jpg", f"José/{long_dir}/{'n' * 60}.jpg", "Zoë/sub/deeper/ü.png"]
    blobs = {}
    for rel in rels:
        os.makedirs(os.path.dirname(src / rel), exist_ok=True)
        blobs[rel] = image_bytes(rng, fmt="PNG" if rel.endswith("png") else "JPEG")
        (src / rel).write_bytes(blobs[rel])
    quiet_pack(src, tmp_path / "out", shuffle=False)
    names = [n for n, _ in tar_members(tmp_path / "out" / "shard-000000.tar")]
    assert f"José/{long_dir}/{'n' * 60}.jpg" in names and "Zoë/sub/deeper/ü.png" in names
    gnu = subprocess.run(
        ["tar", "-tf", tmp_path / "out" / "shard-000000.tar"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert gnu.stdout.splitlines() == names


def test_empty_class_folder_keeps_label_and_warns(tmp_path):
    src = tmp_path / "src"
    make_tree(src, {"a": 2, "c": 2})
    os.makedirs(src / "b")
    (src / "b" / "readme.txt").write_text("no images here")
    report, warns = quiet_pack(src, tmp_path / "out")
    m = read_manifest(str(tmp_path / "out"))
    assert m.classes == ["a", "b", "c"]
    assert report.empty_classes == ["b"]
    assert {label for *_, label in shard_samples(tmp_path / "out")} == {0, 2}
    assert any("has no images" in w and os.path.join(str(src), "b") in w for w in warns)


def test_hidden_files_and_folders_are_ignored(tmp_path):
    src = tmp_path / "src"
    make_tree(src, {"a": 2})
    os.makedirs(src / ".ipynb_checkpoints")
    (src / ".ipynb_checkpoints" / "x.jpg").write_bytes(b"junk")
    (src / "a" / "._a_0000.jpg").write_bytes(b"AppleDouble junk")
    report, _ = quiet_pack(src, tmp_path / "out")
    assert report.samples == 2 and report.classes == 1 and report.errors == 0


# --- bad input (issue section 5) -------------------------------------------------------------


@pytest.mark.slow  # the CLI in a child process
def test_src_missing(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        quiet_pack(tmp_path / "nope", tmp_path / "out")
    r = run_cli("pack", tmp_path / "nope", tmp_path / "out")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"error: source '{tmp_path / 'nope'}' does not exist; pass a folder with one sub-folder "
        "per class"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the CLI in a child process
def test_src_not_a_directory(tmp_path):
    f = tmp_path / "file.jpg"
    f.write_bytes(b"x")
    r = run_cli("pack", f, tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: source '{f}' is not a directory")


@pytest.mark.slow  # the CLI in a child process
def test_src_without_images(tmp_path):
    src = tmp_path / "src"
    os.makedirs(src / "a")
    (src / "a" / "x.txt").write_text("text")
    with pytest.raises(InputError, match="has no images"):
        quiet_pack(src, tmp_path / "out")
    os.makedirs(tmp_path / "flat")
    (tmp_path / "flat" / "x.jpg").write_bytes(image_bytes(np.random.default_rng(0)))
    r = run_cli("pack", tmp_path / "flat", tmp_path / "out")
    assert r.returncode == 2 and "has no class folders" in r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_non_image_files_are_skipped_and_counted(tree, tmp_path):
    src, files = tree
    (src / "cat" / "labels.csv").write_text("a,b")
    (src / "dog" / "thumbs.db").write_bytes(b"\0" * 10)
    (src / "README").write_text("top-level file")
    report, warns = quiet_pack(src, tmp_path / "out")
    assert report.samples == len(files)
    assert report.not_images == 3 and report.errors == 0
    assert warns == []  # not errors: nothing to warn about
    skipped = {s.path: s.reason for s in read_manifest(str(tmp_path / "out")).skipped}
    assert skipped == {
        "README": "not in a class folder",
        "cat/labels.csv": "not an image",
        "dog/thumbs.db": "not an image",
    }


def _truncate(path, keep: float = 0.5):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: int(len(data) * keep)])


def test_corrupt_and_truncated_images_skip(tree, tmp_path):
    src, files = tree
    _truncate(src / "cat" / "cat_0001.jpg")
    (src / "dog" / "dog_0002.jpg").write_bytes(b"<html>404 not found</html>")
    (src / "dog" / "dog_0003.jpg").write_bytes(b"")
    png = make_tree(tmp_path / "png", {"p": 1}, ext="png")
    (src / "bird" / "bird_0000.png").write_bytes(png["p/p_0000.png"][:-30])
    report, warns = quiet_pack(src, tmp_path / "out")
    assert report.samples == len(files) - 3  # 3 bad jpgs; the truncated png is an extra file
    reasons = {s.path: s.reason for s in read_manifest(str(tmp_path / "out")).skipped}
    assert reasons["cat/cat_0001.jpg"] == "truncated JPEG (no end-of-image marker)"
    assert reasons["dog/dog_0002.jpg"].startswith(
        "not a JPEG, PNG, WebP, BMP, GIF, TIFF or PPM/PGM file"
    )
    assert reasons["dog/dog_0003.jpg"] == "empty file"
    assert reasons["bird/bird_0000.png"] == "truncated PNG (no IEND chunk)"
    assert report.errors == 4
    assert any(w.startswith("skipped 4 bad or unreadable image(s)") for w in warns)
    keys = {k for k, *_ in shard_samples(tmp_path / "out")}
    assert "cat/cat_0001" not in keys and "cat/cat_0000" in keys


@pytest.mark.slow  # the CLI in a child process
def test_corrupt_image_fail_names_the_path(tree, tmp_path):
    src, _ = tree
    _truncate(src / "cat" / "cat_0001.jpg")
    with pytest.raises(InputError) as err:
        quiet_pack(src, tmp_path / "out", on_error="fail")
    assert str(src / "cat" / "cat_0001.jpg") in str(err.value)
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert [n for n in os.listdir(tmp_path / "out") if n.startswith("shard-")] == []
    r = run_cli("pack", src, tmp_path / "out2", "--on-error", "raise", "-q")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [
        f"error: {src / 'cat' / 'cat_0001.jpg'}: truncated JPEG (no end-of-image marker); remove "
        "or fix it, or pass --on-error skip"
    ]
    assert os.listdir(tmp_path / "out2") == []


@pytest.mark.slow  # the CLI in a child process
def test_cli_skip_warns_with_count(tree, tmp_path):
    src, _ = tree
    _truncate(src / "cat" / "cat_0001.jpg")
    r = run_cli("pack", src, tmp_path / "out", "-q")
    assert r.returncode == 0, r.stderr
    assert (
        f"warning: skipped 1 bad or unreadable image(s) of 15; their paths and reasons are in "
        f"{tmp_path / 'out' / 'manifest.json'} under 'skipped'"
    ) in r.stderr.splitlines()
    assert r.stdout.startswith("Packed 14 samples of 3 classes into 1 tar shard")


def test_validate_modes(tmp_path):
    src = tmp_path / "src"
    good = make_tree(src, {"a": 3})
    # Right magic and end marker, garbage between: passes the header check, fails a decode.
    (src / "a" / "fake.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 200 + b"\xff\xd9")
    # Valid JPEG followed by a long trailer: fails the header check, decodes fine -> kept.
    (src / "a" / "trailer.jpg").write_bytes(good["a/a_0000.jpg"] + b"\x01" * 5000)
    _truncate(src / "a" / "a_0002.jpg")
    keys = {}
    for mode in ("header", "decode", "none"):
        quiet_pack(src, tmp_path / mode, validate=mode)
        keys[mode] = {k for k, *_ in shard_samples(tmp_path / mode)}
    assert keys["none"] == {"a/a_0000", "a/a_0001", "a/a_0002", "a/fake", "a/trailer"}
    assert keys["header"] == {"a/a_0000", "a/a_0001", "a/fake", "a/trailer"}
    assert keys["decode"] == {"a/a_0000", "a/a_0001", "a/trailer"}
    reasons = {s.path: s.reason for s in read_manifest(str(tmp_path / "decode")).skipped}
    assert reasons["a/fake.jpg"].startswith("cannot decode")


def test_check_image_bytes_accepts_real_formats():
    rng = np.random.default_rng(3)
    for fmt in ("JPEG", "PNG", "WEBP", "BMP", "GIF", "PPM"):
        data = image_bytes(rng, fmt=fmt)
        assert check_image_bytes(data) is None, fmt
        assert check_image_bytes(data[: len(data) // 2]) is not None, fmt


def test_unreadable_broken_symlink_and_fifo_do_not_hang(tree, tmp_path):
    src, files = tree
    os.symlink(tmp_path / "missing.jpg", src / "cat" / "dangling.jpg")
    os.mkfifo(src / "dog" / "pipe.jpg")
    report, warns = quiet_pack(src, tmp_path / "out")
    assert report.samples == len(files) and report.errors == 2
    reasons = {s.path: s.reason for s in read_manifest(str(tmp_path / "out")).skipped}
    assert reasons["cat/dangling.jpg"] == "unreadable: broken symbolic link"
    assert reasons["dog/pipe.jpg"] == "unreadable: not a regular file (FIFO, socket or device)"
    assert any(w.startswith("skipped 2 ") for w in warns)
    with pytest.raises(InputError, match="dangling.jpg: unreadable: broken symbolic link"):
        quiet_pack(src, tmp_path / "out2", on_error="fail")


def _drop_file_permission_override():
    """In the child: give up root's power to read files regardless of their mode bits.

    Tests run as root, where chmod 000 stops nothing. Dropping CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH from the bounding set (so exec cannot regain them) and from the current
    sets makes the kernel check mode bits again: a real EACCES on open().
    """
    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    caps = (1, 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    for cap in caps:
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            os._exit(77)
    header, data = Header(0x20080522, 0), (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        os._exit(77)
    for cap in caps:
        for field in ("effective", "permitted", "inheritable"):
            setattr(data[0], field, getattr(data[0], field) & ~(1 << cap))
    if libc.capset(ctypes.byref(header), data) != 0:
        os._exit(77)


@pytest.mark.slow  # the CLI in a child process
def test_unreadable_file_permission_denied(tree, tmp_path):
    src, files = tree
    locked = src / "cat" / "cat_0002.jpg"
    locked.chmod(0)
    kw = {"preexec_fn": _drop_file_permission_override} if os.geteuid() == 0 else {}
    probe = subprocess.run([sys.executable, "-c", f"open({str(locked)!r}, 'rb')"], **kw)
    if probe.returncode == 77:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here, so no file is unreadable to root")
    assert probe.returncode != 0, "the locked file is still readable"
    r = run_cli("pack", src, tmp_path / "out", "-q", **kw)
    assert r.returncode == 0, r.stderr
    reasons = {s.path: s.reason for s in read_manifest(str(tmp_path / "out")).skipped}
    assert reasons == {"cat/cat_0002.jpg": "unreadable: Permission denied"}
    assert read_manifest(str(tmp_path / "out")).num_samples == len(files) - 1
    r = run_cli("pack", src, tmp_path / "out2", "-q", "--on-error", "raise", **kw)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"error: {locked}: unreadable: Permission denied; remove or fix it, or pass --on-error skip"
    ]


def test_symlink_loops_end_and_linked_folders_count_once(tree, tmp_path):
    src, files = tree
    os.symlink("..", src / "cat" / "up")  # cat/up -> src: a loop through every class
    os.symlink(src / "dog", src / "dog" / "self")  # dog/self -> dog
    os.symlink("loop", src / "bird" / "loop")  # a symlink to itself (ELOOP)
    report, warns = quiet_pack(src, tmp_path / "out")
    assert report.samples == len(files)
    m = read_manifest(str(tmp_path / "out"))
    assert m.classes == ["bird", "cat", "dog"]
    reasons = {s.path: s.reason for s in m.skipped}
    assert reasons["cat/up/"].startswith("directory already visited")
    assert reasons["dog/self/"].startswith("directory already visited")
    assert reasons["bird/loop"] == "not an image"


@pytest.mark.slow  # the CLI in a child process
def test_out_not_empty_needs_overwrite(tree, tmp_path):
    src, _ = tree
    out = tmp_path / "out"
    os.makedirs(out)
    (out / "something.txt").write_text("keep me")
    with pytest.raises(OutputError) as err:
        quiet_pack(src, out)
    assert str(out) in str(err.value) and "overwrite=True" in str(err.value)  # Python's name
    r = run_cli("pack", src, out, "-q")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"error: output directory '{out}' is not empty; pass --overwrite to replace the shards "
        "and manifest in it, or choose an empty directory"
    ]
    assert sorted(os.listdir(out)) == ["something.txt"]


def _out_state(out) -> dict[str, tuple[int, bytes]]:
    """Every file in OUT with its mtime and bytes: what "rewrites nothing" compares."""
    return {
        n: (os.stat(os.path.join(out, n)).st_mtime_ns, open(os.path.join(out, n), "rb").read())
        for n in sorted(os.listdir(out))
    }


def test_a_pack_already_in_out_is_up_to_date_and_rewrites_nothing(tree, tmp_path):
    """As make would: the same files with the same options into OUT again exits 0, untouched."""
    src, _ = tree
    out = tmp_path / "out"
    first = run_cli("pack", src, out, "--shard-size", "4KB", "-q")
    assert first.returncode == 0, first.stderr
    fingerprint = read_manifest(str(out)).pack["source_fingerprint"]
    assert fingerprint.startswith("sha256:") and len(fingerprint) == 7 + 64
    before = _out_state(out)
    time.sleep(0.01)  # a rewrite would show in the mtimes
    again = run_cli("pack", src, out, "--shard-size", "4KB", "--threads", "3", "-q")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"{out} is up to date: 15 samples of 3 classes in ")
    assert "nothing to do" in again.stdout and again.stderr == ""
    assert _out_state(out) == before
    report, _ = quiet_pack(src, out, shard_size="4KB")
    assert (
        report.up_to_date
        and report.samples == 15
        and report.shards == len([n for n in shard_files(out) if n.endswith(".tar")])
    )
    assert _out_state(out) == before


@pytest.mark.parametrize(
    "change",
    ["shard size", "seed", "format", "touched file", "new file", "removed file", "shard gone"],
)
def test_a_different_source_or_options_still_needs_overwrite(tree, tmp_path, change):
    src, _ = tree
    out = tmp_path / "out"
    quiet_pack(src, out, shard_size="4KB")
    args = ["--shard-size", "4KB"]
    if change == "shard size":
        args = ["--shard-size", "8KB"]
    elif change == "seed":
        args += ["--seed", "1"]
    elif change == "format":
        args += ["--format", "lmdb"]
    elif change == "touched file":
        path = src / "cat" / "cat_0001.jpg"
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    elif change == "new file":
        (src / "cat" / "cat_0099.jpg").write_bytes((src / "cat" / "cat_0001.jpg").read_bytes())
    elif change == "removed file":
        os.remove(src / "dog" / "dog_0003.jpg")
    else:
        os.remove(out / sorted(shard_files(out))[0])
    before = _out_state(out)
    r = run_cli("pack", src, out, *args, "-q")
    assert r.returncode == 2
    why = {
        "shard size": "other options: --shard-size 4.0 kB -> 8.0 kB",
        "seed": "other options: --seed 0 -> 1",
        "format": "other options: --format tar -> lmdb",
        "shard gone": "its shard shard-000000.tar missing or changed",
    }.get(change, "the same options, but the source's files changed since (names, sizes or mtimes)")
    assert r.stderr.splitlines() == [
        f"error: {out} holds a pack made with {why}; pass --overwrite to replace it, or choose "
        "another output"
    ]
    assert _out_state(out) == before
    r = run_cli("pack", src, out, *args, "--overwrite", "-q")  # and --overwrite repacks
    assert r.returncode == 0 and r.stdout.startswith("Packed "), r.stderr


def test_a_manifest_without_a_fingerprint_is_never_up_to_date(tree, tmp_path):
    """Manifests written before the fingerprint existed (or by ShardWriter) behave as before."""
    src, _ = tree
    out = tmp_path / "out"
    quiet_pack(src, out)
    path = out / "manifest.json"
    doc = json.loads(path.read_text())
    del doc["pack"]["source_fingerprint"]
    path.write_text(json.dumps(doc))
    with pytest.raises(OutputError, match="not empty"):
        quiet_pack(src, out)


def test_overwrite_replaces_old_shards_and_keeps_other_files(tree, tmp_path):
    src, files = tree
    out = tmp_path / "out"
    quiet_pack(src, out, shard_size=2048)
    old = shard_files(out)
    assert len(old) > 3
    (out / "notes.txt").write_text("keep me")
    quiet_pack(src, out, overwrite=True)
    assert sorted(os.listdir(out)) == [
        "manifest.json",
        "manifest.keys",  # its key file, replaced with the shards
        "notes.txt",
        "shard-000000.tar",
        "shard-000000.tar.idx",  # its sample index
    ]
    assert read_manifest(str(out)).num_samples == len(files)
    quiet_pack(src, out, overwrite=True, format="lmdb")
    listed = ["manifest.json", "manifest.keys", "notes.txt", "shard-000000.lmdb"]
    assert sorted(os.listdir(out)) == listed


def test_out_inside_src_is_refused(tree):
    src, _ = tree
    with pytest.raises(OutputError, match="inside the source"):
        quiet_pack(src, src / "cat" / "out")


# --- shard sizes -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_shards_stay_within_the_size_limit(tmp_path, fmt):
    src = tmp_path / "src"
    files = make_tree(src, {"a": 60, "b": 60}, size=(48, 48))
    # LMDB's writer reserves about 64 KiB for fixed and copy-on-write pages, so give it room.
    limit = 100_000 if fmt == "tar" else 256 * 1024
    report, _ = quiet_pack(src, tmp_path / "out", format=fmt, shard_size=limit)
    m = read_manifest(str(tmp_path / "out"))
    assert len(m.shards) == report.shards > 2
    for s in m.shards:
        assert s.bytes == os.path.getsize(tmp_path / "out" / s.path) <= limit
    assert m.num_samples == len(files)
    # Shards are filled, not split early: each but the last could not take its successor's
    # first sample.
    sizes = [s.bytes for s in m.shards[:-1]]
    assert min(sizes) > limit * 0.6


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_sample_bigger_than_limit_gets_its_own_shard(tmp_path, fmt):
    src = tmp_path / "src"
    make_tree(src, {"a": 6}, size=(16, 16))
    big = image_bytes(np.random.default_rng(9), size=(300, 300), fmt="PNG")
    (src / "a" / "big.png").write_bytes(big)
    limit = 20_000
    assert len(big) > limit
    quiet_pack(src, tmp_path / "out", format=fmt, shard_size=limit, shuffle=False)
    m = read_manifest(str(tmp_path / "out"))
    per_shard = [
        [r.key for r in get_format(fmt).iter_records(tmp_path / "out" / s.path)] for s in m.shards
    ]
    assert ["a/big"] in per_shard
    assert sum(map(len, per_shard)) == 7
    for s, keys in zip(m.shards, per_shard, strict=True):
        assert s.bytes <= limit or keys == ["a/big"]


# --- determinism and order -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_same_input_and_seed_give_identical_bytes(tree, tmp_path, fmt):
    src, _ = tree
    quiet_pack(src, tmp_path / "one", format=fmt, shard_size=4096, seed=7)
    quiet_pack(src, tmp_path / "two", format=fmt, shard_size=4096, seed=7, workers=3)
    assert shard_files(tmp_path / "one") == shard_files(tmp_path / "two")
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert one == two
    quiet_pack(src, tmp_path / "three", format=fmt, shard_size=4096, seed=8)
    assert [k for k, *_ in shard_samples(tmp_path / "one")] != [
        k for k, *_ in shard_samples(tmp_path / "three")
    ]


def test_shuffle_is_a_permutation_and_no_shuffle_keeps_sorted_order(tree, tmp_path):
    src, files = tree
    quiet_pack(src, tmp_path / "sorted", shuffle=False)
    quiet_pack(src, tmp_path / "mixed", seed=0)
    in_order = [k for k, *_ in shard_samples(tmp_path / "sorted")]
    mixed = [k for k, *_ in shard_samples(tmp_path / "mixed")]
    expected = sorted(rel[:-4] for rel in files)
    assert in_order == expected
    assert sorted(mixed) == expected and mixed != expected
    n = len(expected)
    assert mixed == [expected[i] for i in np.random.default_rng(0).permutation(n)]


def test_manifest_records_pack_parameters(tree, tmp_path):
    src, _ = tree
    report, _ = quiet_pack(src, tmp_path / "out", shard_size="64MiB", seed=3, shuffle=False)
    m = read_manifest(str(tmp_path / "out"))
    assert m.pack["source"] == str(src)
    assert m.pack["shard_size"] == 64 * 2**20
    assert (m.pack["shuffle"], m.pack["seed"], m.pack["format"]) == (False, 3, "tar")
    assert (m.pack["validate"], m.pack["on_error"], m.pack["resize_short"]) == (
        "header",
        "skip",
        None,
    )
    assert m.pack["shardkit_version"]
    assert report.manifest_path == str(tmp_path / "out" / "manifest.json")
    assert report.shards == 1 and report.classes == 3 and report.bytes == m.total_bytes


# --- readers of our shards -------------------------------------------------------------------


def test_tar_shards_read_by_tarfile_gnu_tar_and_webdataset(tree, tmp_path):
    import webdataset as wds

    src, files = tree
    quiet_pack(src, tmp_path / "out", shard_size=8192)
    m = read_manifest(str(tmp_path / "out"))
    paths = [str(tmp_path / "out" / s.path) for s in m.shards]
    assert len(paths) > 1
    expected = {rel[:-4]: (data, m.classes.index(rel.split("/")[0])) for rel, data in files.items()}

    from_tarfile = {}
    for p in paths:
        members = tar_members(p)
        for (img_name, data), (cls_name, label) in zip(members[::2], members[1::2], strict=True):
            assert img_name.endswith(".jpg") and cls_name == img_name[:-4] + ".cls"
            from_tarfile[img_name[:-4]] = (data, int(label))
    assert from_tarfile == expected

    listed = []
    for p in paths:
        r = subprocess.run(["tar", "-tf", p], capture_output=True, text=True, check=True)
        listed += r.stdout.split()
    assert sorted(listed) == sorted([k + ".jpg" for k in expected] + [k + ".cls" for k in expected])

    ds = wds.WebDataset(paths, shardshuffle=False, empty_check=False)
    from_wds = {s["__key__"]: (s["jpg"], int(s["cls"])) for s in ds}
    assert from_wds == expected


def test_lmdb_shards_open_with_plain_lmdb(tree, tmp_path):
    src, files = tree
    quiet_pack(src, tmp_path / "out", format="lmdb", shard_size=8192)
    m = read_manifest(str(tmp_path / "out"))
    assert len(m.shards) > 1
    total = 0
    for s in m.shards:
        env = lmdb.open(str(tmp_path / "out" / s.path), subdir=False, readonly=True, lock=False)
        with env.begin() as txn:
            entries = txn.stat()["entries"]
        env.close()
        assert entries == s.samples + 2  # the samples, the meta record and the index record
        total += s.samples
    assert total == len(files)
    assert not [n for n in os.listdir(tmp_path / "out") if n.endswith("-lock")]
    got = {k: d for k, _, d, _ in shard_samples(tmp_path / "out")}
    assert got == {rel[:-4]: data for rel, data in files.items()}


# --- workers and resize ----------------------------------------------------------------------


def test_resize_short_reencodes_large_images_only(tmp_path):
    src = tmp_path / "src"
    make_tree(src, {"big": 3}, size=(120, 80))
    small = make_tree(src, {"small": 2}, size=(30, 40), ext="png")
    quiet_pack(src, tmp_path / "out", resize_short=50, workers=2)
    m = read_manifest(str(tmp_path / "out"))
    assert (m.pack["resize_short"], m.pack["resize_quality"]) == (50, 90)
    for key, ext, data, _ in shard_samples(tmp_path / "out"):
        img = Image.open(io.BytesIO(data))
        if key.startswith("big/"):
            assert (ext, img.format, img.size) == ("jpg", "JPEG", (75, 50))
        else:
            assert (ext, data) == ("png", small[key + ".png"])


# --- interruption ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_tree(tmp_path_factory):
    """Enough decode work (about a second) that a signal lands mid-pack, not after it."""
    src = tmp_path_factory.mktemp("slow") / "src"
    rng = np.random.default_rng(5)
    blobs = [image_bytes(rng, size=(256, 256)) for _ in range(4)]
    for c in range(4):
        os.makedirs(src / f"c{c}")
        for i in range(100):
            (src / f"c{c}" / f"{i:04d}.jpg").write_bytes(blobs[(c + i) % 4])
    return src


def _start_and_signal(src, out, sig) -> int:
    """Start a real pack, wait until it has finished a shard in staging, then send ``sig``."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardkit.cli",
            "pack",
            str(src),
            str(out),
            "-q",
            "--shard-size",
            "300kB",
            "--validate",
            "decode",
            "--resize-short",
            "200",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # SIGINT as a terminal's job has it, even under a runner that ignores it (nohup, &)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        text=True,
    )
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            staged = []
            for d in os.listdir(out) if os.path.isdir(out) else []:
                if d.startswith(STAGING_PREFIX):
                    try:
                        staged += os.listdir(os.path.join(out, d))
                    except FileNotFoundError:  # the pack finished meanwhile: asserted below
                        pass
            if "shard-000001.tar" in staged:  # shard 0 is complete
                break
            time.sleep(0.005)
        assert proc.poll() is None, "pack finished before the signal: make slow_tree slower"
        proc.send_signal(sig)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode


def _assert_nothing_final(out):
    names = os.listdir(out)
    assert "manifest.json" not in names
    assert [n for n in names if n.startswith("shard-")] == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_pack_leaves_nothing_final_and_rerun_succeeds(slow_tree, tmp_path, sig):
    out = tmp_path / "out"
    rc = _start_and_signal(slow_tree, out, sig)
    if sig == signal.SIGINT:
        assert rc == 130
        assert os.listdir(out) == []  # Ctrl-C also cleans up its staging directory
    else:
        assert rc == -signal.SIGKILL
        assert any(n.startswith(STAGING_PREFIX) for n in os.listdir(out))
    _assert_nothing_final(out)
    r = run_cli("pack", slow_tree, out, "-q", "--shard-size", "300kB")
    assert r.returncode == 0, r.stderr
    assert read_manifest(str(out)).num_samples == 400
    assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]


def test_sha256_in_manifest_matches_file(tree, tmp_path):
    src, _ = tree
    quiet_pack(src, tmp_path / "out", shard_size=4096)
    for s in read_manifest(str(tmp_path / "out")).shards:
        data = (tmp_path / "out" / s.path).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (s.bytes, s.sha256)


def test_scan_source_is_sorted_and_labelled(tree):
    src, files = tree
    scan = scan_source(str(src))
    assert scan.files == sorted(files)
    assert scan.labels.tolist() == [scan.classes.index(f.split("/")[0]) for f in scan.files]
    assert isinstance(scan.labels, np.ndarray)  # per-sample state in arrays, not lists


def test_all_images_bad_is_an_input_error(tmp_path):
    src = tmp_path / "src"
    os.makedirs(src / "a")
    (src / "a" / "x.jpg").write_bytes(b"junk")
    (src / "a" / "y.png").write_bytes(b"")
    with pytest.raises(
        InputError, match=r"none of its 2 images could be packed \(first: a/y.png: empty"
    ):
        quiet_pack(src, tmp_path / "out")
    assert os.listdir(tmp_path / "out") == []


def test_non_images_past_the_listing_limit_are_counted(tree, tmp_path, monkeypatch):
    pack_module = importlib.import_module("shardkit.scan.source")  # pack and FolderDataset

    src, files = tree
    monkeypatch.setattr(pack_module, "LIST_NON_IMAGES", 2)
    for i in range(4):  # no image shares their keys: not fields, just non-images
        (src / "cat" / f"notes_{i:04d}.json").write_text("{}")
    (src / "dog" / "Makefile").write_text("")
    report, _ = quiet_pack(src, tmp_path / "out")
    m = read_manifest(str(tmp_path / "out"))
    assert report.not_images == 5 and report.samples == len(files)
    assert [s.path for s in m.skipped] == ["cat/notes_0000.json", "cat/notes_0001.json"]
    assert m.pack["non_image_files"] == {"(none)": 1, ".json": 4}


@pytest.mark.slow  # the CLI in a child process
def test_bad_seed_and_unwritable_output(tree, tmp_path):
    src, _ = tree
    r = run_cli("pack", src, tmp_path / "out", "--seed", "-1")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: invalid seed -1; use an integer >= 0"
    ]
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="cannot create"):
        quiet_pack(src, tmp_path / "file" / "out")


def test_ctrl_c_after_the_renames_removes_the_moved_shards(tree, tmp_path, monkeypatch):
    """Ctrl-C once every shard is complete, as the manifest is written: nothing is left."""
    pack_module = importlib.import_module("shardkit.write.commit")  # a folder's commit is there

    src, files = tree
    out = tmp_path / "out"

    def interrupted(manifest, out_dir):
        assert len(shard_files(out_dir)) > 1  # every shard is complete (in staging, before commit)
        raise KeyboardInterrupt

    monkeypatch.setattr(pack_module, "write_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quiet_pack(src, out, shard_size=4096)
    assert os.listdir(out) == []
    monkeypatch.undo()
    report, _ = quiet_pack(src, out, shard_size=4096)
    assert report.samples == len(files)


def test_on_shard_reports_each_finished_shard_before_the_manifest(tree, tmp_path):
    """The hook remote uploads hang off: each shard complete (its final bytes) as it is done."""
    src, _ = tree
    out = tmp_path / "out"
    seen = []

    def on_shard(path):
        assert not (out / "manifest.json").exists()
        seen.append((os.path.basename(path), hashlib.sha256(open(path, "rb").read()).hexdigest()))

    report, _ = quiet_pack(src, out, shard_size=4096, on_shard=on_shard)
    manifest = json.loads((out / "manifest.json").read_text())
    assert report.shards > 2
    assert seen == [(s["path"], s["sha256"]) for s in manifest["shards"]]
