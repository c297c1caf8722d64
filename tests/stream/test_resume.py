"""Mid-epoch resume (same world and elastic) and exact ``len(loader)``, through real DataLoader
worker processes, torchdata's StatefulDataLoader and real shard files."""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import uuid
from collections import Counter

import pytest
import torch
from conftest import gloo_rank, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from shardkit.errors import InputError
from shardkit.formats import get_format
from shardkit.formats.sample_index import decode_index, index_path
from shardkit.manifest import read_manifest
from shardkit.remote.storage import RemoteStorage
from shardkit.stream.dataset import ShardDataset, Source
from shardkit.stream.resume import merge_worker_states, round_robin
from shardkit.stream.shuffle import Order, buffer_point, rng_for, shuffle_buffer
from shardkit.stream.storage import LocalStorage

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),  # torchdata 0.11
]

N = 301  # the samples of conftest.resume_shards (prime to 2, 3 and 4)
B = 8


@pytest.fixture(scope="module")
def data(resume_shards):
    return resume_shards  # conftest: 301 samples in three tar shards


def _ds(src, *, shuffle=True, buffer_size=1000, equalize="pad", **kw):
    """The dataset these tests resume: ``shuffle``, ``buffer_size`` and ``equalize`` are its
    ``Order``'s (the tests' shorthand)."""
    kw.setdefault("order", Order(shuffle, buffer_size, equalize))
    kw.setdefault("with_keys", True)
    kw.setdefault("decode", "raw")
    kw.setdefault("seed", 7)
    return ShardDataset(src, **kw)


def _batches(loader, n=None) -> list[list[str]]:
    return [list(b[2]) for b in itertools.islice(iter(loader), n)]


def _roundtrip(state, how: str):
    if how == "json":
        return json.loads(json.dumps(state))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # plain data: loads without unpickling objects


# --- the index-only replay agrees with the real shuffle buffer ---------------------------------


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 9000),
    size=st.integers(0, 40),
    frac=st.floats(0, 1),
    seed=st.integers(0, 2**31),
)
def test_buffer_replay_on_indices_continues_the_real_buffer(n, size, frac, seed):
    """After c outputs, the replay names the delivered items, the residents and the unread rest,
    and a buffer resumed from them emits exactly what the uninterrupted one would have."""
    full = list(shuffle_buffer(range(n), size, rng_for(seed, 0)))
    assert sorted(full) == list(range(n))
    c = int(frac * n)
    point = buffer_point(n, size, rng_for(seed, 0), c)
    assert sorted(point.consumed().tolist()) == sorted(full[:c])
    residents = [None if j < 0 else j for j in point.slots.tolist()]
    rest = shuffle_buffer(
        residents + list(range(point.frontier, n)),
        size,
        rng_for(seed, 0),
        resume=(point.steps, point.flushed),
    )
    assert list(rest) == full[c:]


def test_round_robin_deals_batches_as_the_dataloader_does():
    # workers with 2, 1 and 3 batches: A1 B1 C1 A2 C2 C3
    assert round_robin([2, 1, 3], 4) == ([2, 1, 1], 2)
    assert round_robin([2, 1, 3], 5) == ([2, 1, 2], 2)
    assert round_robin([2, 1, 3], 0) == ([0, 0, 0], 0)
    assert round_robin([2, 1, 3], 3) == ([1, 1, 1], 0)
    with pytest.raises(InputError, match="only 6 batches"):
        round_robin([2, 1, 3], 7)


# --- same-world resume ----------------------------------------------------------------------------


