"""``ShardLoader.stats()``: who waits for whom during training, checked against the test's own
clock around ``next()``; the warning; every rank over gloo; the replayed ideal."""

from __future__ import annotations

import json
import time
import warnings

import numpy as np
import pytest
import torch
from conftest import gloo_rank, run_ranks
from PIL import Image

from shardkit import ShardDataset, ShardLoader, pack
from shardkit.errors import InputError
from shardkit.loader.stats import (
    INPUT_BOUND,
    NOT_INPUT_BOUND,
    PARTLY_INPUT_BOUND,
    READ_SAMPLE,
    StatsOptions,
    WorkerClock,
    _trainer_knob,
    knob,
    replay,
    verdict_of,
)

N = 24


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """24 small JPEGs of one size in 2 classes, in one tar shard."""
    base = tmp_path_factory.mktemp("stats")
    rng = np.random.default_rng(0)
    for i in range(N):
        d = base / "src" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(d / f"{i}.jpg")
    pack(str(base / "src"), str(base / "tar"), progress=False)
    return str(base / "tar")


def _trainer_bound(normalize_s: float) -> dict:
    """An epoch's report where the workers sat idle and the training process's own conversion
    (normalise, copy) was most of the wait: what the hint is chosen from."""
    shares = {f"worker_{p}_share": 0.0 for p in ("read", "decode", "resize", "transform", "copy")}
    return {**shares, "worker_idle_share": 0.9, "wait_s": 1.0, "trainer_copy_s": 0.02,
            "trainer_normalize_s": normalize_s}  # fmt: skip


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-only", "gpu"])
def test_the_hint_for_the_training_processs_own_normalize_can_be_followed_here(shards, gpu):
    """A CPU-only machine cannot take ``device=``: there the hint folds the normalisation into
    the model's first layer; with a GPU it names ``device="cuda"``."""
    mean_std = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    ds = ShardDataset(shards, decode="tensor")
    loader = ShardLoader(ds, 4, num_workers=0, normalize=mean_std)
    hint = _trainer_knob(_trainer_bound(0.9), loader, gpu=gpu)
    if gpu:
        assert hint.startswith('device="cuda"') and "normalize=" in hint
    else:
        assert "device=" not in hint and "first layer" in hint and "normalize=None" in hint
        assert "0.92 s" in hint  # what it cost the training CPU
    assert knob(_trainer_bound(0.9), loader) == _trainer_knob(
        _trainer_bound(0.9), loader, gpu=torch.cuda.is_available()
    )
    plain = ShardLoader(ds, 4, num_workers=0)  # nothing to fold without normalize=
    assert "prefetch_factor" in _trainer_knob(_trainer_bound(0.9), plain, gpu=False)


