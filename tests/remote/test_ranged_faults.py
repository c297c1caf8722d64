"""Ranged and index GETs follow the retry, backoff and timeout policy of whole-shard reads,
against a loopback server that misbehaves on command: a 500 then success is retried and the
epoch is the same; a body that ends early, a connection closed mid-body and a stall past the
timeout too; a store that keeps answering 503 is one ``StorageError`` line naming the URL and
the byte range after the retries, in bounded time, and ``shardkit verify``/``ls`` print that
line, never a traceback. Over split and subset epochs (one GET at a time and GETs ahead),
``ShardView.get`` and the CLI."""

from __future__ import annotations

import uuid
import warnings

import pytest
from conftest import ranged_pack, run_cli
from remote_servers import S3Server

from shardkit import ShardView
from shardkit.errors import StorageError
from shardkit.manifest import read_manifest
from shardkit.remote import RemoteStorage
from shardkit.stream.dataset import ShardDataset
from shardkit.stream.mix import Source
from shardkit.stream.shuffle import Order

pytest.importorskip("aiohttp")
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

RETRIES = 3
EPOCHS = {"split": {"split": "val", "val_fraction": 0.2}, "subset": {"subset": 0.2}}
#: Faults a body can have: an error status, a body that ends early, a close mid-body.
FAULTS = {"500": {"status": 500}, "short": {"body": "short"}, "cut": {"body": "cut"}}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """60 samples in shards of ~10 (with sample indexes), so a 20% split reads ranges."""
    root = ranged_pack(tmp_path_factory.mktemp("faults"), 60, "20kB", seed=1)
    assert len(read_manifest(str(root / "tar")).shards) >= 4
    return root


def _storage(gets: int = 1, timeout: float = 60.0, opts=None) -> RemoteStorage:
    """A policy that retries as the default one does, with waits of milliseconds."""
    return RemoteStorage(
        opts, prefetch=0, ranged_gets=gets, retries=RETRIES, backoff=0.005, max_backoff=0.02,
        timeout=timeout,
    )  # fmt: skip


def _epoch(url, storage, **kw) -> list[tuple[str, bytes]]:
    ds = ShardDataset(
        Source(url, **kw), decode="raw", with_keys=True, storage=storage, order=Order(shuffle=False)
    )
    return [(s[2], s[0]) for s in ds]


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def _sample_gets(log) -> list[str]:
    """The Range headers of the GETs of samples (not of indexes)."""
    return [g[2] for g in log.gets(".tar") if g[2] and not g[1].endswith(".idx")]


def _whole_gets(log) -> int:
    """GETs of whole shards (a slice streamed, or a shard read for want of its index)."""
    return len([g for g in log.gets(".tar") if not g[2] and not g[1].endswith(".idx")])


@pytest.fixture()
def served(http, packed):
    """The dataset's manifest URL on the HTTP server, each epoch's samples as read with no
    fault (what every faulty read must give) and its GETs: (of samples, of whole shards)."""
    http.root = packed
    url = f"{http.url}/tar/manifest.json"
    truth, gets = {}, {}
    for name, kw in EPOCHS.items():
        http.log.clear()
        truth[name] = _epoch(url, _storage(), **kw)
        gets[name] = len(_sample_gets(http.log)), _whole_gets(http.log)
    assert all(len(t) >= 6 for t in truth.values())
    http.log.clear()
    return url, truth, gets


@pytest.mark.parametrize("gets", [1, 4], ids=["one-get", "gets-ahead"])
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("epoch", list(EPOCHS))
def test_a_faulty_sample_get_is_retried_and_the_epoch_is_the_same(http, served, epoch, fault, gets):
    url, truth, clean = served
    http.faults.set(2, suffix=".tar", ranged=True, **FAULTS[fault])
    assert _epoch(url, _storage(gets), **EPOCHS[epoch]) == truth[epoch]
    assert http.faults.taken == 2
    assert len(_sample_gets(http.log)) == clean[epoch][0] + 2  # each asked again (its rest)


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("epoch", list(EPOCHS))
def test_a_faulty_index_get_is_retried_and_the_epoch_is_the_same(http, served, epoch, fault):
    """Read again (its rest), not taken for a damaged index: no warning, no whole index nor
    shard read instead."""
    url, truth, clean = served
    http.faults.set(2, suffix=".idx", **FAULTS[fault])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _epoch(url, _storage(4), **EPOCHS[epoch]) == truth[epoch]
    assert http.faults.taken == 2
    assert _whole_gets(http.log) == clean[epoch][1]
    assert all(g[2] for g in http.log.gets(".idx"))  # only the heads' ranged GETs


@pytest.mark.parametrize("gets", [1, 4], ids=["one-get", "gets-ahead"])
@pytest.mark.parametrize("epoch", list(EPOCHS))
def test_a_store_that_keeps_failing_is_one_line_after_the_retries(http, served, epoch, gets):
    url, _, _ = served
    http.faults.set(None, 503, suffix=".tar", ranged=True)
    with pytest.raises(StorageError) as err:
        _epoch(url, _storage(gets), **EPOCHS[epoch])
    text = _one_line(err)
    assert f"{http.url}/tar/shard-" in text and ".tar: bytes " in text
    assert f"gave up after {RETRIES + 1} attempts" in text and "HTTP 503" in text
    assert "RemoteStorage(retries=" in text  # the fix
    first = text.split(": bytes ", 1)[1].split(":", 1)[0]  # "a-b": the range that failed
    a, b = map(int, first.split("-"))
    asked = [g for g in http.log.gets(".tar") if g[2] == f"bytes={a}-{b - 1}"]
    assert len(asked) == RETRIES + 1  # bounded: the retries, no more


