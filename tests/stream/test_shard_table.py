"""The shard list as a table (``ShardTable``): opening a dataset makes no object a shard, a
reader makes them only for the shards it reads, the manifest is read once per process, and the
table answers as the tuple of ``ShardInfo`` it replaced."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

import shardkit.manifest as manifest_module
from shardkit import Order, ShardDataset, ShardView, ShardWriter
from shardkit.manifest import ShardEntries, ShardEntry, read_manifest, write_manifest
from shardkit.records import ShardInfo, ShardTable
from shardkit.stream.partition import sample_counts
from shardkit.stream.resume import dataset_facts
from shardkit.stream.sources import resolve_source
from shardkit.urls import join_parts, join_url

SHARDS = 24


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> str:
    """24 tar shards of 5 tiny samples each, with their indexes and manifest."""
    out = tmp_path_factory.mktemp("table") / "out"
    with ShardWriter(str(out), shard_size=5 * 3072, classes=["a", "b"]) as w:
        for i in range(SHARDS * 5):
            w.add(f"k{i:04d}", "jpg", b"\xff\xd8" + bytes(1000) + i.to_bytes(4, "big"), i % 2)
    assert len(read_manifest(str(out)).shards) == SHARDS
    return str(out)


@pytest.fixture
def made(monkeypatch) -> dict[str, int]:
    """How many ``ShardInfo`` and ``ShardEntry`` objects are built while it is in use."""
    counts = {"ShardInfo": 0, "ShardEntry": 0}
    for cls in (ShardInfo, ShardEntry):
        init = cls.__init__

        def counting(self, *args, _init=init, _name=cls.__name__, **kw):
            counts[_name] += 1
            _init(self, *args, **kw)

        monkeypatch.setattr(cls, "__init__", counting)
    return counts


def test_opening_a_dataset_makes_no_object_a_shard(many, made):
    ds = ShardDataset(many, decode="raw")
    assert len(ds) == SHARDS * 5 and len(ds.shards) == SHARDS
    assert made == {"ShardInfo": 0, "ShardEntry": 0}
    view = ShardView(many)
    assert len(view) == SHARDS * 5
    assert made == {"ShardInfo": 0, "ShardEntry": 0}


def test_a_reader_makes_objects_only_for_the_shards_it_reads(many, made):
    ds = ShardDataset(many, decode="raw", rank=0, world_size=8, order=Order(shuffle=False))
    got = list(ds)
    assert len(got) == len(ds) == SHARDS * 5 // 8
    read = {s.shard for s in ds.plan()}
    assert 1 <= len(read) <= 4  # 15 samples of 5 a shard: three or four shards
    assert 0 < made["ShardInfo"] <= 4 * len(read) < SHARDS
    assert made["ShardEntry"] == 0


def test_the_manifest_is_read_once_per_process_and_not_by_a_copy(many, monkeypatch):
    reads = []
    real = manifest_module.Manifest.from_json

    def counted(text, source="manifest.json"):
        reads.append(source)
        return real(text, source)

    monkeypatch.setattr(manifest_module.Manifest, "from_json", staticmethod(counted))
    ds = ShardDataset(many, decode="raw", order=Order(shuffle=False), with_keys=True)
    first = [key for _, _, key in ds]
    assert len(reads) == 1
    again = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker is handed
    assert [key for _, _, key in again] == first and again.shards == ds.shards
    assert len(reads) == 1


def test_the_table_answers_as_the_tuple_it_replaced(many):
    table = resolve_source(many).shards
    m = read_manifest(many)
    infos = tuple(
        ShardInfo(
            os.path.join(many, e.path),
            e.samples,
            e.bytes,
            e.sha256,
            e.index,
            e.index_sha256,
            e.columns_sha256,
        )
        for e in m.shards
    )
    assert all(i.columns_sha256 for i in infos)  # the manifest's, carried to the readers
    assert isinstance(table, ShardTable) and table == infos and list(table) == list(infos)
    assert table[-1] == infos[-1] and table[3] == infos[3]
    assert table[2:5] == infos[2:5] and isinstance(table[2:5], ShardTable)
    assert table[::-3] == infos[::-3]
    with pytest.raises(IndexError):
        table[SHARDS]
    assert table.urls == [s.url for s in infos]
    assert sample_counts(table).tolist() == [s.samples for s in infos]
    counts = sample_counts(table)
    counts[0] = -5  # the caller's copy: the table's own column is untouched (and read-only)
    assert table[0].samples == infos[0].samples and not table.samples.flags.writeable
    both = ShardTable.concat([table, ShardTable.of(infos[:2])])
    assert both == infos + infos[:2]
    assert pickle.loads(pickle.dumps(table)) == infos
    assert ShardTable.of(infos) == table and ShardTable.of(table) is table


def test_an_older_manifests_offsets_ride_in_the_table():
    rows = [ShardInfo("a.tar", 130, 9000, "0" * 64, (0, 700, 1400)), ShardInfo("b.tar", 3, 99)]
    table = ShardTable.of(rows)
    assert table.index == {0: (0, 700, 1400)} and table == rows
    assert table[1:] == rows[1:] and table[1:].index == {}
    assert ShardTable.concat([ShardTable.of(rows[1:]), table]).index == {1: (0, 700, 1400)}


@pytest.mark.parametrize(
    "base",
    ["s3://b/prefix", "s3://b/prefix/", "https://h/p?tok=x/y", "https://h/?sig=1", "", "/tmp/d"],
)
def test_join_parts_make_what_join_url_makes(base):
    head, tail = join_parts(base)
    for name in ("shard-000000.tar", "a b.lmdb"):
        assert head + name + tail == join_url(base, name)


def test_a_read_manifest_writes_back_byte_for_byte_and_its_entries_can_be_replaced(many, tmp_path):
    m = read_manifest(many)
    assert isinstance(m.shards, ShardEntries)
    with open(os.path.join(many, "manifest.json"), encoding="utf-8") as f:
        assert m.to_json() == f.read()
    e = m.shards[4]
    m.shards[4] = ShardEntry(e.path, e.samples, e.bytes + 1, "f" * 64, (), e.index_sha256)
    assert m.shards[4].bytes == e.bytes + 1 and m.shards[4].sha256 == "f" * 64
    assert m.shards[3] == read_manifest(many).shards[3]  # the others as they were
    write_manifest(m, str(tmp_path))
    again = read_manifest(str(tmp_path))
    assert again == m and again.shards == list(m.shards)
    assert again.total_bytes == read_manifest(many).total_bytes + 1
    assert np.array_equal(again.shards.samples, m.shards.samples)


def test_offsets_listed_beside_index_sha256_are_read_as_columns_and_not_used(many, tmp_path, made):
    """A manifest from between the two formats lists each shard's JSON offsets and its index's
    sha256: the offsets are ignored (the index has them) and the entries stay columns."""
    doc = json.loads(open(os.path.join(many, "manifest.json"), encoding="utf-8").read())
    for s in doc["shards"]:
        s.update(index_every=64, index=[0])
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    m = read_manifest(str(tmp_path))
    assert made["ShardEntry"] == 0 and not m.shards.index
    assert list(m.shards) == [ShardEntry.from_dict(s) for s in doc["shards"]]
    assert list(m.shards) == list(read_manifest(many).shards)


@pytest.mark.parametrize(
    "head, tail", [(None, ""), ("", ""), ("s3://b/p/", ""), ("h://x/", "?t=a/b")]
)
def test_the_resume_fingerprint_of_a_table_is_the_one_its_urls_give(many, head, tail):
    """A checkpoint saved before the shard list became a table still loads: the fingerprint
    over the shards' file names is the same, whichever way the table holds its URLs."""
    table = resolve_source(many).shards
    if head is not None:
        table = ShardTable(table.names, table.samples, table.bytes, head=head, tail=tail)
    kw = dict(seed=3, order=Order(buffer_size=10))
    by_urls = dataset_facts(list(table.urls), table.samples.tolist(), "tar", **kw)
    assert dataset_facts(table, table.samples, "tar", **kw) == by_urls