@pytest.mark.parametrize("buffer_size", [0, 40])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_stateful_dataloader_resume_equals_the_uninterrupted_epoch(
    data, world_size, num_workers, buffer_size
):
    for rank in range(world_size):
        kw = dict(rank=rank, world_size=world_size, buffer_size=buffer_size, batch_size=B)
        ds = _ds(data, **kw)
        ds.set_epoch(2)
        full = _batches(StatefulDataLoader(ds, batch_size=B, num_workers=num_workers))
        k = len(full) * 2 // 3 + rank
        ds = _ds(data, **kw)
        ds.set_epoch(2)
        loader = StatefulDataLoader(ds, batch_size=B, num_workers=num_workers)
        it = iter(loader)
        before = [list(next(it)[2]) for _ in range(k)]
        state = _roundtrip(loader.state_dict(), "torch")
        del it
        resumed = StatefulDataLoader(_ds(data, **kw), batch_size=B, num_workers=num_workers)
        resumed.load_state_dict(state)
        after = _batches(resumed)
        assert before + after == full
        assert len(after) == len(full) - k > 0


@pytest.mark.parametrize("buffer_size", [0, 40])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_plain_dataloader_resume_from_a_batch_count(data, world_size, num_workers, buffer_size):
    """``ds.state_dict(batches=k, num_workers=...)`` works out a plain DataLoader's position; the
    resumed loader continues in the same order (its round robin restarts at worker 0)."""
    for rank in range(world_size):
        kw = dict(rank=rank, world_size=world_size, buffer_size=buffer_size)
        ds = _ds(data, **kw)
        ds.set_epoch(1)
        full = _batches(DataLoader(ds, batch_size=B, num_workers=num_workers))
        k = len(full) // 2 + rank
        ds = _ds(data, **kw)
        ds.set_epoch(1)
        before = _batches(DataLoader(ds, batch_size=B, num_workers=num_workers), k)
        state = ds.state_dict(batches=k, num_workers=num_workers, batch_size=B)
        assert json.loads(json.dumps(state)) == state
        ds2 = _ds(data, **kw)
        ds2.load_state_dict(_roundtrip(state, "json"))
        after = _batches(DataLoader(ds2, batch_size=B, num_workers=num_workers))
        assert before + after == full


@pytest.mark.parametrize("how", ["json", "torch"])
def test_in_process_state_round_trips_and_resumes_without_set_epoch(data, how):
    ds = _ds(data, buffer_size=40)
    ds.set_epoch(3)
    it = iter(ds)
    before = [s[2] for s in itertools.islice(it, 123)]
    state = ds.state_dict()
    assert _roundtrip(state, how) == state
    assert state["epoch"] == 3

    fresh = _ds(data, buffer_size=40)  # epoch 0 until the state says otherwise
    fresh.load_state_dict(_roundtrip(state, how))
    assert fresh.epoch == 3
    after = [s[2] for s in fresh]
    epoch3 = [s[2] for s in _epoch(data, 3, buffer_size=40)]
    assert before + after == epoch3
    assert after != [s[2] for s in _epoch(data, 0, buffer_size=40)][123:]
    # A state saved mid-resume continues again.
    fresh2 = _ds(data, buffer_size=40)
    fresh2.load_state_dict(state)
    it2 = iter(fresh2)
    part = [s[2] for s in itertools.islice(it2, 50)]
    again = _ds(data, buffer_size=40)
    again.load_state_dict(fresh2.state_dict())
    assert before + part + [s[2] for s in again] == epoch3
    # The epoch after the resumed one is the ordinary next epoch.
    fresh.set_epoch(4)
    assert [s[2] for s in fresh] == [s[2] for s in _epoch(data, 4, buffer_size=40)]


def _epoch(src, epoch, **kw):
    ds = _ds(src, **kw)
    ds.set_epoch(epoch)
    return list(ds)


def test_state_saved_at_an_epochs_end_leads_to_the_next_epoch(data):
    ds = _ds(data, buffer_size=40)
    ds.set_epoch(3)
    list(ds)
    fresh = _ds(data, buffer_size=40)
    fresh.load_state_dict(ds.state_dict())
    assert fresh.epoch == 4
    assert [s[2] for s in fresh] == [s[2] for s in _epoch(data, 4, buffer_size=40)]


