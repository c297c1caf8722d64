"""ShardDataset over s3:// and http:// URLs through real DataLoader worker processes, with the
servers (moto S3, a Range-capable HTTP server, a fault-injecting proxy) on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import traceback
import uuid
from collections import Counter
from pathlib import Path

import pytest
from remote_servers import FAKE_KEY, FAKE_SECRET, FaultProxy, S3Server, free_env
from torch.utils.data import DataLoader

from shardkit import Order, pack
from shardkit.errors import OutputError, StorageError
from shardkit.manifest import read_manifest
from shardkit.remote import ShardCache
from shardkit.remote.storage import RemoteStorage
from shardkit.stream.dataset import ShardDataset

pytest.importorskip("s3fs")
pytest.importorskip("aiohttp")
pytest.importorskip("moto.server")
pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.slow,  # real servers and DataLoader worker processes
]

N = 40
ALL_KEYS = sorted(f"class{i % 3}/img{i:03d}" for i in range(N))


@pytest.fixture(scope="module")
def data(packed_tree):
    """40 tiny JPEGs in 3 classes, packed as ~10 tar shards and as LMDB shards."""
    out = packed_tree(N, 3, {"tar": 12000, "lmdb": 40000})
    return {"src": out["src"], "tar": Path(out["tar"]), "lmdb": Path(out["lmdb"])}


@pytest.fixture(scope="module")
def bucket(s3_server, data):
    """One bucket with the tar dataset under tar/ and the LMDB one under lmdb/."""
    name = f"ds-{uuid.uuid4().hex[:10]}"
    s3_server.upload_dir(name, "tar", data["tar"])
    s3_server.upload_dir(name, "lmdb", data["lmdb"])
    return name


def _shards(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("shard-") and "." not in n[13:])


def _keys(ds, num_workers=2, **kw) -> list[str]:
    loader = DataLoader(ds, batch_size=4, num_workers=num_workers, **kw)
    return [k for batch in loader for k in batch[2]]


def _ds(source, opts, *, cache_dir=None, cache_limit=None, prefetch=2, **kw) -> ShardDataset:
    """``opts``, ``cache_dir``, ``cache_limit``, ``prefetch``: the ``RemoteStorage``'s."""
    storage = RemoteStorage(opts, cache_dir, cache_limit, prefetch)
    return ShardDataset(source, storage=storage, decode="raw", with_keys=True, **kw)


# --- what works ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    ["s3://{b}/tar/", "s3://{b}/tar/manifest.json", "s3://{b}/tar/shard-{{000000..{last}}}.tar"],
)
def test_s3_sources_stream_every_sample_exactly_once_through_workers(s3, bucket, data, source):
    last = _shards(data["tar"])[-1][len("shard-") : -len(".tar")]
    ds = _ds(source.format(b=bucket, last=last), S3Server.options(s3.endpoint))
    assert len(ds.urls) == len(_shards(data["tar"])) >= 5
    assert sorted(_keys(ds, num_workers=2)) == ALL_KEYS


def test_http_brace_pattern_and_manifest_url(data, http):
    http.root = data["tar"].parent
    last = _shards(data["tar"])[-1][len("shard-") : -len(".tar")]
    for source in [
        f"{http.url}/tar/shard-{{000000..{last}}}.tar",
        f"{http.url}/tar/manifest.json",
    ]:
        ds = _ds(source, None)
        assert ds.classes == ["class0", "class1", "class2"]
        assert sorted(_keys(ds, num_workers=2)) == ALL_KEYS


def test_http_manifest_url_with_a_query_string(data, http):
    """A presigned-style URL (a token for the whole prefix): names ignore the query, and every
    shard URL derived from the manifest's keeps it last (shardkit.urls)."""
    http.root = data["tar"].parent
    query = "?sig=a/b%2Fc&X-Amz-Expires=60"
    for fmt in ("tar", "lmdb"):
        for source in (f"{http.url}/{fmt}/manifest.json{query}", f"{http.url}/{fmt}/{query}"):
            ds = _ds(source, None)
            assert ds.urls[0] == f"{http.url}/{fmt}/shard-000000.{fmt}{query}"
            assert ds.classes == ["class0", "class1", "class2"]
            assert sorted(_keys(ds, num_workers=0)) == ALL_KEYS


