"""The index record inside each LMDB shard: written by every writer with the same bytes, giving
the keys and split hashes of the samples in a few reads per shard, the same results as reading
every sample's key, and named then read around when damaged (old packs without it still work)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import warnings

import lmdb
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import quiet, random_tree

import shardkit.formats.lmdb.reader as lmdb_reader
from shardkit.cli import main
from shardkit.formats.lmdb import LmdbSampleReader, iter_lmdb_records, read_lmdb_index
from shardkit.formats.lmdb.index import (
    INDEX_KEY,
    LmdbIndexError,
    decode_lmdb_index,
    encode_lmdb_index,
)
from shardkit.formats.sample_index import key_hashes
from shardkit.manifest import read_manifest, write_manifest
from shardkit.stream.dataset import Order, ShardDataset, Source
from shardkit.stream.lookup import ViewCache
from shardkit.stream.view import ShardView
from shardkit.stream.world import World
from shardkit.write.engines import LocalRunner
from shardkit.write.merge import merge
from shardkit.write.packer import pack
from shardkit.write.verify import verify
from shardkit.write.writer import ShardWriter


def shards(out) -> list[str]:
    return [os.path.join(out, e.path) for e in read_manifest(str(out)).shards]


def record(path) -> bytes | None:
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return txn.get(INDEX_KEY)
    finally:
        env.close()


def put_record(path, value: bytes | None) -> None:
    """Replace (or with None delete) a shard's index record through the lmdb package: how a
    damaged record or a pack made before the record existed is made here."""
    env = lmdb.open(str(path), subdir=False, lock=False)
    try:
        with env.begin(write=True) as txn:
            if value is None:
                txn.delete(INDEX_KEY)
            else:
                txn.put(INDEX_KEY, value)
    finally:
        env.close()


def recommit(out) -> None:
    """Rewrite the manifest's sizes and digests to the shards' bytes now: as if the writer had
    put the record there itself (so ``verify`` opens the shard and reads the record)."""
    m = read_manifest(str(out))
    for i, e in enumerate(m.shards):
        data = open(os.path.join(out, e.path), "rb").read()
        m.shards[i] = dataclasses.replace(
            e, bytes=len(data), sha256=hashlib.sha256(data).hexdigest()
        )
    write_manifest(m, str(out))


def without_records(out, to) -> str:
    """A copy of the pack ``out`` whose shards have no index record (an older pack)."""
    shutil.copytree(out, to)
    for path in shards(to):
        put_record(path, None)
    return str(to)


def check_all(out) -> None:
    """Every shard's record lists its samples' keys, in order, and their split hashes."""
    for e in read_manifest(str(out)).shards:
        path = os.path.join(out, e.path)
        keys = [r.key for r in iter_lmdb_records(path)]
        ix = decode_lmdb_index(record(path), path, e.samples)
        assert ix.keys() == keys and ix.samples == e.samples == len(keys)
        assert ix.hashes.tolist() == key_hashes(keys).tolist()


def records(out) -> dict[str, bytes]:
    return {os.path.basename(p): record(p) for p in shards(out)}


def writer_pack(out, n: int, size: int = 3000, shard_size: str = "100kB") -> list[str]:
    """``n`` samples of ``size`` bytes (past half a page: stored apart, as images are)."""
    keys = [f"c{i % 4}/s{i:04d}" + ("é" if i % 7 == 0 else "") for i in range(n)]
    with ShardWriter(str(out), shard_size=shard_size, format="lmdb") as w:
        for i, key in enumerate(keys):
            w.add(key, "jpg", bytes([i % 251]) * size, i % 4, extra={"txt": b"cap %d" % i})
    return keys


@pytest.fixture
def src(tmp_path):
    return random_tree(tmp_path / "src", 40)


def test_the_record_round_trips_and_hashes_as_the_tar_index():
    keys = [b"a/k1", "ü/ß".encode(), b"x" * 300, b"b"]
    ix = decode_lmdb_index(encode_lmdb_index(keys, [1, 2, 3, 2**64 - 1]), "s.lmdb", 4)
    assert ix.keys() == [k.decode() for k in keys] and ix.key(1) == "ü/ß"
    assert ix.digests.tolist() == [1, 2, 3, 2**64 - 1]
    assert ix.hashes.tolist() == key_hashes(keys).tolist()
    assert [ix.position(k.decode()) for k in keys] == [0, 1, 2, 3]
    assert ix.position("a/k") is None and ix.position("") is None
    empty = decode_lmdb_index(encode_lmdb_index([], []), "s.lmdb", 0)
    assert empty.keys() == [] and len(empty.hashes) == 0


@pytest.mark.slow  # worker processes
def test_pack_engines_append_merge_and_writer_write_the_same_records(src, tmp_path):
    out = tmp_path / "out"
    quiet(pack, src, str(out), format="lmdb", shard_size="40kB", progress=False)
    assert len(shards(out)) > 2
    check_all(out)
    local = tmp_path / "local"
    quiet(pack, src, str(local), format="lmdb", shard_size="40kB", progress=False,
          runner=LocalRunner(2))  # fmt: skip
    assert records(local) == records(out)
    more = random_tree(tmp_path / "more", 12, seed=1, prefix="x")
    before = records(out)
    quiet(pack, more, str(out), format="lmdb", shard_size="40kB", progress=False, append=True)
    after = records(out)
    assert {k: after[k] for k in before} == before and len(after) > len(before)
    check_all(out)
    other = tmp_path / "other"
    quiet(pack, more, str(other), format="lmdb", shard_size="40kB", progress=False)
    merged = tmp_path / "merged"
    quiet(merge, [str(local), str(other)], str(merged))
    check_all(merged)  # shards are linked or copied: each keeps its record
    w_out = tmp_path / "writer"
    writer_pack(w_out, 30)
    check_all(w_out)


def _split(where, **kw) -> list[str]:
    ds = ShardDataset(Source(str(where), **kw), decode="raw", with_keys=True, order=Order(False))
    return [s[2] for s in ds]


def test_splits_subsets_views_ls_and_show_are_the_same_without_the_record(tmp_path):
    out = tmp_path / "out"
    keys = writer_pack(out, 90)
    bare = without_records(out, tmp_path / "bare")
    assert len(shards(out)) > 2 and all(record(p) is None for p in shards(bare))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a shard without a record is no warning
        warnings.filterwarnings("ignore", "(?s).*no per-sample digests")  # but unchecked: said
        for kw in ({"split": "val", "val_fraction": 0.3}, {"split": "train"}):
            assert _split(out, **kw) == _split(bare, **kw)
        assert _split(out, subset=keys[::3]) == _split(bare, subset=keys[::3]) == keys[::3]
        view, slow = (
            ShardView(str(out), with_keys=True, decode="raw"),
            ShardView(bare, decode="raw"),
        )
        assert view.keys() == slow.keys() == keys
        for key in (keys[0], keys[44], keys[-1]):
            assert view.get(key)[2] == key and view.get(key)[:2] == slow.get(key)
        assert view.members(44) == slow.members(44)
    # the split is the one a tar pack of the same keys gives
    tar = tmp_path / "tar"
    with ShardWriter(str(tar), shard_size="100kB") as w:
        for i, key in enumerate(keys):
            w.add(key, "jpg", b"x%d" % i, i % 4)
    assert _split(tar, split="val", val_fraction=0.3) == _split(out, split="val", val_fraction=0.3)
    runner = CliRunner()
    for args in (("ls",), ("ls", "--json", "--offset", "40"), ("show", keys[61]), ("show", "#7")):
        a = runner.invoke(main, [args[0], str(out), *args[1:]])
        b = runner.invoke(main, [args[0], bare, *args[1:]])
        assert a.exit_code == b.exit_code == 0, a.output + b.output
        assert a.output.replace(str(out), "OUT") == b.output.replace(bare, "OUT")


class _Reads:
    """Counts ``os.pread`` calls and bytes (how the LMDB reader reads every page)."""

    def __init__(self, monkeypatch):
        self.calls = self.bytes = 0
        real = os.pread

        def counting(fd, n, offset):
            data = real(fd, n, offset)
            self.calls += 1
            self.bytes += len(data)
            return data

        monkeypatch.setattr(lmdb_reader.os, "pread", counting)

    def take(self) -> tuple[int, int]:
        got = self.calls, self.bytes
        self.calls = self.bytes = 0
        return got


def test_the_record_makes_splits_views_and_show_cost_reads_per_shard_not_per_sample(
    tmp_path, monkeypatch
):
    out = tmp_path / "out"
    keys = writer_pack(out, 240, shard_size="400kB")
    bare = without_records(out, tmp_path / "bare")
    n_shards = len(shards(out))
    assert 3 <= n_shards <= 12
    reads = _Reads(monkeypatch)

    def planned(where) -> int:
        """A split built and its epoch planned: the key file counts it, and each shard's
        record is read when the plan reaches the shard."""
        ds = ShardDataset(Source(str(where), split="val"), decode="raw")
        ds.plan(World(), 0)
        return len(ds)

    for where in (out, bare):  # a first pass: the bare pack's walk is cached per process too
        planned(where)
    reads.take()
    assert planned(out) > 0
    calls, nbytes = reads.take()
    assert calls <= 8 * n_shards and nbytes <= 16 * 4096 * n_shards
    planned(bare)
    slow_calls, _ = reads.take()
    assert slow_calls >= 240  # the start of every value
    view = ShardView(str(out), decode="raw")
    assert reads.take() == (0, 0)  # open: the manifest and a stat per shard
    assert view.index(keys[-1]) == 239
    assert reads.take()[0] <= 8 * n_shards  # every shard's record, nothing else
    # the key file names the one shard: its keys from the start of each of its values
    ShardView(bare, decode="raw", cache=ViewCache()).index(keys[-1])
    assert 0 < reads.take()[0] < 240
    os.unlink(os.path.join(bare, "manifest.keys"))  # none: a table built from every value
    with pytest.warns(RuntimeWarning, match="manifest.keys: unreadable"):
        ShardView(bare, decode="raw", cache=ViewCache()).index(keys[-1])
    assert reads.take()[0] >= 240


def test_a_damaged_record_is_named_and_read_around(tmp_path):
    out = tmp_path / "out"
    keys = writer_pack(out, 60)
    first, second = shards(out)[:2]
    good = record(first)
    bad = bytearray(good)
    bad[60] ^= 1
    put_record(first, bytes(bad))
    n2 = read_manifest(str(out)).shards[1].samples
    fewer = [k.encode() for k in LmdbSampleReader(second).keys()[:-1]]
    # checks out, but lists one sample less
    put_record(second, encode_lmdb_index(fewer, [0] * len(fewer)))
    for path, why in ((first, "checksum"), (second, f"lists {n2 - 1} samples, the shard holds")):
        with pytest.warns(RuntimeWarning, match=rf"{os.path.basename(path)}: damaged sample index"):
            assert read_lmdb_index(path)[0] is None
        with pytest.raises(LmdbIndexError, match=why):
            LmdbSampleReader(path).index(strict=True)
    with pytest.warns(RuntimeWarning, match="damaged sample index record"):
        view = ShardView(str(out), decode="raw", with_keys=True)
        assert view.keys() == keys and view.get(keys[3])[2] == keys[3]
    with pytest.warns(RuntimeWarning, match="reading each sample's key instead"):
        assert _split(out, subset=keys[::5]) == keys[::5]
    recommit(out)
    report = quiet(verify, str(out))
    problems = {os.path.basename(b.path): " ".join(b.problems) for b in report.bad}
    assert "checksum does not match" in problems["shard-000000.lmdb"]
    assert "lists" in problems["shard-000001.lmdb"]


def test_verify_names_a_record_whose_keys_are_not_the_samples(tmp_path):
    out = tmp_path / "out"
    writer_pack(out, 20, shard_size="1MB")
    (path,) = shards(out)
    assert verify(str(out)).ok
    keys = [k.encode() for k in LmdbSampleReader(path).keys()]
    keys[3], keys[4] = keys[4], keys[3]
    digests = LmdbSampleReader(path).index().digests
    put_record(path, encode_lmdb_index(keys, digests))  # checks out, but lists other keys
    recommit(out)
    report = verify(str(out))
    (bad,) = report.bad
    assert any("index record: sample 3 is" in p for p in bad.problems)
    view = ShardView(str(out), decode="raw")
    with pytest.raises(Exception, match="sample 4 is not where the index says"):
        view.get(keys[4].decode())  # never another sample than the one asked for


def test_a_count_other_than_the_manifests_is_refused(tmp_path):
    out = tmp_path / "out"
    writer_pack(out, 20, shard_size="1MB")
    (path,) = shards(out)
    with pytest.raises(Exception, match="holds 20 samples, its manifest says 21"):
        LmdbSampleReader(path).index(21)
    assert np.array_equal(
        read_lmdb_index(path, samples=20)[0].hashes, LmdbSampleReader(path).index().hashes
    )


def test_growth_reads_the_same_keys_with_and_without_the_record(tmp_path, monkeypatch):
    from shardkit.write.keys import dataset_keys

    out = tmp_path / "out"
    keys = writer_pack(out, 120, shard_size="400kB")
    bare = without_records(out, tmp_path / "bare")
    reads = _Reads(monkeypatch)
    assert dataset_keys(str(out), read_manifest(str(out))) == set(keys)
    fast = reads.take()[0]
    assert dataset_keys(bare, read_manifest(bare)) == set(keys)
    assert fast <= 8 * len(shards(out)) < 120 <= reads.take()[0]
