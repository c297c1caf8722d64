"""``shardkit index``: a manifest for tars written elsewhere, and what it buys."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import warnings

import pytest
from conftest import gnu_tar

from shardkit import Order, ShardDataset
from shardkit.errors import OutputError, ShardFormatError
from shardkit.formats.sample_index import sample_offset
from shardkit.formats.tar import iter_tar_records
from shardkit.manifest import INDEX_EVERY, read_manifest
from shardkit.write.index import index_shards
from shardkit.write.verify import verify

wds = pytest.importorskip("webdataset")


def _members(n: int, seed: int) -> list[tuple[str, bytes]]:
    """``n`` samples in the webdataset shape other tools write: image, class, caption; some long
    names, a metadata record up front."""
    rng = random.Random(seed)
    out = [("__meta__.json", b'{"source": "elsewhere"}')]
    for i in range(n):
        stem = f"part{seed}/{'x' * 120 if i % 17 == 0 else ''}s{i:05d}"
        out += [
            (f"{stem}.jpg", rng.randbytes(rng.randint(100, 3000))),
            (f"{stem}.cls", b"%d" % (i % 5)),
            (f"{stem}.json", b'{"i": %d}' % i),
        ]
    return out


def _tarfile(out, members) -> str:
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(out)


@pytest.fixture
def foreign(tmp_path):
    """A directory of tars from three writers, one of them gzip-compressed."""
    d = tmp_path / "shards"
    d.mkdir()
    if shutil.which("tar"):
        gnu_tar(tmp_path / "t0", d / "a-000.tar", _members(150, 0))
    else:
        _tarfile(d / "a-000.tar", _members(150, 0))
    _tarfile(d / "a-001.tar", _members(70, 1))
    plain = _tarfile(tmp_path / "c.tar", _members(20, 2))
    (d / "a-002.tar.gz").write_bytes(gzip.compress(open(plain, "rb").read()))
    return d


def test_index_then_verify_and_stream(foreign):
    with pytest.warns(RuntimeWarning, match="3 records without an image member"):
        (result,) = index_shards([foreign])
    assert result.manifest_path == str(foreign / "manifest.json")
    m = read_manifest(str(foreign))
    assert [e.path for e in m.shards] == ["a-000.tar", "a-001.tar", "a-002.tar.gz"]
    assert [e.samples for e in m.shards] == [150, 70, 20]
    assert m.classes == ["0", "1", "2", "3", "4"] and m.fields == {"json": 240}
    for e in m.shards:
        data = (foreign / e.path).read_bytes()
        assert e.bytes == len(data)
        import hashlib

        assert e.sha256 == hashlib.sha256(data).hexdigest()
    # the plain tars' offsets are in their sample indexes, the gzip one cannot seek: the
    # manifest lists no offsets of its own
    assert [bool(e.index_sha256) for e in m.shards] == [True, True, False]
    assert '"index"' not in (foreign / "manifest.json").read_text()
    assert all(e.index == () for e in m.shards)
    report = verify(str(foreign))
    assert report.ok, report.bad
    assert verify(str(foreign), decode=False).samples == 240
    # ShardDataset now takes counts from the manifest: no header pass, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = ShardDataset(str(foreign), decode="raw", order=Order(shuffle=False), with_keys=True)
    assert len(ds) == 240 and ds.classes == m.classes
    theirs = [
        (s["__key__"], s["jpg"], int(s["cls"]))
        for s in wds.WebDataset(
            [str(foreign / e.path) for e in m.shards], shardshuffle=False, empty_check=False
        )
        if "jpg" in s
    ]
    assert [(k, img, label) for img, label, k in ds] == theirs


def test_index_offsets_seek_to_the_right_sample(foreign):
    with pytest.warns(RuntimeWarning):
        index_shards([foreign])
    entry = read_manifest(str(foreign)).shards[0]
    path = str(foreign / entry.path)
    every = list(iter_tar_records(path))
    raw = open(path, "rb").read()
    facts = (entry.samples, entry.bytes, entry.sha256, entry.index_sha256)
    for start in (5, INDEX_EVERY + 5, 2 * INDEX_EVERY + 5, entry.samples - 1):
        offset = sample_offset(path, start, *facts)  # from the index the manifest checks
        assert raw[offset + 257 : offset + 262] == b"ustar"  # a header starts there
        got = list(iter_tar_records(path, start=start, stop=start + 3, at=offset))
        assert [r.key for r in got] == [r.key for r in every[start : start + 3]]
    # through the dataset: three workers starting mid-shard read, together, the whole epoch
    from shardkit.formats import get_format
    from shardkit.stream.stages import read_slices
    from shardkit.stream.world import World

    ds = ShardDataset(str(foreign), decode="raw", order=Order(shuffle=False), with_keys=True)
    parts = [
        [
            r.key
            for r in read_slices(
                ds.plan(World(0, 1, w, 3)), ds.shards, get_format("tar"), ds.storage
            )
        ]
        for w in range(3)
    ]
    assert sum(parts, []) == [k for _, _, k in ds]
    assert ds.plan(World(0, 1, 1, 3))[0].start == 80  # worker 1 starts mid-shard: seeks


@pytest.mark.slow  # the CLI in a child process
def test_index_refuses_an_existing_manifest_unless_overwrite(foreign):
    with pytest.warns(RuntimeWarning):
        index_shards([foreign])
    before = (foreign / "manifest.json").read_bytes()
    with pytest.raises(OutputError, match=r"manifest\.json already exists.*overwrite=True"):
        index_shards([foreign])
    assert (foreign / "manifest.json").read_bytes() == before
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "index", str(foreign), "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "index", str(foreign), "--overwrite", "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "indexed 3 shards: 240 samples" in proc.stdout
    assert json.loads((foreign / "manifest.json").read_text())["num_samples"] == 240


def test_a_damaged_tar_leaves_no_manifest_and_no_temp_file(foreign):
    data = (foreign / "a-001.tar").read_bytes()
    (foreign / "a-001.tar").write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardFormatError, match=r"a-001\.tar: truncated tar"):
        index_shards([foreign])
    assert sorted(os.listdir(foreign)) == ["a-000.tar", "a-001.tar", "a-002.tar.gz"]


def test_verify_catches_a_foreign_tar_changed_after_indexing(foreign):
    with pytest.warns(RuntimeWarning):
        index_shards([foreign / "a-001.tar"])  # one file: the manifest lists only it
    assert [e.path for e in read_manifest(str(foreign)).shards] == ["a-001.tar"]
    with open(foreign / "a-001.tar", "r+b") as f:
        f.seek(1024 + 100)
        f.write(b"!")
    report = verify(str(foreign))
    assert not report.ok and "sha256" in str(report.bad[0])


def test_shards_in_two_directories_get_one_manifest_each(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    a = _tarfile(tmp_path / "x" / "a.tar", _members(5, 0)[1:])
    b = _tarfile(tmp_path / "y" / "b.tar", _members(9, 1)[1:])
    results = index_shards([a, b])
    assert [r.manifest_path for r in results] == [
        str(tmp_path / "x" / "manifest.json"),
        str(tmp_path / "y" / "manifest.json"),
    ]
    assert all(r.manifest.classes == ["0", "1", "2", "3", "4"] for r in results)
    ds = ShardDataset([a, b], decode="raw")  # both manifests: same class list, exact counts
    assert len(ds) == 14 and ds.classes == ["0", "1", "2", "3", "4"]


def test_tars_without_labels_index_with_no_classes_and_verify(tmp_path):
    (tmp_path / "d").mkdir()
    members = [(f"s{i}.png", b"p" * (i + 1)) for i in range(10)]
    _tarfile(tmp_path / "d" / "n.tar", members)
    (r,) = index_shards([tmp_path / "d"])
    assert r.manifest.classes == []
    assert verify(str(tmp_path / "d")).ok
    assert {label for _, label in ShardDataset(str(tmp_path / "d"), decode="raw")} == {-1}


def test_index_counts_fields_as_the_pack_did_and_a_merge_adds_them_up(tmp_path):
    from PIL import Image

    from shardkit import pack
    from shardkit.write.merge import merge

    want = {"seg.png": 4, "txt": 8}
    for name, stem in (
        ("a", "x"),
        ("b", "y"),
    ):  # two datasets: other keys (a merge refuses one twice)
        src = tmp_path / f"src-{name}"
        for c in ("cat", "dog"):
            (src / c).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (8, 6), (40 * i, 9, 0)).save(src / c / f"{stem}{i}.jpg")
                (src / c / f"{stem}{i}.txt").write_text(f"a {c}")
                if i % 2:
                    (src / c / f"{stem}{i}.seg.png").write_bytes(b"\x89PNG mask")
        packed = tmp_path / f"packed-{name}"
        pack(str(src), str(packed), shard_size="12kB", progress=False, validate="none")
        assert read_manifest(str(packed)).fields == want
        (tmp_path / name).mkdir()
        for s in read_manifest(str(packed)).shards:  # the shards alone: index counts the fields
            shutil.copy(packed / s.path, tmp_path / name / s.path)
        (r,) = index_shards([tmp_path / name])
        assert r.manifest.fields == want and read_manifest(str(tmp_path / name)).fields == want
    merge([tmp_path / "a", tmp_path / "b"], tmp_path / "merged")
    assert read_manifest(str(tmp_path / "merged")).fields == {"seg.png": 8, "txt": 16}


def test_samples_without_a_label_index_as_minus_one_beside_labelled_ones(tmp_path):
    (tmp_path / "d").mkdir()
    members = [("a.png", b"p"), ("a.cls", b"1"), ("b.png", b"q"), ("c.png", b"r"), ("c.cls", b"-1")]
    _tarfile(tmp_path / "d" / "m.tar", members)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # -1 is "no label", not a label outside the classes
        (r,) = index_shards([tmp_path / "d"])
    assert r.manifest.classes == ["0", "1"] and verify(str(tmp_path / "d")).ok
    ds = ShardDataset(str(tmp_path / "d"), decode="raw", with_keys=True, order=Order(shuffle=False))
    assert [(k, label) for _, label, k in ds] == [("a", 1), ("b", -1), ("c", -1)]


def test_index_append_adds_only_the_new_tars_and_refuses_a_key_twice(foreign, tmp_path):
    from click.testing import CliRunner

    from shardkit.cli import main
    from shardkit.errors import InputError

    with pytest.warns(RuntimeWarning):
        index_shards([foreign])
    before = read_manifest(str(foreign))
    _tarfile(foreign / "a-003.tar", _members(30, 3))  # dropped in later
    r = CliRunner().invoke(main, ["index", str(foreign), "-q"])
    assert r.exit_code == 2 and "does not list a-003.tar: --append adds" in r.output
    assert "--overwrite (--overwrite)" not in r.output and r.output.count("--overwrite") == 1
    old = [os.path.realpath(foreign / s.path) for s in before.shards]
    opened = []

    def hook(event, args):
        if event == "open" and isinstance(args[0], str):
            opened.append(os.path.realpath(args[0]))

    sys.addaudithook(hook)  # growth reads the new tar and the old indexes, not the old tars
    try:
        (result,) = quiet_index([foreign], append=True)
    finally:
        opened.append(None)  # the hook stays (it cannot be removed): stop counting here
    opened = opened[: opened.index(None)]
    assert os.path.realpath(foreign / "a-003.tar") in opened  # read whole: counted, hashed
    # a compressed tar has no index (it cannot seek): its keys come from its headers
    assert set(opened) & set(old) == {os.path.realpath(foreign / "a-002.tar.gz")}
    assert result.added == 1 and "added 1 shard" in result.summary()
    m = read_manifest(str(foreign))
    assert m.shards[:3] == before.shards and m.shards[3].path == "a-003.tar"
    assert m.num_samples == before.num_samples + 30 and m.classes == before.classes
    assert verify(str(foreign)).ok
    keys = [k for _, _, k in ShardDataset(str(foreign), decode="raw", with_keys=True)]
    assert len(keys) == 270 == len(set(keys))
    (again,) = quiet_index([foreign], append=True)  # nothing new: nothing written
    assert again.added == 0 and read_manifest(str(foreign)) == m
    _tarfile(foreign / "a-004.tar", _members(5, 1))  # the keys of a-001.tar again
    with pytest.raises(InputError, match=r"a-004.tar: 5 of the new shards' keys are in .* already"):
        quiet_index([foreign], append=True)
    assert read_manifest(str(foreign)) == m


def quiet_index(paths, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return index_shards(paths, **kw)
