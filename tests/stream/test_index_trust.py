"""Nothing an index says is trusted blindly: a split hash, a key table, a member's size or a
label that is not the shard's never puts a sample on the wrong side of a split, nor hands out
other bytes than the shard's; each is a warning and the shard's own answer, or a one-line
error naming the shard."""

from __future__ import annotations

import gc
import hashlib
import os
import struct
import warnings

import lmdb
import pytest
from conftest import one_shard_tar, quiet, random_tree, split_keys, without_index_sha256

from shardkit import Order, ShardDataset, ShardView
from shardkit.errors import ShardFormatError
from shardkit.formats.lmdb.index import INDEX_KEY, decode_lmdb_index, encode_lmdb_index
from shardkit.formats.sample_index import _HEAD, decode_index, index_path, key_hashes
from shardkit.manifest import read_manifest
from shardkit.write.packer import pack
from shardkit.write.writer import ShardWriter

VAL = 0.2


def _truth(out) -> tuple[set[str], set[str]]:
    """(val keys, train keys) by each key's own hash, from a plain epoch (no index used)."""
    keys = [
        s[2] for s in ShardDataset(out, decode="raw", with_keys=True, order=Order(shuffle=False))
    ]
    val = {k for k, h in zip(keys, key_hashes(keys).tolist(), strict=True) if h < VAL * 2**64}
    return val, set(keys) - val


def _split(out, split: str, **kw) -> list[str]:
    return split_keys(out, split, VAL, **kw)


@pytest.fixture
def tar_pack(tmp_path):
    return one_shard_tar(tmp_path)


def _flip_val_hash(out, *, fix_trailer: bool) -> str:
    """Set the top bit of one val sample's split hash in the shard's .idx (it then reads as a
    train sample's), with or without the file's trailing sha256 fixed up; the key flipped."""
    (entry,) = read_manifest(out).shards
    path = index_path(os.path.join(out, entry.path))
    data = bytearray(open(path, "rb").read())
    ix = decode_index(bytes(data), path)
    i = next(i for i, h in enumerate(ix.hashes.tolist()) if h < VAL * 2**64)
    data[_HEAD.size + 8 * (ix.samples + 1) + 8 * i + 7] ^= 0x80  # little-endian: the top bit
    if fix_trailer:
        data[-32:] = hashlib.sha256(bytes(data[:-32])).digest()
    with open(path, "wb") as f:
        f.write(data)
    return ix.key(i)


@pytest.mark.parametrize(
    "how", ["damaged", "trailer fixed", "trailer fixed, no index_sha256 in the manifest"]
)
def test_a_flipped_split_hash_in_a_tar_index_keeps_every_sample_on_its_side(tar_pack, how):
    val, train = _truth(tar_pack)
    assert 2 * len(val) < len(train)  # val is read as exact ranges, train streams
    flipped = _flip_val_hash(tar_pack, fix_trailer=how != "damaged")
    if "no index_sha256" in how:
        without_index_sha256(tar_pack)
    assert flipped in val
    got_val, got_train, said = _both_sides(tar_pack)
    assert sorted(got_val) == sorted(val) and sorted(got_train) == sorted(train)
    assert "shard-000000.tar.idx" in said  # the index is named


def test_a_flipped_hash_under_a_listed_columns_sha256_is_caught(tar_pack):
    """The split reads the columns alone where the manifest lists their sha256: a hash flipped
    there (the file's trailing sha256 fixed up) no longer matches it, and the whole file is
    checked as without it: the index is named and the shard's own keys decide."""
    assert read_manifest(tar_pack).shards[0].columns_sha256
    val, train = _truth(tar_pack)
    assert _flip_val_hash(tar_pack, fix_trailer=True) in val
    got_val, got_train, said = _both_sides(tar_pack)
    assert sorted(got_val) == sorted(val) and sorted(got_train) == sorted(train)
    assert "shard-000000.tar.idx" in said


