"""Where a reader starting mid-shard seeks: a sample's offset comes from the shard's sample index
(checked by the manifest's ``index_sha256``), not from JSON ints in the manifest; older
manifests that list them still read."""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import pytest

from shardkit import ShardWriter
from shardkit.formats import get_format
from shardkit.formats.sample_index import columns_size, decode_index, index_path
from shardkit.manifest import INDEX_EVERY, Manifest, read_manifest
from shardkit.records import ShardInfo
from shardkit.stream.sources import resolve_source
from shardkit.stream.storage import LocalStorage
from shardkit.write.verify import verify

N = 300  # one shard: samples 0..299, offsets listed at 0, 64, 128, 192, 256


class SeekLog(LocalStorage):
    """Local files, noting where each opened shard was first positioned (0: read from its
    start)."""

    def __init__(self):
        super().__init__()
        self.seeks: list[int] = []

    def open(self, shard):
        f = super().open(shard)
        log, seek = self.seeks, f.seek

        def logged(pos, whence=0):
            log.append(pos)
            return seek(pos, whence)

        f.seek = logged
        return f


@pytest.fixture
def pack(tmp_path):
    out = tmp_path / "pack"
    with ShardWriter(str(out), shard_size="1GB", classes=["a", "b"]) as w:
        for i in range(N):
            w.add(f"k{i:04d}", "jpg", b"\xff\xd8" + os.urandom(200 + i), i % 2)
    return out


def _shard(out) -> ShardInfo:
    (info,) = resolve_source(str(out)).shards
    return info


def _keys(info: ShardInfo, start: int, stop: int, storage=None) -> list[str]:
    fmt = get_format("tar")
    return [r.key for r in fmt.records(storage or LocalStorage(), info, start, stop)]


def _offsets(out) -> list[int]:
    (name,) = [n for n in os.listdir(out) if n.endswith(".tar")]
    path = os.path.join(out, index_path(name))
    return decode_index(open(path, "rb").read(), path).offsets.tolist()


def _old_way(out, *, keep_index: bool) -> None:
    """The manifest as shardkit wrote it before: each tar shard's sparse offsets as JSON ints
    (``index_every``, ``index``); ``keep_index=False``: a pack from before the sample index
    (no ``index_sha256``, no ``.idx``)."""
    path = out / "manifest.json"
    doc = json.loads(path.read_text())
    offsets = _offsets(out)  # the pack's one shard
    for e in doc["shards"]:
        e["index_every"] = INDEX_EVERY
        e["index"] = offsets[:-1:INDEX_EVERY]
        if not keep_index:
            del e["index_sha256"]
            os.unlink(out / index_path(e["path"]))
    path.write_text(json.dumps(doc, indent=1))


def test_a_pack_lists_no_offsets_and_a_slice_seeks_to_its_first_sample(pack):
    doc = json.loads((pack / "manifest.json").read_text())
    (entry,) = doc["shards"]
    assert "index" not in entry and "index_every" not in entry and entry["index_sha256"]
    info = _shard(pack)
    assert info.index == ()  # nothing per sample held by each process
    every = _keys(info, 0, N)
    offsets = _offsets(pack)
    for start in (1, 63, 64, 130, N - 1):
        storage = SeekLog()
        assert _keys(info, start, start + 5, storage) == every[start : start + 5]
        # past the first 64: straight to the sample itself, no samples hopped over
        assert storage.seeks == ([offsets[start]] if start >= INDEX_EVERY else [])
    # the manifest round-trips: offsets stay out, index_sha256 in
    again = Manifest.from_json(read_manifest(str(pack)).to_json())
    assert again.shards[0].index == () and again.shards[0].index_sha256 == entry["index_sha256"]


@pytest.mark.parametrize("keep_index", [True, False], ids=["with-idx", "before-idx"])
def test_older_manifests_with_json_offsets_still_read(pack, keep_index):
    offsets = _offsets(pack)
    every = _keys(_shard(pack), 0, N)
    _old_way(pack, keep_index=keep_index)
    info = _shard(pack)
    if keep_index:  # offsets beside an index_sha256: not held; the index serves, checked
        assert info.index == () and info.index_sha256
        want_seek = offsets[130]
    else:  # the oldest packs: the manifest's offsets, as before
        assert info.index == tuple(offsets[:-1:INDEX_EVERY]) and not info.index_sha256
        want_seek = offsets[128]
    storage = SeekLog()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _keys(info, 130, 140, storage) == every[130:140]
    assert storage.seeks == [want_seek]
    assert verify(str(pack)).ok


@pytest.mark.parametrize("how", ["its-label-member", "one-bit"])
def test_a_flipped_byte_in_the_index_offsets_is_caught_before_the_offset_is_used(pack, how):
    info = _shard(pack)
    every = _keys(info, 0, N)
    (name,) = [n for n in os.listdir(pack) if n.endswith(".tar")]
    idx = pack / index_path(name)
    data = bytearray(idx.read_bytes())
    at = columns_size(N) - 16 * N - 8 + 8 * 130  # sample 130's offset in the offsets column
    if how == "its-label-member":  # a real header, inside sample 130 (its .cls member): read
        # from there unchecked, sample 130 has no image and the slice would start at 131
        members = decode_index(bytes(data), str(idx)).members
        label_data = int(members.offsets[int(members.starts[130]) + 1])
        data[at : at + 8] = (label_data - 512).to_bytes(8, "little")
    else:
        data[at + 1] ^= 0x01
    body = bytes(data[:-32])
    idx.write_bytes(body + hashlib.sha256(body).digest())  # its own trailer made to match
    storage = SeekLog()
    with pytest.warns(RuntimeWarning, match=r"\.idx: stale or damaged sample index"):
        got = _keys(info, 130, 135, storage)
    assert got == every[130:135]  # read from the shard's start instead
    assert storage.seeks == []
    assert not verify(str(pack)).ok  # verify names the index too


def test_verify_names_an_older_manifest_offset_that_is_not_its_sample(pack):
    offsets = _offsets(pack)
    _old_way(pack, keep_index=False)
    doc = json.loads((pack / "manifest.json").read_text())
    doc["shards"][0]["index"][2] = offsets[129]  # sample 129, listed as 128
    (pack / "manifest.json").write_text(json.dumps(doc))
    report = verify(str(pack))
    assert not report.ok
    (bad,) = report.bad
    assert "offset index: entry 2 (sample 128)" in " ".join(bad.problems)
