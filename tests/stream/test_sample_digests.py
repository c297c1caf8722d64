"""Reading less never means checking less: every read of part of a shard (a split's or subset's
ranged epoch, ``ShardView[i]``, ``get``, ``members``, ``ls``/``show``) checks each sample's bytes
against the digest its index holds before handing it out. A byte altered in a shard is a one-line
error naming the shard, the key and the fix; a dataset whose indexes predate the digests says so
once and is read as before, until ``shardkit index --rehash`` gives it the digests."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings

import lmdb
import pytest
from click.testing import CliRunner
from conftest import quiet, random_tree

from shardkit import Order, ShardDataset, ShardView, Source
from shardkit.cli import main
from shardkit.errors import ShardFormatError
from shardkit.formats.lmdb.index import INDEX_KEY, decode_lmdb_index, lmdb_digest
from shardkit.formats.sample_index import (
    _HEAD,
    columns_size,
    decode_index,
    file_digests,
    index_digests,
    index_path,
    key_hashes,
    sample_digest,
)
from shardkit.formats.tar import reader as tar_reader
from shardkit.manifest import read_manifest
from shardkit.stream import ranges
from shardkit.write.index import index_shards
from shardkit.write.packer import pack
from shardkit.write.verify import verify

VAL = 0.2


def _split(out, split="val", **kw) -> list[tuple[str, bytes]]:
    ds = ShardDataset(
        Source(out, split=split, val_fraction=VAL), decode="raw", with_keys=True, **kw
    )
    return [(s[2], s[0]) for s in ds]


def _subset(out, keys) -> list[tuple[str, bytes]]:
    ds = ShardDataset(
        Source(out, subset=list(keys)), decode="raw", with_keys=True, order=Order(shuffle=False)
    )
    return [(s[2], s[0]) for s in ds]


@pytest.fixture
def tar_pack(tmp_path):
    out = str(tmp_path / "tar")
    quiet(pack, random_tree(tmp_path / "src", 120), out, shard_size="60kB", progress=False)
    assert len(read_manifest(out).shards) >= 3
    return out


def _a_val_sample(out) -> tuple[int, str, str, int, int]:
    """(shard number, shard path, key, position in shard, its byte range start) of a val sample
    in the middle of its shard."""
    for k, e in enumerate(read_manifest(out).shards):
        path = os.path.join(out, e.path)
        ix = decode_index(open(index_path(path), "rb").read(), path)
        keys = ix.keys()
        for j in range(1, ix.samples - 1):
            if int(key_hashes([keys[j]])[0]) < VAL * 2**64:
                return k, path, keys[j], j, int(ix.offsets[j])
    raise AssertionError("no val sample")


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))


def _one_line(exc) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


# --- the format -------------------------------------------------------------------------------


def test_a_v3_index_holds_each_samples_digest_and_grows_by_8_bytes_a_sample(tar_pack):
    for e in read_manifest(tar_pack).shards:
        path = os.path.join(tar_pack, e.path)
        data = open(index_path(path), "rb").read()
        ix = decode_index(data, path)
        assert data[8] == 3 and ix.digests is not None
        raw = open(path, "rb").read()
        offsets = ix.offsets.tolist()
        want = [sample_digest(raw[a:b]) for a, b in zip(offsets, offsets[1:], strict=False)]
        assert ix.digests.tolist() == want == file_digests(path, offsets).tolist()
        old = _as_v2(data, e.samples)
        assert len(data) - len(old) == 8 * e.samples  # exactly 8 bytes a sample
        assert columns_size(e.samples) - columns_size(e.samples, 2) == 8 * e.samples
        back = decode_index(old, path)
        assert back.digests is None and back.keys() == ix.keys()
        assert back.members.labels.tolist() == ix.members.labels.tolist()
        # the columns an epoch reads hold the digests, and columns_sha256 covers them
        assert index_digests(data, e.samples)["columns_sha256"] == e.columns_sha256
        assert e.columns_sha256 == hashlib.sha256(data[: columns_size(e.samples)]).hexdigest()


def _as_v2(data: bytes, n: int) -> bytes:
    """A version-3 index as version 2 wrote it: no digest column, the version 2."""
    at = _HEAD.size + 8 * (n + 1) + 8 * n  # where the digests start
    body = bytearray(data[:at] + data[at + 8 * n : -32])
    body[8:12] = (2).to_bytes(4, "little")
    return bytes(body) + hashlib.sha256(bytes(body)).digest()


def _to_v2(out) -> None:
    """Every index of the pack ``out`` as version 2 wrote it, its manifest's checksums those
    of the version-2 files (a pack made before the digests)."""
    path = os.path.join(out, "manifest.json")
    doc = json.load(open(path))
    for s in doc["shards"]:
        idx = index_path(os.path.join(out, s["path"]))
        old = _as_v2(open(idx, "rb").read(), s["samples"])
        open(idx, "wb").write(old)
        s["index_sha256"] = hashlib.sha256(old).hexdigest()
        s["columns_sha256"] = hashlib.sha256(old[: columns_size(s["samples"], 2)]).hexdigest()
    json.dump(doc, open(path, "w"), indent=1)


def test_an_lmdb_record_holds_each_samples_digest_of_its_value_and_fields(tmp_path):
    from shardkit.write.writer import ShardWriter

    out = tmp_path / "lmdb"
    with ShardWriter(str(out), format="lmdb") as w:
        w.add("a", "jpg", b"\xff\xd8one", 1, extra={"txt": b"cap", "json": b"{}"})
        w.add("b", "jpg", b"\xff\xd8two", 0)
    (e,) = read_manifest(str(out)).shards
    env = lmdb.open(str(out / e.path), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        ix = decode_lmdb_index(bytes(txn.get(INDEX_KEY)), e.path, 2)
        values = [bytes(txn.get(b"%010d" % i)) for i in range(2)]
    env.close()
    assert ix.digests.tolist() == [
        lmdb_digest(values[0], [("txt", b"cap"), ("json", b"{}")]),
        sample_digest(values[1]),  # no fields: the value's own XXH3-64
    ]
    assert lmdb_digest(values[0], [("json", b"{}"), ("txt", b"cap")]) == ix.digests[0]


# --- a byte altered in a local shard ------------------------------------------------------------


def test_a_flipped_byte_in_a_tar_sample_is_refused_by_every_partial_read(tar_pack):
    k, path, key, j, start = _a_val_sample(tar_pack)
    before = _split(tar_pack)
    assert key in [k for k, _ in before]
    _flip(path, start + 512 + 40)  # inside the image's data: headers and key intact
    name = os.path.basename(path)
    expect = rf"{name}: sample {j} \(key '{key}'\) is not the bytes packed.*re-pack it"
    for read in (lambda: _split(tar_pack), lambda: _subset(tar_pack, [key])):
        with pytest.raises(ShardFormatError, match=expect) as err:
            read()
        _one_line(err)
    view = ShardView(tar_pack, decode="raw", with_keys=True)
    i = view.index(key)
    for read in (
        lambda: view[i],
        lambda: view.get(key),
        lambda: view.members(i),
        lambda: view.members(i, ("cls",)),  # a member alone is handed out checked too
        lambda: view.summary(i),
    ):
        with pytest.raises(ShardFormatError, match=expect):
            read()
    # the other samples still read, checked
    others = [k for k, _ in before if k != key]
    assert sorted(k for k, _ in _subset(tar_pack, others[:5])) == sorted(others[:5])
    runner = CliRunner()
    for args in (("show", tar_pack, key), ("ls", tar_pack, "--offset", str(max(0, i - 1)))):
        got = runner.invoke(main, args)
        assert got.exit_code != 0 and "Traceback" not in got.output
        assert f"sample {j} (key '{key}') is not the bytes packed" in got.output


@pytest.mark.parametrize("parser", ["c", "python"])
def test_a_flipped_byte_is_refused_by_a_split_and_a_subset_that_stream_their_shard(
    tar_pack, monkeypatch, parser
):
    """A train side (80% of each shard) and a key subset of most of a shard stream it (faster
    than ranges) and check each sample they hand out all the same: in C as it parses it, and
    where Python parses (here: no C parser), by the sample's index range read again."""
    if parser == "python":
        monkeypatch.setattr(tar_reader, "_tar_samples", None)
    (e, *_) = read_manifest(tar_pack).shards
    path = os.path.join(tar_pack, e.path)
    ix = decode_index(open(index_path(path), "rb").read(), path)
    keys = ix.keys()
    train = [j for j in range(ix.samples) if int(key_hashes([keys[j]])[0]) >= VAL * 2**64]
    j = train[len(train) // 2]
    key = keys[j]
    assert key in [k for k, _ in _split(tar_pack, "train")]
    _flip(path, int(ix.offsets[j]) + 512 + 40)  # inside the image's data: headers intact
    expect = rf"{e.path}: sample {j} \(key '{key}'\) is not the bytes packed.*re-pack it"
    for read in (lambda: _split(tar_pack, "train"), lambda: _subset(tar_pack, keys[1:])):
        with pytest.raises(ShardFormatError, match=expect) as err:
            read()
        _one_line(err)


def test_a_flipped_byte_in_an_lmdb_sample_is_refused_by_every_partial_read(tmp_path):
    out = str(tmp_path / "lmdb")
    quiet(pack, random_tree(tmp_path / "src", 80), out, format="lmdb", progress=False)
    truth = _split(out)
    key, img = truth[len(truth) // 2]
    (e,) = read_manifest(out).shards
    path = os.path.join(out, e.path)
    raw = open(path, "rb").read()
    assert raw.count(img) == 1
    _flip(path, raw.index(img) + 40)
    expect = rf"{e.path}: sample \d+ \(key '{key}'\) is not the bytes packed"
    for read in (lambda: _split(out), lambda: _subset(out, [key])):
        with pytest.raises(ShardFormatError, match=expect) as err:
            read()
        _one_line(err)
    view = ShardView(out, decode="raw")
    for read in (lambda: view.get(key), lambda: view[view.index(key)]):
        with pytest.raises(ShardFormatError, match=expect):
            read()
    got = CliRunner().invoke(main, ["show", out, key])
    assert got.exit_code != 0 and "is not the bytes packed" in got.output


def _lmdb_train_samples(out) -> tuple[str, list[tuple[int, str]]]:
    """(shard path, (position, key) of each train sample) of the one-shard LMDB pack ``out``,
    from its index record."""
    (e,) = read_manifest(out).shards
    path = os.path.join(out, e.path)
    env = lmdb.open(path, subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        keys = decode_lmdb_index(bytes(txn.get(INDEX_KEY)), e.path, e.samples).keys()
    env.close()
    return path, [(j, k) for j, k in enumerate(keys) if int(key_hashes([k])[0]) >= VAL * 2**64]


def test_a_flipped_byte_is_refused_by_lmdb_splits_and_subsets_that_stream_their_shard(tmp_path):
    """A train side (80% of the shard) and a subset of most of it want more than a quarter of
    their LMDB shard, so they stream it by cursor; each sample is checked all the same."""
    out = str(tmp_path / "lmdb")
    quiet(pack, random_tree(tmp_path / "src", 80), out, format="lmdb", progress=False)
    path, train_samples = _lmdb_train_samples(out)
    j, key = train_samples[len(train_samples) // 2]
    train = dict(_split(out, "train"))
    keys = [k for k, _ in _split(out)] + list(train)
    raw = open(path, "rb").read()
    assert raw.count(train[key]) == 1
    _flip(path, raw.index(train[key]) + 40)
    name = os.path.basename(path)
    expect = rf"{name}: sample {j} \(key '{key}'\) is not the bytes packed.*re-pack it"
    for read in (lambda: _split(out, "train"), lambda: _subset(out, keys[1:])):
        with pytest.raises(ShardFormatError, match=expect) as err:
            read()
        _one_line(err)
    # a plain epoch reads whole shards: the shard's sha256 vouches for them (`shardkit verify`)
    assert len(list(ShardDataset(out, decode="raw", order=Order(shuffle=False)))) == 80


def test_an_lmdb_streamed_slice_checks_each_samples_fields_too(tmp_path):
    """The digest covers a sample's fields, which sit apart from the samples: a streamed slice
    reads them by a second cursor, those asked for and the others alike."""
    from shardkit.write.writer import ShardWriter

    out = tmp_path / "lmdb"
    with ShardWriter(str(out), format="lmdb") as w:
        for i in range(40):
            extra = {"txt": b"caption %03d" % i, "json": b'{"i": %d}' % i} if i % 3 else {}
            w.add(f"k{i:03d}", "jpg", b"\xff\xd8" + bytes([i]) * 300, i % 2, extra=extra)
    out = str(out)
    ds = ShardDataset(
        Source(out, split="train", val_fraction=VAL, fields=("txt",)),
        decode="raw",
        with_keys=True,
        fields=("txt",),
    )
    got = {s[2]: s[3] for s in ds}
    assert len(got) > 40 * 0.25  # more than a quarter: streamed
    assert got == {k: None if int(k[1:]) % 3 == 0 else b"caption " + k[1:].encode() for k in got}
    path, train_samples = _lmdb_train_samples(out)
    j, key = next((j, k) for j, k in train_samples[5:] if j % 3)  # one with fields
    env = lmdb.open(path, subdir=False, lock=False)
    with env.begin(write=True) as txn:  # a field not asked for, altered in place of its bytes
        assert txn.replace(b"+%010d.json" % j, b'{"I": %d}' % j) == b'{"i": %d}' % j
    env.close()
    with pytest.raises(ShardFormatError, match=rf"sample {j} \(key '{key}'\) is not the bytes"):
        list(ShardDataset(Source(out, split="train", val_fraction=VAL), decode="raw"))


# --- packs made before the digests ------------------------------------------------------------


def test_a_pack_without_digests_warns_once_reads_and_is_checked_after_rehash(tar_pack):
    truth = _split(tar_pack)
    packed = {n: open(os.path.join(tar_pack, n), "rb").read() for n in os.listdir(tar_pack)}
    _to_v2(tar_pack)
    assert verify(tar_pack).ok  # an older index is not a damaged one
    ranges._UNDIGESTED.discard(tar_pack)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _split(tar_pack) == truth
        assert sorted(_subset(tar_pack, [k for k, _ in truth[:3]])) == sorted(truth[:3])
        view = ShardView(tar_pack, decode="raw", with_keys=True)
        assert view.get(truth[0][0])[0] == truth[0][1]
    said = [str(w.message) for w in seen if "per-sample digests" in str(w.message)]
    assert len(said) == 1 and f"shardkit index --rehash {tar_pack}" in said[0]  # once, the fix
    assert "\n" not in said[0]
    # the fix: the indexes and the manifest's checksums as a pack of today writes them
    runner = CliRunner()
    got = runner.invoke(main, ["index", "--rehash", "-q", tar_pack])
    assert got.exit_code == 0, got.output
    after = {n: open(os.path.join(tar_pack, n), "rb").read() for n in os.listdir(tar_pack)}
    assert after == packed  # byte for byte: indexes and manifest
    assert runner.invoke(main, ["index", "--rehash", "-q", tar_pack]).exit_code == 0  # again:
    assert {n: open(os.path.join(tar_pack, n), "rb").read() for n in packed} == packed  # same
    _k, path, key, _j, start = _a_val_sample(tar_pack)
    _flip(path, start + 600)
    with pytest.raises(ShardFormatError, match="is not the bytes packed"):
        _split(tar_pack)


def test_rehash_refuses_a_shard_that_is_not_its_manifests_and_an_lmdb_dataset(tar_pack, tmp_path):
    from shardkit.errors import InputError

    _to_v2(tar_pack)
    _k, path, _key, _j, start = _a_val_sample(tar_pack)
    _flip(path, start + 600)
    with pytest.raises(InputError, match="is not the shard its manifest lists"):
        index_shards([tar_pack], rehash=True)
    lm = str(tmp_path / "lmdb")
    quiet(pack, random_tree(tmp_path / "src2", 10), lm, format="lmdb", progress=False)
    shutil.copy(os.path.join(tar_pack, os.path.basename(path)), lm)  # a tar to name
    with pytest.raises(InputError, match="pack the dataset again"):
        index_shards([lm], rehash=True)


def test_an_lmdb_pack_without_digests_warns_once_naming_the_fix(tmp_path):
    out = str(tmp_path / "lmdb")
    quiet(pack, random_tree(tmp_path / "src", 60), out, format="lmdb", progress=False)
    truth = _split(out)
    (e,) = read_manifest(out).shards
    env = lmdb.open(os.path.join(out, e.path), subdir=False, lock=False)
    with env.begin(write=True) as txn:  # the record as version 1 wrote it: no digests
        data = bytes(txn.get(INDEX_KEY))
        n = e.samples
        body = bytearray(data[: 32 + 8 * n] + data[32 + 16 * n : -32])
        body[8:12] = (1).to_bytes(4, "little")
        txn.put(INDEX_KEY, bytes(body) + hashlib.sha256(bytes(body)).digest())
    env.close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _split(out) == truth and _split(out) == truth
        assert ShardView(out, decode="raw").get(truth[0][0])[0] == truth[0][1]
    said = [str(w.message) for w in seen if "per-sample digests" in str(w.message)]
    assert len(said) == 1 and "pack it again" in said[0]


@pytest.mark.parametrize("native", [True, False])
def test_read_at_checks_each_samples_bytes_against_its_digest_in_c_or_python(tar_pack, native):
    """The check hashes the read buffer's bytes of each sample (in C as it is parsed; in Python
    where the C parser is not built): the first sample that differs is named, none handed out."""
    if native and tar_reader._tar_at is None:
        pytest.skip("shardkit.images._native is not built")
    e = read_manifest(tar_pack).shards[0]
    path = os.path.join(tar_pack, e.path)
    ix = decode_index(open(index_path(path), "rb").read(), path)
    blob = bytearray(open(path, "rb").read())
    starts, ends = ix.offsets[:-1].copy(), ix.offsets[1:].copy()
    saved = tar_reader._tar_at
    if not native:
        tar_reader._tar_at = None
    try:
        got, _ = tar_reader.read_at(blob, starts, ends, path, (), ix.hashes, ix.digests)
        assert [r.key for r in got] == list(ix.keys())
        blob[int(starts[2]) + 700] ^= 1
        with pytest.raises(tar_reader.SampleAltered) as err:
            tar_reader.read_at(blob, starts, ends, path, (), ix.hashes, ix.digests)
        assert err.value.args == (2,)
        # a range the buffer does not hold is not its digest's either
        short = blob[: int(ends[0]) - 1]
        with pytest.raises(tar_reader.SampleAltered) as err:
            tar_reader.read_at(short, starts[:1], ends[:1], path, (), None, ix.digests[:1])
        assert err.value.args == (0,)
    finally:
        tar_reader._tar_at = saved


def test_a_split_epoch_calls_no_python_digest_a_sample(tar_pack, monkeypatch):
    """With the C parser built, a split's digests are checked inside it (one call a batch): the
    Python digest, one call a sample before, is not called at all."""
    if tar_reader._tar_at is None:
        pytest.skip("shardkit.images._native is not built")
    calls = []

    def counted(data):
        calls.append(len(data))
        return sample_digest(data)

    monkeypatch.setattr(ranges, "sample_digest", counted)
    monkeypatch.setattr(tar_reader, "sample_digest", counted, raising=False)
    assert len(_split(tar_pack)) > 0
    assert calls == []