class _Slow:
    """A transform that takes ``seconds`` per image (picklable: it runs in the workers)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, img):
        time.sleep(self.seconds)
        return img


def _timed_epoch(loader, step):
    """One epoch with the test's own clock: (seconds in each ``next()`` after the first, seconds
    between batches, images)."""
    it = iter(loader)
    inside, outside, images = [], 0.0, 0
    first = True
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            inside.append(time.perf_counter() - t0)
            break
        t1 = time.perf_counter()
        if not first:
            inside.append(t1 - t0)
        first = False
        images += len(batch[0])
        step()
        outside += time.perf_counter() - t1
    return sum(inside), outside, images


def test_a_trainer_slower_than_the_loader_is_not_input_bound(shards):
    ds = ShardDataset(shards, decode="tensor")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not input-bound: silent
        loader = ShardLoader(ds, batch_size=4, num_workers=1)
        try:
            wait, step, images = _timed_epoch(loader, lambda: time.sleep(0.2))
            s = loader.stats()
        finally:
            loader.close()
    assert s["finished"] and s["batches"] == len(loader) == 6 and s["images"] == images == N
    assert s["wait_share"] < 0.10 and s["verdict"] == NOT_INPUT_BOUND
    assert s["wait_s"] == pytest.approx(wait, rel=0.15, abs=0.002)
    assert s["step_s"] == pytest.approx(step, rel=0.15)
    assert s["first_wait_s"] is not None and s["wait_max_s"] >= s["wait_p95_s"] >= s["wait_p50_s"]
    # the workers waited on the ring (the trainer was slow): idle is their largest share
    shares = {p: s[f"worker_{p}_share"] for p in ("read", "decode", "transform", "copy", "idle")}
    assert max(shares, key=shares.get) == "idle", shares


def test_a_trainer_that_does_nothing_is_input_bound_and_warned_once(shards):
    ds = ShardDataset(shards, decode="tensor", transform=_Slow(0.05))
    # ~1.2 s lost per epoch: warned about below the default 2 s
    loader = ShardLoader(ds, batch_size=2, num_workers=1, stats=StatsOptions(min_wait_s=0.3))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wait, step, images = _timed_epoch(loader, lambda: None)
            s = loader.stats()
            _timed_epoch(loader, lambda: None)  # a second epoch: its own single warning
    finally:
        loader.close()
    assert s["batches"] == 12 and images == N
    assert s["wait_share"] > 0.5 and s["verdict"] == INPUT_BOUND
    assert s["wait_s"] == pytest.approx(wait, rel=0.15)
    assert s["step_s"] == pytest.approx(step, rel=0.15, abs=0.002)
    assert s["worker_transform_share"] > 0.5  # the sleeping transform, measured in the worker
    mine = [str(w.message) for w in caught if "input-bound" in str(w.message)]
    assert len(mine) == 2, mine  # once per epoch, not per batch
    assert "epoch 0 is input-bound" in mine[0] and "a cheaper transform" in mine[0]
    assert f"{s['wait_share']:.0%}" in mine[0]


def test_the_warning_can_be_turned_off_or_logged(shards, caplog):
    def ds():
        return ShardDataset(shards, decode="tensor", transform=_Slow(0.02))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off = ShardLoader(ds(), batch_size=4, num_workers=1, stats=False)
        try:
            _timed_epoch(off, lambda: None)
            assert off.stats()["verdict"] == INPUT_BOUND  # still measured, not said
        finally:
            off.close()
        options = StatsOptions(logger=True, min_wait_s=0.1)
        logged = ShardLoader(ds(), batch_size=4, num_workers=1, stats=options)
        try:
            with caplog.at_level("WARNING", logger="shardkit.loader"):
                _timed_epoch(logged, lambda: None)
        finally:
            logged.close()
    assert [r.getMessage() for r in caplog.records if "input-bound" in r.getMessage()]
    with pytest.raises(InputError, match="stats must be"):
        ShardLoader(ds(), batch_size=4, stats="yes")
    with pytest.raises(InputError, match="min_wait_s"):
        StatsOptions(min_wait_s=-1)


def test_a_short_input_bound_loop_is_not_warned_about_by_default(shards):
    ds = ShardDataset(shards, decode="tensor", transform=_Slow(0.01))
    loader = ShardLoader(ds, batch_size=4, num_workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ~0.2 s lost: under the 2 s worth a warning
        try:
            _timed_epoch(loader, lambda: None)
        finally:
            loader.close()
    assert loader.stats()["verdict"] == INPUT_BOUND


@pytest.mark.filterwarnings("ignore:ShardDataset iterated epoch:RuntimeWarning")
def test_stats_of_the_epoch_in_progress_and_the_last_one(shards):
    ds = ShardDataset(shards, decode="tensor")
    loader = ShardLoader(ds, batch_size=4, num_workers=0)
    assert loader.stats()["batches"] == 0
    for _ in loader:
        pass
    it = iter(loader)
    next(it), next(it)
    now, last = loader.stats(), loader.stats(last=True)
    assert (now["batches"], now["finished"]) == (2, False)
    assert (last["batches"], last["finished"], last["images"]) == (6, True, N)
    del it
    assert loader.stats()["batches"] == 2  # an abandoned iteration stays the latest
    assert loader.stats(last=True)["batches"] == 6
    # one flat dict of numbers and short strings: ready for any logger
    assert all(isinstance(v, (int, float, str, bool, type(None))) for v in now.values())
    assert loader.stats(all_ranks=True)["slowest_rank"] == 0  # no process group: this rank


def test_verdict_words_and_thresholds():
    assert [verdict_of(x) for x in (0.0, 0.049, 0.05, 0.19, 0.2, 1.0)] == [
        NOT_INPUT_BOUND, NOT_INPUT_BOUND, PARTLY_INPUT_BOUND, PARTLY_INPUT_BOUND,
        INPUT_BOUND, INPUT_BOUND,
    ]  # fmt: skip
    assert verdict_of(None) is None


def test_replay_times_the_step_on_delivered_batches(shards):
    ds = ShardDataset(shards, decode="tensor")
    loader = ShardLoader(ds, batch_size=4, num_workers=1)
    seen = []
    try:
        ideal = replay(loader, lambda b: seen.append(b[0].sum().item()), keep=3, steps=7)
    finally:
        loader.close()
    assert ideal.steps == 7 and len(seen) == 2 + 7  # warm-up, then the timed steps
    assert len(set(seen)) == 3 and seen[2:] == (seen[2:5] * 3)[:7]  # 3 kept batches, in turn
    assert ideal.images_per_s == pytest.approx(4 / ideal.step_s)
    assert ideal.speedup({"images_per_s": ideal.images_per_s / 2}) == pytest.approx(2.0)


def _rank(rank: int, port: int, shards: str, out: str):
    with gloo_rank(rank, port, 2):
        slow = _Slow(0.03) if rank == 1 else None  # rank 1's loader holds the others up
        ds = ShardDataset(shards, decode="tensor", transform=slow)
        loader = ShardLoader(ds, batch_size=2, num_workers=1, stats=False)
        for _ in loader:
            time.sleep(0.01)
        s = loader.stats(all_ranks=True)
        loader.close()
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(s, f)


@pytest.mark.slow
def test_stats_of_every_rank_over_gloo(shards, tmp_path):
    run_ranks(_rank, 2, shards, str(tmp_path))
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for s in got:
        assert s["slowest_rank"] == 1
        assert s["max_wait_share"] == s["rank1_wait_share"] > s["rank0_wait_share"]
        assert s["max_verdict"] == INPUT_BOUND
    assert got[0]["wait_share"] == got[0]["rank0_wait_share"] < 0.5


def test_reading_is_timed_in_one_batch_of_sixteen_and_its_share_given_to_the_rest():
    clock = WorkerClock()
    records = iter(range(100))
    assert clock.source(records, first=True) is not records  # a new epoch's first: timed
    clock.read = 0.25
    assert clock.batch(fill_s=1.0, resize_s=0.0)[:2] == (0.25, 0.75)
    for _ in range(READ_SAMPLE - 1):  # the rest of the 16: read untimed, its share applied
        assert clock.source(records, first=False) is records
        assert clock.batch(fill_s=2.0, resize_s=1.0)[:3] == (0.25, 0.75, 1.0)
    assert clock.source(records, first=False) is not records
