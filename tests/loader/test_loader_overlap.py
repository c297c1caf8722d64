"""No bubble between epochs: ShardLoader's workers fill the next epoch's first batches while the
caller drains the last ones, and an epoch gives the same batches, byte for byte, as without it.

Whether the workers filled ahead is seen through a transform that counts the images it is given
(it runs in the workers, once per decoded image): once an epoch is drained, every slot is free
and each worker fills ``PREFETCH`` batches of the next epoch (its prefetch_factor), then waits.
A loader's ``_overlap_epochs`` (read at each ``iter()``) turns filling ahead off for the
comparisons.
"""

from __future__ import annotations

import gc
import os
import signal
import time
import warnings

import numpy as np
import pytest
from conftest import DecodeCount
from PIL import Image

from shardkit import Decode, RandomResizedCrop, ShardDataset, ShardLoader, pack
from shardkit.errors import TransformError
from shardkit.images.device import device_decode_available
from shardkit.loader.epoch import next_epoch
from shardkit.loader.workers import WorkerDied

pytestmark = pytest.mark.filterwarnings("ignore:ShardDataset iterated epoch:RuntimeWarning")

N, B = 48, 4  # 2 workers: 6 batches each
PREFETCH = 2  # the loader's default prefetch_factor: what a worker fills ahead
AHEAD = 2 * PREFETCH * B  # images filled ahead once an epoch is drained