@pytest.mark.parametrize("listed", [True, False])
def test_a_damaged_key_table_after_the_columns_leaves_the_split_right(tar_pack, listed):
    """A val and a train key swapped in the key table (after the columns; the hashes and the
    file's trailing sha256 left as the writer's): with ``columns_sha256`` listed the split
    reads the columns alone, whose sha256 vouches for the writer's hashes, and the key table
    is nothing it uses, so the sides are the shard's; without it the whole file's sha256 is
    not ``index_sha256``, the index is named and the shard's headers decide. Right either way."""
    import json

    val, train = _truth(tar_pack)
    (entry,) = read_manifest(tar_pack).shards
    path = index_path(os.path.join(tar_pack, entry.path))
    data = bytearray(open(path, "rb").read())
    ix = decode_index(bytes(data), path)
    keys = ix.keys()
    a = next(i for i, k in enumerate(keys) if k in val)
    b = next(i for i, k in enumerate(keys) if k not in val and len(k) == len(keys[a]))
    at = bytes(data).index(ix.table)
    lo_a, lo_b = (int(ix.ends[i - 1]) if i else 0 for i in (a, b))
    n = len(keys[a])
    data[at + lo_a : at + lo_a + n], data[at + lo_b : at + lo_b + n] = (
        keys[b].encode(),
        keys[a].encode(),
    )
    data[-32:] = hashlib.sha256(bytes(data[:-32])).digest()
    with open(path, "wb") as f:
        f.write(data)
    if not listed:
        mpath = os.path.join(tar_pack, "manifest.json")
        doc = json.load(open(mpath))
        del doc["shards"][0]["columns_sha256"]
        with open(mpath, "w") as f:
            json.dump(doc, f)
    got_val, got_train, said = _both_sides(tar_pack)
    assert sorted(got_val) == sorted(val) and sorted(got_train) == sorted(train)
    assert ("shard-000000.tar.idx" in said) is not listed  # the split read no key table


