"""shardkit.remote against real servers on 127.0.0.1: moto S3, a Range-capable HTTP server, and a
TCP proxy that resets or stalls connections mid-object."""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import pickle
import time
import traceback
import uuid

import pytest
from remote_servers import FAKE_KEY, FAKE_SECRET, FaultProxy, S3Server

from shardkit.errors import InputError, StorageError
from shardkit.redact import redact
from shardkit.remote import (
    Expected,
    FetchStats,
    MissingObjectError,
    RemoteStorage,
    ShardCache,
    Uploader,
    fetch,
    read_bytes,
    upload_file,
)
from shardkit.remote.prefetch import Prefetcher
from shardkit.retry import RetryPolicy, is_transient

pytest.importorskip("s3fs")
pytest.importorskip("aiohttp")
pytest.importorskip("moto.server")
pytestmark = pytest.mark.slow  # real servers on loopback

FAST = RetryPolicy(retries=4, backoff=0.01, max_backoff=0.05)
SIZE = 600_000


def _bucket(s3server: S3Server, files: dict[str, bytes]) -> str:
    """A fresh bucket holding ``files``; returns its name."""
    name = f"b-{uuid.uuid4().hex[:12]}"
    c = s3server.client()
    c.create_bucket(Bucket=name)
    for key, data in files.items():
        c.put_object(Bucket=name, Key=key, Body=data)
    s3server.log.clear()
    return name


@pytest.fixture(scope="module")
def blob() -> bytes:
    return os.urandom(SIZE)


@pytest.fixture(scope="module")
def http_root(tmp_path_factory, blob):
    root = tmp_path_factory.mktemp("http")
    (root / "obj.bin").write_bytes(blob)
    return root


@pytest.fixture()
def http(http, http_root):
    """The session's HTTP server (remote_servers.py), serving ``obj.bin`` for this module."""
    http.root = http_root
    return http


def _get(url, opts=None, **kw) -> tuple[bytes, FetchStats]:
    out, st = io.BytesIO(), FetchStats()
    fetch(url, out, storage_options=opts, stats=st, **kw)
    return out.getvalue(), st


# --- retry classification and redaction ---------------------------------------------------------


def test_transient_errors_are_told_from_permanent_ones():
    from botocore.exceptions import ClientError

    def client_error(code: str, status: int) -> ClientError:
        resp = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return ClientError(resp, "GetObject")

    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(client_error("SlowDown", 503))
    assert is_transient(client_error("InternalError", 500))
    assert not is_transient(client_error("NoSuchKey", 404))
    assert not is_transient(client_error("AccessDenied", 403))
    assert not is_transient(FileNotFoundError("x"))
    assert not is_transient(ValueError("bad"))
    wrapped = OSError(5, "translated")  # s3fs turns ClientErrors into OSErrors with a cause
    wrapped.__cause__ = client_error("SlowDown", 503)
    assert is_transient(wrapped)