def _image(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, (14, 20, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """48 JPEGs of one size in 3 classes, in several tar shards."""
    base = tmp_path_factory.mktemp("overlap")
    for i in range(N):
        d = base / "src" / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(_image(i)).save(d / f"im{i:02d}.jpg", quality=90)
    pack(str(base / "src"), str(base / "tar"), shard_size=20_000, progress=False)
    return str(base / "tar")


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory):
    """12 JPEGs, one of them (c/im07) garbage after its header."""
    base = tmp_path_factory.mktemp("overlap-corrupt")
    d = base / "src" / "c"
    d.mkdir(parents=True)
    for i in range(12):
        Image.fromarray(_image(i)).save(d / f"im{i:02d}.jpg")
    data = bytearray((d / "im07.jpg").read_bytes())
    data[200:-2] = b"\x00" * (len(data) - 202)
    (d / "im07.jpg").write_bytes(bytes(data))
    pack(str(base / "src"), str(base / "tar"), shard_size=8000, on_error="skip", progress=False)
    return str(base / "tar")


Count = DecodeCount


def _loader(path, *, overlap=True, batch_size=B, workers=2, loader_kw=None, **kw):
    kw.setdefault("seed", 3)
    ds = ShardDataset(
        path, decode=Decode("tensor", crop=RandomResizedCrop(8), flip=True), with_keys=True, **kw
    )
    loader = ShardLoader(ds, batch_size, num_workers=workers, **(loader_kw or {}))
    loader._overlap_epochs = overlap
    return loader


def _epoch(loader, epoch: int | None = None):
    """(keys, images by key, batches) of one iteration, after ``set_epoch(epoch)``."""
    if epoch is not None:
        loader.set_epoch(epoch)
    keys, images, batches = [], {}, 0
    for x, _, k in loader:
        keys += k
        images.update(zip(k, x.clone(), strict=True))
        batches += 1
    return keys, images, batches


def _same(a, b) -> None:
    assert a[0] == b[0] and a[2] == b[2]
    assert all(np.array_equal(a[1][k].numpy(), b[1][k].numpy()) for k in a[0])


@pytest.fixture(scope="module")
def plain(shards):
    """Epochs of a loader that never fills ahead: what every other loader must give."""
    loader = _loader(shards, overlap=False)
    out = {e: _epoch(loader, e) for e in (0, 1, 2, 3)}
    loader.close()
    return out


def test_the_next_epoch_is_the_one_after_unless_the_loop_repeats_its_epoch():
    assert next_epoch(None, 0) == 1 and next_epoch(4, 5) == 6 and next_epoch(7, 2) == 3
    assert next_epoch(5, 5) == 5  # a loop without set_epoch: the dataset repeats its epoch


@pytest.mark.slow
def test_a_drained_epoch_leaves_the_workers_filling_the_next_one(shards, plain, tmp_path):
    count = Count(tmp_path / "count")
    loader = _loader(shards, transform=count)
    _same(_epoch(loader, 0), plain[0])
    count.reaches(N + AHEAD)  # every slot of both workers holds a batch of epoch 1
    loader._overlap_epochs = False  # nothing filled after epoch 1: the count is final
    _same(_epoch(loader, 1), plain[1])
    loader.close()
    assert count.seen() == 2 * N  # epoch 1's first batches were taken, not filled again


@pytest.mark.slow
@pytest.mark.parametrize("how", ["set_epoch", "load_state_dict"])
def test_another_start_than_the_one_filled_ahead_drops_it(shards, plain, tmp_path, how):
    count = Count(tmp_path / "count")
    loader = _loader(shards, transform=count)
    _same(_epoch(loader, 0), plain[0])
    count.reaches(N + AHEAD)
    loader._overlap_epochs = False
    if how == "set_epoch":
        _same(_epoch(loader, 3), plain[3])
    else:  # the saved start of epoch 0 again: from its beginning, but not epoch 1
        other = _loader(shards, overlap=False)
        other.set_epoch(0)
        state = other.state_dict()
        loader.load_state_dict(state)
        _same(_epoch(loader), plain[0])
    loader.close()
    assert count.seen() == 2 * N + AHEAD


@pytest.mark.slow
def test_a_loop_without_set_epoch_gets_its_repeated_epoch_filled_ahead(shards, plain, tmp_path):
    count = Count(tmp_path / "count")
    loader = _loader(shards, transform=count)
    _same(_epoch(loader), plain[0])
    count.reaches(N + AHEAD)  # epoch 1 guessed: the usual loop calls set_epoch(1)
    _same(_epoch(loader), plain[0])  # it did not: dropped
    count.reaches(2 * N + 2 * AHEAD)  # epoch 0 again, this time
    loader._overlap_epochs = False
    _same(_epoch(loader), plain[0])
    loader.close()
    assert count.seen() == 3 * N + AHEAD  # the third epoch took what was filled ahead


@pytest.mark.slow
@pytest.mark.parametrize(
    ("batch_size", "drop_last", "decode_on"),
    [(4, False, "workers"), (5, False, "workers"), (5, True, "workers"), (5, False, "device")],
)
def test_epochs_back_to_back_equal_epochs_without_overlap(shards, batch_size, drop_last, decode_on):
    if decode_on == "device" and not device_decode_available():
        pytest.skip("needs nvImageCodec (shardkit[gpu])")
    kw = dict(batch_size=batch_size, loader_kw=dict(drop_last=drop_last, decode_on=decode_on))
    loaders = [_loader(shards, overlap=o, **kw) for o in (False, True, True)]
    runs = []
    for i, loader in enumerate(loaders):
        runs.append([])
        for epoch in (0, 1, 2, 4, 5, 5, 6):
            if i == 2:  # a pause between epochs: the workers fill ahead as far as they can
                gc.collect()
                time.sleep(0.3)
            runs[-1].append(_epoch(loader, epoch))
            assert runs[-1][-1][2] == len(loader)
        loader.close()
    for a, b, c in zip(*runs, strict=True):
        _same(a, b)
        _same(a, c)


@pytest.mark.slow
def test_a_break_after_taking_batches_filled_ahead_and_a_close_while_filling(
    shards, plain, tmp_path
):
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    count = Count(tmp_path / "count")
    loader = _loader(shards, transform=count)
    _epoch(loader, 0)
    count.reaches(N + AHEAD)
    loader.set_epoch(1)
    for _ in loader:  # takes the batches filled ahead, then breaks
        break
    _same(_epoch(loader, 2), plain[2])  # the rest of epoch 1 is dropped
    procs = list(loader._res.workers.procs)
    loader.close()  # the workers fill epoch 3 ahead (or wait, keeping it): they stop at once
    assert loader.worker_pids == [] and [p.exitcode for p in procs] == [0, 0]
    del loader, procs  # a Process object holds its sentinel pipe open
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.slow
def test_a_worker_killed_while_it_keeps_batches_filled_ahead_is_an_error_not_a_hang(
    shards, plain, tmp_path
):
    count = Count(tmp_path / "count")
    loader = _loader(shards, transform=count)
    _epoch(loader, 0)
    count.reaches(N + AHEAD)
    os.kill(loader.worker_pids[0], signal.SIGKILL)
    with pytest.raises(WorkerDied, match="worker 0 .*SIGKILL"):
        _epoch(loader, 1)
    _same(_epoch(loader, 1), plain[1])  # new workers, the right batches
    loader.close()


@pytest.mark.slow
def test_skipped_samples_count_once_whether_filled_ahead_batches_are_taken_or_dropped(
    corrupt, tmp_path
):
    count = Count(tmp_path / "count")
    # prefetch_factor 3: each worker's whole part (3 batches of 2) is filled ahead
    loader = _loader(
        corrupt, transform=count, on_error="skip", batch_size=2, loader_kw={"prefetch_factor": 3}
    )
    ds = loader.dataset

    def epoch(e: int) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            keys = _epoch(loader, e)[0]
        skipped = [w for w in caught if "skipped:" in str(w.message)]
        assert len(skipped) == 1 and "c/im07" in str(skipped[0].message)
        return keys

    assert len(epoch(0)) == 11 and ds.skipped == 1
    count.reaches(22)  # each worker's whole part of epoch 1 is filled ahead: c/im07 too
    assert ds.skipped == 1  # not counted until its batch is handed over
    assert len(epoch(5)) == 11 and ds.skipped == 2  # dropped: counted once, in epoch 5
    count.reaches(44)
    loader._overlap_epochs = False  # nothing filled after epoch 6: the count is final
    assert len(epoch(6)) == 11 and ds.skipped == 3  # taken: counted (and warned) once
    loader.close()
    assert count.seen() == 44  # epoch 6 was filled once, ahead


def _failing_on_some_seeds(sample: dict) -> str:
    """A sample_transform that fails for about one sample in 23 of an epoch, depending on the
    epoch (the seed is a function of seed, epoch and key): some epochs fail, some do not."""
    if sample["seed"] % 23 == 0:
        raise ValueError(f"no good for {sample['key']}")
    return sample["key"]


@pytest.mark.slow
def test_an_error_in_batches_filled_ahead_is_raised_in_its_turn_as_without_filling_ahead(shards):
    """Epochs that fail after those that did not: the workers met the error while filling the
    next epoch ahead (kept with its batches). It is raised after the same batches, naming the
    same sample, as by a loader that does not fill ahead; the loader goes on afterwards."""
    runs = []
    for overlap in (False, True):
        loader = _loader(shards, overlap=overlap, sample_transform=_failing_on_some_seeds)
        runs.append([])
        for epoch in range(8):
            gc.collect()
            time.sleep(0.2)  # time to fill ahead (the outcome is the same either way)
            loader.set_epoch(epoch)
            keys, error = [], None
            try:
                for batch in loader:
                    keys += batch
            except TransformError as exc:
                error = str(exc)
                assert isinstance(exc.__cause__, ValueError)
            runs[-1].append((keys, error))
        loader.close()
    assert runs[0] == runs[1]
    errors = [error is not None for _, error in runs[0]]
    assert any(not a and b for a, b in zip(errors, errors[1:], strict=False))  # after a success
