"""Source resolution: globs, brace patterns, lists, directories, manifests, URLs."""

from __future__ import annotations

import os
import shutil

import pytest

from shardkit.errors import InputError, ManifestError
from shardkit.manifest import MANIFEST_NAME, read_manifest
from shardkit.records import ShardInfo
from shardkit.stream.sources import UNKNOWN, resolve_source
from shardkit.stream.storage import LocalStorage, is_url, storage_for


@pytest.fixture(scope="module")
def packed(packed_tree):
    """The same 12 images packed as tar and as LMDB, several shards each."""
    return packed_tree(12, 3, ("tar", "lmdb"), shard_size=9000, size=(8, 8))


def _shards(d, suffix):
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(suffix))


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_directory_manifest_glob_brace_and_list_agree(packed, fmt):
    d = packed[fmt]
    shards = _shards(d, "." + fmt)
    assert len(shards) >= 3
    manifest = read_manifest(d)
    last = len(shards) - 1
    sources = [
        d,
        os.path.join(d, MANIFEST_NAME),
        os.path.join(d, f"*.{fmt}"),
        os.path.join(d, f"shard-{{000000..{last:06d}}}.{fmt}"),
        shards,
    ]
    for source in sources:
        res = resolve_source(source)
        assert list(res.urls) == shards, source
        assert res.format == fmt
        assert [s.samples for s in res.shards] == [e.samples for e in manifest.shards]
        assert list(res.classes) == ["class0", "class1", "class2"]
        assert res.manifest is not None and res.manifest.num_samples == 12


def test_subset_of_shards_takes_counts_from_the_manifest(packed):
    shards = _shards(packed["tar"], ".tar")
    res = resolve_source(shards[1:3])
    m = read_manifest(packed["tar"])
    assert [s.samples for s in res.shards] == [m.shards[1].samples, m.shards[2].samples]
    # every manifest fact of a shard travels with it, in one record
    e = m.shards[1]
    assert res.shards[0] == ShardInfo(
        shards[1], e.samples, e.bytes, e.sha256, e.index, e.index_sha256, e.columns_sha256
    )


def test_tars_without_manifest_have_unknown_counts(packed, tmp_path):
    for p in _shards(packed["tar"], ".tar"):
        shutil.copy(p, tmp_path)
    res = resolve_source(str(tmp_path))
    assert res.manifest is None and res.classes is None
    assert {s.samples for s in res.shards} == {UNKNOWN}


def test_mixed_formats_are_refused(packed, tmp_path):
    shutil.copy(_shards(packed["tar"], ".tar")[0], tmp_path)
    shutil.copy(_shards(packed["lmdb"], ".lmdb")[0], tmp_path)
    with pytest.raises(InputError, match="mixes shard formats"):
        resolve_source(str(tmp_path))


def test_glob_matching_nothing(tmp_path):
    with pytest.raises(InputError, match=r"no shards match"):
        resolve_source(str(tmp_path / "*.tar"))


def test_missing_shard_in_a_brace_pattern_is_named(packed):
    pattern = os.path.join(packed["tar"], "shard-{000000..000099}.tar")
    with pytest.raises(InputError, match=r"shard-0000\d\d\.tar: shard not found"):
        resolve_source(pattern)


def test_directory_without_shards(tmp_path):
    with pytest.raises(InputError, match="no shards"):
        resolve_source(str(tmp_path))


def test_shard_not_in_the_manifest_beside_it(packed, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(packed["tar"], d)
    shutil.copy(d / "shard-000000.tar", d / "shard-000777.tar")
    with pytest.raises(ManifestError, match=r"shard-000777\.tar is not listed"):
        resolve_source(str(d / "*.tar"))


def test_listing_a_shard_twice(packed):
    s = _shards(packed["tar"], ".tar")[0]
    with pytest.raises(InputError, match="listed twice"):
        resolve_source([s, s])


def test_broken_manifest_is_reported(packed, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(packed["tar"], d)
    (d / MANIFEST_NAME).write_text("{ not json")
    with pytest.raises(ManifestError, match="manifest.json"):
        resolve_source(str(d))


def test_manifest_listing_a_deleted_shard(packed, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(packed["tar"], d)
    os.unlink(d / "shard-000001.tar")
    with pytest.raises(InputError, match=r"shard-000001\.tar: shard not found"):
        resolve_source(str(d))


def test_file_urls_resolve_through_fsspec(packed):
    d = packed["tar"]
    res = resolve_source(f"file://{d}/*.tar")
    assert all(u.startswith("file://") for u in res.urls)
    assert [u[len("file://") :] for u in res.urls] == _shards(d, ".tar")
    assert [s.samples for s in res.shards] == [e.samples for e in read_manifest(d).shards]
    res = resolve_source(f"file://{d}")
    assert res.manifest is not None and len(res.urls) == len(_shards(d, ".tar"))


def test_url_detection():
    assert is_url("s3://bucket/x.tar") and is_url("https://h/x.tar") and is_url("file:///x")
    assert not is_url("/data/x.tar") and not is_url("out/*.tar") and not is_url("C:\\x.tar")


def test_local_sources_get_local_storage(packed):
    assert isinstance(storage_for(packed["tar"]), LocalStorage)
    assert isinstance(storage_for([packed["tar"], packed["lmdb"]]), LocalStorage)


def test_local_storage_latency_and_errors(tmp_path):
    p = tmp_path / "x.bin"
    p.write_bytes(b"abc")
    st = LocalStorage(latency_ms=1)
    with st.open(str(p)) as f:
        assert f.read() == b"abc"
    assert st.local_path(f"file://{p}") == str(p)
    with pytest.raises(Exception, match="no such file"):
        st.open(str(tmp_path / "nope.tar"))
    with pytest.raises(InputError, match="latency_ms"):
        LocalStorage(latency_ms=-1)
