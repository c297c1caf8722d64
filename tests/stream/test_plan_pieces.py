"""A worker's plan of a mixed, subset, split or sized epoch made in pieces (``PLAN_PIECE`` drawn
samples at a time, as the reader reaches them): the same slices, masks, buffer points and
schedule as its whole part planned at once, and memory bounded by a piece, not the part."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace

import numpy as np
import pytest

import shardkit.stream.planner as planner
from shardkit.stream.dataset import ShardDataset, Source
from shardkit.stream.partition import positions_to_slices
from shardkit.stream.planner import segment_streams, worker_plan
from shardkit.stream.resume import EpochState, Segment
from shardkit.stream.shuffle import Order, buffer_point
from shardkit.stream.world import World
from shardkit.write.writer import ShardWriter

N = 1203


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """N samples in ~50 tar shards, and 300 in ~3 LMDB shards."""
    base = tmp_path_factory.mktemp("pieces")
    out = {}
    for fmt, size, n in (("tar", "60KB", N), ("lmdb", "1MB", 300)):
        with ShardWriter(str(base / fmt), format=fmt, shard_size=size, classes=["x"]) as w:
            for i in range(n):
                w.add(f"{fmt}/{i:05d}", "jpg", b"%d" % i, 0)
        out[fmt] = str(base / fmt)
    return out


def _whole(layout, sources, world, state, batch_size):
    """The plan as it was made before pieces: the part's ids and sources as arrays, each
    source's wanted positions at once, then ``positions_to_slices`` of them all."""
    state = replace(
        state.on_world(world.world_size, world.num_workers, batch_size), rank=world.rank
    )
    seg, number = state.segments[-1], len(state.segments) - 1
    stream = segment_streams(layout, state.segments) if number else None
    total = layout.total if stream is None else len(stream)
    worker = (seg.slot0 + world.worker) % world.num_workers
    lo, hi = layout.span(total, world.rank, seg, worker)
    done = min(seg.delivered[worker], hi - lo)
    part = np.arange(lo, hi, dtype=np.int64) % max(total, 1)
    if stream is not None:
        part = stream[part]
    src, ids = layout.source[part], layout.ids[part]
    out = []
    for i, s in enumerate(sources):
        mine = ids[src == i] - s.offset
        c = int(np.count_nonzero(src[:done] == i))
        rng = layout.buffer_rng(world.rank, worker, number, i)
        point = buffer_point(len(mine), layout.buffered, rng, c)
        held = np.flatnonzero(point.slots >= 0)
        by = np.argsort(point.slots[held], kind="stable")
        wanted = np.concatenate(
            (point.slots[held][by], np.arange(point.frontier, len(mine), dtype=np.int64))
        )
        slices, keep = positions_to_slices(s.layout(), mine[wanted])
        fill = len(point.slots) if layout.buffered else 0
        out.append((slices, keep.tolist(), held[by].tolist(), fill, (point.steps, point.flushed)))
    return out, src[done:].tolist()


def _pieced(plan):
    out = []
    for p in plan.sources:
        slices, keep = p.whole()
        how = p.arrangement
        out.append((slices, keep.tolist(), how.slots, how.fill, p.buffer))
    schedule = [int(i) for chunk in plan.schedule() for i in chunk.tolist()]
    return out, schedule


DATASETS = {
    "val": lambda p: [Source(p["tar"], split="val")],
    "train-passes": lambda p: [Source(p["tar"], split="train")],  # epoch_size: 2.5 passes
    "subset": lambda p: [Source(p["tar"], subset=0.3)],
    "mixture": lambda p: [
        Source(p["tar"], split="train", weight=2),
        Source(p["lmdb"], subset=0.5, weight=1),
    ],
}


@pytest.mark.parametrize("piece", [1, 7, 64])
@pytest.mark.parametrize("kind", sorted(DATASETS))
def test_a_pieced_plan_is_the_whole_plan(packs, monkeypatch, kind, piece):
    """For every rank and worker of several worlds (batches cut or not, equalize pad / none),
    fresh, resumed on the same world (buffer residents held) and resumed on another world
    (the stream of what the old one left): the pieces laid end to end are the slices, masks,
    buffer points and schedule the whole part planned at once gives."""
    monkeypatch.setattr(planner, "PLAN_PIECE", piece)
    sources_of = DATASETS[kind]
    size = 2500 if kind == "train-passes" else None
    for equalize, buffer in (("pad", 40), ("none", 0)):
        ds = ShardDataset(
            sources_of(packs), epoch_size=size, decode="raw", seed=3,
            order=Order(buffer_size=buffer, equalize=equalize),
        )  # fmt: skip
        layout, facts = ds._layout(1), ds._facts
        for ws, nw, bs in ((1, 1, None), (2, 3, None), (3, 2, 16)):
            old = Segment(2, 2, None, (77, 150))  # another world's progress: frozen
            states = [
                EpochState.start(1, 0, facts, ws, nw, bs),
                EpochState(1, 0, facts, (Segment(ws, nw, bs, tuple(range(30, 30 + 19 * nw, 19))),)),
                EpochState(1, 0, facts, (old,)),
            ]
            for state in states:
                for rank in range(ws):
                    for w in range(nw):
                        world = World(rank, ws, w, nw)
                        plan = worker_plan(layout, world, facts, state, batch_size=bs)
                        want = _whole(layout, ds.sources, world, state, bs)
                        assert _pieced(plan) == want, (kind, equalize, ws, nw, rank, w, state)


