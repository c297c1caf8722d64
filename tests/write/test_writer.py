"""ShardWriter and pack from Python samples: real shards, real readers, real SIGKILLed writers."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap

import lmdb
import numpy as np
import pytest
import torch
from PIL import Image

import shardkit
from shardkit import Order, ShardDataset, ShardWriter, pack
from shardkit.errors import InputError, OutputError
from shardkit.formats import get_format
from shardkit.fsutil import HOST, STAGING_PREFIX
from shardkit.manifest import read_manifest


def jpeg(seed: int, size=(16, 12)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def records(out):
    m = read_manifest(str(out))
    fmt = get_format(m.shard_format)
    return [r for s in m.shards for r in fmt.iter_records(os.path.join(str(out), s.path))]


def final_names(out):
    return sorted(n for n in os.listdir(out) if not n.startswith("."))


# --- ShardWriter -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, limit", [("tar", 6000), ("lmdb", 60000)])
def test_writer_rolls_shards_and_round_trips_through_shard_dataset(tmp_path, fmt, limit):
    out = tmp_path / "out"
    images = {f"s{i:03d}": jpeg(i) for i in range(30)}
    size = f"{limit // 1000}kB"
    with ShardWriter(str(out), format=fmt, shard_size=size, classes=list("abc")) as w:
        for i, (key, data) in enumerate(images.items()):
            w.write(key, data, i % 3, json={"i": i}, txt=f"caption {i}")
    m = read_manifest(str(out))
    assert len(m.shards) > 2 and m.num_samples == 30 and m.classes == ["a", "b", "c"]
    assert all(s.bytes <= limit for s in m.shards)
    assert w.report.samples == 30 and w.report.manifest_path == str(out / "manifest.json")
    indexes = [s.path + ".idx" for s in m.shards if s.path.endswith(".tar")]
    listed = [s.path for s in m.shards] + indexes + ["manifest.json", "manifest.keys"]
    assert final_names(out) == sorted(listed)
    ds = ShardDataset(str(out), decode="raw", with_keys=True)
    got = {key: (bytes(img), label) for img, label, key in ds}
    assert got == {k: (d, i % 3) for i, (k, d) in enumerate(images.items())}


def test_writer_extra_fields_are_tar_members_webdataset_reads(tmp_path):
    import webdataset as wds

    out = tmp_path / "out"
    with ShardWriter(out, shard_size="1MB") as w:
        w.write("a/x", jpeg(1), 0, json={"k": [1, 2]}, txt="hello", score=0.5)
        w.write("a/y", jpeg(2), 1, json={"k": []}, txt="bye", score=2)
    shard = str(out / read_manifest(str(out)).shards[0].path)
    with tarfile.open(shard) as tf:
        names = tf.getnames()
    assert names == ["a/x.jpg", "a/x.cls", "a/x.json", "a/x.txt", "a/x.score"] + [
        "a/y.jpg",
        "a/y.cls",
        "a/y.json",
        "a/y.txt",
        "a/y.score",
    ]
    samples = list(wds.WebDataset([shard], shardshuffle=False, empty_check=False))
    assert [json.loads(s["json"]) for s in samples] == [{"k": [1, 2]}, {"k": []}]
    assert [(s["txt"], s["score"], s["cls"]) for s in samples] == [
        (b"hello", b"0.5", b"0"),
        (b"bye", b"2", b"1"),
    ]
    assert [r.key for r in records(out)] == ["a/x", "a/y"]  # our reader: extra fields ride along
    ds = ShardDataset(
        str(out), decode="raw", with_keys=True, fields=("json", "txt"), order=Order(shuffle=False)
    )
    assert [(k, json.loads(j), t) for _, _, k, j, t in ds] == [
        ("a/x", {"k": [1, 2]}, b"hello"),
        ("a/y", {"k": []}, b"bye"),
    ]


def test_writer_extra_fields_in_lmdb_sit_outside_the_sample_keys(tmp_path):
    out = tmp_path / "out"
    with ShardWriter(out, format="lmdb") as w:
        for i in range(3):
            w.write(f"k{i}", jpeg(i), i, json={"i": i})
    path = str(out / read_manifest(str(out)).shards[0].path)
    env = lmdb.open(path, subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.get(b"+0000000002.json") == b'{"i": 2}'
        keys = [k for k, _ in txn.cursor()]
    env.close()
    assert keys[:3] == [b"+0000000000.json", b"+0000000001.json", b"+0000000002.json"]
    assert [(r.key, r.label) for r in records(out)] == [("k0", 0), ("k1", 1), ("k2", 2)]


def test_writer_refuses_bad_keys_fields_labels_and_bytes(tmp_path):
    with ShardWriter(tmp_path / "out") as w:
        with pytest.raises(InputError, match=r"key='x\.jpg'.*encode_key"):
            w.write("x.jpg", jpeg(0), 0)
        with pytest.raises(InputError, match="not an encoded image"):
            w.write("x", b"plain text", 0)
        with pytest.raises(InputError, match="field name 'cls'"):
            w.write("x", jpeg(0), 0, cls=3)
        with pytest.raises(InputError, match="label=-2"):
            w.write("x", jpeg(0), -2)
        w.write("x", jpeg(0), 0)
    assert read_manifest(str(tmp_path / "out")).num_samples == 1


def test_label_minus_one_is_a_sample_without_a_label(tmp_path):
    with ShardWriter(tmp_path / "out") as w:
        w.write("x", jpeg(0), -1, txt="a caption")
    m = read_manifest(str(tmp_path / "out"))
    with tarfile.open(str(tmp_path / "out" / m.shards[0].path)) as tf:
        assert tf.getnames() == ["x.jpg", "x.txt"]  # no .cls member
    assert m.classes == [] and m.fields == {"txt": 1}
    ds = ShardDataset(str(tmp_path / "out"), decode="raw", fields=("txt",))
    assert [(label, txt) for _, label, txt in ds] == [(-1, b"a caption")]


def test_writer_exception_leaves_no_final_name(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="producer died"):
        with ShardWriter(out, shard_size="5kB") as w:
            for i in range(20):
                w.write(f"k{i}", jpeg(i), 0)
            assert len(w._entries) > 1  # several shards were complete
            raise RuntimeError("producer died")
    assert os.listdir(out) == []
    with ShardWriter(out) as w:  # the output is free again (lock released)
        w.write("k", jpeg(0), 0)
    assert final_names(out) == [
        "manifest.json",
        "manifest.keys",
        "shard-000000.tar",
        "shard-000000.tar.idx",
    ]


_KILLED_WRITER = textwrap.dedent(
    """
    import io, sys, time
    import numpy as np
    from PIL import Image
    from shardkit import ShardWriter

    def jpeg(seed):
        buf = io.BytesIO()
        rng = np.random.default_rng(seed)
        Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(buf, "JPEG")
        return buf.getvalue()

    with ShardWriter(sys.argv[1], shard_size="5kB") as w:
        for i in range(20):
            w.write(f"k{i}", jpeg(i), 0)
        print(len(w._entries), flush=True)  # shards complete in staging
        time.sleep(120)
    """
)


def test_sigkilled_writer_leaves_no_final_name_and_the_next_one_cleans_up(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert int(proc.stdout.readline()) > 1
        staged = [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]
        # the owner's host and pid: stale detection by pid alone is wrong across machines
        assert staged == [f"{STAGING_PREFIX}{HOST}-{proc.pid}-{staged[0].rsplit('-', 1)[1]}"]
        assert len(os.listdir(out / staged[0])) > 1
        with pytest.raises(OutputError, match=f"{out}.* in use by another shardkit writer"):
            ShardWriter(out)  # live owner: refused at once, its files untouched
        assert os.listdir(out) == staged
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert final_names(out) == []
    with pytest.raises(shardkit.ManifestError, match="no manifest"):
        read_manifest(str(out))
    with ShardWriter(out) as w:  # owner dead and we hold the lock: its staging is removed
        w.write("k", jpeg(0), 0)
    assert sorted(os.listdir(out)) == [
        "manifest.json",
        "manifest.keys",
        "shard-000000.tar",
        "shard-000000.tar.idx",
    ]


# --- pack from Python samples ------------------------------------------------------------------


def _as_kinds(n: int):
    """Every accepted image kind: encoded bytes, PIL, HWC uint8 array, CHW uint8 tensor."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        arr = rng.integers(0, 256, (10, 14, 3), dtype=np.uint8)
        kind = i % 4
        if kind == 0:
            img = jpeg(i, size=(14, 10))
        elif kind == 1:
            img = Image.fromarray(arr)
        elif kind == 2:
            img = arr
        else:
            img = torch.from_numpy(arr).permute(2, 0, 1).contiguous()
        out.append((img, i % 3))
    return out


