"""The sample index beside each tar shard: written by every writer with the same bytes, read
back exactly, and refused by name when damaged or stale (readers then walk the headers)."""

from __future__ import annotations

import hashlib
import os
import warnings

import numpy as np
import pytest
from conftest import as_previous_release, quiet, random_tree, without_index_sha256

from shardkit import Order, Source
from shardkit.formats.sample_index import (
    SampleIndexError,
    build_index,
    decode_index,
    index_path,
    key_hashes,
    load_index,
)
from shardkit.formats.tar.tally import tally_tar
from shardkit.manifest import read_manifest
from shardkit.stream.mix import split_members
from shardkit.write.engines import LocalRunner
from shardkit.write.index import index_shards
from shardkit.write.merge import merge
from shardkit.write.packer import pack
from shardkit.write.writer import ShardWriter


def indexes(out) -> dict[str, bytes]:
    return {
        n: open(os.path.join(out, n), "rb").read()
        for n in sorted(os.listdir(out))
        if n.endswith(".idx")
    }


def check_all(out) -> None:
    """Every tar shard the manifest lists has the index its headers give, read back exactly."""
    m = read_manifest(str(out))
    for e in m.shards:
        shard = os.path.join(out, e.path)
        data = open(index_path(shard), "rb").read()
        assert data == build_index(shard, e.bytes, e.sha256)
        assert e.index_sha256 == hashlib.sha256(data).hexdigest()  # the manifest covers it
        ix = decode_index(data, shard)
        tally = tally_tar(shard, every=1, keys=True)
        assert ix.keys() == tally.keys and ix.samples == e.samples
        assert ix.offsets.tolist() == [*tally.index, e.bytes - 1024]
        assert ix.hashes.tolist() == key_hashes(tally.keys).tolist()


@pytest.fixture
def src(tmp_path):
    return random_tree(tmp_path / "src", 40)


def test_pack_writes_an_index_per_shard_equal_to_the_headers(src, tmp_path):
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    assert len(indexes(out)) == len(read_manifest(str(out)).shards) > 2
    check_all(out)
    again = tmp_path / "again"
    quiet(pack, src, str(again), shard_size="6kB", progress=False)
    assert indexes(again) == indexes(out)  # byte-identical like the shards


def test_engines_append_merge_and_writer_give_the_same_index_bytes(src, tmp_path):
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    local = tmp_path / "local"
    quiet(pack, src, str(local), shard_size="6kB", progress=False, runner=LocalRunner(2))
    assert indexes(local) == indexes(out)
    more = random_tree(tmp_path / "more", 12, seed=1, prefix="x")
    before = indexes(out)
    quiet(pack, more, str(out), shard_size="6kB", progress=False, append=True)
    after = indexes(out)
    assert {k: after[k] for k in before} == before and len(after) > len(before)
    check_all(out)
    merged = tmp_path / "merged"
    other = tmp_path / "other"
    quiet(pack, more, str(other), shard_size="6kB", progress=False)
    as_previous_release(other)  # an older pack: version-1 indexes, rebuilt as version 2
    os.remove(index_path(os.path.join(other, "shard-000000.tar")))  # one missing: built
    quiet(merge, [str(local), str(other)], str(merged))
    check_all(merged)
    w_out = tmp_path / "writer"
    with ShardWriter(str(w_out), shard_size="1MB") as w:
        w.write("a/k1", open(os.path.join(src, "c0", "im000.jpg"), "rb").read(), 0)
    check_all(w_out)


def test_shardkit_index_adds_indexes_to_an_older_pack_and_keeps_its_manifest(src, tmp_path):
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    want = indexes(out)
    manifest = (out / "manifest.json").read_bytes()
    for name in want:
        os.remove(out / name)
    (result,) = index_shards([str(out)])
    assert "kept" in result.summary()
    assert indexes(out) == want and (out / "manifest.json").read_bytes() == manifest


def test_shardkit_index_writes_indexes_beside_foreign_tars(src, tmp_path):
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for n in os.listdir(out):
        if n.endswith(".tar"):
            os.link(out / n, foreign / n)
    index_shards([str(foreign)])
    assert indexes(foreign) == indexes(out)
    check_all(foreign)