# torchdata builds an iterator for the finished state and drops it unused: "epoch 4 again".
@pytest.mark.filterwarnings("ignore:ShardDataset iterated epoch 4 again:RuntimeWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_loader_state_at_an_epochs_end_keeps_the_next_set_epoch(data, num_workers):
    """torchdata restarts a finished state's iteration; loading it must not undo set_epoch(4)."""
    ds = _ds(data, buffer_size=40, batch_size=B)
    ds.set_epoch(3)
    loader = StatefulDataLoader(ds, batch_size=B, num_workers=num_workers)
    epoch3 = _batches(loader)
    state = loader.state_dict()
    ds = _ds(data, buffer_size=40, batch_size=B)
    loader = StatefulDataLoader(ds, batch_size=B, num_workers=num_workers)
    loader.load_state_dict(state)
    ds.set_epoch(4)  # the training loop's next epoch
    fresh = _ds(data, buffer_size=40, batch_size=B)
    fresh.set_epoch(4)
    epoch4 = _batches(DataLoader(fresh, batch_size=B, num_workers=num_workers))
    assert _batches(loader) == epoch4 != epoch3


def test_loaded_state_survives_set_epoch_of_its_own_epoch_only(data):
    ds = _ds(data, shuffle=False)
    it = iter(ds)
    list(itertools.islice(it, 100))
    state = ds.state_dict()
    ds2 = _ds(data, shuffle=False)
    ds2.load_state_dict(state)
    ds2.set_epoch(0)  # a training loop that always calls set_epoch keeps the resume
    assert len(list(ds2)) == N - 100
    assert len(list(ds2)) == N  # and only the first iteration resumes
    ds3 = _ds(data, shuffle=False)
    ds3.load_state_dict(state)
    ds3.set_epoch(1)  # another epoch drops it
    assert len(list(ds3)) == N


# --- elastic ----------------------------------------------------------------------------------


@pytest.mark.parametrize("buffer_size", [0, 40])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("old", "new"), [(2, 1), (3, 2), (4, 3)])
def test_elastic_resume_delivers_the_rest_exactly_once(data, old, new, num_workers, buffer_size):
    """Ranks step together, so rank 0's state stands for the world: after k batches on every old
    rank, the new ranks deliver every sample not yet delivered, exactly once between them."""
    kw = dict(buffer_size=buffer_size, equalize="none", batch_size=B)
    before, k = [], 4
    for rank in range(old):
        ds = _ds(data, rank=rank, world_size=old, **kw)
        ds.set_epoch(5)
        before += _flat(_batches(DataLoader(ds, batch_size=B, num_workers=num_workers), k))
        if rank == 0:
            state = ds.state_dict(batches=k, num_workers=num_workers)
    after = []
    for rank in range(new):
        ds = _ds(data, rank=rank, world_size=new, **kw)
        ds.load_state_dict(_roundtrip(state, "json"))
        after += _flat(_batches(DataLoader(ds, batch_size=B, num_workers=num_workers)))
    assert len(before) == old * k * B
    counts = Counter(before + after)
    assert len(counts) == N and set(counts.values()) == {1}


@pytest.mark.parametrize(("old", "new"), [(2, 1), (3, 2)])
def test_elastic_resume_keeps_ranks_in_step(data, old, new):
    """With equalize="pad" every new rank takes the same number of steps; the only repeats are
    the padding each world adds (fewer than its world size)."""
    kw = dict(buffer_size=40, batch_size=B)
    before, k = [], 5
    for rank in range(old):
        ds = _ds(data, rank=rank, world_size=old, **kw)
        before += _flat(_batches(DataLoader(ds, batch_size=B, num_workers=2), k))
        if rank == 0:
            state = ds.state_dict(batches=k, num_workers=2)
    steps, after = [], []
    for rank in range(new):
        ds = _ds(data, rank=rank, world_size=new, **kw)
        ds.load_state_dict(state)
        got = _batches(DataLoader(ds, batch_size=B, num_workers=2))
        steps.append(len(got))
        after += _flat(got)
    assert len(set(steps)) == 1
    counts = Counter(before + after)
    assert len(counts) == N
    assert sum(c - 1 for c in counts.values()) < old + new


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_states_merged_for_a_resize(data, num_workers):
    kw = dict(buffer_size=40, equalize="none", batch_size=B)
    before, k = [], 6
    for rank in range(3):
        ds = _ds(data, rank=rank, world_size=3, **kw)
        loader = StatefulDataLoader(ds, batch_size=B, num_workers=num_workers)
        it = iter(loader)
        before += _flat([list(next(it)[2]) for _ in range(k)])
        if rank == 0:
            state = merge_worker_states(_roundtrip(loader.state_dict(), "torch"))
        del it
    after = []
    for rank in range(2):
        ds = _ds(data, rank=rank, world_size=2, **kw)
        ds.load_state_dict(state)
        after += _flat(_batches(DataLoader(ds, batch_size=B, num_workers=2)))
    counts = Counter(before + after)
    assert len(counts) == N and set(counts.values()) == {1}


