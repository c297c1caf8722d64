"""A split's construction and plan read the index heads of the shards a rank reads, not every
shard's: each shard's count of val samples comes from the dataset's key file (its prefix), and
a shard's sides from its own index when a reader first reaches it. Counted by an audit hook on
``open`` in a child process (every ``.idx`` opened), at world size 1 and at rank 0 of 8."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
from conftest import without_key_file

from shardkit.errors import ShardFormatError
from shardkit.formats.key_file import HEAD, mapped
from shardkit.stream.dataset import ShardDataset, Source
from shardkit.stream.shuffle import Order
from shardkit.stream.world import World
from shardkit.write.writer import ShardWriter

_CHILD = r"""
import json, sys
from shardkit.stream.dataset import ShardDataset, Source
from shardkit.stream.world import World
out, split, subset, ws, workers = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:6])
checkpoint = sys.argv[6:] == ["checkpoint"]
opened, on = [], [False]
def hook(event, args):
    if on[0] and event == "open" and str(args[0]).endswith(".idx"):
        opened.append(str(args[0]))
sys.addaudithook(hook)
on[0] = True
src = Source(out, split=split, subset=float(subset) if subset != "-" else None)
ds = ShardDataset(src, decode="raw", rank=0, world_size=ws, seed=3)
built = len(opened)
read = set()
for w in range(workers):
    read |= {ds.shards.url(s.shard) for s in ds.plan(World(0, ws, w, workers), 0)}
if checkpoint:  # a rank's first checkpoint saved and loaded in this process
    ds.load_state_dict(ds.state_dict())
on[0] = False
print(json.dumps({"built": built, "opened": opened, "read": sorted(read),
                  "shards": len(ds.shards), "len": len(ds)}))
