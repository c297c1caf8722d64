"""ShardLoader.state_dict / load_state_dict: the resume guarantees of tests/test_resume.py
through the loader's decode threads (which deal batches as DataLoader deals from workers)."""

from __future__ import annotations

import io
import itertools
import json
from collections import Counter

import pytest
import torch
from conftest import DecodeCount
from PIL import Image

from shardkit import Order, ShardDataset, ShardLoader
from shardkit.errors import InputError

N = 301  # the samples of conftest.resume_shards
B = 8


@pytest.fixture(scope="module")
def data(resume_shards):
    return resume_shards  # conftest: 301 samples in three tar shards


def _loader(src, num_workers, *, buffer_size=1000, equalize="pad", **kw):
    """A loader over ``src``; ``buffer_size`` and ``equalize`` are its ``Order``'s."""
    kw.setdefault("order", Order(buffer_size=buffer_size, equalize=equalize))
    kw.setdefault("seed", 7)
    ds = ShardDataset(src, decode="tensor", with_keys=True, **kw)
    return ShardLoader(ds, batch_size=B, num_workers=num_workers)


def _keys(loader, n=None) -> list[list[str]]:
    return [list(b[2]) for b in itertools.islice(iter(loader), n)]


def _roundtrip(state, how):
    if how == "json":
        return json.loads(json.dumps(state))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("buffer_size", [0, 40])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_loader_resume_equals_the_uninterrupted_epoch(data, world_size, num_workers, buffer_size):
    for rank in range(world_size):
        kw = dict(rank=rank, world_size=world_size, buffer_size=buffer_size)
        loader = _loader(data, num_workers, **kw)
        loader.set_epoch(2)
        full = _keys(loader)
        assert len(full) == len(loader)
        k = len(full) * 2 // 3 + rank
        loader = _loader(data, num_workers, **kw)
        loader.set_epoch(2)
        it = iter(loader)
        before = [list(next(it)[2]) for _ in range(k)]
        state = _roundtrip(loader.state_dict(), "json" if rank % 2 else "torch")
        loader.close()
        resumed = _loader(data, num_workers, **kw)  # a new process: no set_epoch
        resumed.load_state_dict(state)
        assert resumed.dataset.epoch == 2
        after = _keys(resumed)
        assert before + after == full
        # The next epoch is the ordinary one.
        resumed.set_epoch(3)
        plain = _loader(data, num_workers, **kw)
        plain.set_epoch(3)
        assert _keys(resumed) == _keys(plain)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("old", "new"), [(2, 1), (3, 2), (4, 3)])
def test_loader_elastic_resume_delivers_the_rest_exactly_once(data, old, new, num_workers):
    kw = dict(buffer_size=40, equalize="none")
    before, k = [], 4
    for rank in range(old):
        loader = _loader(data, num_workers, rank=rank, world_size=old, **kw)
        loader.set_epoch(5)
        it = iter(loader)
        before += [key for _ in range(k) for key in next(it)[2]]
        if rank == 0:
            state = loader.state_dict()
        loader.close()
    after = []
    for rank in range(new):
        loader = _loader(data, num_workers, rank=rank, world_size=new, **kw)
        loader.load_state_dict(state)
        after += [key for batch in _keys(loader) for key in batch]
    counts = Counter(before + after)
    assert len(counts) == N and set(counts.values()) == {1}


def test_loader_state_round_trips_and_mismatch_is_an_input_error(data):
    loader = _loader(data, 2, buffer_size=40)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    assert _roundtrip(state, "json") == state == _roundtrip(state, "torch")
    with pytest.raises(InputError, match="seed"):
        _loader(data, 2, buffer_size=40, seed=8).load_state_dict(state)


def test_loader_len_is_exact_where_dataloader_len_lied(tmp_path):
    from shardkit.formats import get_format

    fmt = get_format("tar")
    for s, n in enumerate([1058, 1057]):  # the layout: 2,115 samples
        w = fmt.open_writer(str(tmp_path / f"shard-{s:06d}.tar"))
        img = io.BytesIO()
        Image.new("RGB", (4, 4)).save(img, format="JPEG")
        for i in range(n):
            w.add(f"s{s}-{i:05d}", "jpg", img.getvalue(), i % 5)
        w.close()
    ds = ShardDataset(str(tmp_path / "*.tar"), decode="tensor")
    for epoch, drop_last in enumerate((False, True)):
        ds.set_epoch(epoch)
        loader = ShardLoader(ds, batch_size=64, num_workers=3, drop_last=drop_last)
        sizes = [len(b[1]) for b in loader]
        assert len(sizes) == len(loader) == (33 if drop_last else 34)


# --- checkpoints while the workers fill the next epoch ahead -----------------------------------


def _counted(src, path, overlap=True):
    count = DecodeCount(path)
    loader = _loader(src, 2, transform=count)
    loader._overlap_epochs = overlap
    return loader, count


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:ShardDataset iterated epoch:RuntimeWarning")
def test_a_checkpoint_while_the_workers_fill_the_next_epoch_resumes_exactly(data, tmp_path):
    plain, _ = _counted(data, tmp_path / "plain", overlap=False)
    plain.set_epoch(2)
    full = _keys(plain)
    k = len(full) - 2  # every worker has sent its last batch: its part of epoch 2 is done
    plain.set_epoch(2)
    it = iter(plain)
    before = [list(next(it)[2]) for _ in range(k)]
    expected = plain.state_dict()
    plain.close()

    loader, count = _counted(data, tmp_path / "count")
    loader.set_epoch(2)
    it = iter(loader)
    assert [list(next(it)[2]) for _ in range(k)] == before
    count.reaches(N + B, exact=False)  # batches of epoch 3 are being filled
    state = loader.state_dict()
    assert state == expected  # epoch 2's position only
    resumed = _loader(data, 2)
    resumed.load_state_dict(_roundtrip(state, "json"))
    rest = _keys(resumed)
    assert before + rest == full  # nothing replayed, nothing skipped
    loader.load_state_dict(state)  # the same loader: epoch 2 again, what was filled is dropped
    assert _keys(loader) == rest
    loader.set_epoch(3)
    resumed.set_epoch(3)
    assert _keys(loader) == _keys(resumed)
    loader.close()
    resumed.close()


@pytest.mark.slow
def test_a_checkpoint_at_the_epoch_end_takes_the_next_epoch_filled_ahead(data, tmp_path):
    plain = _loader(data, 2)
    plain.set_epoch(3)
    third = _keys(plain)
    plain.close()
    loader, count = _counted(data, tmp_path / "count")
    loader.set_epoch(2)
    assert sum(len(b) for b in _keys(loader)) == N
    ahead = count.reaches(N + 2 * 2 * B, exact=False) - N  # 2 workers x prefetch_factor 2
    state = loader.state_dict()
    loader.load_state_dict(state)  # saved at the end: the next epoch, from its beginning
    assert loader.dataset.epoch == 3
    loader._overlap_epochs = False
    assert _keys(loader) == third
    loader.close()
    assert ahead == 2 * 2 * B and count.seen() == 2 * N  # epoch 3's first batches were taken
