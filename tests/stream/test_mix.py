"""Mixtures, subsets, splits and epoch size: exact counts, stratified batches, exact resume."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DataLoader

from shardkit import InputError, Order
from shardkit.errors import ShardFormatError
from shardkit.stream.dataset import ShardDataset, Source
from shardkit.stream.mix import apportion, split_members
from shardkit.write.writer import ShardWriter

B = 64
EPOCH = 10_000


def _write(out, prefix: str, n: int, fmt: str, shard_size: str, classes=("x", "y")) -> str:
    with ShardWriter(str(out), format=fmt, shard_size=shard_size, classes=list(classes)) as w:
        for i in range(n):
            w.add(f"{prefix}{i:05d}", "jpg", b"%d" % i, i % len(classes))
    return str(out)


@pytest.fixture(scope="module")
def mixdata(tmp_path_factory):
    """big: 8,000 samples in tar shards (more than its 7,000 share: drawn without replacement);
    small: 300 in one LMDB (a tenth of its 3,000 share: repeated ten times)."""
    base = tmp_path_factory.mktemp("mix")
    big = _write(base / "big", "a/", 8000, "tar", "60KB")
    small = _write(base / "small", "b/", 300, "lmdb", "1MB", classes=("x", "y", "z"))
    return big, small


def _mix(mixdata, *, equalize="pad", **kw) -> ShardDataset:
    """Two sources mixed 0.7/0.3 over EPOCH samples, a buffer of 100; ``equalize``: the
    ``Order``'s."""
    big, small = mixdata
    kw.setdefault("decode", "raw")
    kw.setdefault("with_keys", True)
    kw.setdefault("order", Order(buffer_size=100, equalize=equalize))
    kw.setdefault("epoch_size", EPOCH)
    kw.setdefault("seed", 3)
    return ShardDataset([Source(big, weight=0.7), Source(small, weight=0.3)], **kw)


def _keys(loader) -> list[list[str]]:
    return [list(b[2]) for b in loader]


def _flat(batches):
    return [k for b in batches for k in b]


def test_apportion_is_exact_and_deterministic():
    assert apportion(10_000, [0.7, 0.3]) == [7000, 3000]
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(apportion(997, [0.5, 0.25, 0.125, 0.125])) == 997


