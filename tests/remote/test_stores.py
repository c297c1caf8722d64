"""S3, GCS and Azure Blob alike: each test runs over moto S3, fake-gcs-server and Azurite (the
``store`` fixture, tests/remote_servers.py), on 127.0.0.1, through the same drivers users
install (s3fs, gcsfs, adlfs). A store whose emulator cannot start fails its tests.

Not slow: one pack to each store and one epoch from it, and the failure paths that end at once.
Slow: repacks, the CLI, worker processes, resume, subsets and splits, and the fault proxy."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import uuid
import warnings
from pathlib import Path

import fsspec
import fsspec.implementations.memory
import pytest
from remote_servers import FaultProxy, StoreCase
from torch.utils.data import DataLoader

from shardkit import Order, Source, pack
from shardkit.errors import InputError, MissingExtraError, StorageError
from shardkit.remote import RemoteStorage, read_bytes
from shardkit.remote.fetch import fetch_range
from shardkit.remote.fs import filesystem
from shardkit.retry import RetryPolicy
from shardkit.stream.dataset import ShardDataset

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N = 40
ALL_KEYS = sorted(f"class{i % 3}/img{i:03d}" for i in range(N))
FAST = RetryPolicy(retries=2, backoff=0.01, max_backoff=0.02)


@pytest.fixture(scope="module")
def data(packed_tree):
    """40 tiny JPEGs in 3 classes, and their local tar pack (~10 shards): the reference."""
    out = packed_tree(N, 3, {"tar": 12000})
    return {"src": out["src"], "tar": Path(out["tar"])}


def _pack(store: StoreCase, data, tmp_path, **kw) -> str:
    url = store.url(store.new_bucket(), "lfw/")
    _pack_to(url, store, data, tmp_path, **kw)
    return url


def _pack_to(url: str, store: StoreCase, data, tmp_path, **kw):
    """``pack`` of the test's source to ``url`` in shards of 12 kB; its report."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pack(
            data["src"],
            url,
            shard_size=12000,
            progress=False,
            storage_options=store.options(),
            work_dir=str(tmp_path),
            **kw,
        )


def _samples(source, storage=None, **kw) -> dict[str, bytes]:
    ds = ShardDataset(source, decode="raw", with_keys=True, storage=storage, **kw)
    return {key: image for image, _label, key in ds}


def _keys(ds, num_workers=2) -> list[str]:
    loader = DataLoader(ds, batch_size=4, num_workers=num_workers)
    return [k for batch in loader for k in batch[2]]


def _ds(url, store: StoreCase, **kw) -> ShardDataset:
    storage = RemoteStorage(store.options(), cache_dir=kw.pop("cache_dir", None))
    return ShardDataset(url, storage=storage, decode="raw", with_keys=True, **kw)


# --- every store: pack, stream, the counters --------------------------------------------------


def test_pack_to_the_store_streams_the_local_packs_bytes(store, data, tmp_path):
    """A pack straight to the URL, read back: the same samples, byte for byte, as the local
    pack of the same folder; the storage's byte counter is the sum over every shard fetched."""
    url = _pack(store, data, tmp_path)
    storage = RemoteStorage(store.options(), prefetch=0)
    remote = _samples(url, storage)
    assert remote == _samples(str(data["tar"]))
    assert sorted(remote) == ALL_KEYS
    shards = store.fs().ls(url.split("://", 1)[1].rstrip("/"), detail=True)
    tars = [e["size"] for e in shards if e["name"].endswith(".tar")]
    assert storage.stats()["fetched"] == len(tars) >= 3
    assert storage.stats()["bytes"] == sum(tars)  # the sum, not the last shard's


@pytest.mark.slow  # two packs a store (the CLI test below runs it too)
def test_an_unchanged_pack_to_the_store_is_up_to_date(store, data, tmp_path):
    url = _pack(store, data, tmp_path)
    manifest = store.fs().cat_file(url.split("://", 1)[1] + "manifest.json")
    report = _pack_to(url, store, data, tmp_path)
    assert report.up_to_date and report.samples == N
    assert report.manifest_path == url + "manifest.json"
    assert store.fs().cat_file(url.split("://", 1)[1] + "manifest.json") == manifest
    # a different shard size is another pack: not up to date (it needs overwrite=True)
    with pytest.raises(Exception, match="already holds a packed dataset"):
        pack(data["src"], url, shard_size=9000, progress=False, storage_options=store.options())


