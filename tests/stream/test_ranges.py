"""Subsets, splits and mixtures read each drawn sample's bytes exactly, through the sample
index: counted as bytes read from local files and as ranged GETs against the S3 server."""

from __future__ import annotations

import os
import uuid
import warnings

import numpy as np
import pytest
from PIL import Image

from shardkit.formats.sample_index import decode_index, index_path
from shardkit.manifest import read_manifest
from shardkit.remote.storage import RemoteStorage
from shardkit.stream.dataset import ShardDataset
from shardkit.stream.mix import Source
from shardkit.write.packer import pack


def _tree(root, n: int) -> str:
    rng = np.random.default_rng(0)
    for i in range(n):
        os.makedirs(os.path.join(root, f"c{i % 3}"), exist_ok=True)
        arr = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)
        Image.fromarray(arr).save(os.path.join(root, f"c{i % 3}", f"im{i:03d}.jpg"))
    return str(root)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """200 samples in shards of ~40, with sample indexes, and the same shards without them."""
    root = tmp_path_factory.mktemp("ranges")
    out = root / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pack(_tree(root / "src", 200), str(out), shard_size="60kB", progress=False)
    bare = root / "bare"
    bare.mkdir()
    for n in os.listdir(out):
        if not n.endswith(".idx"):
            os.link(out / n, bare / n)
    return out, bare


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _sizes(out) -> dict[str, int]:
    """Each sample's bytes in its shard (all its members), by key."""
    sizes = {}
    for e in read_manifest(str(out)).shards:
        shard = os.path.join(out, e.path)
        ix = decode_index(open(index_path(shard), "rb").read(), shard)
        for j, key in enumerate(ix.keys()):
            sizes[key] = int(ix.offsets[j + 1] - ix.offsets[j])
    return sizes


def _epoch(where, **kw):
    where = where if isinstance(where, Source) else str(where)
    ds = ShardDataset(where, decode="raw", with_keys=True, **kw)
    before = _rchar()
    keys = [s[2] for s in ds]
    return keys, _rchar() - before


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads through /proc")
@pytest.mark.parametrize(
    "kw", [{"subset": 0.05}, {"split": "val", "val_fraction": 0.05}], ids=["subset", "split"]
)
def test_an_epoch_of_a_few_samples_reads_about_their_bytes(packed, kw):
    out, bare = packed
    sizes = _sizes(out)
    _epoch(Source(out, **kw))  # the modules a first epoch imports are read once, not counted
    keys, read = _epoch(Source(out, **kw))
    slow_keys, slow_read = _epoch(Source(bare, **kw))
    assert keys == slow_keys and 0 < len(keys) < 30
    drawn = sum(sizes[k] for k in keys)
    assert read <= 2 * drawn  # without the indexes: windows of whole shards
    assert slow_read > 4 * drawn


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads through /proc")
def test_a_subset_of_up_to_half_of_each_shard_reads_about_its_samples_bytes(packed):
    """Slices that want up to half their shard are read as ranges (measured faster than the
    streamed shard with the unwanted dropped): a 30% subset reads about its drawn samples'
    bytes, not each shard whole (about 3.3 times them)."""
    out, _ = packed
    sizes = _sizes(out)
    keys, read = _epoch(Source(out, subset=0.3))
    drawn = sum(sizes[k] for k in keys)
    assert len(keys) == 60 and read <= 1.5 * drawn


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads through /proc")
def test_a_mixture_with_repeats_reads_each_drawn_sample_exactly(packed):
    out, bare = packed
    sizes = _sizes(out)
    mix = [Source(str(out), subset=0.02, weight=1.0), Source(str(out), subset=0.5, weight=1.0)]
    list(ShardDataset(mix, decode="raw", epoch_size=40))  # its imports read once, not counted
    ds = ShardDataset(mix, decode="raw", with_keys=True, epoch_size=40)
    before = _rchar()
    keys = [s[2] for s in ds]
    read = _rchar() - before
    slow = ShardDataset(
        [Source(str(bare), subset=0.02, weight=1.0), Source(str(bare), subset=0.5, weight=1.0)],
        decode="raw",
        with_keys=True,
        epoch_size=40,
    )
    assert keys == [s[2] for s in slow] and len(keys) == 40
    assert read <= 2 * sum(sizes[k] for k in keys)


@pytest.mark.slow  # the S3 server
def test_a_subset_on_s3_is_one_ranged_get_per_run(s3, packed):
    pytest.importorskip("s3fs")
    from remote_servers import S3Server

    out, _ = packed
    name = f"ranges-{uuid.uuid4().hex[:10]}"
    s3.upload_dir(name, "tar", out)
    opts = S3Server.options(s3.endpoint)
    local = ShardDataset(Source(str(out), subset=0.05), decode="raw", with_keys=True)
    want = [s[2] for s in local]
    ds = ShardDataset(
        Source(f"s3://{name}/tar/", subset=0.05),
        storage=RemoteStorage(storage_options=opts),
        decode="raw",
        with_keys=True,
    )
    s3.log.clear()
    assert [s[2] for s in ds] == want
    shard_gets = s3.log.gets(".tar")
    ranged = [g for g in shard_gets if not g[1].endswith(".idx")]
    assert ranged and all(rng.startswith("bytes=") for _, _, rng in ranged)
    assert len(ranged) <= len(want)  # one GET per run of drawn samples, never a whole shard
    sizes = _sizes(out)
    spans = [int(r.split("-")[1]) - int(r.split("=")[1].split("-")[0]) + 1 for _, _, r in ranged]
    assert sum(spans) <= 2 * sum(sizes[k] for k in want)