def test_mixture_counts_are_exact_and_every_batch_follows_the_weights(mixdata):
    ds = _mix(mixdata, batch_size=B)
    assert len(ds) == EPOCH and ds.shares == (7000, 3000)
    draws = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        batches = _keys(DataLoader(ds, batch_size=B, num_workers=2))
        assert len(batches) == -(-EPOCH // B)
        keys = _flat(batches)
        big = [k for k in keys if k.startswith("a/")]
        small = Counter(k for k in keys if k.startswith("b/"))
        assert len(big) == 7000 == len(set(big))  # without replacement
        assert len(small) == 300 and set(small.values()) == {10}  # repeated: ten times each
        for b in batches[:-1]:
            assert abs(sum(k.startswith("a/") for k in b) - 45) <= 2, b
        draws.append(set(big))
    assert draws[0] != draws[1]  # a fresh draw each epoch


def test_every_window_of_64_holds_44_or_45_of_the_07_source(mixdata):
    ds = _mix(mixdata)
    ds.set_epoch(3)
    big = np.array([s[2].startswith("a/") for s in ds], dtype=int)
    windows = np.convolve(big, np.ones(B, dtype=int), "valid")
    assert set(windows.tolist()) == {44, 45}


def test_mixture_repeats_the_same_epoch_for_the_same_seed_and_epoch(mixdata):
    one, two = _mix(mixdata), _mix(mixdata)
    one.set_epoch(4), two.set_epoch(4)
    first = [s[2] for s in one]
    assert first == [s[2] for s in two]
    other = _mix(mixdata, seed=4)
    other.set_epoch(4)
    assert first != [s[2] for s in other]


def test_weights_default_to_sizes_and_epoch_size_to_the_sum(mixdata):
    big, small = mixdata
    ds = ShardDataset([Source(big), Source(small)], decode="raw")
    assert ds.shares == (8000, 300) and len(ds) == 8300
    with pytest.raises(InputError, match="weight"):
        ShardDataset([Source(big, weight=1), Source(small)], decode="raw")
    for bad in (-1, 0, float("nan"), "0.7", True):
        with pytest.raises(InputError, match="weight"):
            Source(big, weight=bad)


def test_epoch_size_on_a_plain_source(mixdata):
    big, _ = mixdata
    ds = ShardDataset(big, decode="raw", with_keys=True, epoch_size=500, order=Order(buffer_size=0))
    keys = [s[2] for s in ds]
    assert len(ds) == len(keys) == 500 == len(set(keys))


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_at_any_batch_gives_exactly_the_rest(mixdata, world_size, num_workers):
    for rank in range(world_size):
        kw = dict(rank=rank, world_size=world_size, batch_size=B)
        ds = _mix(mixdata, **kw)
        ds.set_epoch(2)
        full = _keys(DataLoader(ds, batch_size=B, num_workers=num_workers))
        for k in (1, len(full) // 3 + rank, len(full) - 1):
            ds = _mix(mixdata, **kw)
            ds.set_epoch(2)
            state = ds.state_dict(batches=k, num_workers=num_workers)
            again = _mix(mixdata, **kw)
            again.load_state_dict(json.loads(json.dumps(state)))
            after = _keys(DataLoader(again, batch_size=B, num_workers=num_workers))
            assert full[:k] + after == full


def test_resume_after_every_batch_of_a_short_epoch(mixdata):
    kw = dict(epoch_size=1000, batch_size=B, rank=1, world_size=2)
    ds = _mix(mixdata, **kw)
    ds.set_epoch(6)
    full = _keys(DataLoader(ds, batch_size=B))
    assert len(full) == 8
    for k in range(len(full) + 1):
        state = ds.state_dict(batches=k, num_workers=0)
        again = _mix(mixdata, **kw)
        again.load_state_dict(state)
        if k == len(full):  # saved at the epoch's end: the next epoch follows
            assert again.epoch == 7
            break
        assert full[:k] + _keys(DataLoader(again, batch_size=B)) == full


def test_ranks_see_disjoint_positions_and_together_the_epoch(mixdata):
    per_rank = []
    for rank in range(2):
        ds = _mix(mixdata, rank=rank, world_size=2, equalize="none")
        ds.set_epoch(1)
        per_rank.append([s[2] for s in ds])
    whole = _mix(mixdata)
    whole.set_epoch(1)
    assert Counter(per_rank[0]) + Counter(per_rank[1]) == Counter(s[2] for s in whole)
    big = [set(k for k in r if k.startswith("a/")) for r in per_rank]
    assert not big[0] & big[1]


@pytest.mark.parametrize(("old", "new", "workers"), [(2, 1, 2), (3, 2, 0), (1, 3, 1)])
def test_elastic_resume_delivers_the_rest_of_the_mixture_once(mixdata, old, new, workers):
    kw = dict(equalize="none", batch_size=B)
    whole = _mix(mixdata)
    whole.set_epoch(5)
    epoch = Counter(s[2] for s in whole)
    before, k = [], 9
    for rank in range(old):
        ds = _mix(mixdata, rank=rank, world_size=old, **kw)
        ds.set_epoch(5)
        before += _flat(_keys(DataLoader(ds, batch_size=B, num_workers=workers))[:k])
        if rank == 0:
            state = ds.state_dict(batches=k, num_workers=workers)
    after = []
    for rank in range(new):
        ds = _mix(mixdata, rank=rank, world_size=new, **kw)
        ds.load_state_dict(state)
        after += _flat(_keys(DataLoader(ds, batch_size=B, num_workers=2)))
    assert len(before) == old * k * B
    assert Counter(before) + Counter(after) == epoch


def test_in_process_state_resumes_with_nothing_replayed(mixdata):
    ds = _mix(mixdata)
    ds.set_epoch(1)
    full = [s[2] for s in ds]
    ds = _mix(mixdata)
    ds.set_epoch(1)
    it = iter(ds)
    before = [next(it)[2] for _ in range(4321)]
    state = ds.state_dict()
    it.close()
    again = _mix(mixdata)
    again.load_state_dict(state)
    assert before + [s[2] for s in again] == full


def test_a_state_from_another_mixture_is_refused(mixdata):
    ds = _mix(mixdata)
    ds.set_epoch(1)
    state = ds.state_dict(batches=3, num_workers=0, batch_size=B)
    big, small = mixdata
    other = ShardDataset(
        [Source(big, weight=0.6), Source(small, weight=0.4)],
        decode="raw",
        epoch_size=EPOCH,
        order=Order(buffer_size=100),
        seed=3,
    )
    with pytest.raises(InputError, match="settings the state was saved with|mix"):
        other.load_state_dict(state)


def test_two_parts_of_one_lmdb_read_side_by_side(mixdata):
    """LMDB opens a file once per process: both parts share one environment, read interleaved."""
    _, small = mixdata
    ds = ShardDataset(
        [Source(small, split="train"), Source(small, split="val")],
        decode="raw",
        with_keys=True,
        order=Order(shuffle=False),
    )
    keys = [s[2] for s in ds]
    assert sorted(keys) == sorted(f"b/{i:05d}" for i in range(300))
    from shardkit import ShardView

    view = ShardView(small, decode="raw", with_keys=True)
    it = iter(ds)
    assert [view.get(next(it)[2])[2] for _ in range(5)] == keys[:5]  # a view beside a stream
    it.close()
    view.close()


def test_labels_keep_or_union(mixdata):
    big, small = mixdata  # ["x", "y"] and ["x", "y", "z"]: they agree label by label
    kept = ShardDataset([Source(big), Source(small)], decode="raw", order=Order(buffer_size=0))
    assert kept.classes == ["x", "y", "z"]
    union = ShardDataset([Source(small), Source(big)], decode="raw", labels="union", with_keys=True)
    assert union.classes == ["x", "y", "z"]
    for _, label, key in union:
        i = int(key[2:])
        want = ["x", "y"][i % 2] if key.startswith("a/") else ["x", "y", "z"][i % 3]
        assert union.classes[label] == want


# --- subsets and splits ------------------------------------------------------------------------


def test_subset_fraction_is_seeded(mixdata):
    big, _ = mixdata

    def keys(seed):
        ds = ShardDataset(Source(big, subset=0.01), decode="raw", with_keys=True, seed=seed)
        return {s[2] for s in ds}

    assert len(keys(1)) == 80
    assert keys(1) == keys(1)
    assert keys(1) != keys(2)


def test_subset_by_keys_and_an_unknown_key(mixdata):
    big, _ = mixdata
    want = ["a/00003", "a/07999", "a/00100"]
    ds = ShardDataset(Source(big, subset=want), decode="raw", with_keys=True)
    assert sorted(s[2] for s in ds) == sorted(want)
    with pytest.raises(InputError, match="a/nope"):
        ShardDataset(Source(big, subset=["a/00001", "a/nope"]), decode="raw")


def test_split_is_disjoint_covering_and_stable_after_a_repack(tmp_path):
    first = _write(tmp_path / "one", "k", 500, "tar", "8KB")
    again = _write(tmp_path / "two", "k", 500, "lmdb", "1MB")  # the same keys, re-packed

    def part(src, split, seed=0):
        ds = ShardDataset(
            Source(src, split=split, val_fraction=0.2), decode="raw", with_keys=True, seed=seed
        )
        assert len(ds) == len(keys := [s[2] for s in ds])  # len() is exact
        return keys

    train, val = part(first, "train"), part(first, "val")
    assert 70 <= len(val) <= 130 and len(train) + len(val) == 500  # about a fifth
    assert not set(train) & set(val) and len(set(train) | set(val)) == 500
    assert set(part(again, "val")) == set(val)
    assert set(part(again, "train")) == set(train)
    assert set(part(first, "val", seed=9)) == set(val)  # the seed shuffles; it moves no sample


def test_split_members_depends_on_each_key_alone():
    keys = [f"s{i}" for i in range(1000)]
    val = {keys[i] for i in split_members(keys, "val", 0.1)}
    shuffled = list(reversed(keys))
    assert {shuffled[i] for i in split_members(shuffled, "val", 0.1)} == val
    grown = keys[::2] + [f"new{i}" for i in range(3000)]  # some keys gone, many added
    assert {grown[i] for i in split_members(grown, "val", 0.1)} & set(keys) == val & set(grown)
    # the documented rule (FORMAT.md): val iff the key's 64-bit BLAKE2b is below f * 2**64
    rule = {
        k for k in keys
        if int.from_bytes(hashlib.blake2b(b"shardkit-split:" + k.encode(), digest_size=8)
                          .digest(), "big") < 0.1 * 2**64
    }  # fmt: skip
    assert rule == val and 70 <= len(val) <= 130
    wider = {keys[i] for i in split_members(keys, "val", 0.2)}
    assert val < wider  # a larger fraction only moves samples from train to val


def test_val_keys_stay_val_when_the_dataset_grows(tmp_path):
    """Pack, note the val keys, append more images: every old sample keeps its side."""
    from conftest import image_tree

    from shardkit.write.packer import pack

    image_tree(tmp_path / "v1", 60, classes=2)
    out = tmp_path / "out"
    pack(str(tmp_path / "v1"), str(out), format="tar", progress=False)

    def sides():
        got = {}
        for split in ("train", "val"):
            ds = ShardDataset(
                Source(str(out), split=split, val_fraction=0.3), decode="raw", with_keys=True
            )
            got.update((s[2], split) for s in ds)
        return got

    before = sides()
    assert set(before.values()) == {"train", "val"}
    more = tmp_path / "v2"
    image_tree(more, 90, classes=2, size=(9, 7))
    for path in more.rglob("*.jpg"):  # other file names: new keys, not the packed ones
        path.rename(path.with_name("more_" + path.name))
    pack(str(more), str(out), format="tar", append=True, progress=False)
    after = sides()
    assert len(after) == 150
    assert {k: after[k] for k in before} == before


def test_bad_mixture_arguments_are_clear_errors(mixdata):
    big, small = mixdata
    with pytest.raises(InputError, match="split"):
        Source(big, split="test")
    with pytest.raises(InputError, match="fraction"):
        ShardDataset(Source(big, subset=1.5))
    with pytest.raises(InputError, match="fraction or a list"):
        ShardDataset(Source(big, subset=True))
    with pytest.raises(InputError, match="each Source"):
        ShardDataset(Source([Source(big), Source(small)], subset=0.5))
    with pytest.raises(InputError, match="epoch_size"):
        ShardDataset(big, epoch_size=0)
    with pytest.raises(InputError, match="wrap every path"):
        ShardDataset([Source(big), os.path.join(small, "x.lmdb")])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"epoch_size": float("nan")}, "epoch_size=nan must be a whole number"),
        ({"epoch_size": float("inf")}, "epoch_size=inf must be a whole number"),
        ({"epoch_size": 2.7}, "epoch_size=2.7 must be a whole number"),  # not cut to 2
        ({"epoch_size": "7"}, "epoch_size='7' must be a whole number"),
        ({"split": "val", "val_fraction": "0.1"}, "val_fraction='0.1' must be a number"),
    ],
)
def test_mixture_settings_that_would_crash_or_be_cut_are_one_line_errors(mixdata, kw, match):
    with pytest.raises(InputError, match=match) as err:
        ShardDataset(mixdata[1], decode="raw", **kw)
    assert "\n" not in str(err.value)