def test_pack_a_list_of_samples_round_trips(tmp_path):
    samples = _as_kinds(12)
    report = pack(samples, tmp_path / "out", shuffle=False, progress=False, workers=2)
    assert (report.samples, report.classes) == (12, 3)
    m = read_manifest(str(tmp_path / "out"))
    assert m.classes == ["0", "1", "2"] and m.pack["shuffle"] is False
    ds = ShardDataset(str(tmp_path / "out"), decode="raw", with_keys=True)
    got = sorted((key, label, bytes(img)[:3]) for img, label, key in ds)
    assert [(k, y) for k, y, _ in got] == [(f"{i:09d}", i % 3) for i in range(12)]
    assert all(head == b"\xff\xd8\xff" for *_, head in got)  # every kind became a JPEG
    first = next(r for r in records(tmp_path / "out") if r.key == "000000000")
    assert first.data == samples[0][0]  # encoded bytes are kept as they are
    decoded = ShardDataset(str(tmp_path / "out"), decode="tensor", with_keys=True)
    shapes = {tuple(img.shape) for img, _, _ in decoded}
    assert shapes == {(3, 10, 14)}


class _MapDataset(torch.utils.data.Dataset):
    classes = ["cat", "dog"]

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        arr = np.full((8, 8, 3), i * 10, dtype=np.uint8)
        return torch.from_numpy(arr).permute(2, 0, 1), torch.tensor(i % 2)


