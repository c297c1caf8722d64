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
checkpoint, epoch = "checkpoint" in sys.argv[6:], "epoch" in sys.argv[6:]
made = [a for a in sys.argv[6:] if a not in ("checkpoint", "epoch")]  # a source of ``out``
opened, on = [], [False]
def hook(event, args):
    if on[0] and event == "open" and str(args[0]).endswith(".idx"):
        opened.append(str(args[0]))
sys.addaudithook(hook)
on[0] = True
if made:
    src = eval(made[0], {"Source": Source, "out": out})
else:
    src = Source(out, split=split, subset=float(subset) if subset != "-" else None)
ds = ShardDataset(src, decode="raw", rank=0, world_size=ws, seed=3)
built = len(opened)
read = set()
for w in range(workers):
    read |= {ds.shards.url(s.shard) for s in ds.plan(World(0, ws, w, workers), 0)}
if checkpoint:  # a rank's first checkpoint saved and loaded in this process
    ds.load_state_dict(ds.state_dict())
if epoch:  # rank 0's epoch 0 read, in this process
    sum(1 for _ in ds)
on[0] = False
print(json.dumps({"built": built, "opened": opened, "read": sorted(read),
                  "shards": len(ds.shards), "len": len(ds)}))
"""


def _written(out: str, prefix: str, n: int, shard_size: str) -> str:
    """``n`` samples of fixed bytes (keys ``<prefix>00000``...) in tar shards of
    ``shard_size``, with the key file ShardWriter writes."""
    with ShardWriter(out, format="tar", shard_size=shard_size, classes=["x"]) as w:
        for i in range(n):
            w.add(f"{prefix}{i:05d}", "jpg", b"%d" % i, 0)
    return out


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """2,560 samples of fixed bytes in 64 tar shards, with the key file ShardWriter writes."""
    out = _written(str(tmp_path_factory.mktemp("ranklocal") / "pack"), "k", 2560, "84KB")
    assert 60 <= len(json.load(open(os.path.join(out, "manifest.json")))["shards"]) <= 70
    assert os.path.exists(os.path.join(out, "manifest.keys"))
    return out


def _child(out: str, split: str, ws: int, workers: int = 1, subset: str = "-", *more: str) -> dict:
    """Rank 0 of ``ws`` (``workers`` each) built and planned in a child process: the ``.idx``
    files it opened building (``built``) and in all (``opened``), the shards its plans read.
    ``more``: "checkpoint" (a state saved and loaded too), "epoch" (epoch 0 read too) and/or a
    Python expression of the source, in ``Source`` and ``out`` (in place of ``split`` and
    ``subset``)."""
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


@pytest.mark.parametrize("ws", [1, 8])
def test_a_val_epoch_opens_each_reached_index_once(pack, ws):
    """Rank 0 of ``ws`` plans and reads its val epoch opening each reached shard's index once:
    the head its split read for the shard's sides (checked by the manifest's
    ``columns_sha256``) is the one its samples' ranges are read through. Before, each twice
    (the range reader's own read, from the page cache)."""
    got = _child(pack, "val", ws, 1, "-", "epoch")
    assert got["opened"] and len(got["opened"]) == len(set(got["opened"])), got["opened"]
    assert {p.removesuffix(".idx") for p in got["opened"]} == set(got["read"])


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


#: Constructions of a pack ``P`` that are counted by its key file, as ``Source`` expressions:
#: a split, a subset by keys (alone, under a split), mixtures (of splits, of a key subset).
_KEYED = {
    "val": 'Source(P, split="val", val_fraction=0.2)',
    "train-subset": 'Source(P, split="train", subset=0.25)',
    "keys": 'Source(P, subset=[f"k{i:05d}" for i in range(2559, 0, -3)])',
    "keys-val": 'Source(P, split="val", subset=[f"k{i:05d}" for i in range(0, 2560, 2)])',
    "mix": '[Source(P, split="train"), Source(P, split="val")]',
    "mix-weighted": '[Source(P, split="train", weight=0.7), Source(P, split="val", weight=0.3)]',
    "mix-keys": '[Source(P, subset=[f"k{i:05d}" for i in range(0, 2560, 5)]), '
    'Source(P, split="val", subset=0.5)]',
}


def _made(expr: str, root: str):
    return eval(expr, {"Source": Source, "P": root})


@pytest.mark.parametrize(
    "name,epoch_size",
    [("val", None), ("train-subset", None), ("val", 700), ("keys", None), ("keys-val", None),
     ("keys", 900), ("mix", None), ("mix-weighted", None), ("mix", 1000),
     ("mix-keys", None)],
)  # fmt: skip
def test_the_key_file_gives_the_epochs_of_every_shards_heads(pack, tmp_path, name, epoch_size):
    """Every rank's and worker's samples, their order and the states are those of the same
    pack without a key file (every shard's index read at construction, as before)."""
    old = without_key_file(pack, str(tmp_path / "old"))

    def make(root, ws=3):
        return ShardDataset(
            _made(_KEYED[name], root), order=Order(buffer_size=5), seed=4, rank=1,
            world_size=ws, epoch_size=epoch_size,
        )  # fmt: skip

    new_ds, old_ds = make(pack), make(old)
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
    assert not state["dataset"]["mix"].startswith("k1:")
    assert keyed["dataset"]["mix"].startswith("k1:")
    assert {**keyed["dataset"], "mix": None} == {**state["dataset"], "mix": None}
    assert {**keyed, "dataset": None} == {**state, "dataset": None}
    new_ds.load_state_dict(state)  # a state saved without the key file loads with it
    old_ds.load_state_dict(keyed)


@pytest.mark.parametrize("name", ["keys", "keys-val", "mix", "mix-keys"])
def test_rank_zero_of_eight_reads_an_eighth_of_the_heads_of_keys_and_mixtures(pack, name):
    """A subset by keys finds each key's shard in the key file and a mixture draws each
    source as one source alone does, so rank 0 of 8 (two workers) builds, plans, saves its
    state and loads it opening only the indexes of the shards it reads, each once: at most
    1/8 of world size 1's plus two a source (its part's ends; here each source's share is
    its size: a source drawn more than once an epoch has a rank's part cover more of its
    shards). Before, construction read every shard's index (a key subset) or every epoch's
    draw did (a mixture), in each process."""
    expr = _KEYED[name].replace("P", "out")
    sources = expr.count("Source(")  # two of one pack: each reads its own shards' heads
    whole = _child(pack, "-", 1, 1, "-", expr)
    rank0 = _child(pack, "-", 8, 2, "-", "checkpoint", expr)
    assert rank0["built"] == 0
    assert len(whole["opened"]) > 0.6 * whole["shards"]  # the sources' shards, in all
    assert len(rank0["opened"]) <= sources * len(set(rank0["opened"]))  # once a source
    assert {p.removesuffix(".idx") for p in rank0["opened"]} <= set(rank0["read"])
    bound = len(whole["opened"]) / 8 + 2 * sources
    assert len(rank0["opened"]) <= bound, (rank0, whole["shards"])


def test_a_key_the_shards_do_not_hold_is_named(pack, tmp_path):
    """A key the key file does not hold is named at construction, as before, in one line; an
    empty list is refused as before, the key file not searched."""
    from shardkit.errors import InputError

    with pytest.raises(InputError, match="subset names 1 key.*'nope'") as err:
        ShardDataset(Source(pack, subset=["k00001", "nope"]), decode="raw")
    assert "\n" not in str(err.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no key file problem: an empty list has no members
        with pytest.raises(InputError, match="no samples to draw"):
            ShardDataset(Source(pack, subset=[]), decode="raw")


def test_a_key_file_whose_counts_are_not_the_shards_is_named(pack, tmp_path):
    """A key file edited (its size and head intact): its counts come from blocks each checked
    by its digest, so an edit is named in a warning and the split reads every shard's index
    (the honest epoch); edited with its block table and the manifest's ``blocks_sha256``
    computed again (vouched for), its count of a shard's val samples is not the shard index's,
    and the epoch that reaches the shard stops with an error naming the key file and the fix,
    never an epoch cut by wrong counts; a subset by keys it puts in the wrong shard stops with
    the subset's error naming the key, never a wrong sample."""
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
    table = block_table(hashes, column)  # the forgery vouched for: tables and manifest
    grid = _forged_counts(
        hashes, column, len(json.load(open(os.path.join(out, "manifest.json")))["shards"]), table
    )
    with open(keys, "r+b") as f:
        f.seek(HEAD + 12 * n)
        f.write(table + grid)
    path = os.path.join(out, "manifest.json")
    doc = json.load(open(path))
    doc["keys"]["blocks_sha256"] = hashlib.sha256(table).hexdigest()
    k = doc["keys"]["counts"]["k"]
    doc["keys"]["counts"]["sha256"] = hashlib.sha256(grid[: 16 << k]).hexdigest()
    with open(path, "w") as f:
        json.dump(doc, f)
    ds = ShardDataset(Source(out, split="val"), decode="raw")
    with pytest.raises(ShardFormatError) as err:
        list(ds)
    assert keys in str(err.value) and "delete it" in str(err.value)
    assert "\n" not in str(err.value)
    # a subset by keys takes the shard the key file names: the key is looked for in that
    # shard's own index when the epoch reaches it, and one it does not hold is named there
    from shardkit.errors import InputError
    from shardkit.formats.sample_index import key_hashes

    names = [f"k{i:05d}" for i in range(2560)]
    moved = names[int(np.argmin(key_hashes(names)))]  # shard a's first val key, "in b"
    ds = ShardDataset(Source(out, subset=["k00001", moved]), decode="raw")
    with pytest.raises(InputError, match=f"subset names 1 key.*'{moved}'") as err:
        list(ds)
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


def _forged_counts(hashes, shards, num_shards: int, blocks: bytes) -> bytes:
    """A run's count table from its columns and block table, as a writer computes it."""
    from shardkit.formats.key_file import CountTable

    table = CountTable(len(hashes), num_shards)
    table.add(np.asarray(hashes), np.asarray(shards))
    return table.table(blocks)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """8,000 samples in 4 shards: a key file with a count table of 2^5 points."""
    out = _written(str(tmp_path_factory.mktemp("wide") / "pack"), "w", 8000, "4.5MB")
    keys = json.load(open(os.path.join(out, "manifest.json")))["keys"]
    assert (
        keys["counts"]["k"] == 5
        and len(json.load(open(os.path.join(out, "manifest.json")))["shards"]) == 4
    )
    return out


def _key_file_bytes(monkeypatch, make) -> int:
    """The bytes ``make()`` reads from key files by ``os.pread`` (every partial read)."""
    got, real = [], os.pread

    def pread(fd, n, at):
        raw = real(fd, n, at)
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("manifest.keys"):
            got.append(len(raw))
        return raw

    with monkeypatch.context() as m:
        m.setattr(os, "pread", pread)
        make()
    return sum(got)


@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.6, 0.95])
def test_a_split_reads_one_count_vector_not_the_val_prefix(wide, monkeypatch, fraction):
    """A split's per-shard counts come from the key file's count table: its rows, one vector
    of ``4 * S`` bytes, the block-table rows of one segment and the blocks between the grid
    point and the threshold (at most two blocks of 512 here: 250 samples a point), whatever
    the val fraction (the prefix was 12 bytes a val sample: 29 KB at 0.3); the counts are the
    indexes'."""
    shards, k = 4, 5
    bound = (16 << k) + 4 * shards + 16 * 3 + 12 * 2 * 512
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read = _key_file_bytes(
            monkeypatch,
            lambda: ShardDataset(Source(wide, split="val", val_fraction=fraction), decode="raw"),
        )
    assert 0 < read <= bound, (read, bound)
    old = ShardDataset(Source(without_key_file(wide, wide + f"-old-{fraction}"), split="val",
                              val_fraction=fraction), decode="raw")  # fmt: skip
    new = ShardDataset(Source(wide, split="val", val_fraction=fraction), decode="raw")
    assert new.sources[0].side is not None and len(new) == len(old)
    assert list(new.sources[0].members.per_shard) == list(old.sources[0].members.per_shard)


