"""The one planner of every epoch: what each rank and worker reads, fresh or from a checkpoint.

Plain, split, subset, sized and mixed epochs are planned here alike. The epoch's stream is its
layout (``stream.partition``: ``EpochLayout`` lays shards end to end, ``MixLayout`` draws a
mixture, subset, split or epoch size); ``worker_plan`` finds the part a worker plays on the last
world the epoch was played on (``_Part``: its span, what it delivered, where its buffer stands,
the same arithmetic for every layout) and turns it into what that worker reads: a plain epoch's
slices (``WorkerPlan``), or one plan per source made in pieces as it is read (``MixPlan``).

A checkpoint's positions are worked out from positions alone, never from bytes: the stream
each frozen segment leaves to the next (``segment_streams``), the samples left
(``samples_left``, ``worker_left``) and the state after a DataLoader's batches or its workers'
counts (``rank_state``, ``worker_counts_state``). The state's format is ``stream.resume``'s;
reading and decoding the slices is ``stream.stages``' (and ``stream.mix``'s for a mixture).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from ..errors import InputError
from ..records import Record, ShardSlice
from .partition import (
    PLAN_PIECE,
    EpochLayout,
    MixLayout,
    PlanPiece,
    plan_epoch,
    plan_pieces,
    positions_to_slices,
)
from .resume import EpochState, Progress, Segment, round_robin
from .shuffle import buffer_point
from .world import World

__all__ = [
    "Arrangement",
    "arrange",
    "WorkerPlan",
    "SourcePlan",
    "MixPlan",
    "worker_plan",
    "segment_streams",
    "samples_left",
    "worker_left",
    "progress_at",
    "rank_state",
    "worker_counts_state",
]


# --- what a worker reads ---------------------------------------------------------------------


@dataclass(frozen=True)
class Arrangement:
    """How a resumed worker's records become the shuffle buffer's input: drop the records read
    only to bridge small holes (``keep``; None where the reader dropped them already, as a pieced
    plan's reads do: ``SourcePlan``), put the first ``len(slots)`` kept ones in their
    buffer slots (``fill`` slots, None where the flush already emitted), pass the rest through."""

    keep: np.ndarray | None
    slots: list[int]
    fill: int


def arrange(
    records: Iterable[Record], how: Arrangement, dropped: bool = False
) -> Iterator[Record | None]:
    """``records`` as ``how`` arranges them; ``dropped``: they are the kept ones already
    (``read_slices(drop=True)``), so where the buffer's slots take them in their own order
    (an epoch's start: slot j holds the j-th) they are passed on as they are, with no
    generator around them."""
    if dropped and how.slots == list(range(how.fill)):
        return iter(records)
    return _arranged(records, how, dropped)


def _arranged(records: Iterable[Record], how: Arrangement, dropped: bool) -> Iterator:
    it = iter(records)
    holes = np.flatnonzero(~how.keep) if not dropped else np.empty(0, np.int64)
    checked = int(holes[-1]) + 1 if len(holes) else 0  # past the last hole, keep everything
    kept = it
    if checked:
        kept = itertools.chain(
            itertools.compress(itertools.islice(it, checked), how.keep[:checked].tolist()), it
        )
    if how.fill:
        buf: list[Record | None] = [None] * how.fill
        for slot, rec in zip(how.slots, kept, strict=False):
            buf[slot] = rec
        yield from buf
    yield from kept


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker of a plain epoch reads and how: the pipeline in ShardDataset.__iter__
    follows it."""

    slices: list[ShardSlice]
    rng: np.random.Generator
    buffer: tuple[int, int]
    arrangement: Arrangement | None
    progress: Progress


@dataclass(frozen=True)
class SourcePlan:
    """What a worker reads from one source: its slices piece by piece (``pieces()``, made as
    they are read), how they refill that source's buffer (``arrangement``: its ``keep`` is
    each piece's) and where that buffer stands."""

    pieces: Callable[[], Iterator[PlanPiece]]
    arrangement: Arrangement
    buffer: tuple[int, int]
    rng: np.random.Generator

    @property
    def slices(self) -> list[ShardSlice]:
        """Every piece's slices at once (``ShardDataset.plan``, tests): O(the part's slices)."""
        return [sl for piece in self.pieces() for sl in piece.slices]

    def whole(self) -> tuple[list[ShardSlice], np.ndarray]:
        """The slices and the mask of every piece at once: for tests."""
        pieces = list(self.pieces())
        keep = [p.keep for p in pieces]
        return [sl for p in pieces for sl in p.slices], (
            np.concatenate(keep) if keep else np.zeros(0, dtype=bool)
        )


@dataclass(frozen=True)
class MixPlan:
    """One worker's epoch over a mixture: per-source plans and the source sequence still to
    deliver (``schedule()``: its chunks, made as they are dealt), with the live count for
    ``state_dict``."""

    sources: list[SourcePlan]
    schedule: Callable[[], Iterator[np.ndarray]]
    progress: Progress


def _part_chunks(lo: int, hi: int, total: int, stream: np.ndarray | None) -> Iterator[np.ndarray]:
    """The epoch positions of a worker's part [lo, hi) of ``stream`` (None: every position),
    wrapping past ``total``, ``PLAN_PIECE`` at a time."""
    for a in range(lo, hi, PLAN_PIECE):
        p = np.arange(a, min(hi, a + PLAN_PIECE), dtype=np.int64) % max(total, 1)
        yield p if stream is None else stream[p]


def _source_counts(
    layout: MixLayout, part: Callable[[], Iterator], n: int, done: int
) -> list[tuple[int, int]]:
    """Per source: (its samples in the part of ``n``, those among the part's first ``done``)."""
    if layout.num_sources == 1:
        return [(n, done)]
    out = np.zeros((layout.num_sources, 2), dtype=np.int64)
    at = 0
    for p in part():
        src = layout.source[p]
        out[:, 0] += np.bincount(src, minlength=layout.num_sources)
        head = src[: max(0, done - at)]
        out[:, 1] += np.bincount(head, minlength=layout.num_sources)
        at += len(p)
    return [(int(a), int(b)) for a, b in out]


def _source_positions(
    layout: MixLayout, part: Callable, i: int, offset: int, held: np.ndarray, frontier: int
) -> Iterator[np.ndarray]:
    """Source ``i``'s positions (its ids less ``offset``) at the wanted indices of its sequence
    in the part: ``held`` (ascending, below ``frontier``: the buffer's residents) then every
    index from ``frontier``, chunk by chunk; ids are asked only where one is wanted."""
    k0 = 0
    for p in part():
        if layout.num_sources > 1:
            p = p[layout.source[p] == i]
        k1 = k0 + len(p)
        h = held[np.searchsorted(held, k0) : np.searchsorted(held, k1)] - k0
        ask = np.concatenate((h, np.arange(max(frontier, k0) - k0, len(p), dtype=np.int64)))
        if len(ask):
            yield np.asarray(layout.ids[p[ask]], dtype=np.int64) - offset
        k0 = k1


def _source_pieces(layout, s, part, i, held, frontier) -> Iterator[PlanPiece]:
    return plan_pieces(s.layout(), _source_positions(layout, part, i, s.offset, held, frontier))


def _schedule(layout: MixLayout, part: Callable, done: int) -> Iterator[np.ndarray]:
    """The part's source sequence after its first ``done``, a chunk at a time."""
    at = 0
    for p in part():
        if at + len(p) > done:
            yield np.asarray(layout.source[p[max(0, done - at) :]])
        at += len(p)


# --- one worker's plan, any epoch ----------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """Where plan worker ``worker`` stands on the last segment of ``state``: the segment's
    number, its stream (None: the first segment, every position in order) of ``total``
    positions, the worker's span [lo, hi) of it and the ``done`` samples it delivered."""

    state: EpochState
    number: int
    stream: np.ndarray | None
    total: int
    worker: int
    lo: int
    hi: int
    done: int


def _part(layout: EpochLayout, world: World, facts: dict, state, batch_size) -> _Part:
    if state is None:
        state = EpochState.start(
            layout.epoch, world.rank, facts, world.world_size, world.num_workers, batch_size
        )
    state = replace(
        state.on_world(world.world_size, world.num_workers, batch_size), rank=world.rank
    )
    seg, number = state.segments[-1], len(state.segments) - 1
    # One segment (no checkpoint of another world): the stream is every position in order, and
    # a worker's part is its span alone, not an array of the whole epoch's positions.
    stream = segment_streams(layout, state.segments) if number else None
    total = layout.total if stream is None else len(stream)
    worker = (seg.slot0 + world.worker) % world.num_workers
    lo, hi = layout.span(total, world.rank, seg, worker)
    done = seg.delivered[worker]
    if done is None:
        raise InputError(
            f"state holds no count for DataLoader worker {worker}: it was saved by another "
            "worker; load each worker's state into its own worker (StatefulDataLoader does)"
        )
    return _Part(state, number, stream, total, worker, lo, hi, min(done, hi - lo))


def worker_plan(
    layout: EpochLayout,
    world: World,
    facts: dict,
    state: EpochState | None = None,
    *,
    batch_size: int | None = None,
    in_worker: bool = False,
) -> WorkerPlan | MixPlan:
    """The plan of worker ``world.worker`` for ``layout.epoch``, continuing ``state`` if given;
    ``batch_size``: cut worker parts at its multiples (``stream.worker_span``). A plain epoch's
    is a ``WorkerPlan``; a drawn one's (``MixLayout``) a ``MixPlan``."""
    part = _part(layout, world, facts, state, batch_size)
    progress = progress_at(layout, part.state, part.total, part.worker, in_worker, part.done)
    if isinstance(layout, MixLayout):
        return _mix_plan(layout, world.rank, part, progress)
    if state is None:  # the epoch's start: its slices straight from the shard order
        slices = plan_epoch(
            layout.counts, layout.permutation, rank=world.rank, world_size=world.world_size,
            worker=world.worker, num_workers=world.num_workers, equalize=layout.order.equalize,
            batch_size=batch_size,
        )  # fmt: skip
        return WorkerPlan(slices, layout.segment_rng(world.rank, world.worker, 0), (0, 0), None,
                          progress)  # fmt: skip
    n, total = part.hi - part.lo, part.total
    rng = layout.segment_rng(world.rank, part.worker, part.number)
    point = buffer_point(n, layout.buffered, rng, part.done)
    held = np.flatnonzero(point.slots >= 0)
    by_position = np.argsort(point.slots[held], kind="stable")
    wanted = np.concatenate(
        (point.slots[held][by_position], np.arange(point.frontier, n, dtype=np.int64))
    )
    positions = (part.lo + wanted) % max(total, 1) if total else wanted
    if part.stream is not None and total:
        positions = part.stream[positions]
    slices, keep = positions_to_slices(layout, positions)
    how = Arrangement(keep, held[by_position].tolist(), len(point.slots) if layout.buffered else 0)
    rng = layout.segment_rng(world.rank, part.worker, part.number)
    return WorkerPlan(slices, rng, (point.steps, point.flushed), how, progress)


def _mix_plan(layout: MixLayout, rank: int, part: _Part, progress: Progress) -> MixPlan:
    """A drawn epoch's part: one buffer per source. Only the buffers' points are worked out
    here; each source's slices and the schedule are made in pieces as they are read
    (``SourcePlan.pieces``, ``MixPlan.schedule``): O(``PLAN_PIECE``) at a time."""
    lo, total, done = part.lo, part.total, part.done
    hi = part.hi if total else lo
    chunks = partial(_part_chunks, lo, hi, total, part.stream)  # each call: the part afresh
    counts = _source_counts(layout, chunks, hi - lo, done)
    plans = []
    size = layout.buffered
    for i, (s, (n, c)) in enumerate(zip(layout.sources, counts, strict=True)):
        point = buffer_point(n, size, layout.buffer_rng(rank, part.worker, part.number, i), c)
        held = np.flatnonzero(point.slots >= 0)
        by_position = np.argsort(point.slots[held], kind="stable")
        residents = point.slots[held][by_position]
        pieces = partial(_source_pieces, layout, s, chunks, i, residents, point.frontier)
        how = Arrangement(None, held[by_position].tolist(), len(point.slots) if size else 0)
        rng = layout.buffer_rng(rank, part.worker, part.number, i)
        plans.append(SourcePlan(pieces, how, (point.steps, point.flushed), rng))
    return MixPlan(plans, partial(_schedule, layout, chunks, done), progress)


# --- checkpoint positions, from positions alone -------------------------------------------------


def segment_streams(layout: EpochLayout, segments: Sequence[Segment]) -> np.ndarray:
    """The epoch positions the last segment splits: everything for the first, then for each
    frozen segment what its world planned and did not deliver, in epoch stream order."""
    stream = np.arange(layout.total, dtype=np.int64)
    for number, seg in enumerate(segments[:-1]):
        total = len(stream)
        planned = np.zeros(total, dtype=bool)
        planned[: layout.planned(total, seg.world_size)] = True
        consumed = np.zeros(total, dtype=bool)
        for rank in range(seg.world_size):
            for w in range(seg.num_workers):
                lo, hi = layout.span(total, rank, seg, w)
                idx = np.arange(lo, hi, dtype=np.int64) % max(total, 1)
                c = min(seg.delivered[w], hi - lo)
                consumed[layout.consumed(stream, idx, rank, w, number, c)] = True
        stream = stream[planned & ~consumed]
    return stream


def samples_left(layout: EpochLayout, state: EpochState) -> int | None:
    """Samples of the epoch no rank has delivered yet (None: unknown, a one-worker state)."""
    last = state.segments[-1]
    if any(c is None for c in last.delivered):
        return None
    return len(segment_streams(layout, state.segments + (last,)))


def worker_left(layout: EpochLayout, state: EpochState, world: World, batch_size) -> int | None:
    """Samples DataLoader worker ``world.worker`` still has to deliver if it continues
    ``state`` (None: unknown, e.g. the world changed and the rest will be re-split)."""
    seg = state.segments[-1]
    if seg.world() != (world.world_size, world.num_workers, batch_size):
        return None
    worker = (seg.slot0 + world.worker) % world.num_workers
    if seg.delivered[worker] is None:
        return None
    total = len(segment_streams(layout, state.segments))
    lo, hi = layout.span(total, world.rank, seg, worker)
    return max(0, hi - lo - seg.delivered[worker])


def progress_at(
    layout: EpochLayout, state: EpochState, total: int, worker: int, in_worker: bool, done: int
) -> Progress:
    """The progress of plan worker ``worker`` of ``state.rank`` on the last segment of
    ``state`` (whose stream holds ``total`` positions), ``done`` samples delivered."""
    seg = state.segments[-1]
    lo, hi = layout.span(total, state.rank, seg, worker)
    finished = layout.finished(total, seg, worker)
    return Progress(state, worker, in_worker, done, part=hi - lo, finished=finished)


def rank_state(
    layout: EpochLayout,
    facts: dict,
    base: EpochState | None,
    *,
    rank: int,
    world_size: int,
    num_workers: int,
    batch_size: int,
    batches: int,
    cut: int | None = None,
) -> EpochState:
    """The state after a DataLoader with ``num_workers`` workers delivered ``batches`` batches of
    ``batch_size`` from ``base`` (the loaded state, or the epoch's start); ``cut``: the batch
    size worker parts are cut at (the dataset's ``batch_size``; None: not cut). Every batch is
    taken as whole: samples skipped as undecodable are not seen from here."""
    state, seg, plays = _rank_start(layout, facts, base, rank, world_size, num_workers, cut)
    total = len(segment_streams(layout, state.segments))
    left = []
    for w in plays:
        lo, hi = layout.span(total, rank, seg, w)
        left.append(max(0, hi - lo - seg.delivered[w]))
    taken, nxt = round_robin([-(-n // batch_size) for n in left], batches)
    consumed = [min(t * batch_size, n) for t, n in zip(taken, left, strict=True)]
    return _advanced(layout, total, state, plays, consumed, nxt)


def worker_counts_state(
    layout: EpochLayout,
    facts: dict,
    base: EpochState | None,
    *,
    rank: int,
    world_size: int,
    num_workers: int,
    cut: int | None,
    consumed: Sequence[int],
    next_worker: int,
) -> EpochState:
    """The state after DataLoader-numbered worker ``i`` took ``consumed[i]`` records from its
    stream (delivered or skipped as undecodable: a loader that is told of every skip, as
    ShardLoader is, counts exactly) and worker ``next_worker``'s batch is the next one due."""
    state, _, plays = _rank_start(layout, facts, base, rank, world_size, num_workers, cut)
    one = len(state.segments) == 1  # the whole epoch: no stream to build for its length
    total = layout.total if one else len(segment_streams(layout, state.segments))
    return _advanced(layout, total, state, plays, consumed, next_worker)


def _rank_start(layout, facts, base, rank, world_size, num_workers, cut):
    """(state on this world, its last segment, the plan worker each DataLoader worker plays)."""
    if base is None:
        base = EpochState.start(layout.epoch, rank, facts, world_size, num_workers, cut)
    state = replace(base.on_world(world_size, num_workers, cut), rank=rank)
    seg = state.segments[-1]
    if any(c is None for c in seg.delivered):
        raise InputError("state holds one DataLoader worker's count; it cannot be advanced here")
    return state, seg, [(seg.slot0 + slot) % num_workers for slot in range(num_workers)]


def _advanced(layout, total, state, plays, consumed, nxt) -> EpochState:
    """``state`` after each plan worker ``plays[i]`` took ``consumed[i]`` more; a worker whose
    part is done gets the count that says so on every rank (``EpochLayout.finished``)."""
    seg = state.segments[-1]
    delivered = list(seg.delivered)
    for slot, w in enumerate(plays):
        delivered[w] += consumed[slot]
        lo, hi = layout.span(total, state.rank, seg, w)
        if delivered[w] >= hi - lo:
            delivered[w] = max(delivered[w], layout.finished(total, seg, w))
    last = replace(seg, delivered=tuple(delivered), slot0=plays[nxt])
    return replace(state, segments=state.segments[:-1] + (last,))
