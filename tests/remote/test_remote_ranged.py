"""A subset's or split's ranged GETs over real loopback servers (HTTP, moto S3) kept in flight
ahead of the reader: the same requests, the same samples in the same order and the same resume
state as one GET at a time; the bound held; nothing left running after an early stop."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import uuid

import pytest
from conftest import ranged_pack
from remote_servers import S3Server
from torch.utils.data import DataLoader

from shardkit.errors import InputError, StorageError
from shardkit.manifest import read_manifest
from shardkit.remote import RemoteStorage
from shardkit.remote.fs import filesystem
from shardkit.remote.ranged import RangesAhead
from shardkit.stream.dataset import ShardDataset
from shardkit.stream.mix import Source
from shardkit.stream.shuffle import Order

pytest.importorskip("s3fs")
pytest.importorskip("aiohttp")
pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.slow,  # real servers on loopback
]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """240 samples in shards of ~40 (with sample indexes), so a 10% subset reads ranges."""
    root = ranged_pack(tmp_path_factory.mktemp("ranged"), 240, "60kB")
    assert len(read_manifest(str(root / "tar")).shards) >= 5
    return root


def _ds(url, gets: int, opts=None, **kw) -> ShardDataset:
    """``url`` read with ``ranged_gets=gets``; ``kw``: the ``Source``'s subset or split."""
    storage = RemoteStorage(opts, prefetch=0, ranged_gets=gets)
    return ShardDataset(
        Source(url, **kw), decode="raw", with_keys=True, storage=storage, order=Order(shuffle=False)
    )


def _epoch(ds) -> list[tuple[str, bytes]]:
    return [(s[2], s[0]) for s in ds]


def _tar_gets(log) -> list[tuple[str, str, str]]:
    return [g for g in log.gets(".tar") if not g[1].endswith(".idx")]


@pytest.mark.parametrize(
    "kw", [{"subset": 0.1}, {"split": "val", "val_fraction": 0.1}], ids=["subset", "split"]
)
def test_http_sparse_epoch_keeps_the_bound_in_flight_and_reads_the_same(http, packed, kw):
    """Four GETs in flight at the server at once (the server holds the first until four are
    there, so a one-at-a-time reader is seen with one), never more; the same GETs, samples,
    bytes and order as ranged_gets=1."""
    http.root = packed
    url = f"{http.url}/tar/manifest.json"
    http.log.clear()
    one = _epoch(_ds(url, 1, **kw))
    sequential = _tar_gets(http.log)
    assert http.in_flight.most == 1 and len(sequential) >= 8

    http.in_flight.reset()
    http.in_flight.gate(4)
    http.log.clear()
    four = _epoch(_ds(url, 4, **kw))
    assert four == one and 8 <= len(four) < 60
    assert sorted(_tar_gets(http.log)) == sorted(sequential)  # the same ranged GETs, no more
    assert http.in_flight.most == 4


def test_the_indexes_a_sparse_epoch_needs_are_fetched_together(http, packed):
    """The heads of the shards' indexes (one ranged GET each, before the first sample) are in
    flight four at once, and the epoch is the same."""
    http.root = packed
    url = f"{http.url}/tar/manifest.json"
    one = _epoch(_ds(url, 1, subset=0.1))
    http.in_flight.reset(suffix=".idx")
    http.in_flight.gate(4)
    http.log.clear()
    assert _epoch(_ds(url, 4, subset=0.1)) == one
    heads = [g for g in http.log.gets(".idx") if g[2]]
    assert len(heads) == len(read_manifest(str(packed / "tar")).shards)  # one each, as before
    assert http.in_flight.most == 4


def test_s3_subset_and_split_epochs_read_the_same_with_gets_in_flight(s3, packed):
    name = f"ranged-{uuid.uuid4().hex[:10]}"
    s3.upload_dir(name, "tar", packed / "tar")
    opts = S3Server.options(s3.endpoint)
    for kw in ({"subset": 0.1}, {"split": "val", "val_fraction": 0.1}):
        s3.log.clear()
        one = _epoch(_ds(f"s3://{name}/tar/", 1, opts, **kw))
        sequential = sorted(_tar_gets(s3.log))
        s3.log.clear()
        many = _epoch(_ds(f"s3://{name}/tar/", 8, opts, **kw))
        assert many == one and len(one) >= 8
        assert sorted(_tar_gets(s3.log)) == sequential


def test_state_dict_and_resume_are_those_of_one_get_at_a_time(http, packed):
    """Stopped after 5 samples: the same state either way, and a resumed epoch (with GETs in
    flight) gives the rest, in order."""
    http.root = packed
    url = f"{http.url}/tar/manifest.json"
    states, heads = [], []
    for gets in (1, 4):
        ds = _ds(url, gets, subset=0.1)
        it = iter(ds)
        heads.append([next(it)[2] for _ in range(5)])
        states.append(ds.state_dict())
        it.close()
    assert states[0] == states[1] and heads[0] == heads[1]
    rest = _ds(url, 4, subset=0.1)
    rest.load_state_dict(states[1])
    whole = [k for k, _ in _epoch(_ds(url, 1, subset=0.1))]
    assert heads[1] + [k for k, _ in _epoch(rest)] == whole