def test_elastic_twice_and_back(data):
    """2 ranks -> 3 -> 1, each world interrupted: still every sample exactly once."""
    kw = dict(buffer_size=40, equalize="none")
    seen, state = [], None
    for world, k in [(2, 30), (3, 20), (1, None)]:
        states = []
        for rank in range(world):
            ds = _ds(data, rank=rank, world_size=world, **kw)
            if state is not None:
                ds.load_state_dict(state)
            seen += [s[2] for s in itertools.islice(iter(ds), k)]
            states.append(ds.state_dict())
        state = _roundtrip(states[0], "torch")
    counts = Counter(seen)
    assert len(counts) == N and set(counts.values()) == {1}


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 0)])
def test_resume_with_other_workers_or_batch_cut_delivers_the_rest_once(data, old, new):
    """Changing the DataLoader's worker count (or the batch cut) also re-splits the rest."""
    ds = _ds(data, buffer_size=40, batch_size=B)
    before = _flat(_batches(DataLoader(ds, batch_size=B, num_workers=old), 11))
    state = ds.state_dict(batches=11, num_workers=old)
    ds2 = _ds(data, buffer_size=40, batch_size=None if new else 5)
    ds2.load_state_dict(state)
    after = _flat(_batches(DataLoader(ds2, batch_size=B, num_workers=new)))
    counts = Counter(before + after)
    assert len(counts) == N and set(counts.values()) == {1}


@pytest.mark.parametrize("mixture", [False, True])
@pytest.mark.parametrize("how", ["in process", "batches", "stateful"])
def test_shorter_ranks_state_at_the_epochs_end_ends_it_on_every_rank(data, how, mixture):
    """equalize="none" on 2 ranks: rank 0 has 150 samples, rank 1 151. Rank 0's state after its
    last batch stands for both: rank 1, and a world of one, go on to the next epoch instead of
    delivering rank 1's last sample a second time."""
    kw = dict(buffer_size=40, equalize="none", batch_size=B)
    if mixture:
        kw["epoch_size"] = N
    src = [Source(data)] if mixture else data
    for rank in range(2):
        ds = _ds(src, rank=rank, world_size=2, **kw)
        ds.set_epoch(5)
        if how == "stateful":
            loader = StatefulDataLoader(ds, batch_size=B, num_workers=2)
            it = iter(loader)
            steps = len(_flat([list(b[2]) for b in it]))
            state = merge_worker_states(loader.state_dict())
        else:
            workers = 0 if how == "in process" else 2
            batches = _batches(DataLoader(ds, batch_size=B, num_workers=workers))
            steps = len(_flat(batches))
            state = ds.state_dict() if workers == 0 else ds.state_dict(batches=len(batches),
                                                                       num_workers=2)  # fmt: skip
        assert steps == 150 + rank
        if rank == 0:
            saved = _roundtrip(state, "json")
    fresh = _ds(src, **kw)
    fresh.set_epoch(6)
    for rank, world in [(0, 2), (1, 2), (0, 1)]:
        ds = _ds(src, rank=rank, world_size=world, **kw)
        ds.load_state_dict(saved)
        assert ds.epoch == 6
        if world == 1:
            assert [s[2] for s in ds] == [s[2] for s in fresh]