def _older(out) -> None:
    """``out``'s manifest as the previous release wrote it: no index sha256."""
    without_index_sha256(out)


def test_shardkit_index_adds_the_index_sha256_to_an_older_packs_manifest(
    src, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    want = read_manifest(str(out))
    _older(out)
    older = (out / "manifest.json").read_bytes()
    assert all(not e.index_sha256 for e in read_manifest(str(out)).shards)

    real = os.replace

    def fail(a, b):  # interrupted at the manifest's rename: the older one stays whole
        if str(b).endswith("manifest.json"):
            raise OSError(5, "Input/output error")
        real(a, b)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", fail)
        with pytest.raises(Exception, match="manifest.json"):
            index_shards([str(out)])
    assert (out / "manifest.json").read_bytes() == older
    listed = [*indexes(out), "manifest.json", "manifest.keys", *_tars(out)]
    assert sorted(os.listdir(out)) == sorted(listed)
    (result,) = index_shards([str(out)])  # run again: finished
    assert result.kept and read_manifest(str(out)).shards == want.shards
    got = read_manifest(str(out))
    assert (got.classes, got.pack, got.skipped) == (want.classes, want.pack, want.skipped)
    check_all(out)
    again = (out / "manifest.json").read_bytes()
    index_shards([str(out)])
    assert (out / "manifest.json").read_bytes() == again  # nothing left to add: kept as is


def _tars(out) -> list[str]:
    return [n for n in os.listdir(out) if n.endswith(".tar")]


def test_an_index_whose_sha256_is_not_the_manifests_is_stale(src, tmp_path):
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    e = read_manifest(str(out)).shards[0]
    shard = os.path.join(out, e.path)
    data = open(index_path(shard), "rb").read()
    assert load_index(data, shard, e.samples, e.bytes, e.sha256, e.index_sha256) is not None
    with pytest.warns(RuntimeWarning, match=r"shard-000000\.tar: stale sample index.*sha256"):
        assert load_index(data, shard, e.samples, e.bytes, e.sha256, "0" * 64) is None


def test_a_damaged_or_stale_index_is_named_and_readers_fall_back(src, tmp_path):
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    m = read_manifest(str(out))
    a, b = (os.path.join(out, e.path) for e in m.shards[:2])
    data = bytearray(open(index_path(a), "rb").read())
    data[100] ^= 1
    with pytest.raises(SampleIndexError, match=r"shard-000000\.tar: damaged sample index"):
        decode_index(bytes(data), a)
    e = m.shards[0]
    with pytest.warns(RuntimeWarning, match="damaged sample index"):
        assert load_index(bytes(data), a, e.samples, e.bytes, e.sha256) is None
    other = open(index_path(b), "rb").read()  # another shard's index: stale here
    with pytest.warns(RuntimeWarning, match=r"shard-000000\.tar: stale sample index"):
        assert load_index(other, a, e.samples, e.bytes, e.sha256) is None
    good = open(index_path(a), "rb").read()
    assert load_index(good, a, e.samples, e.bytes, e.sha256).samples == e.samples


def test_split_from_the_index_hashes_equals_the_split_from_keys(src, tmp_path):
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    m = read_manifest(str(out))
    keys, hashes = [], []
    for e in m.shards:
        shard = os.path.join(out, e.path)
        ix = decode_index(open(index_path(shard), "rb").read(), shard)
        keys += ix.keys()
        hashes.append(ix.hashes)
    threshold = np.uint64(int(0.3 * 2**64))
    val = np.flatnonzero(np.concatenate(hashes) < threshold)
    assert val.tolist() == split_members(keys, "val", 0.3).tolist()


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _without_indexes(out, to) -> str:
    os.makedirs(to)
    for n in os.listdir(out):
        if not n.endswith(".idx"):
            os.link(os.path.join(out, n), os.path.join(to, n))
    return str(to)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads through /proc")
def test_split_and_subset_read_only_the_indexes_and_match_the_shards(tmp_path):
    from shardkit.stream.dataset import ShardDataset
    from shardkit.stream.world import World

    src = random_tree(tmp_path / "src", 90)
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    bare = _without_indexes(out, tmp_path / "bare")
    shard_bytes = sum(e.bytes for e in read_manifest(str(out)).shards)
    index_bytes = sum(len(v) for v in indexes(out).values())

    def made(where, **kw):  # built and its epoch planned (a key file's split reads each
        before = _rchar()  # shard's index when the plan reaches the shard)
        ds = ShardDataset(where, decode="raw", with_keys=True, order=Order(shuffle=False), **kw)
        ds.plan(World(), 0)
        return ds, _rchar() - before

    for kw in ({"split": "val", "val_fraction": 0.3}, {"split": "train"}, {"subset": 0.2}):
        ds, read = made(Source(str(out), **kw))
        slow, read_bare = made(Source(bare, **kw))
        assert len(ds) == len(slow) and [s[2] for s in ds] == [s[2] for s in slow]
        assert read < index_bytes + 64_000 < shard_bytes // 2  # the indexes and the manifest
        if "split" in kw:
            assert read_bare > read  # without them: every shard's headers
    keys = [s[2] for s in made(Source(str(out), subset=0.3))[0]]
    by_keys, _ = made(Source(str(out), subset=keys[::2]))
    assert [s[2] for s in by_keys] == keys[::2]


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads through /proc")
def test_a_view_opens_without_reading_and_gives_what_the_shards_give(tmp_path):
    from shardkit.stream.view import ShardView

    src = random_tree(tmp_path / "src", 60)
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    bare = _without_indexes(out, tmp_path / "bare")
    before = _rchar()
    view = ShardView(str(out), decode="raw", with_keys=True)
    assert _rchar() - before < os.path.getsize(out / "manifest.json") + 6_000  # the manifest alone
    slow = ShardView(bare, decode="raw", with_keys=True)
    assert len(view) == len(slow) == 60 and view.keys() == slow.keys()
    assert [view[i] for i in range(60)] == [slow[i] for i in range(60)]
    for i in (0, 17, 59):
        key = slow.keys()[i]
        assert view.index(key) == slow.index(key) == i and view.get(key) == slow.get(key)
        assert view.members(i) == slow.members(i)
    with pytest.raises(Exception, match="no sample with key 'c0/nope'"):
        view.index("c0/nope")


def test_a_wrong_index_never_gives_another_sample(tmp_path):
    from shardkit.stream.view import ShardView

    src = random_tree(tmp_path / "src", 30)
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    truth = ShardView(str(out), decode="raw", with_keys=True)
    want = [truth[i] for i in range(len(truth))]
    a, b = (os.path.join(out, e.path) for e in read_manifest(str(out)).shards[:2])
    os.replace(index_path(b), index_path(a))  # shard 0 gets shard 1's index: stale
    with pytest.warns(RuntimeWarning, match=r"shard-000000\.tar\.idx: stale sample index"):
        view = ShardView(str(out), decode="raw", with_keys=True)
        got = [view[i] for i in range(len(view))]
    assert got == want
    with open(index_path(a), "r+b") as f:  # damaged: a flipped byte
        f.seek(80)
        byte = f.read(1)
        f.seek(80)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.warns(RuntimeWarning, match=r"shard-000000\.tar\.idx: damaged sample index"):
        view = ShardView(str(out), decode="raw", with_keys=True)
        assert [view[i] for i in range(len(view))] == want


def test_the_members_section_lists_each_members_data_range(tmp_path):
    out = tmp_path / "out"
    with ShardWriter(str(out), shard_size="1MB", classes=["a", "b"]) as w:
        w.add("k0", "jpg", b"\xff\xd8" + bytes(700), 1, {"txt": "caption zero", "json": {"n": 0}})
        w.add("k1", "JPG", b"\xff\xd8" + bytes(30), -1, {"txt": "one"})  # no label member
        w.add("x" * 150, "jpg", b"\xff\xd8" + bytes(5), 0)  # long-name members
    check_all(out)
    (e,) = read_manifest(str(out)).shards
    shard = os.path.join(out, e.path)
    ix = decode_index(open(index_path(shard), "rb").read(), shard)
    assert ix.members is not None and ix.members.labels.tolist() == [1, -1, 0]
    raw = open(shard, "rb").read()
    got = [[(ext, raw[at : at + n]) for ext, at, n in ix.members.of(j)] for j in range(3)]
    assert [[ext for ext, _ in m] for m in got] == [
        ["jpg", "cls", "txt", "json"],
        ["jpg", "txt"],
        ["jpg", "cls"],
    ]
    assert got[0][2] == ("txt", b"caption zero") and got[1][1] == ("txt", b"one")
    assert got[2] == [("jpg", b"\xff\xd8" + bytes(5)), ("cls", b"0")]
    assert ix.members.names == ("jpg", "cls", "txt", "json")  # ids into a table of distinct ones


def test_the_epochs_head_grows_by_the_digests_and_a_version_1_index_is_still_read(src, tmp_path):
    from shardkit.formats.sample_index import columns_size, decode_columns

    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    e = read_manifest(str(out)).shards[0]
    shard = os.path.join(out, e.path)
    v3 = open(index_path(shard), "rb").read()
    n = e.samples
    assert columns_size(n) == 72 + 24 * n + 8 == columns_size(n, 1) + 8 * n  # 8 bytes a sample
    head = decode_columns(v3[: columns_size(n)], shard, n, e.bytes, e.sha256)
    assert head is not None and head.offsets.tolist() == decode_index(v3, shard).offsets.tolist()
    assert head.digests is not None and head.digests.tolist() == (
        decode_index(v3, shard).digests.tolist()
    )
    as_previous_release(out)
    v1 = open(index_path(shard), "rb").read()
    assert v1[8] == 1 and len(v1) < len(v3) and v1[: columns_size(n, 1)][12:] == v3[
        : columns_size(n, 1)
    ][12:]  # fmt: skip
    v2 = v3  # the same bytes up to the key hashes: the rest of this test is version 1's
    old = decode_index(v1, shard)
    assert old.members is None and old.keys() == decode_index(v2, shard).keys()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read as valid: no warning, no fallback
        assert load_index(v1, shard, e.samples, e.bytes, e.sha256) is not None
        assert decode_columns(v1[: columns_size(e.samples)], shard, e.samples, e.bytes, e.sha256)


def test_a_flipped_byte_in_the_members_section_is_detected(src, tmp_path):
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    e = read_manifest(str(out)).shards[0]
    shard = os.path.join(out, e.path)
    data = bytearray(open(index_path(shard), "rb").read())
    flipped = bytearray(data)
    flipped[-40] ^= 1  # the last member name's bytes: past what an epoch reads
    with pytest.raises(SampleIndexError, match="checksum does not match"):
        decode_index(bytes(flipped), shard)
    with pytest.warns(RuntimeWarning, match=r"shard-000000\.tar: damaged sample index"):
        assert load_index(bytes(flipped), shard, e.samples, e.bytes, e.sha256) is None
    # A members section that lies about a range, its checksum made to match: still refused.
    ix = decode_index(bytes(data), shard)
    at = bytes(data).find(ix.members.sizes.tobytes())
    data[at : at + 8] = (10**9).to_bytes(8, "little")
    body = bytes(data[:-32])
    with pytest.raises(SampleIndexError, match="outside its sample's byte range"):
        decode_index(body + hashlib.sha256(body).digest(), shard)


def test_a_subset_or_split_of_shards_without_indexes_warns_once_naming_shardkit_index(tmp_path):
    from shardkit.stream.dataset import ShardDataset
    from shardkit.stream.view import ShardView

    src = random_tree(tmp_path / "src", 40)
    out = tmp_path / "out"
    quiet(pack, src, str(out), shard_size="6kB", progress=False)
    bare = _without_indexes(out, tmp_path / "bare")
    n = len(read_manifest(bare).shards)
    keys = ShardView(str(out), decode="raw").keys()[::3]
    for kw in ({"split": "val"}, {"subset": 0.2}, {"subset": keys}):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            ShardDataset(Source(bare, **kw), decode="raw")
        said = [str(w.message) for w in got if "no sample index" in str(w.message)]
        assert len(said) == 1, said  # once, at construction
        assert f"{n} of its {n} tar shards have no sample index" in said[0]
        assert f"`shardkit index {bare}`" in said[0]
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*no sample index")
            ShardDataset(Source(str(out), **kw), decode="raw")  # indexed: nothing to say
            ShardDataset(bare, decode="raw")  # a plain epoch reads every shard anyway