def test_spans_join_nearby_samples_within_twice_their_bytes_and_the_cap():
    """A run of samples joins the span before it when the hole is at most ``gap`` and the span
    (its closing block counted) stays at most twice its samples' bytes; ``cap`` bounds a span;
    gap 0 (local reads): adjacent samples only, as before."""
    from shardkit.stream.ranges import spans

    starts = np.array([0, 1000, 2500, 4000, 10_000, 11_000])
    ends = np.array([1000, 2000, 3500, 5000, 11_000, 12_000])  # holes: 0, 500, 500, 5000, 0
    assert spans(starts, ends).tolist() == [0, 2, 3, 4]  # adjacent only
    assert spans(starts, ends, gap=600).tolist() == [0, 4]  # the 5000-byte hole > 600
    assert spans(starts, ends, gap=10_000).tolist() == [0, 4]  # 12,512 read > 2 x 6,000 drawn
    assert spans(starts, ends, gap=400).tolist() == [0, 2, 3, 4]
    assert spans(starts, ends, gap=600, cap=3000).tolist() == [0, 2, 4]  # 0-3500 > 3000
    assert spans(starts[:0], ends[:0], gap=600).tolist() == []


def _positions(out) -> dict[str, tuple[str, int, int, int]]:
    """Each sample's shard, place in it and bytes ``[start, end)``, by key."""
    where = {}
    for e in read_manifest(str(out)).shards:
        shard = os.path.join(out, e.path)
        ix = decode_index(open(index_path(shard), "rb").read(), shard)
        for j, key in enumerate(ix.keys()):
            where[key] = (e.path, j, int(ix.offsets[j]), int(ix.offsets[j + 1]))
    return where


def _runs(where, keys, gap: int) -> int:
    """The runs of nearby drawn samples: within a shard, a hole of at most ``gap`` bytes and
    at most the next drawn sample's bytes keeps the run going (reading it keeps the run's read
    within twice its drawn bytes)."""
    runs, last = 0, None
    for path, _, start, end in sorted(where[k] for k in keys):
        if last is None or last[0] != path or start - last[1] > min(gap, end - start):
            runs += 1
        last = (path, end)
    return runs


@pytest.mark.slow  # the HTTP server
@pytest.mark.parametrize(
    "kw", [{"subset": 0.3}, {"split": "val", "val_fraction": 0.3}], ids=["subset", "split"]
)
@pytest.mark.parametrize("gets", [1, 4])
def test_a_dense_epoch_over_http_is_one_get_per_run_of_nearby_samples(http, packed, kw, gets):
    """Nearby drawn samples share one ranged GET (the holes read and passed over): one GET a
    run of nearby samples, never more, the bytes read at most twice the drawn ones, the samples
    those of the local epoch; ``ranged_gap=0`` is one GET a run of adjacent samples, more."""
    out, _ = packed
    http.root = out.parent
    local = [
        (s[2], s[0]) for s in ShardDataset(Source(str(out), **kw), decode="raw", with_keys=True)
    ]
    keys = [k for k, _ in local]
    where = _positions(out)

    def remote(**opts):
        http.log.clear()
        ds = ShardDataset(
            Source(f"{http.url}/out/manifest.json", **kw),
            storage=RemoteStorage(prefetch=0, ranged_gets=gets, **opts),
            decode="raw",
            with_keys=True,
        )
        got = [(s[2], s[0]) for s in ds]
        ranged = [g[2] for g in http.log.gets(".tar") if g[2] and not g[1].endswith(".idx")]
        return got, ranged

    got, ranged = remote()
    assert got == local
    nearby = _runs(where, keys, 1 << 20)
    assert 0 < len(ranged) <= nearby  # (a shard that wants over half its samples streams)
    read = sum(int(r.split("-")[1]) - int(r.split("=")[1].split("-")[0]) + 1 for r in ranged)
    drawn = sum(where[k][3] - where[k][2] for k in keys)
    assert read <= 2 * drawn
    got, adjacent = remote(ranged_gap=0)
    assert got == local
    assert nearby < len(adjacent) <= _runs(where, keys, 0)


def test_a_stale_or_damaged_index_never_gives_another_sample_in_an_epoch(
    packed, tmp_path, monkeypatch
):
    from shardkit.stream import ranges

    monkeypatch.setattr(ranges, "RANGED_SHARE", 0.6)  # a half subset's slices read as ranges
    out, _ = packed
    copy = tmp_path / "copy"
    copy.mkdir()
    for n in os.listdir(out):
        os.link(out / n, copy / n)
    want = [s[2] for s in ShardDataset(Source(str(out), subset=0.1), decode="raw", with_keys=True)]
    a, b = (os.path.join(copy, e.path) for e in read_manifest(str(copy)).shards[:2])
    os.unlink(index_path(a))
    with open(index_path(b), "rb") as f:
        open(index_path(a), "wb").write(f.read())  # shard 0 gets shard 1's index: stale
    with pytest.warns(RuntimeWarning, match=r"shard-000000\.tar\.idx: stale sample index"):
        got = [
            s[2] for s in ShardDataset(Source(str(copy), subset=0.1), decode="raw", with_keys=True)
        ]
    assert got == want
    os.unlink(index_path(a))
    os.link(index_path(os.path.join(out, os.path.basename(a))), index_path(a))  # good again
    data = bytearray(open(index_path(b), "rb").read())
    data[72 + 8 * 3 + 1] ^= 0x10  # one offset moved (a damaged byte): caught by the key hash
    os.unlink(index_path(b))
    open(index_path(b), "wb").write(bytes(data))
    with pytest.raises(Exception, match=r"shard-000001\.tar|order"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            [
                s[2]
                for s in ShardDataset(Source(str(copy), subset=0.5), decode="raw", with_keys=True)
            ]