def test_weights_whose_sum_overflows_are_refused(mixdata):
    big, small = mixdata
    with pytest.raises(InputError, match="sum to more than a float holds"):
        ShardDataset([Source(big, weight=1e308), Source(small, weight=1e308)], decode="raw")
    huge = ShardDataset([Source(big, weight=1e308), Source(small, weight=1e290)], epoch_size=100)
    assert huge.shares == (100, 0)  # each weight finite, their sum too: shares, not a crash


def test_numpy_numbers_are_numbers(mixdata):
    big, small = mixdata
    ds = ShardDataset(
        [Source(big, weight=np.float32(0.7)), Source(small, weight=np.int64(3) / 10)],
        decode="raw", epoch_size=np.int64(100),
    )  # fmt: skip
    assert ds.shares == (70, 30) and len(ds) == 100
    assert json.loads(json.dumps(ds.state_dict()))  # the checkpoint facts are plain JSON
    sub = ShardDataset(Source(small, subset=np.float32(0.5)), decode="raw", with_keys=True)
    assert len(sub) == 150 and len({s[2] for s in sub}) == 150
    assert (
        len(ShardDataset(Source(small, split="val", val_fraction=np.float64(0.5)), decode="raw"))
        > 0
    )
    with pytest.raises(InputError, match="subset"):
        ShardDataset(Source(small, subset=np.bool_(True)))