def test_a_missing_bucket_is_named_in_the_stores_terms(store, data):
    url = store.url(f"nope{uuid.uuid4().hex[:8]}", "lfw/")
    with pytest.raises(StorageError) as info:
        pack(data["src"], url, progress=False, storage_options=store.options())
    text = str(info.value)
    term = "container" if store.scheme == "az" else "bucket"
    assert f"no such {term}" in text and "\n" not in text
    endpoint = {
        "s3": "AWS_ENDPOINT_URL",
        "gs": "STORAGE_EMULATOR_HOST",
        "az": "AZURE_STORAGE_CONNECTION_STRING",
    }
    assert endpoint[store.scheme] in text


def _refusing_server():
    """A loopback port that accepts each connection and closes it at once; counts them."""
    listener = socket.create_server(("127.0.0.1", 0))
    count = [0]

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            count[0] += 1
            conn.close()

    thread = threading.Thread(target=serve, daemon=True, name="serve_forever-refusing")
    thread.start()
    return listener, count


def test_an_endpoint_that_hangs_up_is_retried_by_our_policy_alone(store):
    """Every connection closed unanswered: the read ends in one line after our 3 attempts;
    the driver's own retry loop (gcsfs: 6 tries per call, up to 32 s apart; the Azure SDK: 3
    more, 15 s apart and growing) is off."""
    listener, count = _refusing_server()
    try:
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(StorageError) as info:
            read_bytes(store.url("b", "x/manifest.json"), store.options(endpoint), policy=FAST)
    finally:
        listener.close()
    text = str(info.value)
    assert "gave up after 3 attempts" in text and "\n" not in text
    # An attempt is one read: a request or two (gcsfs asks for the object and a listing, aiohttp
    # reconnects once to a server that hung up), not the driver's loop of several tries each.
    assert 3 <= count[0] <= 3 * 4


def test_an_unreachable_endpoint_ends_in_one_line(store):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening
        with pytest.raises(StorageError) as info:
            read_bytes(store.url("b", "x/manifest.json"), store.options(endpoint), policy=FAST)
    text = str(info.value)
    assert "gave up after 3 attempts" in text and "\n" not in text


def test_refused_credentials_are_one_line_naming_where_they_come_from(http, tmp_path):
    (tmp_path / "x.bin").write_bytes(b"x" * 100)
    http.root = tmp_path
    http.faults.set(1, 403)
    with pytest.raises(StorageError) as info:
        read_bytes(f"{http.url}/x.bin", policy=FAST)
    text = str(info.value)
    assert "access denied; check the credentials: the URL (a signed query string)" in text
    assert len(http.log.gets("x.bin")) == 1  # not retried


# --- drivers, credentials, log lines (no server) ----------------------------------------------


