"""A hash column that lies with the manifest's word behind it: an ``.idx`` whose split hashes
were edited and whose checksums (the file's trailer, the manifest's ``index_sha256`` and
``columns_sha256``) were all computed again from the edited bytes, as a tool that recomputes a
manifest's checksums from the files on disk would. Nothing vouches for the column but the keys
themselves: a split never moves a sample between train and val without a one-line error, a
merge or an append never hands the column on, and ``get(key)`` and a key subset answer from the
keys."""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import numpy as np
import pytest
from conftest import one_shard_tar, quiet, random_tree, ranged_pack, split_keys

from shardkit import Order, ShardDataset, ShardView, Source
from shardkit.errors import InputError, ShardFormatError
from shardkit.formats.sample_index import _HEAD, decode_index, index_digests, index_path, key_hashes
from shardkit.manifest import read_manifest
from shardkit.write.merge import merge
from shardkit.write.packer import pack

VAL = 0.2


def _truth(out) -> tuple[set[str], set[str]]:
    """(val keys, train keys) by each key's own hash, from a plain epoch (no index used)."""
    ds = ShardDataset(out, decode="raw", with_keys=True, order=Order(shuffle=False))
    keys = [s[2] for s in ds]
    val = {k for k, h in zip(keys, key_hashes(keys).tolist(), strict=True) if h < VAL * 2**64}
    return val, set(keys) - val


def _split(out, split: str, **kw) -> list[str]:
    return split_keys(out, split, VAL, **kw)


@pytest.fixture
def tar_pack(tmp_path):
    return one_shard_tar(tmp_path)


def _lie(out, *, to_train: bool = True, damaged: bool = False) -> tuple[str, int]:
    """One sample's split hash in the only shard's .idx moved across the split (a val sample's
    set to the largest: train under any fraction; ``to_train`` False: a train sample's to 5,
    val under any), then (unless ``damaged``) the file's trailer and the manifest's
    ``index_sha256`` and ``columns_sha256`` computed again to agree. The key and its place."""
    (entry,) = read_manifest(out).shards
    path = index_path(os.path.join(out, entry.path))
    data = bytearray(open(path, "rb").read())
    ix = decode_index(bytes(data), path)
    hashes = ix.hashes.tolist()
    if to_train:
        i = next(i for i, h in enumerate(hashes) if h < VAL * 2**64)
    else:
        i = next(i for i, h in enumerate(hashes) if h >= VAL * 2**64 and h < 2**63)
    at = _HEAD.size + 8 * (ix.samples + 1) + 8 * i
    data[at : at + 8] = ((1 << 64) - 1 if to_train else 5).to_bytes(8, "little")
    if not damaged:
        data[-32:] = hashlib.sha256(bytes(data[:-32])).digest()
    with open(path, "wb") as f:
        f.write(data)
    if not damaged:
        mpath = os.path.join(out, "manifest.json")
        doc = json.load(open(mpath))
        doc["shards"][0].update(index_digests(bytes(data), ix.samples))
        with open(mpath, "w") as f:
            json.dump(doc, f)
    return ix.key(i), i


# --- a split never exchanges samples ----------------------------------------------------------


