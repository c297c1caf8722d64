"""manifest.json: round trip, atomic write, and clear errors for every malformed input."""

from __future__ import annotations

import json
import os

import pytest

from shardkit.errors import ManifestError
from shardkit.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    SkippedFile,
    read_manifest,
    write_manifest,
)


def _manifest() -> Manifest:
    return Manifest(
        shard_format="tar",
        classes=["a", "b", "ü"],
        shards=[
            ShardEntry("shard-000000.tar", 3, 4096, "ab" * 32),
            ShardEntry("shard-000001.tar", 2, 2048, "cd" * 32),
        ],
        skipped=[SkippedFile("a/bad.jpg", "truncated JPEG")],
        pack={"seed": 0, "shard_size": 1024},
    )


def test_round_trip_and_derived_fields(tmp_path):
    m = _manifest()
    path = write_manifest(m, str(tmp_path))
    assert path == str(tmp_path / MANIFEST_NAME)
    doc = json.loads((tmp_path / MANIFEST_NAME).read_text(encoding="utf-8"))
    assert doc["num_samples"] == 5 and doc["total_bytes"] == 6144 and doc["version"] == 1
    assert doc["shards"][0] == {
        "path": "shard-000000.tar",
        "samples": 3,
        "bytes": 4096,
        "sha256": "ab" * 32,
    }
    back = read_manifest(str(tmp_path))
    assert back == m
    assert read_manifest(path) == m


def test_write_leaves_no_temporary_files(tmp_path):
    write_manifest(_manifest(), str(tmp_path))
    write_manifest(_manifest(), str(tmp_path))
    assert os.listdir(tmp_path) == [MANIFEST_NAME]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(version=99), "version 99 is not supported"),
        (lambda d: d.pop("shards"), "missing or malformed field"),
        (lambda d: d["shards"][0].pop("sha256"), "missing or malformed field"),
        (lambda d: d.update(num_samples=6), "disagrees with the shard counts"),
        (lambda d: d["shards"][1].update(path="../../etc/passwd"), "outside the manifest"),
        (lambda d: d["shards"][1].update(path="/abs.tar"), "outside the manifest"),
    ],
)
def test_malformed_manifests_name_the_file(tmp_path, edit, message):
    doc = json.loads(_manifest().to_json())
    edit(doc)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=message) as info:
        read_manifest(str(tmp_path))
    assert str(tmp_path / MANIFEST_NAME) in str(info.value)


def test_missing_and_invalid_json(tmp_path):
    with pytest.raises(ManifestError, match="no manifest; pack the folder"):
        read_manifest(str(tmp_path))
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(str(tmp_path))


def test_offset_index_round_trips_and_is_checked(tmp_path):
    m = Manifest(
        shard_format="tar",
        classes=["a"],
        shards=[ShardEntry("shard-000000.tar", 130, 900_000, "ab" * 32, (0, 300_000, 600_000))],
    )
    write_manifest(m, str(tmp_path))
    doc = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert doc["shards"][0]["index_every"] == 64
    assert read_manifest(str(tmp_path)).shards[0].index == (0, 300_000, 600_000)
    for bad in ([0, 300_000], [0, 600_000, 300_000], [0, 300_000, 950_000]):
        doc["shards"][0]["index"] = bad
        (tmp_path / MANIFEST_NAME).write_text(json.dumps(doc))
        with pytest.raises(ManifestError, match="offset index of shard"):
            read_manifest(str(tmp_path))


def test_columns_sha256_round_trips_beside_index_sha256_and_is_checked(tmp_path):
    """An entry's ``columns_sha256`` (the sha256 of its index's head, offsets and hashes) is
    written and read back beside ``index_sha256``, by the column-wise reader (every entry of
    the writers' shape) and the per-entry one (an entry of another shape among them) alike;
    one that is not 64 hex digits is refused by name; without ``index_sha256`` (an LMDB
    shard's, whose index record is inside it) it is kept, by either reader (a tar split uses
    it beside ``index_sha256`` only: ``stream.indexes``)."""
    shards = [
        ShardEntry("shard-000000.tar", 3, 4096, "ab" * 32, (), "cd" * 32, "ef" * 32),
        ShardEntry("shard-000001.tar", 2, 2048, "ab" * 32, (), "cd" * 32),
        ShardEntry("shard-000002.tar", 130, 900_000, "ab" * 32, (0, 300_000, 600_000)),
    ]
    for some in (shards[:2], shards):
        m = Manifest(shard_format="tar", classes=["a"], shards=some)
        write_manifest(m, str(tmp_path))
        doc = json.loads((tmp_path / MANIFEST_NAME).read_text())
        assert doc["shards"][0]["columns_sha256"] == "ef" * 32
        assert "columns_sha256" not in doc["shards"][1]
        assert read_manifest(str(tmp_path)) == m
    doc["shards"][0]["columns_sha256"] = "EF" * 32
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="shard-000000.tar.: columns_sha256 .* not 64 hex"):
        read_manifest(str(tmp_path))
    doc["shards"][0]["columns_sha256"] = "ef" * 32
    del doc["shards"][0]["index_sha256"]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(doc))
    assert read_manifest(str(tmp_path)).shards[0].columns_sha256 == "ef" * 32
    lmdb = [
        ShardEntry("shard-000000.lmdb", 3, 40960, "ab" * 32, columns_sha256="ef" * 32),
        ShardEntry("shard-000001.lmdb", 2, 40960, "ab" * 32),
    ]
    for some in (lmdb, [*lmdb, shards[2]]):  # column-wise, then entry by entry
        m = Manifest(shard_format="lmdb", classes=["a"], shards=some)
        write_manifest(m, str(tmp_path))
        doc = json.loads((tmp_path / MANIFEST_NAME).read_text())
        assert doc["shards"][0]["columns_sha256"] == "ef" * 32
        assert "index_sha256" not in doc["shards"][0]
        assert read_manifest(str(tmp_path)) == m