def _both_sides(out) -> tuple[list[str], list[str], str]:
    """Both sides' keys and the warnings given while they were read (joined)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_val, got_train = _split(out, "val"), _split(out, "train")
    return got_val, got_train, "\n".join(str(w.message) for w in caught)


@pytest.mark.parametrize("split", ["val", "train"])
def test_a_tar_key_table_that_is_not_the_shards_is_an_error_naming_it(tar_pack, split):
    """A val and a train key swapped in an .idx the manifest lists no sha256 of (its hashes
    and trailing sha256 made to match): val is read as exact ranges, train streams; either
    way a sample on the wrong side is an error naming the shard."""
    from shardkit.formats.sample_index import encode_tally
    from shardkit.formats.tar.tally import tally_tar

    val, _ = _truth(tar_pack)
    (entry,) = read_manifest(tar_pack).shards
    shard = os.path.join(tar_pack, entry.path)
    tally = tally_tar(shard, every=1, keys=True, members=True)
    keys = tally.keys
    a = next(i for i, k in enumerate(keys) if k in val)
    b = next(i for i, k in enumerate(keys) if k not in val and len(k) == len(keys[a]))
    keys[a], keys[b] = keys[b], keys[a]
    with open(index_path(shard), "wb") as f:
        f.write(encode_tally(tally, entry.bytes, entry.sha256, shard))
    without_index_sha256(tar_pack)
    with pytest.raises(ShardFormatError) as err:
        _split(tar_pack, split)
    message = str(err.value)
    assert "shard-000000.tar" in message and f"sample {b if split == 'val' else a}" in message
    assert "\n" not in message


@pytest.fixture
def lmdb_pack(tmp_path):
    out = str(tmp_path / "lmdb")
    quiet(pack, random_tree(tmp_path / "src", 80), out, format="lmdb", progress=False)
    (entry,) = read_manifest(out).shards
    return out, os.path.join(out, entry.path)


def _rewrite_record(path: str, change) -> None:
    """The shard's index record replaced in place by ``change(keys)``'s record: same length,
    a valid checksum (what anyone rewriting it can compute), the keys' own hashes."""
    env = lmdb.open(path, subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        old = bytes(txn.get(INDEX_KEY))
    env.close()
    index = decode_lmdb_index(old, path, _count(old))
    new = change([k.encode() for k in index.keys()], index.digests)
    assert len(new) == len(old) and new != old
    data = open(path, "rb").read()
    assert data.count(old) == 1
    with open(path, "wb") as f:
        f.write(data.replace(old, new))


def _count(record: bytes) -> int:
    return struct.unpack_from("<Q", record, 16)[0]


def test_an_lmdb_index_record_with_a_flipped_hash_and_a_valid_checksum(lmdb_pack):
    out, shard = lmdb_pack
    val, train = _truth(out)

    def flip(keys, digests):
        record = bytearray(encode_lmdb_index(keys, digests))
        i = next(i for i, h in enumerate(key_hashes(keys).tolist()) if h < VAL * 2**64)
        record[32 + 8 * i + 7] ^= 0x80  # the head is 32 bytes, then the hashes
        record[-32:] = hashlib.sha256(bytes(record[:-32])).digest()
        return bytes(record)

    _rewrite_record(shard, flip)
    got_val, got_train, said = _both_sides(out)
    assert sorted(got_val) == sorted(val) and sorted(got_train) == sorted(train)
    assert "shard-000000.lmdb: its index record: 1 split hash(es)" in said


@pytest.mark.parametrize("split", ["val", "train"])
def test_an_lmdb_key_table_that_is_not_the_shards_is_an_error_naming_it(lmdb_pack, split):
    """A val and a train key swapped in the record (hashes and checksum made to match): the
    split's positions then name the wrong samples; each sample read is checked by its own key."""
    out, shard = lmdb_pack
    val, _ = _truth(out)

    def swap(keys, digests):
        a = next(i for i, k in enumerate(keys) if k.decode() in val)
        b = next(i for i, k in enumerate(keys) if k.decode() not in val and len(k) == len(keys[a]))
        keys = list(keys)
        keys[a], keys[b] = keys[b], keys[a]
        return encode_lmdb_index(keys, digests)

    _rewrite_record(shard, swap)
    with pytest.raises(ShardFormatError) as err:
        _split(out, split)
    message = str(err.value)
    assert "shard-000000.lmdb" in message and "split hash" in message and "\n" not in message


# --- a lying index's member sizes and labels --------------------------------------------------


@pytest.fixture
def captioned(tmp_path):
    out = tmp_path / "d"
    with ShardWriter(str(out), shard_size="1MB", classes=["a", "b"]) as w:
        for i in range(6):
            w.add(f"k{i}", "jpg", b"\xff\xd8" + bytes([i]) * 3000, i % 2, extra={"txt": b"c%d" % i})
    return str(out)


def _lie(out, change) -> None:
    """The first shard's .idx with its members' labels or sizes changed by ``change(column,
    copy)``, its trailing sha256 fixed and the manifest's index_sha256 dropped: an index that
    checks out as a file but does not describe its shard."""
    import numpy as np

    (entry,) = read_manifest(out).shards
    path = index_path(os.path.join(out, entry.path))
    blob = open(path, "rb").read()
    data = bytearray(blob)
    m = decode_index(blob, path).members
    base = np.frombuffer(blob, np.uint8).ctypes.data
    for col in (m.labels, m.sizes):
        fresh = col.copy()
        change(fresh)
        pos = col.ctypes.data - base  # the column's place in the file
        data[pos : pos + col.nbytes] = fresh.tobytes()
    data[-32:] = hashlib.sha256(bytes(data[:-32])).digest()
    with open(path, "wb") as f:
        f.write(data)
    without_index_sha256(out)


@pytest.mark.parametrize("delta", [-7, 600])
def test_a_member_size_the_index_lies_about_is_not_believed(captioned, delta):
    truth = ShardView(captioned).members(2, ["jpg"])
    assert len(truth[0][1]) == 3002

    def change(fresh):
        if fresh.dtype.kind == "u":
            fresh[2 * 3] = int(fresh[2 * 3]) + delta  # sample 2's jpg (jpg, cls, txt each)

    _lie(captioned, change)
    view = ShardView(captioned)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, summary = view.members(2, ["jpg"]), view.summary(2)
    assert got == truth  # the shard's bytes, not 7 short nor the next header
    assert summary.members == [("jpg", 3002), ("cls", 1), ("txt", 2)]
    said = [str(w.message) for w in caught]
    assert len(said) == 2 and all("shard-000000.tar.idx: sample 2" in m for m in said)
    view.close()


def test_a_label_the_index_lies_about_is_not_listed(captioned):
    def change(fresh):
        if fresh.dtype.kind == "i":
            fresh[3] = 0  # sample 3 is labelled 1

    _lie(captioned, change)
    view = ShardView(captioned)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        labels = [view.summary(i).label for i in range(6)]
    assert labels == [0, 1, 0, 1, 0, 1]  # the shard's labels
    (said,) = [str(w.message) for w in caught]
    assert "shard-000000.tar.idx: sample 3's label 0" in said
    view.close()


# --- descriptors of a view dropped without close() ----------------------------------------------


def _fds(under: str = "/") -> int:
    """This process's open descriptors on files under ``under`` (other tests' threads may
    close descriptors of their own meanwhile: only the dataset's are counted)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(under)
        except OSError:  # closed since the listing
            pass
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_views_dropped_without_close_leave_no_descriptors(tmp_path, fmt):
    out = str(tmp_path / fmt)
    src = random_tree(tmp_path / "src", 24)
    quiet(pack, src, out, format=fmt, shard_size="4kB", progress=False)
    shards = len(read_manifest(out).shards)
    assert shards > 3
    gc.collect()
    before = _fds(out)
    for _ in range(5):
        view = ShardView(out, decode="raw")
        for i in range(len(view)):
            view[i]
        assert _fds(out) >= before + shards  # the view holds its shards open
        del view
    assert _fds(out) == before
