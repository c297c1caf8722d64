"""Hostile manifest.json text and values: deep nesting, huge numbers, NUL, ``..``, wrong types,
oversized files, local and over HTTP; every outcome is a ``ManifestError`` naming the file."""

from __future__ import annotations

import json

import pytest

from shardkit.manifest import Manifest, ShardEntry

# --- hostile manifest values -----------------------------------------------------------


def _good_doc() -> dict:
    m = Manifest("tar", ["a", "b", "c"], [ShardEntry("shard-000000.tar", 3, 4096, "ab" * 32)])
    return json.loads(m.to_json())


def _edit(doc: dict, path: list, value) -> dict:
    target = doc
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    "raw, message",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"version": 1, "shards": [{"path": "s.tar", "samples": 1e400}]}', "samples"),
        ('{"version": 1e400}', "version"),
        ("null", "JSON object"),
    ],
)
def test_hostile_manifest_text(tmp_path, raw, message):
    from shardkit.errors import ManifestError
    from shardkit.manifest import read_manifest

    (tmp_path / "manifest.json").write_text(raw)
    with pytest.raises(ManifestError, match=message) as info:
        read_manifest(str(tmp_path))
    assert str(tmp_path / "manifest.json") in str(info.value)


@pytest.mark.parametrize(
    "path, value, message",
    [
        (["classes"], "abc", "'classes' is 'abc', expected a list"),
        (["classes"], [1, 2], "class name is 1"),
        (["classes"], ["a\0b"], "without NUL"),
        (["shards"], {"path": "x"}, "'shards' is"),
        (["shards", 0, "path"], "sh\0ard.tar", "without NUL"),
        (["shards", 0, "path"], "sub/shard.tar", "outside the manifest's directory"),
        (["shards", 0, "path"], "..", "outside the manifest's directory"),
        (["shards", 0, "path"], "a\\b.tar", "outside the manifest's directory"),
        (["shards", 0, "path"], 7, "shard path is 7"),
        (["shards", 0, "samples"], -1, "samples is -1"),
        (["shards", 0, "samples"], 3.0, "samples is 3.0"),
        (["shards", 0, "samples"], True, "samples is True"),
        (["shards", 0, "samples"], "3", "samples is '3'"),
        (["shards", 0, "samples"], 2**80, "expected an integer"),
        (["shards", 0, "bytes"], 1e300, "bytes is 1e\\+300"),
        (["shards", 0, "sha256"], "zz" * 32, "64 hex digits"),
        (["shards", 0, "index"], "abc", "index is not a list"),
        (["skipped"], [["x"]], "skipped item"),
        (["pack"], [], "'pack' is"),
        (["num_samples"], "3", "num_samples is '3'"),
    ],
)
def test_hostile_manifest_values(tmp_path, path, value, message):
    from shardkit.errors import ManifestError
    from shardkit.manifest import read_manifest

    doc = _edit(_good_doc(), path, value)
    if path[0] == "shards" and len(path) > 1 and path[-1] == "index":
        doc["shards"][0]["index_every"] = 64
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=message) as info:
        read_manifest(str(tmp_path))
    assert str(tmp_path / "manifest.json") in str(info.value)


def test_manifest_size_is_capped_before_parsing(tmp_path, monkeypatch):
    from shardkit import manifest as manifest_mod
    from shardkit.errors import ManifestError

    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 1000)
    (tmp_path / "manifest.json").write_text(" " * 5000 + json.dumps(_good_doc()))
    with pytest.raises(ManifestError, match="more than any manifest"):
        manifest_mod.read_manifest(str(tmp_path))


def test_a_manifest_read_allocates_its_size_not_the_cap(tmp_path):
    """Counted (tracemalloc): reading a small manifest allocates about its own bytes; a read
    of the cap allocated the cap (512 MiB) on every open before being cut to the file."""
    import tracemalloc

    from shardkit import manifest as manifest_mod

    (tmp_path / "manifest.json").write_text(json.dumps(_good_doc()))
    tracemalloc.start()
    try:
        manifest_mod.read_manifest(str(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.slow  # an HTTP server
def test_manifest_size_is_capped_for_urls_too(tmp_path, monkeypatch, http_server):
    """The one manifest reader refuses an oversized manifest over HTTP while it arrives."""
    from remote_servers import FaultProxy

    from shardkit import manifest as manifest_mod
    from shardkit.errors import ManifestError

    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 1000)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "manifest.json").write_bytes(b" " * (32 << 20) + b"{}")
    http_server.root = tmp_path
    with FaultProxy(("127.0.0.1", http_server.port)) as proxy:  # counts the bytes sent
        url = f"{proxy.url}/big/manifest.json?sig=x"
        with pytest.raises(ManifestError, match="more than any manifest") as info:
            manifest_mod.read_manifest(url)
    assert "/big/manifest.json" in str(info.value)
    assert proxy.bytes_down < 8 << 20  # refused as it arrived, not after 32 MB in memory


def test_manifest_fuzz_raises_only_manifest_errors(tmp_path):
    """Random structural edits of a real manifest: each parses or raises ManifestError."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from shardkit.errors import ManifestError

    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    values = st.recursive(
        leaves,
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
        max_leaves=10,
    )
    keys = st.sampled_from(
        ["version", "shards", "classes", "skipped", "pack", "num_samples", "shard_format"]
    )
    shard_keys = st.sampled_from(["path", "samples", "bytes", "sha256", "index", "index_every"])

    @settings(max_examples=300, deadline=None, database=None)
    @given(keys, shard_keys, values, st.booleans())
    def run(key, shard_key, value, in_shard):
        doc = _good_doc()
        if in_shard:
            doc["shards"][0][shard_key] = value
        else:
            doc[key] = value
        try:
            Manifest.from_json(json.dumps(doc), source="m.json")
        except ManifestError as exc:
            assert str(exc).startswith("m.json: ")

    run()
