"""Hostile remote inputs: credentials in URLs are never shown, and a cache_dir shared with other
files keeps them. Real files and a loopback HTTP server."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
from conftest import lmdb_shard

from shardkit import Order
from shardkit.manifest import Manifest, ShardEntry, write_manifest
from shardkit.remote.storage import RemoteStorage

# --- credentials in URLs never shown ---------------------------------------------------

SECRET_URL = "https://alice:hunter22@example.org/ds/shard-000000.tar?X-Amz-Signature=deadbeef99"


@pytest.mark.parametrize(
    "cls",
    [
        __import__("shardkit.errors", fromlist=["x"]).__dict__[name]
        for name in __import__("shardkit.errors", fromlist=["x"]).__all__
    ],
)
def test_every_error_class_masks_urls(cls):
    exc = cls(f"{SECRET_URL}: something failed")
    for text in (str(exc), f"{exc}", f"skipped: {exc}"):
        assert "hunter22" not in text and "deadbeef99" not in text, text
        assert "example.org/ds/shard-000000.tar" in text  # the URL is still named


def test_skip_warning_masks_urls():
    from shardkit.records import Record
    from shardkit.stream.stages import decode_records

    rec = Record("k", "jpg", b"not an image", 0, SECRET_URL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(decode_records([rec], "pil", on_error="skip")) == []
    (w,) = caught
    assert "hunter22" not in str(w.message) and "deadbeef99" not in str(w.message)
    assert "shard-000000.tar" in str(w.message)


def test_join_url_keeps_the_query_last():
    from shardkit.remote.upload import join_url, url_parent

    assert join_url("https://h/p?tok=1", "manifest.json") == "https://h/p/manifest.json?tok=1"
    assert join_url("s3://b/p/", "s.tar") == "s3://b/p/s.tar"
    assert url_parent("https://h/p/manifest.json?tok=1") == "https://h/p?tok=1"


@pytest.mark.slow  # the CLI in a child process
def test_cli_info_and_verify_mask_userinfo_and_signed_queries(tmp_path):
    """A loopback HTTP server behind URLs with credentials: nothing secret reaches the output,
    and a signed manifest URL is read as is (not with /manifest.json after its query)."""
    from remote_servers import HttpServer

    ds = tmp_path / "ds"
    ds.mkdir()
    import hashlib

    lmdb_shard(ds / "shard-000000.lmdb")
    good = (ds / "shard-000000.lmdb").read_bytes()
    entry = ShardEntry("shard-000000.lmdb", 40, len(good), hashlib.sha256(good).hexdigest())
    write_manifest(Manifest("lmdb", ["c0", "c1", "c2"], [entry]), str(ds))
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TMPDIR=str(tmp_path))
    exe = [sys.executable, "-m", "shardkit.cli"]

    def run(*args):
        return subprocess.run([*exe, *args], env=env, capture_output=True, text=True, timeout=120)

    with HttpServer(tmp_path) as http:
        host = http.url.removeprefix("http://")
        signed = f"http://{host}/ds/manifest.json?X-Amz-Signature=deadbeef99&X-Amz-Credential=AKIAX"
        userinfo = f"http://alice:hunter22@{host}/ds/"
        outputs = []
        for url in (signed, userinfo):
            info = run("info", url)
            assert info.returncode == 0, info.stderr
            outputs.append(info.stdout + info.stderr)
            ok = run("verify", url, "-q")
            assert ok.returncode == 0 and ok.stdout.startswith("OK:"), ok.stderr
            outputs.append(ok.stdout + ok.stderr)
        assert ("GET", "/ds/manifest.json", "") in http.log.gets("manifest") or any(
            p == "/ds/manifest.json" for _, p, _ in http.log.gets("manifest")
        )
        (ds / "shard-000000.lmdb").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        bad = run("verify", userinfo, "-q")
        assert bad.returncode == 1
        outputs.append(bad.stdout + bad.stderr)
        missing = run("info", f"http://alice:hunter22@{host}/nothing/")
        assert missing.returncode != 0 and "Traceback" not in missing.stderr
        outputs.append(missing.stdout + missing.stderr)
    for text in outputs:
        assert "hunter22" not in text and "deadbeef99" not in text and "AKIAX" not in text, text
    assert f"{host}/ds/manifest.json" in outputs[0]


# --- a cache_dir shared with other files -----------------------------------------------


def _user_files(folder) -> dict[str, bytes]:
    """A user's things in the cache folder, all older than anything the cache writes."""
    files = {"notes.txt": b"mine" * 1000, ".tmp-plan.txt": b"keep", "g" * 20 + "-x": b"not hex"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
        os.utime(folder / name, (1, 1))
    (folder / "subdir").mkdir()
    (folder / "subdir" / "inner.bin").write_bytes(b"x" * 5000)
    os.utime(folder / "subdir", (1, 1))
    (folder / "link").symlink_to(folder / "notes.txt")
    return files


def test_cache_evicts_only_its_own_entries(tmp_path):
    from shardkit.remote.cache import ShardCache

    cache = ShardCache(tmp_path, limit=10)
    files = _user_files(tmp_path)
    for i in range(3):
        f, _ = cache.get(f"https://h/s{i}.tar", lambda out, i=i: out.write(bytes([i]) * 100))
        f.close()
    for name, data in files.items():
        assert (tmp_path / name).read_bytes() == data
    assert (tmp_path / "subdir" / "inner.bin").exists() and (tmp_path / "link").is_symlink()
    own = [os.path.basename(p) for _, _, p in cache.entries()]
    assert len(own) == 1 and own[0].endswith("-s2.tar")  # the last one stays, the others went
    assert cache.stats.evicted == 2


@pytest.mark.slow  # an HTTP server
def test_streaming_through_a_cache_dir_with_foreign_files(tmp_path):
    from remote_servers import HttpServer

    from shardkit import ShardDataset

    ds = tmp_path / "ds"
    ds.mkdir()
    import hashlib

    entries = []
    for i in range(3):
        name = f"shard-{i:06d}.lmdb"
        lmdb_shard(ds / name, n=10, seed=i)
        data = (ds / name).read_bytes()
        entries.append(ShardEntry(name, 10, len(data), hashlib.sha256(data).hexdigest()))
    write_manifest(Manifest("lmdb", ["c0", "c1", "c2"], entries), str(ds))
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    files = _user_files(cache_dir)
    with HttpServer(tmp_path) as http:
        got = ShardDataset(
            f"{http.url}/ds/manifest.json",
            decode="raw",
            order=Order(shuffle=False),
            storage=RemoteStorage(
                cache_dir=str(cache_dir),
                cache_limit=sum(e.bytes for e in entries),  # room for the shards, not the user's
            ),
        )
        assert len(list(got)) == 30
    for name, data in files.items():
        assert (cache_dir / name).read_bytes() == data
    assert (cache_dir / "subdir" / "inner.bin").exists()