def _vector_at(out: str, j: int) -> tuple[str, int, int, dict]:
    """The key file, the offset of its count table, of vector ``j``, and its listing."""
    doc = json.load(open(os.path.join(out, "manifest.json")))
    n, shards, keys = doc["num_samples"], len(doc["shards"]), doc["keys"]
    at = HEAD + 12 * n + 16 * -(-n // 512)
    return os.path.join(out, "manifest.keys"), at, at + (16 << 5) + 4 * shards * (j - 1), keys


def test_a_count_vector_edited_in_place_is_named_never_a_wrong_epoch(wide, tmp_path):
    """A vector of the count table edited in place (one val sample moved from shard 0's count
    to shard 1's: its sum, the point's position, kept) is not its point's digest: named in a
    warning, the split reads every shard's index (the honest epoch). Vouched for (its digest
    and the manifest's ``counts`` sha256 computed again), the epoch that reaches shard 0
    stops with an error naming the key file and the fix, never an epoch cut by wrong counts;
    and ``shardkit verify`` names it in one line (its vectors recomputed from the columns)."""
    import hashlib

    from conftest import run_cli
    from xxhash import xxh3_64_intdigest

    out = str(tmp_path / "forged")
    shutil.copytree(wide, out)
    j = 9  # 0.3 of hash space: the last of 32 points below it
    keys, table, at, listed = _vector_at(out, j)
    with open(keys, "r+b") as f:
        f.seek(at)
        vec = np.frombuffer(f.read(16), "<u4").copy()
        vec[0] -= 1
        vec[1] += 1
        f.seek(at)
        f.write(vec.tobytes())
    with pytest.warns(RuntimeWarning, match=r"manifest\.keys: its count table's point 9 is not"):
        ds = ShardDataset(Source(out, split="val", val_fraction=0.3), decode="raw",
                          with_keys=True)  # fmt: skip
    want = ShardDataset(Source(wide, split="val", val_fraction=0.3), decode="raw", with_keys=True)
    assert ds.sources[0].side is None and [s[2] for s in ds] == [s[2] for s in want]
    data = open(keys, "rb").read()  # the forgery vouched for: the point's digest, the manifest
    rows = np.frombuffer(data[table : table + (16 << 5)], "<u8").reshape(-1, 2).copy()
    n = json.load(open(os.path.join(out, "manifest.json")))["num_samples"]
    b0 = int(rows[j, 0]) // 512
    b1 = min(int(rows[j + 1, 0]) // 512, -(-n // 512) - 1) + 1
    blocks = data[HEAD + 12 * n + 16 * b0 : HEAD + 12 * n + 16 * b1]
    rows[j, 1] = xxh3_64_intdigest(vec.tobytes() + blocks)
    with open(keys, "r+b") as f:
        f.seek(table)
        f.write(rows.tobytes())
    path = os.path.join(out, "manifest.json")
    doc = json.load(open(path))
    doc["keys"]["counts"]["sha256"] = hashlib.sha256(rows.tobytes()).hexdigest()
    with open(path, "w") as f:
        json.dump(doc, f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # vouched for: it serves
        ds = ShardDataset(Source(out, split="val", val_fraction=0.3), decode="raw")
    assert ds.sources[0].side is not None
    with pytest.raises(ShardFormatError) as err:
        list(ds)
    assert keys in str(err.value) and "delete it" in str(err.value)
    assert "\n" not in str(err.value)
    r = run_cli("verify", out, "-q")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    (line,) = r.stdout.splitlines()
    assert line.startswith("BAD manifest.keys: its sha256 is not the manifest's")
    from shardkit.formats.key_file import key_file_sha256

    doc["keys"]["sha256"] = key_file_sha256(keys, n)  # the file's sha256 computed again too
    with open(path, "w") as f:
        json.dump(doc, f)
    r = run_cli("verify", out, "-q")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stdout.splitlines() == [
        f"BAD manifest.keys: its count table is not its columns' (point {j}: the counts below "
        f"it); delete it (`rm {keys}`): `get(key)` and growth read every shard's index instead "
        "until the next `shardkit pack --append` or `shardkit merge` of the dataset writes it anew"
    ]


def test_a_grown_dataset_with_and_without_count_tables_counts_every_run(wide, tmp_path):
    """Runs with a count table (the base), without one (a growth run too small for one), and
    a base from shardkit before the count table (its table cut off, ``counts`` not listed):
    the split uses the key file without a warning, its counts every run's, and gives the
    epochs of the same dataset without a key file."""
    from shardkit.formats.key_file import key_file_sha256
    from shardkit.write.merge import merge
    from shardkit.write.verify import verify

    more = str(tmp_path / "more")
    with ShardWriter(more, format="tar", shard_size="4.5MB", classes=["x"]) as w:
        for i in range(8000, 8100):
            w.add(f"w{i:05d}", "jpg", b"%d" % i, 0)
    grown, older = str(tmp_path / "grown"), str(tmp_path / "older")
    shutil.copytree(wide, grown)
    merge([grown, more], grown)
    shutil.copytree(grown, older)
    path = os.path.join(older, "manifest.json")
    doc = json.load(open(path))
    assert "counts" in doc["keys"] and "counts" not in doc["keys"]["runs"][0]
    keys, n = os.path.join(older, "manifest.keys"), 8000
    size = HEAD + 12 * n + 16 * -(-n // 512)
    with open(keys, "r+b") as f:
        f.truncate(size)
    del doc["keys"]["counts"]
    doc["keys"].update(bytes=size, sha256=key_file_sha256(keys, n))
    with open(path, "w") as f:
        json.dump(doc, f)
    assert verify(grown).ok and verify(older).ok
    for root in (grown, older):
        old = without_key_file(root, root + "-old")
        for fraction in (0.02, 0.3):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                new_ds = ShardDataset(Source(root, split="val", val_fraction=fraction),
                                      decode="raw", seed=2)  # fmt: skip
            old_ds = ShardDataset(Source(old, split="val", val_fraction=fraction),
                                  decode="raw", seed=2)  # fmt: skip
            assert new_ds.sources[0].side is not None and len(new_ds) == len(old_ds)
            got, want = new_ds.sources[0].members, old_ds.sources[0].members
            assert list(got.per_shard) == list(want.per_shard)
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