def _flat(batches):
    return [k for b in batches for k in b]


# --- reading nothing before the resume point ----------------------------------------------------


class ReadLog(LocalStorage):
    """LocalStorage that logs every byte range read from a shard file (from any process)."""

    def __init__(self, log_dir: str):
        super().__init__()
        self.log_dir = log_dir

    def open(self, shard):
        url = getattr(shard, "url", shard)  # a ShardInfo (or a plain URL)
        raw = _LoggedFile(super().open(shard).detach(), url, self.log_dir)
        return io.BufferedReader(raw, buffer_size=self.buffer_size)


class _LoggedFile(io.RawIOBase):
    def __init__(self, raw, url, log_dir):
        self.raw, self.url, self.log_dir, self.ranges = raw, url, log_dir, []

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        return self.raw.seek(offset, whence)

    def tell(self):
        return self.raw.tell()

    def readinto(self, b):
        start = self.raw.tell()
        n = self.raw.readinto(b)
        if n:
            self.ranges.append((start, start + n))
        return n

    def close(self):
        if not self.closed:
            name = os.path.join(self.log_dir, f"{uuid.uuid4().hex}.json")
            with open(name, "w") as f:
                json.dump([self.url, self.ranges], f)
            self.raw.close()
        super().close()


def _reads(log_dir):
    out: dict[str, list[tuple[int, int]]] = {}
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            url, ranges = json.load(f)
        out.setdefault(os.path.basename(url), []).extend(map(tuple, ranges))
    return out