def test_stratified_windows_hold_for_three_sources(tmp_path):
    srcs = [_write(tmp_path / f"s{i}", f"{i}/", 50 * (i + 1), "tar", "40KB") for i in range(3)]
    ds = ShardDataset(
        [Source(s, weight=w) for s, w in zip(srcs, (0.5, 0.3, 0.2), strict=True)],
        decode="raw",
        with_keys=True,
        epoch_size=3000,
        order=Order(buffer_size=20),
    )
    src = np.array([int(s[2][0]) for s in ds])
    assert np.bincount(src).tolist() == [1500, 900, 600]
    for start in range(len(src) - B + 1):  # every window of 64, not only aligned ones
        counts = np.bincount(src[start : start + B], minlength=3)
        assert (np.abs(counts - np.array([0.5, 0.3, 0.2]) * B) <= 2).all(), (start, counts)


def test_a_source_repacked_after_the_mixture_was_built_is_refused(tmp_path):
    a = _write(tmp_path / "a", "a/", 50, "tar", "40KB")
    b = _write(tmp_path / "b", "b/", 20, "lmdb", "1MB")
    ds = ShardDataset([Source(a, weight=0.5), Source(b, weight=0.5)], decode="raw")
    shutil.rmtree(a)
    _write(tmp_path / "a", "z/", 50, "tar", "40KB")  # the same names and sizes, other samples
    with pytest.raises(ShardFormatError, match="re-packed"):
        list(ds)