@pytest.mark.parametrize(
    "protocol, module, extra",
    [("gs", "gcsfs", "gcs"), ("az", "adlfs", "azure"), ("s3", "s3fs", "s3")],
)
def test_a_missing_driver_is_one_line_naming_the_extra(monkeypatch, protocol, module, extra):
    registry = sys.modules["fsspec.registry"]._registry  # (fsspec.registry is a mapping)
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    for name in [m for m in sys.modules if m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in list(registry):  # classes fsspec imported already
        monkeypatch.delitem(registry, name)
    with pytest.raises(MissingExtraError) as info:
        filesystem(protocol, {"anon": True, "x_test": uuid.uuid4().hex})
    assert str(info.value) == (
        f"{protocol}:// URLs need {module}, which is not installed: pip install 'shardkit[{extra}]'"
    )


def test_missing_azure_credentials_name_the_variable_and_keys(monkeypatch):
    for k in ("CONNECTION_STRING", "ACCOUNT_NAME", "ACCOUNT_KEY", "SAS_TOKEN"):
        monkeypatch.delenv(f"AZURE_STORAGE_{k}", raising=False)
    with pytest.raises(StorageError) as info:
        filesystem("az", {"x_test": uuid.uuid4().hex})
    text = str(info.value)
    assert "AZURE_STORAGE_CONNECTION_STRING" in text and '"account_name"' in text
    assert "\n" not in text


def test_missing_s3_credentials_name_the_variables_not_a_failed_read(monkeypatch, tmp_path):
    """botocore finds no credentials before it sends anything: said as such, with AWS's
    variables and storage_options keys, not as "read failed" (which reads as a network fault)."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    for k in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(k, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {  # a fresh driver instance: the user agent differs from every cached one
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        "config_kwargs": {"user_agent_extra": uuid.uuid4().hex},
    }
    with pytest.raises(StorageError) as info:
        read_bytes("s3://b/x/manifest.json", options, policy=FAST)
    text = str(info.value)
    assert "no credentials found; set AWS_ACCESS_KEY_ID" in text and '"key"' in text
    assert "read failed" not in text and "\n" not in text


def test_gcsfs_bucket_type_warnings_are_dropped_and_its_other_warnings_kept(caplog):
    filesystem("gs", {"token": "anon", "endpoint_url": "http://127.0.0.1:9"})
    logger = logging.getLogger("gcsfs")
    with caplog.at_level(logging.WARNING, logger="gcsfs"):
        logger.warning("Could not determine bucket type for bucket name b: x, falling back")
        logger.warning("Error: Bucket b not found or you lack permissions for storage layout")
        logger.warning("a real warning")
    assert [r.getMessage() for r in caplog.records] == ["a real warning"]


def test_append_to_a_url_is_refused_naming_the_two_step_route(data):
    with pytest.raises(InputError) as info:
        pack(data["src"], "gs://b/lfw/", append=True, progress=False)
    text = str(info.value)
    assert "local copy" in text and "docs/remote.md" in text and "\n" not in text


def test_merge_into_a_url_is_refused_naming_the_two_step_route(data):
    from shardkit.write.merge import merge

    with pytest.raises(InputError) as info:
        merge([str(data["tar"]), str(data["tar"])], "az://c/lfw/")
    text = str(info.value)
    assert "local copy" in text and "docs/remote.md" in text and "\n" not in text


# --- slow: the CLI, workers, resume, ranges, faults -------------------------------------------


def _cli(store: StoreCase, tmp_path, *args, endpoint=None):
    env = store.env(endpoint) | {"TMPDIR": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-m", "shardkit.cli", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # CLI child processes
def test_cli_pack_info_verify_ls_and_up_to_date(store, data, tmp_path):
    """What a user runs, with the endpoint and credentials from the environment only."""
    url = store.url(store.new_bucket(), "lfw/")
    out = _cli(store, tmp_path, "pack", data["src"], url, "--shard-size", "12000", "-q")
    assert out.returncode == 0, out.stderr
    again = _cli(store, tmp_path, "pack", data["src"], url, "--shard-size", "12000")
    assert again.returncode == 0, again.stderr
    assert "up to date" in again.stdout
    info = _cli(store, tmp_path, "info", url, "--json")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["samples"] == N
    ok = _cli(store, tmp_path, "verify", url, "-q")
    assert ok.returncode == 0 and ok.stdout.startswith("OK:"), ok.stderr
    listed = _cli(store, tmp_path, "ls", url)
    assert listed.returncode == 0, listed.stderr
    assert "class0/img000" in listed.stdout
    bad = _cli(store, tmp_path, "pack", data["src"], url, "--append")
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    for run in (out, again, info, ok, listed):
        assert "Could not determine bucket type" not in run.stderr


@pytest.mark.slow  # CLI child processes
def test_cli_against_an_unreachable_store_is_one_line(store, data, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
        got = _cli(store, tmp_path, "info", store.url("b", "lfw/"), endpoint=endpoint)
    assert got.returncode == 1
    assert got.stderr.startswith("error: ") and len(got.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # DataLoader worker processes
def test_two_ranks_and_two_workers_read_every_sample_exactly_once(store, data, tmp_path):
    url = _pack(store, data, tmp_path)
    assert sorted(_keys(_ds(url, store), num_workers=2)) == ALL_KEYS
    ranks = [_keys(_ds(url, store, rank=r, world_size=2), num_workers=2) for r in range(2)]
    assert sorted(ranks[0] + ranks[1]) == ALL_KEYS and not set(ranks[0]) & set(ranks[1])
    cached = _ds(url, store, cache_dir=str(tmp_path / "cache"))
    assert sorted(_keys(cached, num_workers=2)) == ALL_KEYS


@pytest.mark.slow  # several epochs
def test_a_resumed_epoch_gives_the_rest_in_order(store, data, tmp_path):
    url = _pack(store, data, tmp_path)
    whole = [s[2] for s in _ds(url, store, seed=3)]
    ds = _ds(url, store, seed=3)
    it = iter(ds)
    head = [next(it)[2] for _ in range(13)]
    state = ds.state_dict()
    it.close()
    rest = _ds(url, store, seed=3)
    rest.load_state_dict(state)
    assert head + [s[2] for s in rest] == whole


@pytest.mark.slow  # ranged GETs over many shards
def test_subset_and_split_epochs_read_byte_ranges_and_the_same_samples(store, data, tmp_path):
    url = _pack(store, data, tmp_path)
    for kw in ({"subset": 0.25}, {"split": "val", "val_fraction": 0.25}):
        local = _samples(Source(str(data["tar"]), **kw), order=Order(shuffle=False))
        storage = RemoteStorage(store.options(), prefetch=0, ranged_gets=4)
        remote = _samples(Source(url, **kw), storage, order=Order(shuffle=False))
        assert remote == local and len(remote) >= 5


@pytest.mark.slow  # a fault proxy and retries
def test_an_epoch_completes_through_a_proxy_that_resets_connections(store, data, tmp_path):
    url = _pack(store, data, tmp_path)
    with FaultProxy(("127.0.0.1", store.port)) as proxy:
        storage = RemoteStorage(
            store.options(proxy.url), prefetch=0, retries=8, backoff=0.01, max_backoff=0.05
        )
        proxy.fail(6, drop_after=3000)  # the next 6 connections reset mid-reply
        assert _samples(url, storage) == _samples(str(data["tar"]))
        assert proxy.faults_injected >= 1


@pytest.mark.slow  # waits for timeouts
def test_a_stalled_store_ends_after_timeout_times_attempts(store, data, tmp_path):
    """The proxy forwards nothing back: each attempt times out (0.5 s) and the read ends in one
    line after retries + 1 of them, the driver's loop of tries off."""
    url = _pack(store, data, tmp_path)
    with FaultProxy(("127.0.0.1", store.port)) as proxy:
        proxy.fail(None, stall_after=0)
        with pytest.raises(StorageError) as info:
            read_bytes(url + "manifest.json", store.options(proxy.url), policy=FAST, timeout=0.5)
        assert 3 <= proxy.connections <= 3 * 4  # a request or two an attempt (see above)
    assert "gave up after 3 attempts" in str(info.value)


# --- a protocol whose driver takes no timeout (hf://, sftp:// ...) ---------------------------


class _StalledFS(fsspec.implementations.memory.MemoryFileSystem):
    """An fsspec filesystem whose reads hang until released, as a driver with no timeout of
    ours does against a server that accepts and never answers."""

    protocol = "stalledtest"
    release = threading.Event()
    store: dict = {}  # its own objects, apart from memory://'s

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix(cls.protocol + "://"))

    def cat_file(self, path, start=None, end=None, **kw):
        self.release.wait()
        return super().cat_file(path, start=start, end=end, **kw)

    def _open(self, path, mode="rb", **kw):
        f = super()._open(path, mode, **kw)
        if "r" in mode:
            read = f.read

            def stalled_read(*a):
                self.release.wait()
                return read(*a)

            f.read = stalled_read
        return f