def _sides_or_error(out, **kw):
    """Both sides' keys, or the error each side ended in (its message)."""
    got = {}
    for split in ("val", "train"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got[split] = _split(out, split, **kw)
        except ShardFormatError as exc:
            got[split] = str(exc)
    return got


@pytest.mark.parametrize("to_train", [True, False], ids=["val-as-train", "train-as-val"])
def test_a_lying_column_with_recomputed_checksums_moves_no_sample(tar_pack, to_train):
    """val is read as exact ranges, train streams under a mask built from the column: every
    key train reads is hashed and compared with its side, so the moved sample is an error
    naming the shard and its key, never a val sample in train (or a train one in val). The
    pack's key file counts each shard's val samples by the keys, so the column's count is not
    the key file's either: a val epoch, which reads no train sample, names the one moved out of
    val too (before the key file counted the split, it ended short of it)."""
    val, train = _truth(tar_pack)
    assert 2 * len(val) < len(train)  # val: ranges; train: streamed
    key, _ = _lie(tar_pack, to_train=to_train)
    assert (key in val) is to_train
    got = _sides_or_error(tar_pack)
    for split, truth in (("val", val), ("train", train)):
        if isinstance(got[split], list):
            assert set(got[split]) <= truth, split  # never a sample of the other side
            assert set(got[split]) == truth - {key}
        else:
            message = got[split]
            assert "shard-000000.tar" in message and repr(key) in message, message
            assert "\n" not in message
    assert isinstance(got["train"], str)  # the streamed side saw the moved sample either way
    assert isinstance(got["val"], str)  # the key file's count is not the column's: named


def test_a_lying_column_is_caught_when_both_sides_stream(tar_pack):
    """A val fraction above half of the shard: both sides stream, both check each key."""
    key, _ = _lie(tar_pack)
    for split in ("val", "train"):
        with pytest.raises(ShardFormatError, match=repr(key)):
            quiet(
                lambda s=split: [
                    r[2]
                    for r in ShardDataset(
                        Source(tar_pack, split=s, val_fraction=0.9), decode="raw", with_keys=True
                    )
                ]
            )


def test_a_lying_column_is_caught_through_a_mixture_and_workers(tar_pack):
    """The check is the reader's, so a Source in a mixture and DataLoader workers keep it."""
    from torch.utils.data import DataLoader

    key, _ = _lie(tar_pack)
    ds = ShardDataset(
        [Source(tar_pack, split="train", val_fraction=VAL), Source(tar_pack, subset=0.5)],
        decode="raw",
        with_keys=True,
    )
    with pytest.raises(ShardFormatError, match=repr(key)):
        quiet(lambda: list(ds))
    loader = DataLoader(ds, batch_size=None, num_workers=1)
    with pytest.raises(Exception, match=repr(key)):
        quiet(lambda: list(loader))


def _checks_in_c(monkeypatch) -> list[bool]:
    """Whether each call of the C parser made by a streamed read was given a split's sides to
    check each key against (``reader._tar_samples``: 12 arguments, then the sides' 4, the
    split's bits first: empty where only the digests that follow are checked)."""
    from shardkit.formats.tar import reader

    real, calls = reader._tar_samples, []

    def counting(*args):
        calls.append(len(args) > 12 and len(args[12]) > 0)
        return real(*args)

    monkeypatch.setattr(reader, "_tar_samples", counting)
    return calls


def test_a_streamed_split_checks_each_key_once_a_process_while_its_shard_is_unchanged(
    tar_pack, monkeypatch
):
    """The train side streams and checks every key in C (a BLAKE2b of each); the answers are a
    function of the shard's bytes and the split's bits, so the next epoch of the same process
    over the same file skips them. Any change to the file (here its times: ``utime`` moves the
    ctime too) is read and checked again."""
    from shardkit.formats import sample_index

    monkeypatch.setattr(sample_index, "RACY_NS", 0)  # the pack is seconds old
    monkeypatch.setattr(sample_index, "_CHECKED", type(sample_index._CHECKED)())
    calls = _checks_in_c(monkeypatch)
    ds = ShardDataset(
        Source(tar_pack, split="train", val_fraction=VAL), decode="raw", with_keys=True
    )
    assert set(_four_epochs_checked_twice(ds, tar_pack, calls)) == _truth(tar_pack)[1]


def _four_epochs_checked_twice(ds, tar_pack, calls: list[bool]) -> list[str]:
    """Four epochs of ``ds`` over the one-shard ``tar_pack``, the shard's times changed
    before the third: every C call of epochs 0 and 2 checks keys (``calls``), none of epochs 1
    and 3, and every epoch gives the same keys (returned, sorted)."""
    (entry,) = read_manifest(tar_pack).shards
    shard = os.path.join(tar_pack, entry.path)
    epochs = []
    for epoch in range(4):
        if epoch == 2:
            os.utime(shard, ns=(1, 1))
        ds.set_epoch(epoch)
        calls.clear()
        epochs.append(sorted(s[2] for s in ds))
        assert calls, epoch
        assert all(calls) if epoch in (0, 2) else not any(calls), (epoch, calls)
    assert all(keys == epochs[0] for keys in epochs)
    return epochs[0]


def _key_checks_at(monkeypatch) -> list[bool]:
    """Whether each call of the C parser made by a ranged read was given the index's key
    hashes to check each key against (``reader._tar_at``'s fourth argument: empty where the
    keys are known to be the index's already)."""
    from shardkit.formats.tar import reader

    real, calls = reader._tar_at, []

    def counting(*args):
        calls.append(len(args[3]) > 0)
        return real(*args)

    monkeypatch.setattr(reader, "_tar_at", counting)
    return calls


def test_a_ranged_split_hashes_each_key_once_a_process_while_its_shard_is_unchanged(
    tar_pack, monkeypatch
):
    """The val side is read as ranges, each key hashed in C and compared with its index's hash;
    a later epoch of the same process over the same file and index checks each sample's digest
    again (the bytes its key is part of) but hashes no key. Any change to the file (here its
    times) is read and checked again, and the samples stay the same."""
    from shardkit.formats import sample_index
    from shardkit.stream import ranges

    monkeypatch.setattr(sample_index, "RACY_NS", 0)  # the pack is seconds old
    monkeypatch.setattr(ranges, "_CACHE", type(ranges._CACHE)())
    calls = _key_checks_at(monkeypatch)
    ds = ShardDataset(Source(tar_pack, split="val", val_fraction=VAL), decode="raw", with_keys=True)
    assert set(_four_epochs_checked_twice(ds, tar_pack, calls)) == _truth(tar_pack)[0]


def test_a_ranged_split_over_several_shards_hashes_no_key_in_its_second_epoch(
    tmp_path, monkeypatch
):
    """Each shard's keys are remembered under its own file's identity, so with several shards
    read in turn (each closing the one before) a second epoch hashes no key either."""
    from shardkit.formats import sample_index
    from shardkit.stream import ranges

    monkeypatch.setattr(sample_index, "RACY_NS", 0)
    monkeypatch.setattr(ranges, "_CACHE", type(ranges._CACHE)())
    where = str(ranged_pack(tmp_path, 120, "20kB") / "tar")
    assert len(read_manifest(where).shards) > 2
    calls = _key_checks_at(monkeypatch)
    ds = ShardDataset(Source(where, split="val", val_fraction=VAL), decode="raw", seed=1)
    first = sum(1 for _ in ds)
    assert calls and all(calls)
    ds.set_epoch(1)
    calls.clear()
    assert sum(1 for _ in ds) == first
    assert calls and not any(calls)


def test_a_column_that_lies_after_an_honest_ranged_epoch_is_still_caught(tar_pack, monkeypatch):
    """An index edited after an honest val epoch is another index (read again, its own keys
    remembered from nothing): a train sample its column now puts in val is hashed and named."""
    from shardkit.formats import sample_index
    from shardkit.stream import ranges

    monkeypatch.setattr(sample_index, "RACY_NS", 0)
    monkeypatch.setattr(ranges, "_CACHE", type(ranges._CACHE)())
    assert _split(tar_pack, "val")  # honest: remembered
    assert any(c.keys for c in ranges._CACHE.values() if c is not None)
    key, _ = _lie(tar_pack, to_train=False)
    with pytest.raises(ShardFormatError, match=repr(key)):
        quiet(_split, tar_pack, "val")


def test_a_column_that_lies_after_an_honest_epoch_is_still_caught(tar_pack, monkeypatch):
    """A split built after the column was edited gives its samples other bits: the slice read
    under them is not one checked before, so every key is checked again, and the moved sample
    is named."""
    from shardkit.formats import sample_index

    monkeypatch.setattr(sample_index, "RACY_NS", 0)
    monkeypatch.setattr(sample_index, "_CHECKED", type(sample_index._CHECKED)())
    assert _split(tar_pack, "train")  # honest: remembered
    assert sample_index._CHECKED
    key, _ = _lie(tar_pack)
    with pytest.raises(ShardFormatError, match=repr(key)):
        quiet(_split, tar_pack, "train")


# --- get(key) and a key subset answer from the keys -------------------------------------------


@pytest.mark.parametrize("damaged", [False, True], ids=["checksums-recomputed", "flagged"])
def test_get_finds_a_key_whose_stored_hash_is_wrong(tar_pack, damaged):
    key, i = _lie(tar_pack, damaged=damaged)
    truth = ShardView(tar_pack, decode="raw", with_keys=True)
    want = quiet(lambda: truth[i])
    assert want[2] == key
    assert quiet(ShardView(tar_pack, decode="raw", with_keys=True).get, key) == want  # key file
    os.unlink(os.path.join(tar_pack, "manifest.keys"))  # none: the stored columns decide
    for lookups in (1, 3):  # the first lookup scans columns; later ones search one table
        view = ShardView(tar_pack, decode="raw", with_keys=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(lookups - 1):
                assert view.get("c0/im000")[2] == "c0/im000"
            assert view.get(key) == want
            assert view.index(key) == i
        said = "\n".join(str(w.message) for w in caught)
        assert "shard-000000.tar.idx" in said
        with pytest.raises(InputError, match="no sample with key 'nope'"):
            quiet(view.get, "nope")
        view.close()
    truth.close()


@pytest.mark.parametrize("damaged", [False, True], ids=["checksums-recomputed", "flagged"])
def test_a_key_subset_reads_a_key_whose_stored_hash_is_wrong(tar_pack, damaged):
    key, _ = _lie(tar_pack, damaged=damaged)
    wanted = [key, "c1/im001", "c2/im005"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = ShardDataset([Source(tar_pack, subset=wanted)], decode="raw", with_keys=True)
        got = sorted(s[2] for s in ds)
    assert got == sorted(wanted)
    assert "shard-000000.tar.idx" in "\n".join(str(w.message) for w in caught)


@pytest.fixture
def lmdb_pack(tmp_path):
    out = str(tmp_path / "lmdb")
    quiet(pack, random_tree(tmp_path / "src", 80), out, format="lmdb", progress=False)
    (entry,) = read_manifest(out).shards
    return out, os.path.join(out, entry.path)


def _lie_lmdb(shard: str) -> str:
    """One val sample's hash in the LMDB shard's index record set to the largest (train
    under any fraction), the record's checksum computed again; its key."""
    from test_index_trust import _rewrite_record

    from shardkit.formats.lmdb.index import encode_lmdb_index

    moved = []

    def lie(keys, digests):
        record = bytearray(encode_lmdb_index(keys, digests))
        i = next(i for i, h in enumerate(key_hashes(keys).tolist()) if h < VAL * 2**64)
        record[32 + 8 * i : 32 + 8 * i + 8] = b"\xff" * 8  # the head is 32 bytes, then hashes
        record[-32:] = hashlib.sha256(bytes(record[:-32])).digest()
        moved.append(keys[i].decode())
        return bytes(record)

    _rewrite_record(shard, lie)
    return moved[0]


def test_lmdb_a_lying_hash_moves_no_sample_and_get_and_subsets_find_it(lmdb_pack):
    out, shard = lmdb_pack
    val, train = _truth(out)
    key = _lie_lmdb(shard)
    assert key in val
    got = _sides_or_error(out)
    assert sorted(got["val"]) == sorted(val) and sorted(got["train"]) == sorted(train)
    assert quiet(ShardView(out, decode="raw", with_keys=True).get, key)[2] == key  # key file
    os.unlink(os.path.join(out, "manifest.keys"))  # none: the stored columns decide
    view = ShardView(out, decode="raw", with_keys=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert view.get(key)[2] == key
    assert "shard-000000.lmdb: its index record" in "\n".join(str(w.message) for w in caught)
    view.close()
    ds = ShardDataset([Source(out, subset=[key, "c1/im001"])], decode="raw", with_keys=True)
    assert sorted(s[2] for s in quiet(list, ds)) == sorted([key, "c1/im001"])


def _vouch_lmdb(out: str, shard: str) -> None:
    """The manifest's ``columns_sha256`` (and the shard's sha256) computed again from the
    rewritten shard, as a tool that recomputes a manifest from the files on disk would."""
    import lmdb

    from shardkit.formats.lmdb import INDEX_KEY
    from shardkit.formats.lmdb.index import lmdb_columns_sha256

    env = lmdb.open(shard, subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        record = bytes(txn.get(INDEX_KEY))
    env.close()
    mpath = os.path.join(out, "manifest.json")
    doc = json.load(open(mpath))
    doc["shards"][0]["columns_sha256"] = lmdb_columns_sha256(record)
    doc["shards"][0]["sha256"] = hashlib.sha256(open(shard, "rb").read()).hexdigest()
    with open(mpath, "w") as f:
        json.dump(doc, f)


def test_lmdb_a_lying_hash_under_a_recomputed_columns_sha256_moves_no_sample(lmdb_pack):
    """The split now uses the record's hashes as they stand once the manifest vouches for
    them: the moved val sample is left out of val (val reads exact samples: it ends short of
    it) and train, streamed, checks every key it reads against its side: an error naming the
    shard and the key, never a val sample in train."""
    out, shard = lmdb_pack
    val, train = _truth(out)
    assert 2 * len(val) < len(train)  # val: lookups; train: streamed
    key = _lie_lmdb(shard)
    _vouch_lmdb(out, shard)
    got = _sides_or_error(out)
    assert sorted(got["val"]) == sorted(val - {key})
    message = got["train"]
    assert isinstance(message, str), "a val sample read as train"
    assert "shard-000000.lmdb" in message and repr(key) in message and "\n" not in message


# --- merge and --append never hand the column on ----------------------------------------------


def _grow(how: str, out: str, tmp_path, allow: bool, fmt: str = "tar"):
    other = tmp_path / f"other-{how}-{allow}"
    src = random_tree(tmp_path / f"more-{how}-{allow}", 6, seed=7, prefix="new")
    if how == "append":
        return quiet(
            pack, src, out, append=True, allow_duplicates=allow, format=fmt, progress=False
        )
    quiet(pack, src, str(other), format=fmt, progress=False)
    return quiet(
        merge, [out, str(other)], str(tmp_path / f"merged-{allow}"), allow_duplicates=allow
    )


def _without_key_file(out: str) -> None:
    """``out`` as a dataset made before the key file: growth reads every shard's column."""
    mpath = os.path.join(out, "manifest.json")
    doc = json.load(open(mpath))
    del doc["keys"]
    with open(mpath, "w") as f:
        json.dump(doc, f)
    os.unlink(os.path.join(out, "manifest.keys"))


@pytest.mark.parametrize("how", ["merge", "append"])
def test_growth_by_the_key_file_hands_on_the_keys_hashes_never_a_lying_column(
    tar_pack, tmp_path, how
):
    """With a key file, growth reads no old column (that is its point): the lie stays in its
    one index, where a reader checks every key it streams, and the grown key file lists the
    key's own hash, from the key file the manifest vouched for before the lie."""
    key, _ = _lie(tar_pack)
    _grow(how, tar_pack, tmp_path, False)
    where = tar_pack if how == "append" else str(tmp_path / "merged-False")
    m = read_manifest(where)
    data = open(os.path.join(where, "manifest.keys"), "rb").read()
    hashes = set(np.frombuffer(data, "<u8", m.num_samples, 56).tolist())
    assert int(key_hashes([key])[0]) in hashes
    assert (1 << 64) - 1 not in hashes


@pytest.mark.parametrize("allow", [False, True], ids=["keys-checked", "allow-duplicates"])
@pytest.mark.parametrize("how", ["merge", "append"])
def test_merge_and_append_refuse_a_lying_column(tar_pack, tmp_path, how, allow):
    """The column and all its checksums agree with each other, not with the keys: growing a
    dataset without a key file (which reads every column) would list them again; it is an
    error naming the index, and nothing is written."""
    _without_key_file(tar_pack)
    before = open(os.path.join(tar_pack, "manifest.json")).read()
    _lie(tar_pack)
    listed = open(os.path.join(tar_pack, "manifest.json")).read()
    assert listed != before
    with pytest.raises(InputError) as err:
        _grow(how, tar_pack, tmp_path, allow)
    message = str(err.value)
    assert "shard-000000.tar.idx" in message and "shardkit index" in message, message
    assert "\n" not in message
    assert open(os.path.join(tar_pack, "manifest.json")).read() == listed
    assert not os.path.exists(tmp_path / f"merged-{allow}" / "manifest.json")


@pytest.mark.parametrize("how", ["merge", "append"])
def test_merge_and_append_of_a_sound_dataset_still_work(tar_pack, tmp_path, how):
    _grow(how, tar_pack, tmp_path, False)
    where = tar_pack if how == "append" else str(tmp_path / "merged-False")
    assert len(ShardDataset(where, decode="raw")) == 86


@pytest.mark.parametrize("how", ["merge", "append"])
def test_lmdb_merge_and_append_refuse_a_lying_index_record(lmdb_pack, tmp_path, how):
    out, shard = lmdb_pack
    _without_key_file(out)
    _lie_lmdb(shard)
    with pytest.raises(InputError, match="shard-000000.lmdb: its index record's 1 stored"):
        _grow(how, out, tmp_path, False, fmt="lmdb")
