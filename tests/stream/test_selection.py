"""What is read is one value: a plain path and the one ``Source`` of it read the same epoch, in
the same order, with the same checkpoint; a state saved under one spelling resumes under the
other."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import DataLoader

from shardkit import Order
from shardkit.stream.dataset import ShardDataset, Source
from shardkit.stream.selection import select
from shardkit.stream.world import World
from shardkit.write.writer import ShardWriter


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """97 samples in about a dozen tar shards of uneven size."""
    out = tmp_path_factory.mktemp("onesource") / "out"
    with ShardWriter(str(out), shard_size="10KB", classes=["x", "y"]) as w:
        for i in range(97):
            w.add(f"k{i:03d}", "jpg", b"%d" % i * (1 + i % 7), i % 2)
    return str(out)


#: the one-source spellings of a plain path: weight and a Source(fields=) that carries every
#: field asked for change nothing with a single source
SPELLINGS = {
    "Source": lambda p: Source(p),
    "[Source]": lambda p: [Source(p)],
    "weighted": lambda p: [Source(p, weight=3.0)],
    "options": lambda p: Source(p, storage_options={}),
}


def _ds(source, *, shuffle=True, seed=0, rank=0, world_size=1, **kw):
    order = Order(shuffle=shuffle, buffer_size=8) if shuffle else Order.sequential()
    kw.setdefault("decode", "raw")
    return ShardDataset(
        source, order=order, seed=seed, rank=rank, world_size=world_size, with_keys=True, **kw
    )


def _keys(ds, world, epoch) -> list[str]:
    return [r.key for r in ds.records(world, epoch)]


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world_size", [1, 3])
def test_a_path_and_its_one_source_read_the_same_epochs(data, spelling, shuffle, world_size):
    wrapped = SPELLINGS[spelling](data)
    for seed, rank in itertools.product((0, 7), range(world_size)):
        plain = _ds(data, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)
        one = _ds(wrapped, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)
        assert len(one) == len(plain) and one.urls == plain.urls
        assert one.state_dict() == plain.state_dict()
        for epoch, workers in itertools.product((0, 3), (1, 2)):
            for worker in range(workers):
                world = World(rank, world_size, worker, workers)
                assert one.plan(world, epoch) == plain.plan(world, epoch)
                assert _keys(one, world, epoch) == _keys(plain, world, epoch)
            for ds in (plain, one):
                ds.set_epoch(epoch)
            got = {}
            for name, ds in (("plain", plain), ("one", one)):
                it = iter(ds)
                got[name] = [next(it)[2] for _ in range(5)]
                got[name + " state"] = ds.state_dict()
                got[name + " position"] = ds.position(3, num_workers=2, batch_size=4, cut=None)
            assert got["one"] == got["plain"]
            assert got["one state"] == got["plain state"]
            assert got["one position"] == got["plain position"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_through_a_dataloader_the_two_spellings_give_the_same_batches(data, num_workers):
    batches = {}
    for name, source in (("plain", data), ("one", Source(data))):
        ds = _ds(source, seed=5, batch_size=4)
        ds.set_epoch(2)
        loader = DataLoader(ds, batch_size=4, num_workers=num_workers)
        batches[name] = [list(b[2]) for b in loader]
    assert batches["one"] == batches["plain"] and len(batches["plain"]) == 25


@pytest.mark.parametrize("saved, loaded", [("plain", "one"), ("one", "plain")])
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_checkpoint_resumes_under_the_other_spelling(data, saved, loaded, shuffle):
    spell = {"plain": lambda: data, "one": lambda: Source(data)}
    uninterrupted = _ds(spell[saved](), shuffle=shuffle, seed=11)
    uninterrupted.set_epoch(1)
    whole = [s[2] for s in uninterrupted]
    first = _ds(spell[saved](), shuffle=shuffle, seed=11)
    first.set_epoch(1)
    it = iter(first)
    head = [next(it)[2] for _ in range(40)]
    state = first.state_dict()
    second = _ds(spell[loaded](), shuffle=shuffle, seed=11)
    second.load_state_dict(state)
    assert head + [s[2] for s in second] == whole


def test_a_single_source_selects_the_plain_epoch_unless_it_narrows(data):
    assert select(data).plain and select(Source(data)).plain
    assert select([Source(data, weight=2.0)]).plain
    assert select(Source(data, fields=("txt",)), fields=("txt",)).plain
    assert not select(Source(data, fields=()), fields=("txt",)).plain  # None in its samples
    assert not select(Source(data, subset=0.5)).plain
    assert not select(Source(data, split="val")).plain
    assert not select(data, epoch_size=50).plain
    assert not select([Source(data), Source(data)]).plain


def test_a_single_sources_storage_options_still_resolve_it(data):
    """The one Source's own fsspec options are what its path is resolved with: a bad one is
    still refused, though the epoch is the plain one."""
    from shardkit import InputError
    from shardkit.remote import RemoteStorage

    with pytest.raises(InputError, match="both give fsspec options"):
        ShardDataset(
            Source(data, storage_options={"anon": True}),
            storage=RemoteStorage(storage_options={"anon": True}),
        )
    assert select(Source(data, storage_options={"anon": True})).storage_options == {"anon": True}


@pytest.mark.parametrize("loaded", ["plain", "one"])
def test_a_mixtures_checkpoint_is_refused_by_the_plain_epoch_and_resumes_as_the_mixture(
    data, loaded
):
    """A one-source mixture's state (``epoch_size=``; a lone ``Source`` saved one before it
    was read as its path) is another order: the plain epoch refuses it, naming the
    ``epoch_size=`` that continues it, and the mixture it names continues it exactly."""
    from shardkit import InputError

    def mixture():
        ds = _ds(Source(data), seed=3, epoch_size=97)
        ds.set_epoch(1)
        return ds

    whole = [s[2] for s in mixture()]
    first = mixture()
    it = iter(first)
    head = [next(it)[2] for _ in range(10)]
    state = first.state_dict()
    with pytest.raises(InputError, match="epoch_size=97 to continue"):
        _ds({"plain": data, "one": Source(data)}[loaded], seed=3).load_state_dict(state)
    again = _ds(Source(data), seed=3, epoch_size=97)
    again.load_state_dict(state)
    assert head + [s[2] for s in again] == whole