def test_pieced_epochs_deliver_and_resume_as_whole_ones(packs, monkeypatch):
    """Read through the dataset (the call site that consumes the pieces): a mixture's keys and
    sources, and a checkpoint taken mid-epoch and resumed, are the same with one-sample pieces
    as with pieces longer than the part."""

    def read(piece):
        monkeypatch.setattr(planner, "PLAN_PIECE", piece)
        ds = ShardDataset(
            DATASETS["mixture"](packs), epoch_size=900, decode="raw",
            with_keys=("key", "source"), seed=7, order=Order(buffer_size=50),
        )  # fmt: skip
        ds.set_epoch(2)
        it = iter(ds)
        head = [next(it)[2:] for _ in range(333)]
        state = ds.state_dict()
        again = ShardDataset(
            DATASETS["mixture"](packs), epoch_size=900, decode="raw",
            with_keys=("key", "source"), seed=7, order=Order(buffer_size=50),
        )  # fmt: skip
        again.load_state_dict(state)
        return head, state, [s[2:] for s in again], [s[2:] for s in it]

    head, state, resumed, rest = read(1)
    assert (head, state, resumed) == read(1 << 20)[:3]
    assert resumed == rest and len(head) + len(rest) == 900


def _records_peak(ds) -> int:
    """Bytes allocated at the peak (tracemalloc) while one worker plans and reads its part,
    above what was held before; the epoch's layout is built (and the modules imported) first."""
    next(iter(ds.records(World(), 0)))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        n = sum(1 for _ in ds.records(World(), 0))
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert n == len(ds)
    return peak


def test_a_worker_plans_its_part_in_bounded_memory(packs, monkeypatch):
    """Counted (tracemalloc, numpy's arrays included): reading a one-source epoch of 20,000
    drawn samples peaks within a piece's bytes of reading one of 1,000 (pieces of 256): the
    plan is made piece by piece, not for the whole part (before: ~80 bytes a drawn sample of
    the part: 1.09 MB against 1.74 MB)."""
    monkeypatch.setattr(planner, "PLAN_PIECE", 256, raising=False)  # an older tree: no pieces
    peaks = {}
    for n in (1_000, 20_000):
        ds = ShardDataset(
            Source(packs["tar"], split="train"), epoch_size=n, decode="raw", seed=1,
            order=Order(buffer_size=0),
        )  # fmt: skip
        peaks[n] = _records_peak(ds)
    assert peaks[20_000] <= peaks[1_000] + 200 * 256, peaks


def test_a_resumed_worker_of_a_plain_epoch_plans_its_part_not_the_epoch():
    """Counted: a worker resuming a plain epoch on the world it was saved on plans the rest of
    its part (here a 64th of 1,000,000 samples), not an array of every position of the epoch
    first (8 bytes a sample of the epoch: 8 MB); the same plan as from that array."""
    from shardkit.stream.partition import EpochLayout

    layout = EpochLayout(np.full(100, 10_000, dtype=np.int64), 5, 1, Order())
    seg = Segment(64, 2, None, (3000, 2500))
    state = EpochState(1, 0, {}, (seg,))
    world = World(37, 64, 1, 2)
    worker_plan(layout, world, {}, state)  # imports and first-call caches
    tracemalloc.start()
    try:
        plan = worker_plan(layout, world, {}, state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * layout.total, peak
    lo, hi = layout.span(layout.total, 37, seg, 1)
    point = buffer_point(hi - lo, 1000, layout.segment_rng(37, 1, 0), 2500)
    held = np.sort(point.slots[point.slots >= 0])
    wanted = np.concatenate((held, np.arange(point.frontier, hi - lo)))
    stream = np.arange(layout.total, dtype=np.int64)  # the array it was planned from before
    slices, keep = positions_to_slices(layout, stream[(lo + wanted) % layout.total])
    assert plan.slices == slices and np.array_equal(plan.arrangement.keep, keep)
