"""Nothing an index says is trusted blindly: a split hash, a key table, a member's size or a
label that is not the shard's never puts a sample on the wrong side of a split, nor hands out
other bytes than the shard's; each is a warning and the shard's own answer, or a one-line
error naming the shard."""

from __future__ import annotations

import hashlib
import os
import struct
import warnings

import lmdb
import pytest
from conftest import quiet, random_tree, without_index_sha256

from shardkit import ShardDataset
from shardkit.errors import ShardFormatError
from shardkit.formats.lmdb_index import INDEX_KEY, decode_lmdb_index, encode_lmdb_index
from shardkit.formats.sample_index import _HEAD, decode_index, index_path, key_hashes
from shardkit.manifest import read_manifest
from shardkit.write.packer import pack

VAL = 0.2


def _truth(out) -> tuple[set[str], set[str]]:
    """(val keys, train keys) by each key's own hash, from a plain epoch (no index used)."""
    keys = [s[2] for s in ShardDataset(out, decode="raw", with_keys=True, shuffle=False)]
    val = {k for k, h in zip(keys, key_hashes(keys).tolist(), strict=True) if h < VAL * 2**64}
    return val, set(keys) - val


def _split(out, split: str) -> list[str]:
    ds = ShardDataset(out, split=split, val_fraction=VAL, decode="raw", with_keys=True)
    return [s[2] for s in ds]


@pytest.fixture
def tar_pack(tmp_path):
    out = str(tmp_path / "tar")
    quiet(pack, random_tree(tmp_path / "src", 80), out, progress=False)
    assert len(read_manifest(out).shards) == 1
    return out


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


def _both_sides(out) -> tuple[list[str], list[str], str]:
    """Both sides' keys and the warnings given while they were read (joined)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_val, got_train = _split(out, "val"), _split(out, "train")
    return got_val, got_train, "\n".join(str(w.message) for w in caught)


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
    keys = [k.encode() for k in decode_lmdb_index(old, path, _count(old)).keys()]
    new = change(keys)
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

    def flip(keys):
        record = bytearray(encode_lmdb_index(keys))
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

    def swap(keys):
        a = next(i for i, k in enumerate(keys) if k.decode() in val)
        b = next(i for i, k in enumerate(keys) if k.decode() not in val and len(k) == len(keys[a]))
        keys = list(keys)
        keys[a], keys[b] = keys[b], keys[a]
        return encode_lmdb_index(keys)

    _rewrite_record(shard, swap)
    with pytest.raises(ShardFormatError) as err:
        _split(out, split)
    message = str(err.value)
    assert "shard-000000.lmdb" in message and "split hash" in message and "\n" not in message