@pytest.fixture
def stalled():
    fsspec.register_implementation(_StalledFS.protocol, _StalledFS, clobber=True)
    _StalledFS.release.clear()
    fs = _StalledFS()
    fs.pipe_file("/x.bin", b"y" * 1000)
    yield fs
    _StalledFS.release.set()  # the abandoned reads' threads end


@pytest.mark.parametrize("ranged", [False, True], ids=["whole", "range"])
def test_a_protocol_without_driver_timeouts_still_ends_after_timeout_times_attempts(
    stalled, ranged
):
    """Whole-object and ranged reads on a protocol shardkit cannot time out through its driver
    run under a no-progress deadline: two retries of a 0.2 s timeout end in one line."""
    url = f"{_StalledFS.protocol}://x.bin"
    with pytest.raises(StorageError) as info:
        if ranged:
            fetch_range(url, 10, 20, policy=FAST, timeout=0.2)
        else:
            read_bytes(url, policy=FAST, timeout=0.2)
    text = str(info.value)
    assert "gave up after 3 attempts" in text and "no progress for 0.2 s" in text
    assert "\n" not in text
    _StalledFS.release.set()  # a working read still reads every byte
    assert read_bytes(url, policy=FAST, timeout=5) == b"y" * 1000
    assert fetch_range(url, 10, 20, policy=FAST, timeout=5) == b"y" * 10