"""


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """2,560 samples of fixed bytes in 64 tar shards, with the key file ShardWriter writes."""
    out = str(tmp_path_factory.mktemp("ranklocal") / "pack")
    with ShardWriter(out, format="tar", shard_size="84KB", classes=["x"]) as w:
        for i in range(2560):
            w.add(f"k{i:05d}", "jpg", b"%d" % i, 0)
    assert 60 <= len(json.load(open(os.path.join(out, "manifest.json")))["shards"]) <= 70
    assert os.path.exists(os.path.join(out, "manifest.keys"))
    return out


def _child(out: str, split: str, ws: int, workers: int = 1, subset: str = "-", *more: str) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    args = [sys.executable, "-c", _CHILD, out, split, subset, str(ws), str(workers), *more]
    got = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
    return json.loads(got.stdout)


@pytest.mark.parametrize("split,subset", [("val", "-"), ("train", "-"), ("train", "0.3")])
def test_rank_zero_of_eight_reads_an_eighth_of_the_heads(pack, split, subset):
    """Construction opens no index; planning rank 0's part (two workers) opens each index of
    the shards it reads once, and only those: at most 1/8 of world size 1's, plus two shards
    its part's ends share. Before, construction read every shard's head in each process."""
    whole = _child(pack, split, 1, subset=subset)
    rank0 = _child(pack, split, 8, workers=2, subset=subset)
    assert whole["built"] == rank0["built"] == 0
    # world size 1 reads every shard that holds a member (a shard with none is not read)
    assert sorted(p.removesuffix(".idx") for p in whole["opened"]) == whole["read"]
    assert len(whole["read"]) > 0.9 * whole["shards"]
    assert len(rank0["opened"]) == len(set(rank0["opened"]))  # each once
    assert {p.removesuffix(".idx") for p in rank0["opened"]} <= set(rank0["read"])
    assert len(rank0["opened"]) <= len(whole["opened"]) / 8 + 2, (rank0, whole["shards"])


@pytest.mark.parametrize("split,subset", [("val", "-"), ("train", "0.3")])
def test_a_ranks_first_checkpoint_reads_only_its_own_shards_heads(pack, split, subset):
    """Rank 0 of 8 builds, plans, saves its state and loads it back, opening only the indexes
    of the shards it reads (at most 1/8 of world size 1's plus two): the checkpoint's digest of
    a split counted by the key file is of what vouches for its members (the shards' sha256 and
    counts, the split, its fraction and subset), not of every member's position. Before, the
    first ``state_dict`` opened every shard's index."""
    whole = _child(pack, split, 1, 1, subset)
    rank0 = _child(pack, split, 8, 2, subset, "checkpoint")
    assert len(rank0["opened"]) == len(set(rank0["opened"]))
    assert {p.removesuffix(".idx") for p in rank0["opened"]} <= set(rank0["read"])
    assert len(rank0["opened"]) <= len(whole["opened"]) / 8 + 2, (rank0, whole["shards"])


def test_a_keyed_splits_state_refuses_another_dataset(pack, tmp_path):
    """The digest of what vouches for the members still tells datasets apart: another
    fraction, subset or seed, or shards of other bytes under the same names and counts, refuse
    the state with the one-line error naming the fact; the same dataset takes it."""
    from shardkit.errors import InputError

    def make(root, seed=3, **kw):
        return ShardDataset(Source(root, **{"split": "val", **kw}), decode="raw", seed=seed)

    state = make(pack).state_dict()
    assert state["dataset"]["mix"].startswith("k1:")
    make(pack).load_state_dict(state)
    for other in (make(pack, val_fraction=0.2), make(pack, subset=0.5), make(pack, seed=4)):
        with pytest.raises(InputError, match="state was saved for"):
            other.load_state_dict(state)
    # the same names and counts (the fingerprint agrees), other keys: other shards' sha256
    forged = str(tmp_path / "forged")
    with ShardWriter(forged, format="tar", shard_size="84KB", classes=["x"]) as w:
        for i in range(2560):
            w.add(f"j{i:05d}", "jpg", b"%d" % i, 0)
    other = make(forged)
    assert other.state_dict()["dataset"]["fingerprint"] == state["dataset"]["fingerprint"]
    with pytest.raises(InputError, match="state was saved for a dataset with (mix|epoch_size)="):
        other.load_state_dict(state)


def test_a_state_of_every_position_loads_into_a_keyed_split_and_back(pack, tmp_path):
    """A state whose digest is of every member's position (saved before the key file's
    digest, or by the same pack without a key file) loads into the keyed split, which then
    works that digest out (reading every head, once); a keyed split's ``k1:`` state loads into
    the pack without a key file. A grown dataset refuses either."""
    from shardkit.errors import InputError

    old = without_key_file(pack, str(tmp_path / "old"))
    grown = str(tmp_path / "grown")
    with ShardWriter(grown, format="tar", shard_size="84KB", classes=["x"]) as w:
        for i in range(2600):
            w.add(f"k{i:05d}", "jpg", b"%d" % i, 0)

    def make(root):
        return ShardDataset(Source(root, split="train", subset=0.5), decode="raw", seed=3)

    keyed, plain = make(pack), make(old)
    positions, vouched = plain.state_dict(), keyed.state_dict()
    assert not positions["dataset"]["mix"].startswith("k1:")
    assert vouched["dataset"]["mix"].startswith("k1:")
    assert {**positions["dataset"], "mix": 0} == {**vouched["dataset"], "mix": 0}
    keyed.load_state_dict(positions)
    assert len(keyed.sources[0].side.loaded) == len(keyed.shards)  # every head, for that one
    plain.load_state_dict(vouched)
    for state in (positions, vouched):
        with pytest.raises(InputError, match="state was saved for"):
            make(grown).load_state_dict(state)
    bent = {**positions, "dataset": {**positions["dataset"], "mix": "0" * 32}}
    with pytest.raises(InputError, match="mix="):
        make(pack).load_state_dict(bent)


def _keys(ds, world: World, epoch: int) -> list[str]:
    return [r.key for r in ds.records(world, epoch)]


@pytest.mark.parametrize(
    "kw",
    [
        dict(source=Source("P", split="val", val_fraction=0.2)),
        dict(source=Source("P", split="train", subset=0.25)),
        dict(source=Source("P", split="val"), epoch_size=700),
    ],
    ids=["val", "train-subset", "val-sized"],
)
def test_the_key_file_gives_the_epochs_of_every_shards_heads(pack, tmp_path, kw):
    """Every rank's and worker's samples, their order and the states are those of the same
    pack without a key file (every shard's index read at construction, as before)."""
    old = without_key_file(pack, str(tmp_path / "old"))

    def make(root, ws=3):
        src = kw["source"]
        args = {**kw, "source": Source(root, split=src.split, subset=src.subset,
                                       val_fraction=src.val_fraction)}  # fmt: skip
        return ShardDataset(order=Order(buffer_size=5), seed=4, rank=1, world_size=ws, **args)

    new_ds, old_ds = make(pack), make(old)
    assert new_ds.sources[0].side is not None and old_ds.sources[0].side is None
    assert len(new_ds) == len(old_ds)
    for epoch in (0, 1):
        for w in (0, 1):
            world = World(1, 3, w, 2)
            assert _keys(new_ds, world, epoch) == _keys(old_ds, world, epoch)
    for ds in (new_ds, old_ds):
        ds.set_epoch(1)
    at = [ds.position(3, num_workers=2, batch_size=4, cut=None) for ds in (new_ds, old_ds)]
    assert at[0]["segments"] == at[1]["segments"]
    # the states differ in the kind of the members' digest alone: every position's without
    # the key file, what vouches for them (``k1:``) with it; each loads into the other
    state, keyed = old_ds.state_dict(), new_ds.state_dict()
    assert {**keyed["dataset"], "mix": None} == {**state["dataset"], "mix": None}
    assert {**keyed, "dataset": None} == {**state, "dataset": None}
    new_ds.load_state_dict(state)  # a state saved without the key file loads with it
    old_ds.load_state_dict(keyed)


def test_a_key_file_whose_counts_are_not_the_shards_is_named(pack, tmp_path):
    """A key file edited (its size and head intact): its counts come from blocks each checked
    by its digest, so an edit is named in a warning and the split reads every shard's index
    (the honest epoch); edited with its block table and the manifest's ``blocks_sha256``
    computed again (vouched for), its count of a shard's val samples is not the shard index's,
    and the epoch that reaches the shard stops with an error naming the key file and the fix,
    never an epoch cut by wrong counts."""
    import hashlib

    from shardkit.formats.key_file import block_table

    out = str(tmp_path / "forged")
    shutil.copytree(pack, out)
    keys = os.path.join(out, "manifest.keys")
    n = json.load(open(os.path.join(out, "manifest.json")))["num_samples"]
    hashes, shards = mapped(keys, n)
    threshold = int(np.ceil(0.1 * 2**64))
    val = int(np.searchsorted(hashes, np.uint64(threshold)))
    column = np.array(shards)
    a = int(column[0])
    b = next(int(s) for s in column[:val] if s != a)
    column[:val][column[:val] == a] = b  # shard a's val samples are said to be shard b's
    hashes = np.array(hashes)
    del shards
    with open(keys, "r+b") as f:
        f.seek(HEAD + 8 * n)
        f.write(column.astype("<u4").tobytes())
    with pytest.warns(RuntimeWarning, match="manifest.keys.*block 0"):
        ds = ShardDataset(Source(out, split="val"), decode="raw", with_keys=True)
    want = ShardDataset(Source(pack, split="val"), decode="raw", with_keys=True)
    assert ds.sources[0].side is None and [s[2] for s in ds] == [s[2] for s in want]
    table = block_table(hashes, column)  # the forgery vouched for: table and manifest
    with open(keys, "r+b") as f:
        f.seek(HEAD + 12 * n)
        f.write(table)
    path = os.path.join(out, "manifest.json")
    doc = json.load(open(path))
    doc["keys"]["blocks_sha256"] = hashlib.sha256(table).hexdigest()
    with open(path, "w") as f:
        json.dump(doc, f)
    ds = ShardDataset(Source(out, split="val"), decode="raw")
    with pytest.raises(ShardFormatError) as err:
        list(ds)
    assert keys in str(err.value) and "delete it" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_key_file_that_does_not_name_the_shards_is_not_used(pack, tmp_path):
    """A key file of other shards (its head names others: a shard list narrowed or a stale
    file) is named in a warning and the split reads every shard's index, as before."""
    out = str(tmp_path / "stale")
    shutil.copytree(pack, out)
    with open(os.path.join(out, "manifest.keys"), "r+b") as f:
        f.seek(24)
        f.write(bytes(32))
    with pytest.warns(RuntimeWarning, match="manifest.keys"):
        ds = ShardDataset(Source(out, split="val"), decode="raw")
    assert ds.sources[0].side is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = ShardDataset(Source(pack, split="val"), decode="raw", with_keys=True)
        assert [s[2] for s in ShardDataset(Source(out, split="val"), decode="raw",
                                           with_keys=True)] == [s[2] for s in want]  # fmt: skip


def test_old_packs_without_a_key_file_split_as_before(pack, tmp_path):
    old = without_key_file(pack, str(tmp_path / "old"))
    ds = ShardDataset(Source(old, split="val"), decode="raw", with_keys=True)
    assert ds.sources[0].side is None and len(ds) == len(list(ds))


def test_a_grown_dataset_counts_its_split_from_every_run(pack, tmp_path):
    """A dataset grown in place holds its keys in runs (FORMAT.md, "Runs"): the split counts
    each run's prefix, uses the key file without a warning and gives the epochs of the same
    dataset without one."""
    from shardkit.write.merge import merge

    grown = str(tmp_path / "grown")
    shutil.copytree(pack, grown)
    more = str(tmp_path / "more")
    with ShardWriter(more, format="tar", shard_size="84KB", classes=["x"]) as w:
        for i in range(2560, 2900):
            w.add(f"k{i:05d}", "jpg", b"%d" % i, 0)
    merge([grown, more], grown)
    assert len(json.load(open(os.path.join(grown, "manifest.json")))["keys"]["runs"]) == 1
    old = without_key_file(grown, str(tmp_path / "old"))
    for split in ("val", "train"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            new_ds = ShardDataset(Source(grown, split=split), decode="raw", seed=2)
        old_ds = ShardDataset(Source(old, split=split), decode="raw", seed=2)
        assert new_ds.sources[0].side is not None and len(new_ds) == len(old_ds)
        assert _keys(new_ds, World(0, 1, 0, 1), 0) == _keys(old_ds, World(0, 1, 0, 1), 0)


class _Reads:
    """A key file read through ``pread(n, offset)`` (as a URL's is, by ranged GETs), counted;
    ``cut``: the bytes past which it holds nothing (a file cut short)."""

    def __init__(self, path: str, cut: int | None = None):
        self.data = open(path, "rb").read()[:cut]
        self.reads = 0

    def pread(self, n: int, offset: int) -> bytes:
        self.reads += 1
        return self.data[offset : offset + n]


def test_a_split_counts_the_same_through_any_pread_reader(pack):
    """``key_file.read_at`` takes a descriptor or an object with ``pread``: the counts a split
    reads through one (its head checked there) are the file's; a reader cut short, or whose
    head names other shards, does not serve, and says why."""
    from shardkit.formats.key_file import read_at
    from shardkit.manifest import read_manifest
    from shardkit.stream.lookup import split_counts

    m = read_manifest(pack)
    shards, n, t = m.shards, m.num_samples, 2**62
    want, why = split_counts(pack, m.keys, n, shards, t)
    assert why == "" and want.sum() > 0
    path = os.path.join(pack, "manifest.keys")
    got, why = split_counts(pack, m.keys, n, shards, t, lambda run: _Reads(path))
    assert why == "" and np.array_equal(got, want)
    cut = _Reads(path, HEAD + 4)
    with pytest.raises(OSError, match=f"cut short at byte {HEAD + 4}"):
        read_at(cut, 8, HEAD)
    got, why = split_counts(pack, m.keys, n, shards, t, lambda run: _Reads(path, HEAD + 100))
    assert got is None and "cut short" in why
    other = _Reads(path)
    other.data = other.data[:24] + bytes(32) + other.data[56:]  # names no such shards
    got, why = split_counts(pack, m.keys, n, shards, t, lambda run: other)
    assert got is None and why == "its head does not name this manifest's shards"