@pytest.mark.parametrize("buffer_size", [0, 10])
def test_stateful_resume_reads_no_bytes_before_the_resume_point(data, tmp_path, buffer_size):
    kw = dict(buffer_size=buffer_size, batch_size=B)
    full = _batches(StatefulDataLoader(_ds(data, **kw), batch_size=B, num_workers=2))
    k = len(full) * 9 // 10
    loader = StatefulDataLoader(_ds(data, **kw), batch_size=B, num_workers=2)
    it = iter(loader)
    before = [list(next(it)[2]) for _ in range(k)]
    state = loader.state_dict()
    del it
    log = tmp_path / "log"
    log.mkdir()
    resumed = StatefulDataLoader(
        _ds(data, storage=ReadLog(str(log)), **kw), batch_size=B, num_workers=2
    )
    resumed.load_state_dict(state)
    after = _batches(resumed)
    assert before + after == full

    manifest = read_manifest(os.path.join(data, "manifest.json"))
    needed = set(_flat(after))
    reads = _reads(str(log))
    skipped_bytes = 0
    for shard in manifest.shards:
        order = [s[2] for s in _ds(os.path.join(data, shard.path), shuffle=False)]
        idx = os.path.join(data, index_path(shard.path))
        offsets = decode_index(open(idx, "rb").read(), idx).offsets
        wanted = [i for i, key in enumerate(order) if key in needed]
        ranges = reads.get(shard.path, [])
        if not wanted:
            assert ranges == [], f"{shard.path}: read although nothing in it is left"
            skipped_bytes += shard.bytes
            continue
        # the sample index's offset of the resumed sample, or an earlier multiple of 64's
        resume_point = int(offsets[wanted[0] // 64 * 64])
        assert min(a for a, _ in ranges) >= resume_point
        skipped_bytes += resume_point
    total = sum(s.bytes for s in manifest.shards)
    assert skipped_bytes > total // 3  # whole shards and index-aligned prefixes: never read


# --- len(loader) that never lies -----------------------------------------------------------------


@pytest.fixture(scope="module")
def issue_layout(tmp_path_factory):
    """The issue's layout: 2 shards, 2,115 samples (stored bytes, read raw)."""
    base = tmp_path_factory.mktemp("layout")
    fmt = get_format("tar")
    for s, n in enumerate([1058, 1057]):
        w = fmt.open_writer(str(base / f"shard-{s:06d}.tar"))
        for i in range(n):
            w.add(f"s{s}-{i:05d}", "jpg", b"x", i % 5)
        w.close()
    return str(base / "*.tar")


def test_len_loader_lies_without_batch_size_today(issue_layout):
    ds = _ds(issue_layout)
    loader = DataLoader(ds, batch_size=64, num_workers=3)
    sizes = [len(b[2]) for b in loader]
    assert (len(loader), len(sizes), sizes.count(1)) == (34, 36, 3)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(
    ("world_size", "num_workers", "batch", "equalize"),
    [
        (1, 3, 64, "pad"),
        (2, 3, 64, "pad"),
        (3, 2, 50, "drop"),
        (4, 3, 7, "pad"),
        (1, 5, 1000, "pad"),
    ],
)
def test_len_loader_equals_batches_delivered(
    issue_layout, world_size, num_workers, batch, equalize, drop_last
):
    delivered = []
    for rank in range(world_size):
        ds = _ds(
            issue_layout, rank=rank, world_size=world_size, batch_size=batch, equalize=equalize
        )
        loader = DataLoader(ds, batch_size=batch, num_workers=num_workers, drop_last=drop_last)
        sizes = [len(b[2]) for b in loader]
        assert len(sizes) == len(loader)
        assert sum(s < batch for s in sizes) <= (0 if drop_last else 1)
        delivered.append(len(sizes))
    assert len(set(delivered)) == 1


# --- states that do not fit ---------------------------------------------------------------------


def test_mismatched_state_is_a_clear_input_error(data, issue_layout, tmp_path):
    ds = _ds(data, buffer_size=40)
    list(itertools.islice(iter(ds), 10))
    state = ds.state_dict()
    with pytest.raises(InputError, match=r"seed=7.*seed=8"):
        _ds(data, buffer_size=40, seed=8).load_state_dict(state)
    shards = sorted(os.path.join(data, f) for f in os.listdir(data) if f.endswith(".tar"))
    with pytest.raises(InputError, match="shards=3.*shards=2"):
        _ds(shards[:-1], buffer_size=40).load_state_dict(state)
    renamed = []
    for i, path in enumerate(shards):  # same shards and counts, other names: other data
        renamed.append(str(tmp_path / f"other-{i}.tar"))
        shutil.copyfile(path, renamed[-1])
    with pytest.raises(InputError, match="other shards"):
        _ds(renamed, buffer_size=40).load_state_dict(state)
    with pytest.raises(InputError, match="shards=2"):
        _ds(issue_layout, buffer_size=40).load_state_dict(state)
    with pytest.raises(InputError, match="buffer_size"):
        _ds(data, buffer_size=41).load_state_dict(state)
    with pytest.raises(InputError, match="not a ShardDataset state"):
        _ds(data).load_state_dict({"epoch": 1})
    bad = json.loads(json.dumps(state))
    bad["segments"][0]["delivered"] = [-3]
    with pytest.raises(InputError, match="malformed"):
        _ds(data, buffer_size=40).load_state_dict(bad)


def test_one_workers_state_cannot_resize_the_world(data):
    loader = StatefulDataLoader(_ds(data, batch_size=B), batch_size=B, num_workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    snap = loader.state_dict()["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]
    del it
    with pytest.raises(InputError, match="one DataLoader worker"):
        _ds(data, batch_size=B, rank=0, world_size=2).load_state_dict(snap)


def test_state_dict_in_the_main_process_after_workers_names_the_way_out(data):
    ds = _ds(data)
    _batches(DataLoader(ds, batch_size=B, num_workers=2), 2)
    with pytest.raises(InputError, match="batches="):
        ds.state_dict()
    assert ds.state_dict(batches=2, num_workers=2, batch_size=B)["epoch"] == 0


# --- a real two-rank gloo run -------------------------------------------------------------------


def _gloo_rank(rank: int, port: int, data_dir: str, out_dir: str, stop: int):
    """Take ``stop`` steps and checkpoint; then, as a restarted job would, build a new dataset
    and loader, load rank 0's state and finish the epoch."""
    with gloo_rank(rank, port, 2) as dist:
        out = {}
        for phase in ("before", "after"):
            ds = _ds(data_dir, buffer_size=40, batch_size=B)  # rank, world: torch.distributed
            if phase == "after":
                with open(os.path.join(out_dir, "state0.json")) as f:
                    ds.load_state_dict(json.load(f))
            else:
                ds.set_epoch(1)
            keys, steps = [], 0
            for _, _, batch_keys in DataLoader(ds, batch_size=B, num_workers=2):
                one = torch.ones(1)
                dist.all_reduce(one)  # ranks step together, as DDP's gradient all-reduce makes them
                steps += 1
                keys += list(batch_keys)
                if phase == "before" and steps == stop:
                    with open(os.path.join(out_dir, f"state{rank}.json"), "w") as f:
                        json.dump(ds.state_dict(batches=steps, num_workers=2), f)
                    break
            out[phase] = {"keys": keys, "steps": steps, "epoch": ds.epoch}
            dist.barrier()  # rank 0's state is on disk before anyone loads it
        with open(os.path.join(out_dir, f"keys{rank}.json"), "w") as f:
            json.dump(out, f)


@pytest.mark.slow
def test_two_gloo_ranks_checkpoint_and_resume(data, tmp_path):
    """Two real ranks stop after 7 steps; their states agree (one stands for the world); then
    each loads rank 0's into a new dataset and finishes: each rank's keys are its uninterrupted
    epoch's, and the ranks took equal steps."""
    run_ranks(_gloo_rank, 2, str(data), str(tmp_path), 7)
    states = [json.loads((tmp_path / f"state{r}.json").read_text()) for r in range(2)]
    assert states[0]["rank"] == 0 and states[1]["rank"] == 1
    assert {**states[0], "rank": 1} == states[1]
    steps = []
    for rank in range(2):
        ds = _ds(data, buffer_size=40, batch_size=B, rank=rank, world_size=2)
        ds.set_epoch(1)
        full = _flat(_batches(DataLoader(ds, batch_size=B, num_workers=2)))
        got = json.loads((tmp_path / f"keys{rank}.json").read_text())
        assert got["after"]["epoch"] == 1  # from the state, not set_epoch
        assert got["before"]["keys"] + got["after"]["keys"] == full
        steps.append(got["before"]["steps"] + got["after"]["steps"])
    assert steps[0] == steps[1] == -(-len(ds) // B)


# --- remote shards ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("buffer_size", [0, 40])
def test_resume_over_s3_equals_the_uninterrupted_epoch(data, s3, buffer_size):
    """Through RemoteStorage (moto S3 on loopback): a resumed worker reads several slices of one
    shard (buffer residents, then the rest); prefetch and cache cope."""
    pytest.importorskip("s3fs")
    from pathlib import Path

    from remote_servers import S3Server

    bucket = f"resume-{uuid.uuid4().hex[:10]}"
    s3.upload_dir(bucket, "tar", Path(data))
    source = f"s3://{bucket}/tar/"
    storage = RemoteStorage(storage_options=S3Server.options(s3.endpoint))
    kw = dict(buffer_size=buffer_size, batch_size=B, storage=storage)
    full = _batches(StatefulDataLoader(_ds(source, **kw), batch_size=B, num_workers=2))
    k = len(full) * 3 // 4
    loader = StatefulDataLoader(_ds(source, **kw), batch_size=B, num_workers=2)
    it = iter(loader)
    before = [list(next(it)[2]) for _ in range(k)]
    state = loader.state_dict()
    del it, loader
    resumed = StatefulDataLoader(_ds(source, **kw), batch_size=B, num_workers=2)
    resumed.load_state_dict(state)
    assert before + _batches(resumed) == full
