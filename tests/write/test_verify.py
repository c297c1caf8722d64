"""shardkit info / verify on real packed shards, good and damaged."""

from __future__ import annotations

import hashlib
import io
import json
import os
import warnings

import numpy as np
import pytest
from conftest import run_cli
from PIL import Image

from shardkit.errors import ManifestError
from shardkit.manifest import read_manifest
from shardkit.sizes import size_text
from shardkit.write.packer import pack
from shardkit.write.verify import dataset_info, verify


def _tree(root, classes: dict[str, int], seed=0) -> int:
    rng = np.random.default_rng(seed)
    n = 0
    for cls, count in classes.items():
        os.makedirs(os.path.join(root, cls))
        for i in range(count):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(buf, "JPEG")
            with open(os.path.join(root, cls, f"{i:03d}.jpg"), "wb") as f:
                f.write(buf.getvalue())
            n += 1
    return n


def _pack(src, out, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pack(str(src), str(out), progress=False, **kw)


@pytest.fixture(params=["tar", "lmdb"])
def packed(request, tmp_path):
    src = tmp_path / "src"
    n = _tree(src, {f"class_{c}": 6 for c in range(7)})
    out = tmp_path / "out"
    _pack(src, out, format=request.param, shard_size=8192 if request.param == "tar" else 96_000)
    assert len(read_manifest(str(out)).shards) >= 3
    return out, n


def test_verify_good_dataset(packed):
    out, n = packed
    report = verify(str(out), decode=True)
    assert report.ok and report.bad == []
    assert (report.samples, report.decoded) == (n, n)
    r = run_cli("verify", out, "--decode", "-q")
    assert r.returncode == 0, r.stderr
    m = read_manifest(str(out))
    assert r.stdout.strip() == (
        f"OK: {len(m.shards)} shards, {n} samples, {m.total_bytes / 1e6:.1f} MB in {out} "
        "(size, sha256, sample count, decoded every image)"
    )


def test_verify_names_every_bad_shard(packed):
    out, _ = packed
    shards = read_manifest(str(out)).shards
    flipped, cut, gone = (str(out / s.path) for s in shards[:3])
    with open(flipped, "r+b") as f:  # one byte inside an image: only the checksum can tell
        f.seek(shards[0].bytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(cut, "r+b") as f:
        f.truncate(shards[1].bytes // 2)
    os.unlink(gone)
    report = verify(str(out))
    assert not report.ok
    bad = {b.path: b.problems for b in report.bad}
    assert sorted(bad) == sorted(s.path for s in shards[:3])
    assert bad[shards[0].path] == ["sha256 differs from the manifest"]
    assert bad[shards[1].path][:2] == [
        f"size {shards[1].bytes // 2} bytes, manifest says {shards[1].bytes}",
        "sha256 differs from the manifest",
    ]
    assert len(bad[shards[1].path]) == 3  # and the reader fails or finds too few samples
    assert bad[shards[2].path] == ["missing"]

    r = run_cli("verify", out, "-q")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"BAD {s.path}" for s in shards[:3]]
    assert r.stderr.splitlines() == [
        f"error: 3 of {len(shards)} shards in {out} failed verification: "
        + ", ".join(s.path for s in shards[:3])
        + "; re-copy them or re-pack"
    ]


def test_verify_decode_finds_images_that_do_not_decode(tmp_path):
    src = tmp_path / "src"
    _tree(src, {"a": 4})
    (src / "a" / "fake.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 100 + b"\xff\xd9")
    _pack(src, tmp_path / "out", validate="none")
    assert verify(str(tmp_path / "out")).ok  # bytes match the manifest ...
    report = verify(str(tmp_path / "out"), decode=True)  # ... but one image is not an image
    assert [b.path for b in report.bad] == ["shard-000000.tar"]
    assert "image does not decode (sample 'a/fake'" in report.bad[0].problems[0]


def test_verify_detects_wrong_sample_count(tmp_path):
    src = tmp_path / "src"
    _tree(src, {"a": 3})
    _pack(src, tmp_path / "out")
    path = tmp_path / "out" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["shards"][0]["samples"] = 4
    doc["num_samples"] = 4
    path.write_text(json.dumps(doc))
    report = verify(str(tmp_path / "out"))
    assert report.bad[0].problems == ["3 samples, manifest says 4"]


def test_info_text_and_json(packed):
    out, n = packed
    m = read_manifest(str(out))
    r = run_cli("info", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"format:   {m.shard_format}",
        f"shards:   {len(m.shards)}",
        f"samples:  {n}",
        f"bytes:    {m.total_bytes} ({size_text(m.total_bytes)})",
        "classes:  7 (class_0, class_1, class_2, class_3, class_4, ...)",
        "fields:   none",
        "skipped:  0",
        f"manifest: {out / 'manifest.json'}",
    ]
    r = run_cli("info", out, "--json")
    doc = json.loads(r.stdout)
    assert doc == dataset_info(str(out))
    assert (doc["shards"], doc["samples"], doc["num_classes"]) == (len(m.shards), n, 7)
    assert doc["classes"] == [f"class_{c}" for c in range(7)]
    assert doc["format"] == m.shard_format and doc["bytes"] == m.total_bytes


def test_info_and_verify_without_manifest(tmp_path):
    with pytest.raises(ManifestError):
        verify(str(tmp_path))
    for cmd in ("info", "verify"):
        r = run_cli(cmd, tmp_path)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert r.stderr.splitlines() == [
            f"error: {tmp_path / 'manifest.json'}: no manifest; pack the folder with "
            "`shardkit pack`"
        ]


def _flip(path, at) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_verify_checks_each_sample_index_against_the_manifest_and_the_headers(tmp_path):
    src = tmp_path / "src"
    _tree(src, {f"class_{c}": 6 for c in range(4)})
    out = tmp_path / "out"
    _pack(src, out, shard_size=8192)
    shards = read_manifest(str(out)).shards
    assert len(shards) >= 4 and all(len(s.index_sha256) == 64 for s in shards)
    gone, flipped, stale, swapped = (str(out / s.path) + ".idx" for s in shards[:4])
    os.unlink(gone)
    _flip(flipped, 60)
    # rewritten with a matching sha256 in the manifest, but not what the headers give
    doc = json.loads((out / "manifest.json").read_text())
    other = open(swapped, "rb").read()
    with open(stale, "wb") as f:
        f.write(other)
    doc["shards"][2]["index_sha256"] = __import__("hashlib").sha256(other).hexdigest()
    doc["shards"][3]["columns_sha256"] = "0" * 64  # the index as written, its columns' digest not
    (out / "manifest.json").write_text(json.dumps(doc))
    report = verify(str(out))
    bad = {b.path: " ".join(b.problems) for b in report.bad}
    assert sorted(bad) == [s.path for s in shards[:4]]
    assert bad[shards[3].path].startswith(f"sample index {shards[3].path}.idx: the sha256 of its ")
    assert "columns_sha256" in bad[shards[3].path] and "damaged" not in bad[shards[3].path]
    fix = f"rebuild it with `shardkit index {out}`"
    assert bad[shards[0].path] == f"sample index {shards[0].path}.idx missing; {fix}"
    assert "sha256 differs from the manifest" in bad[shards[1].path]
    assert "damaged or stale" in bad[shards[1].path] and fix in bad[shards[1].path]
    assert "sha256 differs" not in bad[shards[2].path]
    assert "damaged or stale" in bad[shards[2].path]
    r = run_cli("verify", out, "-q")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"BAD {shards[0].path}: sample index" in r.stdout
    from shardkit.write.index import index_shards

    index_shards([str(out)])  # the fix it names
    assert verify(str(out)).ok


def test_verify_passes_an_older_pack_without_indexes_and_checks_one_it_has(tmp_path):
    src = tmp_path / "src"
    _tree(src, {"a": 5})
    out = tmp_path / "out"
    _pack(src, out)
    doc = json.loads((out / "manifest.json").read_text())
    for s in doc["shards"]:
        del s["index_sha256"]  # as the previous release wrote it
    (out / "manifest.json").write_text(json.dumps(doc))
    assert verify(str(out)).ok  # its index still matches the headers
    _flip(str(out / "shard-000000.tar.idx"), 60)
    (problem,) = verify(str(out)).bad
    assert "damaged or stale" in problem.problems[0]
    os.unlink(out / "shard-000000.tar.idx")
    assert verify(str(out)).ok  # none listed, none there: nothing to check


def test_verify_passes_the_previous_releases_version_1_indexes(tmp_path):
    from conftest import as_previous_release

    src = tmp_path / "src"
    _tree(src, {"a": 5, "b": 4})
    out = tmp_path / "out"
    _pack(src, out, shard_size=8192)
    as_previous_release(out)
    assert verify(str(out)).ok
    idx = out / read_manifest(str(out)).shards[1].path
    _flip(str(idx) + ".idx", 80)  # an offset: the v1 index is still checked
    assert [b.path for b in verify(str(out)).bad] == [idx.name]


# --- the key file, manifest.keys ---------------------------------------------------------------


def _key_file(out) -> tuple[str, int]:
    """The key file's path and the dataset's sample count."""
    m = read_manifest(str(out))
    assert m.keys and m.keys["path"] == "manifest.keys"
    return str(out / m.keys["path"]), m.num_samples


def _flip_bit(path: str, at: int) -> None:
    data = bytearray(open(path, "rb").read())
    data[at] ^= 1
    open(path, "wb").write(data)


def _key_problem(out) -> str:
    """The one line verify gives the key file; the CLI prints it and exits non-zero."""
    report = verify(str(out))
    assert not report.ok and report.bad == [] and report.key_file is not None
    (said,) = report.key_file.problems
    assert "\n" not in said and ("delete it" in said or "missing" in said)
    r = run_cli("verify", out, "-q")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stdout.splitlines() == [f"BAD manifest.keys: {said}"]
    assert r.stderr.splitlines() == [
        f"error: the key file manifest.keys of {out} failed verification"
    ]
    return said


def test_verify_checks_the_key_file_its_manifest_lists(packed):
    out, _ = packed
    path, n = _key_file(out)
    good = open(path, "rb").read()
    assert verify(str(out)).ok
    _flip_bit(path, 56 + 8 * (n // 2))  # a hash
    assert _key_problem(out).startswith("its sha256 is not the manifest's; delete it (`rm ")
    with open(path, "r+b") as f:
        f.truncate(len(good) - 4)
    size = 56 + 12 * n + 16 * -(-n // 512)  # the columns and the block table
    assert _key_problem(out).startswith(f"not the {size} bytes of {n} samples; delete it")
    os.unlink(path)
    said = _key_problem(out)
    assert said.startswith("missing (the manifest lists it); `get(key)` and growth read every")
    assert "`shardkit pack --append` or `shardkit merge`" in said
    with open(path, "wb") as f:
        f.write(good)
    assert verify(str(out)).ok
    _flip_bit(path, 56 + 12 * n + 8)  # the block table: the first block's digest
    said = _key_problem(out)  # its sha256 (the file's) is not the manifest's
    assert said.startswith("its sha256 is not the manifest's; delete it")
    _vouch(out, path, n)  # the file's sha256 computed again: the table's is still listed
    assert _key_problem(out).startswith("its block table's sha256 is not the manifest's")
    doc = json.loads((out / "manifest.json").read_text())
    table = open(path, "rb").read()[56 + 12 * n :]
    doc["keys"]["blocks_sha256"] = hashlib.sha256(table).hexdigest()  # and the table's
    (out / "manifest.json").write_text(json.dumps(doc))
    assert _key_problem(out).startswith("its block table is not its columns' (from sample 0)")


def _vouch(out, path: str, n: int) -> None:
    """The manifest's key-file sha256 computed again from the file (as a tool that recomputes
    checksums from the files on disk would)."""
    from shardkit.formats.key_file import key_file_sha256

    doc = json.loads((out / "manifest.json").read_text())
    doc["keys"]["sha256"] = key_file_sha256(path, n)
    (out / "manifest.json").write_text(json.dumps(doc))


def test_verify_checks_the_key_files_columns_against_the_shards_keys(packed):
    """A key file whose checksums agree with wrong columns (recomputed after an edit) serves
    ``get(key)`` and growth: verify checks its columns against what the shards' keys give."""
    out, _ = packed
    path, n = _key_file(out)
    good = open(path, "rb").read()
    names = [e.path for e in read_manifest(str(out)).shards]
    hashes = np.frombuffer(good, "<u8", n, 56)
    shards = np.frombuffer(good, "<u4", n, 56 + 8 * n)
    i = int(np.flatnonzero(np.diff(hashes) > 2)[n // 3]) + 1  # a hash one can flip in order
    _flip_bit(path, 56 + 8 * i)
    _vouch(out, path, n)
    said = _key_problem(out)
    assert said.startswith(f"its hashes of {names[int(shards[i])]} are not that shard's keys'")
    # two samples of two shards with their shards exchanged: each shard's count still right
    j = int(np.flatnonzero(shards != shards[0])[0])
    swapped = bytearray(good)
    a, b = 56 + 8 * n + 4 * 0, 56 + 8 * n + 4 * j
    swapped[a : a + 4], swapped[b : b + 4] = good[b : b + 4], good[a : a + 4]
    with open(path, "wb") as f:
        f.write(swapped)
    _vouch(out, path, n)
    said = _key_problem(out)
    assert "are not that shard's keys'" in said and "(and 1 more shard)" in said
    # out of order
    unsorted = bytearray(good)
    unsorted[56 : 56 + 16] = good[64:72] + good[56:64]
    with open(path, "wb") as f:
        f.write(unsorted)
    _vouch(out, path, n)
    assert _key_problem(out).startswith("its hashes are out of order; delete it")


def test_verify_reads_every_run_of_a_grown_key_file(packed, tmp_path):
    """A dataset grown in place keeps its key file as runs (FORMAT.md, "Runs"): verify takes
    the runs together (a grown dataset is good) and names a run whose bytes changed."""
    out, _ = packed
    more = tmp_path / "more"
    _tree(more, {"class_9": 3}, seed=5)
    _pack(more, out, format=read_manifest(str(out)).shard_format, append=True)
    runs = read_manifest(str(out)).keys["runs"]
    assert len(runs) == 1
    assert verify(str(out)).ok
    _flip_bit(str(out / runs[0]["path"]), 56)  # the run's first hash
    said = _key_problem(out)
    assert said.startswith(f"its run {out / runs[0]['path']}: its sha256 is not the manifest's")