def test_pack_a_torch_dataset_round_trips_in_the_shuffled_order(tmp_path):
    report = pack(_MapDataset(20), tmp_path / "out", shard_size="3kB", progress=False, seed=1)
    m = read_manifest(str(tmp_path / "out"))
    assert report.samples == 20 and len(m.shards) > 1 and m.classes == ["cat", "dog"]
    order = np.random.default_rng(1).permutation(20).tolist()
    assert [int(r.key) for r in records(tmp_path / "out")] == order  # shuffled once, seeded
    ds = ShardDataset(str(tmp_path / "out"), decode="tensor", with_keys=True)
    for img, label, key in ds:
        i = int(key)
        assert label == i % 2 and abs(int(img.float().mean()) - i * 10) <= 2


def test_pack_an_iterator_skips_unusable_samples(tmp_path):
    def gen():
        yield jpeg(0), 0
        yield b"not an image", 1
        yield np.zeros((4, 4, 3), dtype=np.float32), 1
        yield jpeg(3), 1

    with pytest.warns(shardkit.write.packer.PackWarning, match="skipped 2 .* keys"):
        report = pack(gen(), tmp_path / "out", progress=False)
    reasons = {s.path: s.reason for s in read_manifest(str(tmp_path / "out")).skipped}
    assert report.samples == 2 and set(reasons) == {"000000001", "000000002"}
    assert "uint8" in reasons["000000002"]
    with pytest.raises(InputError, match=r"sample 1 of <generator>: unusable .*on_error"):
        pack(gen(), tmp_path / "out2", progress=False, on_error="raise")
    assert final_names(tmp_path / "out2") == []