def test_lmdb_shards_over_s3_with_and_without_cache(s3, bucket, tmp_path):
    opts = S3Server.options(s3.endpoint)
    for cache_dir in (None, str(tmp_path / "cache")):
        ds = _ds(f"s3://{bucket}/lmdb/", opts, cache_dir=cache_dir)
        assert sorted(_keys(ds, num_workers=2)) == ALL_KEYS


def test_ranks_get_equal_lengths_and_cover_the_epoch(s3, bucket):
    opts = S3Server.options(s3.endpoint)
    per_rank = []
    for rank in range(3):
        ds = _ds(f"s3://{bucket}/tar/", opts, rank=rank, world_size=3, order=Order())
        keys = _keys(ds, num_workers=2)
        assert len(keys) == len(ds) == -(-N // 3)
        per_rank.append(keys)
    counts = Counter(k for keys in per_rank for k in keys)
    assert sorted(counts) == ALL_KEYS and sum(counts.values()) - N == 3 * 14 - N  # pad only


def test_workers_reuse_the_manifest_read_at_construction(s3, bucket):
    """The manifest is fetched once, by source resolution; workers get its sizes and checksums."""
    s3.log.clear()
    ds = _ds(f"s3://{bucket}/tar/", S3Server.options(s3.endpoint))
    assert len(s3.log.gets("/tar/manifest.json")) == 1
    s3.log.clear()
    assert sorted(_keys(ds, num_workers=2)) == ALL_KEYS
    assert s3.log.gets("/tar/manifest.json") == []
    assert len(s3.log.gets("/tar/shard-")) == len(ds.urls)


# --- cache --------------------------------------------------------------------------------------


def test_second_epoch_is_served_from_the_cache(s3, bucket, data, tmp_path):
    ds = _ds(f"s3://{bucket}/tar/", S3Server.options(s3.endpoint), cache_dir=str(tmp_path))
    shard_gets = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        s3.log.clear()
        assert sorted(_keys(ds, num_workers=2)) == ALL_KEYS
        shard_gets.append(len(s3.log.gets("/tar/shard-")))
    assert shard_gets == [len(_shards(data["tar"])), 0]


def test_cache_limit_is_respected_during_an_epoch(s3, bucket, data, tmp_path):
    sizes = sorted(os.path.getsize(data["tar"] / n) for n in _shards(data["tar"]))
    limit = sum(sizes[-3:])  # room for three of the largest shards, not for all of them
    ds = _ds(
        f"s3://{bucket}/tar/",
        S3Server.options(s3.endpoint),
        cache_dir=str(tmp_path),
        cache_limit=limit,
    )
    for epoch in range(2):
        ds.set_epoch(epoch)
        assert sorted(_keys(ds, num_workers=2)) == ALL_KEYS
        assert 0 < ShardCache(tmp_path).size() <= limit
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_lmdb_shards_survive_a_cache_too_small_for_two(s3, packed_tree, tmp_path):
    """Regression: a prefetch (or another worker) adding an entry evicted the LMDB shard whose
    path had just been handed out, before it was opened ("LMDB shard not found")."""
    out = Path(packed_tree(30, 3, {"lmdb": 1})["lmdb"])  # one image per shard
    name = f"ds-{uuid.uuid4().hex[:10]}"
    s3.upload_dir(name, "lmdb", out)
    keys = sorted(f"class{i % 3}/img{i:03d}" for i in range(30))
    cache = tmp_path / "cache"
    ds = _ds(
        f"s3://{name}/lmdb/",
        S3Server.options(s3.endpoint),
        cache_dir=str(cache),
        cache_limit="1B",  # every insert evicts everything else
        prefetch=3,
    )
    assert len(ds.urls) == 30
    for epoch, workers in enumerate((0, 2)):
        ds.set_epoch(epoch)
        assert sorted(_keys(ds, num_workers=workers)) == keys
    assert not [n for n in os.listdir(cache) if n.startswith((".pin-", ".tmp-"))]


def test_concurrent_ranks_share_one_cache_dir_and_fetch_each_shard_once(s3, bucket, data, tmp_path):
    """Two ranks x two workers = four processes reading one cache dir at the same time."""
    opts = S3Server.options(s3.endpoint)
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            ds = _ds(
                f"s3://{bucket}/tar/",
                opts,
                rank=rank,
                world_size=2,
                order=Order(shuffle=False, equalize="none"),
                cache_dir=str(tmp_path),
            )
            results[rank] = _keys(ds, num_workers=2)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sorted(results[0] + results[1]) == ALL_KEYS
    gets = Counter(p for _, p, _ in s3.log.gets("/tar/shard-"))
    assert len(gets) == len(_shards(data["tar"])) and set(gets.values()) == {1}


# --- faults -------------------------------------------------------------------------------------


def test_epoch_completes_through_a_proxy_that_resets_connections(s3, bucket, data):
    with FaultProxy(("127.0.0.1", s3.port)) as proxy:
        ds = _ds(f"s3://{bucket}/tar/", S3Server.options(proxy.url))
        proxy.fail(None, drop_after=5000)  # every shard (~12 kB) needs several connections
        ds.storage.policy = ds.storage.policy.__class__(retries=6, backoff=0.01, max_backoff=0.05)
        assert sorted(_keys(ds, num_workers=2)) == ALL_KEYS
        assert proxy.faults_injected >= len(_shards(data["tar"]))
    ranged = [r for _, _, r in s3.log.gets("/tar/shard-") if r]
    assert ranged and all(int(r[6:-1]) > 0 for r in ranged)  # resumed, never restarted


def test_exhausted_retries_in_a_worker_raise_a_clean_error(s3, bucket):
    with FaultProxy(("127.0.0.1", s3.port)) as proxy:
        ds = _ds(f"s3://{bucket}/tar/", S3Server.options(proxy.url))
        ds.storage.policy = ds.storage.policy.__class__(retries=2, backoff=0.01)
        proxy.fail(None, drop_after=0)
        with pytest.raises(StorageError) as info:
            _keys(ds, num_workers=2)
    text = "".join(traceback.format_exception(info.value))
    # Workers know the shards' sizes from the manifest read at construction: the first object
    # they ask for is a shard, and the error names it with this URL's own attempt count.
    assert f"s3://{bucket}/tar/shard-" in text and "gave up after 3 attempts" in text
    assert FAKE_KEY not in text and FAKE_SECRET not in text


def test_truncated_shard_fails_instead_of_a_short_epoch(s3, data):
    b = f"trunc-{uuid.uuid4().hex[:8]}"
    s3.upload_dir(b, "tar", data["tar"])
    first = _shards(data["tar"])[0]
    body = (data["tar"] / first).read_bytes()
    s3.client().put_object(Bucket=b, Key=f"tar/{first}", Body=body[: len(body) // 2])
    ds = _ds(f"s3://{b}/tar/", S3Server.options(s3.endpoint))
    with pytest.raises(StorageError, match=f"{first}: object is .* manifest says"):
        _keys(ds, num_workers=0)  # in-process: a worker error's teardown costs 5 s per worker


def test_missing_shard_fails_with_its_url(s3, data):
    b = f"miss-{uuid.uuid4().hex[:8]}"
    s3.upload_dir(b, "tar", data["tar"])
    gone = _shards(data["tar"])[1]
    s3.client().delete_object(Bucket=b, Key=f"tar/{gone}")
    ds = _ds(f"s3://{b}/tar/", S3Server.options(s3.endpoint))
    with pytest.raises(StorageError, match=f"{gone}: no such object"):
        _keys(ds, num_workers=0)


# --- pack to a URL ------------------------------------------------------------------------------


def test_pack_to_s3_uploads_shards_then_manifest(s3, data, tmp_path):
    b = f"pack-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=b)
    s3.log.clear()
    opts = S3Server.options(s3.endpoint)
    report = pack(
        data["src"],
        f"s3://{b}/lfw/",
        storage_options=opts,
        shard_size=12000,
        progress=False,
        work_dir=str(tmp_path),
    )
    assert report.out == f"s3://{b}/lfw/"
    puts = [p for m, p, _ in s3.log.entries if m == "PUT" and "/lfw/" in p]
    indexes = [p for p in puts if p.endswith(".tar.idx")]  # each shard's sample index
    assert sorted(p[: -len(".idx")] for p in indexes) == sorted(p for p in puts if p.endswith("r"))
    assert puts[-1] == f"/{b}/lfw/manifest.json" and len(puts) == 2 * report.shards + 2
    assert f"/{b}/lfw/manifest.keys" in puts  # the key file, before the manifest
    for e in read_manifest(f"s3://{b}/lfw/", storage_options=opts).shards:  # covered by it
        body = s3.client().get_object(Bucket=b, Key=f"lfw/{e.path}.idx")["Body"].read()
        assert e.index_sha256 == hashlib.sha256(body).hexdigest()
    assert os.listdir(tmp_path) == []  # the local staging copy is gone
    ds = _ds(f"s3://{b}/lfw/", opts)
    assert sorted(_keys(ds, num_workers=0)) == ALL_KEYS
    with pytest.raises(OutputError, match="already holds a packed dataset"):
        pack(data["src"], f"s3://{b}/lfw/", storage_options=opts, progress=False)
    shutil.rmtree(tmp_path, ignore_errors=True)


# --- info / verify on URLs ----------------------------------------------------------------------


def test_info_and_verify_read_a_remote_dataset(s3, data):
    from shardkit.write.verify import dataset_info, verify

    b = f"verify-{uuid.uuid4().hex[:8]}"
    s3.upload_dir(b, "tar", data["tar"])
    opts = S3Server.options(s3.endpoint)
    info = dataset_info(f"s3://{b}/tar/", opts)
    assert info["samples"] == N and info["manifest"] == f"s3://{b}/tar/manifest.json"
    report = verify(f"s3://{b}/tar/manifest.json", decode=True, storage_options=opts)
    assert report.ok and report.decoded == N
    names = _shards(data["tar"])
    c = s3.client()
    body = (data["tar"] / names[0]).read_bytes()
    c.put_object(Bucket=b, Key=f"tar/{names[0]}", Body=body[:-1024])
    c.delete_object(Bucket=b, Key=f"tar/{names[1]}")
    idx = bytearray((data["tar"] / f"{names[2]}.idx").read_bytes())
    idx[70] ^= 0xFF  # the sample index beside a good shard, damaged
    c.put_object(Bucket=b, Key=f"tar/{names[2]}.idx", Body=bytes(idx))
    report = verify(f"s3://{b}/tar/", storage_options=opts)
    problems = {p.path: p.problems for p in report.bad}
    assert set(problems) == {*names[:3]} and problems[names[1]] == ["missing"]
    assert any("manifest says" in p for p in problems[names[0]])
    assert f"sample index {names[2]}.idx: sha256 differs from the manifest" in problems[names[2]][0]


def test_a_corrupt_object_never_enters_the_cache(s3, data, tmp_path):
    b = f"corrupt-{uuid.uuid4().hex[:8]}"
    s3.upload_dir(b, "tar", data["tar"])
    first = _shards(data["tar"])[0]
    body = bytearray((data["tar"] / first).read_bytes())
    body[700] ^= 0xFF  # same size, different bytes
    s3.client().put_object(Bucket=b, Key=f"tar/{first}", Body=bytes(body))
    ds = _ds(f"s3://{b}/tar/", S3Server.options(s3.endpoint), cache_dir=str(tmp_path))
    with pytest.raises(StorageError, match=f"{first}: sha256 .* does not match"):
        _keys(ds, num_workers=0)
    assert not any(n.endswith(first) for n in os.listdir(tmp_path))


def test_cli_pack_info_verify_on_s3_urls(s3, data, tmp_path):
    """`shardkit pack SRC s3://...`, `info` and `verify` as a user runs them: endpoint and
    credentials from the environment, shards uploaded before the manifest."""
    b = f"cli-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=b)
    s3.log.clear()
    env = free_env() | {"AWS_ENDPOINT_URL": s3.endpoint, "TMPDIR": str(tmp_path)}
    exe = [sys.executable, "-m", "shardkit.cli"]

    def run(*args):
        return subprocess.run([*exe, *args], env=env, capture_output=True, text=True, timeout=120)

    url = f"s3://{b}/lfw/"
    out = run("pack", data["src"], url, "--shard-size", "12000", "-q")
    assert out.returncode == 0, out.stderr
    assert f"in {url}" in out.stdout
    puts = [p for m, p, _ in s3.log.entries if m == "PUT" and "/lfw/" in p]
    assert puts[-1] == f"/{b}/lfw/manifest.json" and len(puts) > 2

    info = run("info", url, "--json")
    assert info.returncode == 0, info.stderr
    doc = json.loads(info.stdout)
    assert doc["samples"] == N and doc["shards"] == len([p for p in puts if p.endswith(".tar")])

    ok = run("verify", url, "-q")
    assert ok.returncode == 0 and ok.stdout.startswith("OK:"), ok.stderr
    s3.client().put_object(Bucket=b, Key="lfw/shard-000001.tar", Body=b"damaged")
    bad = run("verify", url, "-q")
    assert bad.returncode != 0
    assert "shard-000001.tar" in bad.stderr and "Traceback" not in bad.stderr
    assert FAKE_SECRET not in bad.stderr + bad.stdout


def test_pack_verify_and_info_take_urls_themselves(s3, data, tmp_path):
    """One entry point each: pack(src, url), verify(url), dataset_info(url)."""
    from shardkit import ShardWriter
    from shardkit.write.verify import dataset_info, verify

    b = f"urls-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=b)
    opts = S3Server.options(s3.endpoint)
    url = f"s3://{b}/ds/"
    report = pack(
        data["src"],
        url,
        storage_options=opts,
        shard_size=12000,
        progress=False,
        work_dir=str(tmp_path),
    )
    assert report.out == url and report.manifest_path == f"{url}manifest.json"
    assert os.listdir(tmp_path) == []
    info = dataset_info(url, storage_options=opts)
    assert (info["samples"], info["shards"]) == (N, report.shards)
    checked = verify(url, storage_options=opts, decode=True, work_dir=str(tmp_path))
    assert checked.ok and checked.decoded == N and checked.out == url
    # Overwrite with one big shard: the old manifest's other shards go, a user's object stays.
    s3.client().put_object(Bucket=b, Key="ds/notes.txt", Body=b"keep me")
    with ShardWriter(url, shard_size="1GB", overwrite=True, storage_options=opts) as w:
        with open(os.path.join(data["src"], "class0", "img000.jpg"), "rb") as f:
            w.write("k", f.read(), 0, txt="one")
    listed = sorted(
        o["Key"] for o in s3.client().list_objects_v2(Bucket=b, Prefix="ds/")["Contents"]
    )
    assert listed == [
        "ds/manifest.json",
        "ds/manifest.keys",  # the new pack's, replacing the old one's
        "ds/notes.txt",
        "ds/shard-000000.tar",
        "ds/shard-000000.tar.idx",
    ]
    assert len(ShardDataset(url, storage=RemoteStorage(storage_options=opts))) == 1