def test_redact_masks_userinfo_signatures_and_known_secrets(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envSecretValue123")
    text = (
        "GET https://alice:pw0rd@host/x?X-Amz-Signature=abcdef&X-Amz-Credential=AKIA1/2&ok=1 "
        f"failed; key {FAKE_KEY} secret {FAKE_SECRET}; env envSecretValue123"
    )
    from shardkit.redact import secret_values

    out = redact(text, secret_values({"key": FAKE_KEY, "client_kwargs": {"secret": FAKE_SECRET}}))
    for leaked in ("pw0rd", "alice", "abcdef", "AKIA1", FAKE_KEY, FAKE_SECRET, "envSecretValue123"):
        assert leaked not in out
    assert "ok=1" in out and "https://***@host/x" in out


# --- whole-object reads -------------------------------------------------------------------------


def test_s3_object_is_read_with_one_request_and_verified(s3, blob):
    b = _bucket(s3, {"d/obj.bin": blob})
    exp = Expected(len(blob), hashlib.sha256(blob).hexdigest())
    data, st = _get(f"s3://{b}/d/obj.bin", S3Server.options(s3.endpoint), expected=exp)
    assert data == blob and st.attempts == 1
    assert s3.log.gets("obj.bin") == [("GET", f"/{b}/d/obj.bin", "")]


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_resets_mid_object_resume_from_the_byte_reached(s3, http, blob, kind):
    """Every connection dies after SIZE/4 bytes: only a resuming reader can ever finish."""
    if kind == "s3":
        b = _bucket(s3, {"obj.bin": blob})
        target, log = ("127.0.0.1", s3.port), s3.log
    else:
        target, log = ("127.0.0.1", http.port), http.log
    with FaultProxy(target) as proxy:
        proxy.fail(None, drop_after=SIZE // 4)
        if kind == "s3":
            url, opts = f"s3://{b}/obj.bin", S3Server.options(proxy.url)
        else:
            url, opts = f"{proxy.url}/obj.bin", None
        data, st = _get(url, opts, policy=FAST)
    assert data == blob
    assert st.attempts >= 4 and proxy.faults_injected >= 4
    starts = [int(r[len("bytes=") : -1]) for _, _, r in log.gets("obj.bin")[1:]]
    assert len(starts) == st.attempts - 1
    assert starts == sorted(starts) and starts[0] > 0  # each retry asks for the rest only
    assert all(r == "" or r.endswith("-") for _, _, r in log.gets("obj.bin"))


def test_http_server_that_ignores_range_still_resumes_correctly(http, blob):
    http.ignore_range = True
    with FaultProxy(("127.0.0.1", http.port)) as proxy:
        proxy.fail(2, drop_after=SIZE // 2)
        data, st = _get(f"{proxy.url}/obj.bin", policy=FAST)
    assert data == blob and st.attempts == 3


def test_stalled_connection_times_out_and_resumes(s3, blob):
    b = _bucket(s3, {"obj.bin": blob})
    with FaultProxy(("127.0.0.1", s3.port)) as proxy:
        proxy.fail(1, stall_after=SIZE // 3)
        data, st = _get(f"s3://{b}/obj.bin", S3Server.options(proxy.url), policy=FAST, timeout=0.5)
    assert data == blob and st.attempts == 2
    assert s3.log.gets("obj.bin")[1][2].startswith("bytes=")


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_throttling_and_5xx_are_retried_with_backoff(s3, http, blob, kind):
    if kind == "s3":
        b = _bucket(s3, {"obj.bin": blob})
        s3.faults.set(2, 503, "obj.bin")  # <Code>SlowDown</Code>, as S3 sends it
        url, opts, log = f"s3://{b}/obj.bin", S3Server.options(s3.endpoint), s3.log
    else:
        http.faults.set(2, 503)
        url, opts, log = f"{http.url}/obj.bin", None, http.log
    sleeps: list[float] = []
    out, st = io.BytesIO(), FetchStats()
    fetch(url, out, storage_options=opts, stats=st, policy=FAST, sleep=sleeps.append)
    assert out.getvalue() == blob
    assert st.attempts == 3 and len(log.gets("obj.bin")) == 3  # our retries only, no hidden ones
    assert len(sleeps) == 2 and 0.005 <= sleeps[0] <= 0.01 and 0.01 <= sleeps[1] <= 0.02


def test_exhausted_retries_name_url_and_cause_without_credentials(s3, blob):
    b = _bucket(s3, {"obj.bin": blob})
    with FaultProxy(("127.0.0.1", s3.port)) as proxy:
        proxy.fail(None, drop_after=0)
        with pytest.raises(StorageError) as info:
            _get(f"s3://{b}/obj.bin", S3Server.options(proxy.url), policy=FAST)
    text = str(info.value)
    assert f"s3://{b}/obj.bin" in text and "gave up after 5 attempts" in text
    assert "Error" in text  # the cause's class is named
    full = "".join(traceback.format_exception(info.value)) + repr(info.value)
    assert FAKE_KEY not in full and FAKE_SECRET not in full


def test_credentials_in_an_http_url_never_reach_the_error(http):
    with FaultProxy(("127.0.0.1", http.port)) as proxy:
        proxy.fail(None, drop_after=0)
        url = f"http://user:hunter2secret@127.0.0.1:{proxy.port}/obj.bin?sig=s3cr3tsig"
        with pytest.raises(StorageError) as info:
            _get(url, policy=RetryPolicy(retries=1, backoff=0.01))
    full = "".join(traceback.format_exception(info.value))
    assert "hunter2secret" not in full and "s3cr3tsig" not in full and "obj.bin" in full


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_missing_object_is_a_clear_error_without_retries(s3, http, kind):
    if kind == "s3":
        b = _bucket(s3, {})
        url, opts = f"s3://{b}/nope.tar", S3Server.options(s3.endpoint)
    else:
        url, opts = f"{http.url}/nope.tar", None
    with pytest.raises(MissingObjectError, match="nope.tar: no such object") as info:
        _get(url, opts, policy=FAST)
    assert isinstance(info.value, StorageError)


def test_size_and_checksum_disagreeing_with_the_manifest_fail(s3, blob):
    b = _bucket(s3, {"obj.bin": blob[:-100]})  # truncated upload
    opts = S3Server.options(s3.endpoint)
    sha = hashlib.sha256(blob).hexdigest()
    with pytest.raises(StorageError, match="manifest says 600000.*truncated"):
        _get(f"s3://{b}/obj.bin", opts, expected=Expected(len(blob), sha))
    with pytest.raises(StorageError, match="sha256 .* does not match"):
        _get(f"s3://{b}/obj.bin", opts, expected=Expected(len(blob) - 100, sha))


def test_read_bytes_for_manifests_and_verify(http, blob):
    assert read_bytes(f"{http.url}/obj.bin") == blob


# --- cache --------------------------------------------------------------------------------------


def _fill_with(data: bytes):
    calls = []

    def fill(f):
        calls.append(1)
        f.write(data)

    return fill, calls


def test_cache_hit_serves_the_entry_without_fetching(tmp_path):
    cache = ShardCache(tmp_path)
    fill, calls = _fill_with(b"x" * 100)
    f, path = cache.get("s3://b/a.tar", fill)
    assert f.read() == b"x" * 100 and len(calls) == 1
    g, same = cache.get("s3://b/a.tar", fill)
    assert same == path and g.read() == b"x" * 100 and len(calls) == 1
    assert cache.stats.hits == 1 and cache.stats.misses == 1
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no temp or lock left


def test_failed_fill_leaves_no_entry(tmp_path):
    cache = ShardCache(tmp_path)

    def bad(f):
        f.write(b"half")
        raise StorageError("boom")

    with pytest.raises(StorageError):
        cache.get("s3://b/a.tar", bad)
    assert os.listdir(tmp_path) == []


def test_cache_limit_evicts_least_recently_used(tmp_path):
    cache = ShardCache(tmp_path, limit=250)
    opened = []
    for name in ["a", "b"]:
        f, _ = cache.get(f"s3://b/{name}.tar", _fill_with(name.encode() * 100)[0])
        opened.append(f)
    past = time.time() - 100
    for i, (_, _, p) in enumerate(cache.entries()):  # make the order explicit: a older than b
        os.utime(p, (past + i, past + i))
    cache.get("s3://b/a.tar", _fill_with(b"")[0])  # a hit: a is now the most recent
    cache.get("s3://b/c.tar", _fill_with(b"c" * 100)[0])  # over 250 bytes: b must go
    names = sorted(p.rsplit("-", 1)[1] for _, _, p in cache.entries())
    assert names == ["a.tar", "c.tar"] and cache.size() <= 250 and cache.stats.evicted == 1
    assert opened[1].read() == b"b" * 100  # an evicted entry stays readable through its open fd


def _dead_pid() -> int:
    child = multiprocessing.get_context("spawn").Process(target=int)
    child.start()
    child.join()
    return child.pid


def test_cache_removes_temporaries_only_of_dead_processes(tmp_path):
    """One stale-temp policy (fsutil): by owner pid, never by age; a live writer's stays."""
    cache = ShardCache(tmp_path, limit=10**6)
    entry = os.path.basename(cache.path("s3://b/x.tar"))
    dead = tmp_path / f".tmp-{entry}.{_dead_pid()}.0123abcd"
    live = tmp_path / f".tmp-{entry}.{os.getppid()}.4567abcd"  # pytest's parent: alive
    pinned = tmp_path / f".pin-{entry}.{_dead_pid()}.89abcdef"
    for p in (dead, live, pinned):
        p.write_bytes(b"partial")
        os.utime(p, (1, 1))  # ancient: age alone would have removed all three
    cache.evict()
    assert sorted(os.listdir(tmp_path)) == [live.name]


def test_pinned_entry_survives_eviction_by_another_insert(tmp_path):
    """A path handed out for LMDB is a pin: an insert evicting the entry cannot break it."""
    cache = ShardCache(tmp_path, limit=100)
    f, path = cache.get("s3://b/a.lmdb", _fill_with(b"a" * 100)[0])
    with f:
        pin = cache.pin(f, path)
    assert os.path.samefile(pin, path)  # a hard link, not a copy
    g, _ = cache.get("s3://b/b.lmdb", _fill_with(b"b" * 100)[0])  # evicts a.lmdb
    g.close()
    assert not os.path.exists(path) and [os.path.basename(p) for _, _, p in cache.entries()] == [
        os.path.basename(cache.path("s3://b/b.lmdb"))
    ]
    with open(pin, "rb") as h:
        assert h.read() == b"a" * 100
    cache.evict()
    assert os.path.exists(pin)  # ours, alive: never a stale temporary
    f, path = cache.get("s3://b/c.lmdb", _fill_with(b"c" * 100)[0])
    os.unlink(path)  # evicted between get() and pin(): the open descriptor still has the bytes
    with f:
        copy = cache.pin(f, path)
    with open(copy, "rb") as h:
        assert h.read() == b"c" * 100


def test_entry_depends_on_content_hash(tmp_path):
    cache = ShardCache(tmp_path)
    assert cache.path("s3://b/a.tar", "00") != cache.path("s3://b/a.tar", "11")
    assert cache.path("s3://b/a.tar").endswith("-a.tar")


def _read_all_in_child(cache_dir, urls, opts, seed, q):
    import random

    storage = RemoteStorage(opts, cache_dir=cache_dir, prefetch=0, retries=2)
    order = list(urls)
    random.Random(seed).shuffle(order)
    digests = {}
    for u in order:
        with storage.open(u) as f:
            digests[u] = hashlib.sha256(f.read()).hexdigest()
    q.put(digests)


def test_concurrent_processes_share_one_cache_and_fetch_each_shard_once(s3, tmp_path):
    files = {f"d/shard-{i:06d}.tar": os.urandom(200_000 + i) for i in range(6)}
    b = _bucket(s3, files)
    urls = [f"s3://{b}/{k}" for k in files]
    opts = S3Server.options(s3.endpoint)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_read_all_in_child, args=(str(tmp_path), urls, opts, s, q))
        for s in range(4)
    ]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    want = {f"s3://{b}/{k}": hashlib.sha256(v).hexdigest() for k, v in files.items()}
    assert all(r == want for r in results)
    assert len(s3.log.gets(".tar")) == len(files)  # flock de-duplication: once per machine
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temps, no locks


# --- RemoteStorage and prefetch ----------------------------------------------------------------


def test_prefetcher_keeps_depth_ahead_and_fetches_on_demand():
    seen: list[str] = []
    pre: Prefetcher[str] = Prefetcher(lambda u: seen.append(u) or u.upper(), depth=2)
    pre.want(["b", "c", "d", "e"])
    assert pre.take("a") == "A"  # not prefetched: fetched in the caller
    assert pre.take("b") == "B" and pre.take("c") == "C"
    assert sorted(seen) == ["a", "b", "c"] and pre.started == 2  # d, e were never asked for
    pre.close()


def test_remote_storage_prefetches_the_plan_and_never_more(s3):
    files = {f"p/shard-{i:06d}.tar": os.urandom(50_000) for i in range(6)}
    b = _bucket(s3, files)
    urls = [f"s3://{b}/{k}" for k in files]
    storage = RemoteStorage(S3Server.options(s3.endpoint), prefetch=2, verify=False)
    for n, u in enumerate(urls[:3]):
        storage.prefetch(urls[n + 1 :])  # what the dataset does before each shard
        with storage.open(u) as f:
            assert f.read() == files[u.split("/", 3)[3]]
    storage.close()
    st = storage.stats()
    assert st["fetched"] <= 5 and st["prefetched"] == 4  # shards 1..4: never the whole dataset
    gets = [p for _, p, _ in s3.log.gets(".tar")]
    assert len(gets) == len(set(gets))  # nothing fetched twice
    assert f"/{b}/p/shard-000005.tar" not in gets


def test_remote_storage_pickles_without_threads_or_sockets(s3, tmp_path):
    b = _bucket(s3, {"x.tar": b"abc"})
    storage = RemoteStorage(S3Server.options(s3.endpoint), cache_dir=tmp_path, verify=False)
    with storage.open(f"s3://{b}/x.tar") as f:
        assert f.read() == b"abc"
    clone = pickle.loads(pickle.dumps(storage))
    assert clone._rt is None and clone.cache_dir == str(tmp_path)
    with clone.open(f"s3://{b}/x.tar") as f:  # a cache hit in the "new process"
        assert f.read() == b"abc"
    assert len(s3.log.gets("x.tar")) == 1


def test_remote_storage_verifies_against_the_manifest_found_beside_the_shards(s3):
    import json

    from shardkit.stream.sources import resolve_source

    good, bad = os.urandom(3000), os.urandom(3000)
    manifest = {
        "version": 1,
        "shard_format": "tar",
        "classes": ["a"],
        "shards": [
            {"path": n, "samples": 1, "bytes": 3000, "sha256": hashlib.sha256(good).hexdigest()}
            for n in ("good.tar", "bad.tar")
        ],
    }
    b = _bucket(s3, {"good.tar": good, "bad.tar": bad, "manifest.json": json.dumps(manifest)})
    opts = S3Server.options(s3.endpoint)
    # The manifest beside a brace pattern's shards is read once, by resolution; the ShardInfo
    # it yields is what the storage verifies against.
    shards = resolve_source(f"s3://{b}/{{good,bad}}.tar", storage_options=opts).shards
    storage = RemoteStorage(opts, prefetch=0)
    with storage.open(shards[0]) as f:
        assert f.read() == good
    with pytest.raises(StorageError, match="bad.tar: sha256"):
        storage.open(shards[1])
    assert len(s3.log.gets("manifest.json")) == 1  # read once per process
    storage.close()
    plain = RemoteStorage(opts, prefetch=0)
    with plain.open(f"s3://{b}/bad.tar") as f:  # a plain URL promises nothing: unchecked
        assert f.read() == bad


def test_local_path_for_lmdb_without_cache_is_a_private_copy(s3):
    b = _bucket(s3, {"a.lmdb": b"A" * 10, "b.lmdb": b"B" * 10, "c.lmdb": b"C" * 10})
    storage = RemoteStorage(S3Server.options(s3.endpoint), prefetch=1, verify=False)
    paths = [storage.local_path(f"s3://{b}/{n}.lmdb") for n in "abc"]
    with open(paths[2], "rb") as f:
        assert f.read() == b"C" * 10
    assert not os.path.exists(paths[0])  # only the last two private copies are kept
    storage.close()
    assert not any(os.path.exists(p) for p in paths)  # close() drops the private copies


def test_bad_arguments_are_input_errors():
    with pytest.raises(InputError, match="cache_limit needs cache_dir"):
        RemoteStorage(cache_limit=10)
    with pytest.raises(InputError, match="prefetch"):
        RemoteStorage(prefetch=-1)
    with pytest.raises(InputError, match="cache_limit='lots'"):
        RemoteStorage(cache_dir="/nonexistent", cache_limit="lots")
    assert RemoteStorage(cache_dir="/nonexistent", cache_limit="1GB").cache_limit == 10**9


# --- uploads ------------------------------------------------------------------------------------


def test_upload_file_retries_and_checks_size(s3, tmp_path):
    b = _bucket(s3, {})
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(100_000))
    with FaultProxy(("127.0.0.1", s3.port)) as proxy:
        proxy.fail(2, drop_after=0)
        n = upload_file(src, f"s3://{b}/up/f.bin", S3Server.options(proxy.url), policy=FAST)
    assert n == 100_000
    body = s3.client().get_object(Bucket=b, Key="up/f.bin")["Body"].read()
    assert body == src.read_bytes()


def test_uploader_sends_the_manifest_last(s3, tmp_path):
    b = _bucket(s3, {})
    for i in range(4):
        (tmp_path / f"shard-{i:06d}.tar").write_bytes(os.urandom(20_000))
    (tmp_path / "manifest.json").write_text("{}")
    up = Uploader(f"s3://{b}/ds/", S3Server.options(s3.endpoint), concurrency=3)
    for i in range(4):
        up.submit(tmp_path / f"shard-{i:06d}.tar")
    assert up.finish(tmp_path / "manifest.json") == f"s3://{b}/ds/manifest.json"
    puts = [p for m, p, _ in s3.log.entries if m == "PUT" and "/ds/" in p]
    assert len(puts) == 5 and puts[-1].endswith("/ds/manifest.json")


def test_http_destinations_are_refused():
    with pytest.raises(InputError, match="read-only"):
        upload_file(__file__, "https://example.invalid/x")