@pytest.mark.parametrize("how", ["break", "close"])
def test_early_stop_cancels_the_gets_in_flight_and_leaves_no_thread(http, packed, how):
    """The server answers the ranged GET of the first sample and holds every other one; the
    consumer takes one sample and stops: the GETs it had started ahead are hung up by the
    client (their connections closed), none is answered, and no thread of the read is left.
    (The first GET is named, not "the first to arrive": the four reach the server in any order,
    and holding the one the reader waits for would stall ``next`` until the hold ran out.)"""
    http.root = packed
    url = f"{http.url}/tar/manifest.json"
    ds = _ds(url, 4, subset=0.1)
    http.log.clear()
    list(_ds(url, 1, subset=0.1))  # the filesystem and its IO thread exist before we count
    first = _tar_gets(http.log)[0]  # one GET at a time: the one the first sample is read by
    before = {t for t in threading.enumerate() if "process_request" not in t.name}
    http.in_flight.reset(wait=30.0)
    http.in_flight.hold(answer=[first[1:]])
    if how == "close":
        it = iter(ds)
        next(it)
        it.close()
        del it
    else:
        for _ in ds:
            break
    # As test_lifecycle's: the stages' generators are closed once the iteration and its
    # dataset are collected; read_slices' finally then closes the range reader, which cancels
    # the GETs ahead and waits for them.
    del ds
    gc.collect()
    f = http.in_flight
    assert f.settled(timeout=30.0), (f.held, f.abandoned, f.now)  # hung up, not timed out
    assert 1 <= f.abandoned <= f.held <= 3, (f.held, f.abandoned, f.seen, f.now, f.most)
    after = {t for t in threading.enumerate() if "process_request" not in t.name}
    assert after <= before


def test_ranges_ahead_close_cancels_its_tasks(http, packed):
    http.root = packed
    shard = read_manifest(str(packed / "tar")).shards[0]
    url = f"{http.url}/tar/{shard.path}"
    plan = [(url, i * 512, i * 512 + 100) for i in range(12)]
    ahead = RangesAhead(None, 3, 1 << 20)
    ahead.plan(iter(plan))
    data = (packed / "tar" / shard.path).read_bytes()
    assert ahead.take(*plan[0]) == data[:100]
    assert ahead.started == 3 and ahead.most == 3  # the one taken and two ahead: never four
    queued = list(ahead._queue)
    assert len(queued) == 2
    ahead.close()
    assert all(g.task is None or g.task.done() for g in queued)
    loop = filesystem("http").loop
    assert not [t for t in asyncio.all_tasks(loop) if t in {g.task for g in queued}]
    # the plan stays: the next take refills it, and an off-plan take is read all the same
    assert ahead.take(*plan[1]) == data[512:612]
    assert ahead.take(url, 0, 10) == data[:10]


def test_ranges_ahead_keeps_to_its_byte_cap(http, packed):
    http.root = packed
    shard = read_manifest(str(packed / "tar")).shards[0]
    url = f"{http.url}/tar/{shard.path}"
    data = (packed / "tar" / shard.path).read_bytes()
    ahead = RangesAhead(None, 8, 2500)
    ahead.plan((url, i * 1000, i * 1000 + 1000) for i in range(10))
    got = [ahead.take(url, i * 1000, i * 1000 + 1000) for i in range(10)]
    assert b"".join(got) == data[:10_000]
    assert ahead.most == 2  # 8 allowed by count, 2 by bytes
    ahead.close()


def test_a_failed_get_ahead_raises_one_line_naming_the_shard(http, packed, tmp_path):
    """A shard gone after construction: its GET fails ahead, and the error comes when the
    reader reaches it, as one line naming the shard."""
    import shutil

    shutil.copytree(packed / "tar", tmp_path / "tar")
    http.root = tmp_path
    ds = _ds(f"{http.url}/tar/manifest.json", 8, subset=0.1)
    last = ds.urls[-1]
    it = iter(ds)
    next(it)
    os.unlink(tmp_path / "tar" / last.rsplit("/", 1)[1])
    with pytest.raises(StorageError) as err:
        list(it)
    assert last in str(err.value) and "\n" not in str(err.value)


def test_ranged_gets_must_be_positive():
    with pytest.raises(InputError, match="ranged_gets=0"):
        RemoteStorage(ranged_gets=0)
    with pytest.raises(InputError, match="ranged_bytes"):
        RemoteStorage(ranged_bytes="lots")


def test_dataloader_workers_read_the_same_with_gets_in_flight(http, packed):
    """Forked workers each make their own event loop and GETs (none inherited)."""
    http.root = packed
    url = f"{http.url}/tar/manifest.json"
    _epoch(_ds(url, 4, subset=0.1))  # the parent's loop and sessions exist before the fork

    def keys(gets):
        loader = DataLoader(_ds(url, gets, subset=0.1), batch_size=4, num_workers=2)
        return [k for batch in loader for k in batch[2]]

    http.log.clear()
    one = keys(1)
    sequential = sorted(_tar_gets(http.log))
    http.log.clear()
    assert keys(4) == one and len(one) >= 8
    assert sorted(_tar_gets(http.log)) == sequential