def test_labels_keep_takes_class_lists_that_agree_label_by_label(tmp_path):
    xy = _write(tmp_path / "xy", "a/", 6, "tar", "1MB", classes=("x", "y"))
    xyz = _write(tmp_path / "xyz", "b/", 6, "lmdb", "1MB", classes=("x", "y", "z"))
    yx = _write(tmp_path / "yx", "c/", 6, "tar", "1MB", classes=("y", "x"))
    with ShardWriter(str(tmp_path / "none"), shard_size="1MB") as w:  # captions: no labels
        for i in range(4):
            w.add(f"d/{i}", "jpg", b"%d" % i, -1, {"txt": "a caption"})
    ds = ShardDataset([Source(xy), Source(xyz)], decode="raw", with_keys=True)
    assert ds.classes == ["x", "y", "z"]  # a longer list adds classes at the end, as merge does
    assert sorted(label for _, label, _ in ds) == [0] * 5 + [1] * 5 + [2] * 2
    with_none = ShardDataset([Source(xy), Source(str(tmp_path / "none"))], decode="raw")
    assert with_none.classes is None and sorted(label for _, label in with_none)[:4] == [-1] * 4
    with pytest.raises(
        InputError,
        match=r"yx and .*xyz store labels under other class lists \(\['y', 'x'\] and "
        r"\['x', 'y', 'z'\]\), so a stored label would mean two classes: pass labels=\"union\"",
    ):
        ShardDataset([Source(xyz), Source(yx)], decode="raw")
    union = ShardDataset([Source(xyz), Source(yx)], decode="raw", labels="union", with_keys=True)
    assert union.classes == ["x", "y", "z"]
    got = {k: label for _, label, k in union}
    assert got["b/00002"] == 2 and got["c/00000"] == 1 and got["c/00001"] == 0  # mapped by name


def test_with_source_names_each_samples_source_per_sample_and_per_batch(mixdata):
    big, small = mixdata
    ds = _mix(mixdata, with_keys=("key", "source"), batch_size=B)
    assert ds.source_names == (big, small)
    seen = Counter()
    for _, _, key, source in ds:
        assert source == (0 if key.startswith("a/") else 1)
        seen[source] += 1
    assert seen == {0: 7000, 1: 3000}
    batches = list(DataLoader(ds, batch_size=B, num_workers=2))  # default collate: a tensor
    for _, _, keys, sources in batches:
        assert sources.tolist() == [0 if k.startswith("a/") else 1 for k in keys]
    plain = ShardDataset(big, decode="raw", with_keys="source", order=Order(shuffle=False))
    assert {s for _, _, s in plain} == {0} and plain.source_names[0].endswith("big")
    with pytest.raises(InputError, match="with_keys='path'"):
        ShardDataset(big, with_keys="path")


def test_with_source_leaves_exact_resume_unchanged(mixdata):
    """Resumed at a batch, the rest is the same samples with and without sources, and each
    sample keeps its source."""
    rests = []
    for extras in (True, ("key", "source")):
        kw = dict(with_keys=extras, batch_size=B)
        ds = _mix(mixdata, **kw)
        ds.set_epoch(1)
        full = _keys(DataLoader(ds, batch_size=B, num_workers=2))
        state = ds.state_dict(batches=50, num_workers=2)
        again = _mix(mixdata, **kw)
        again.load_state_dict(json.loads(json.dumps(state)))
        batches = list(DataLoader(again, batch_size=B, num_workers=2))
        assert full[:50] + [list(b[2]) for b in batches] == full
        if extras is not True:
            for b in batches:
                assert b[3].tolist() == [0 if k.startswith("a/") else 1 for k in b[2]]
        rests.append(full)
    assert rests[0] == rests[1]