@pytest.mark.parametrize("epoch", list(EPOCHS))
def test_an_index_that_keeps_failing_is_one_line_naming_it(http, served, epoch):
    url, _, _ = served
    http.faults.set(None, 503, suffix=".idx")
    with pytest.raises(StorageError) as err:
        _epoch(url, _storage(4), **EPOCHS[epoch])
    text = _one_line(err)
    assert ".tar.idx" in text and "gave up after" in text


@pytest.mark.slow  # each stall lasts the timeout
@pytest.mark.parametrize("gets", [1, 4], ids=["one-get", "gets-ahead"])
def test_a_stalled_get_times_out_and_is_retried(http, served, gets):
    url, truth, _ = served
    http.faults.set(1, body="stall", suffix=".tar", ranged=True)
    assert _epoch(url, _storage(gets, timeout=0.5), **EPOCHS["split"]) == truth["split"]
    http.faults.set(1, body="stall", suffix=".idx", ranged=True)
    assert _epoch(url, _storage(gets, timeout=0.5), **EPOCHS["subset"]) == truth["subset"]
    assert http.faults.taken == 1


def test_view_get_retries_a_500_and_refuses_a_store_that_keeps_failing(http, packed):
    http.root = packed
    url = f"{http.url}/tar/manifest.json"
    keys = ShardView(url, decode="raw", with_keys=True).keys()
    key = keys[len(keys) // 2]
    want = ShardView(url, decode="raw", with_keys=True).get(key)
    http.faults.set(1, 500, suffix=".tar", ranged=True)
    assert ShardView(url, decode="raw", with_keys=True).get(key) == want  # the default policy
    assert http.faults.taken == 1
    for fault in FAULTS.values():
        http.faults.set(1, suffix=".tar", ranged=True, **fault)
        view = ShardView(url, decode="raw", with_keys=True, storage=_storage())
        assert view.get(key) == want
    http.faults.set(None, 503, suffix=".tar", ranged=True)
    with pytest.raises(StorageError) as err:
        ShardView(url, decode="raw", storage=_storage()).get(key)
    assert ".tar: bytes " in _one_line(err) and f"gave up after {RETRIES + 1}" in str(err.value)


def test_a_range_is_exactly_its_bytes(http, packed):
    """``fetch_range`` hands out exactly ``stop - start`` bytes: a body that ends early brings
    the rest with the next attempt; a server that ignores Range is an error, not a longer
    answer."""
    from shardkit.remote.fetch import fetch_range

    http.root = packed
    shard = read_manifest(str(packed / "tar")).shards[0]
    data = (packed / "tar" / shard.path).read_bytes()
    url = f"{http.url}/tar/{shard.path}"
    http.faults.set(3, body="short")
    assert fetch_range(url, 1000, 5000) == data[1000:5000]
    assert [g[2] for g in http.log.gets(shard.path)] == [
        "bytes=1000-4999", "bytes=3000-4999", "bytes=4000-4999", "bytes=4500-4999",
    ]  # fmt: skip
    http.faults.set(0)
    http.ignore_range = True
    with pytest.raises(StorageError, match="ignore Range"):
        fetch_range(url, 1000, 5000)


def test_s3_slowdown_on_ranged_gets_is_retried(s3, packed):
    name = f"faults-{uuid.uuid4().hex[:10]}"
    s3.upload_dir(name, "tar", packed / "tar")
    opts = S3Server.options(s3.endpoint)
    url = f"s3://{name}/tar/"
    for kw in EPOCHS.values():
        truth = _epoch(url, _storage(4, opts=opts), **kw)
        s3.faults.set(3, 503, suffix=".tar", ranged=True)  # the samples' GETs
        assert _epoch(url, _storage(4, opts=opts), **kw) == truth
        assert s3.faults.taken == 3
        s3.faults.set(None, 503, suffix=".tar", ranged=True)
        with pytest.raises(StorageError) as err:
            _epoch(url, _storage(4, opts=opts), **kw)
        text = _one_line(err)
        assert f"s3://{name}/tar/shard-" in text and ".tar: bytes " in text
        assert f"gave up after {RETRIES + 1}" in text
        s3.faults.set(0)


@pytest.mark.slow  # the CLI in a child process, waiting out the default retries
@pytest.mark.parametrize("command", ["verify", "ls"])
def test_cli_verify_and_ls_print_one_line_when_the_store_keeps_failing(http, packed, command):
    http.root = packed
    url = f"{http.url}/tar/manifest.json"
    http.faults.set(1, 500, suffix=".idx")
    ok = run_cli(command, url)
    assert ok.returncode == 0, ok.stderr
    http.faults.set(None, 503, suffix=".idx")
    proc = run_cli(command, url)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and ".tar.idx" in lines[0] and "gave up" in lines[0]


def test_a_view_takes_storage_or_its_loose_options_not_both(tmp_path):
    from shardkit.errors import InputError

    with pytest.raises(InputError, match="storage_options= and storage= both set one option group"):
        ShardView("http://127.0.0.1:9/tar/", storage=RemoteStorage(), storage_options={})
