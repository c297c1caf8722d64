"""The plan of every epoch: which samples each rank and worker reads, in which order.

An epoch is one stream of positions, a pure function of (seed, epoch): a plain epoch lays the
shards end to end in ``shard_order``; a mixture, subset, split or fixed epoch size draws one
(``MixLayout``, ``stream.mix``). The stream is cut into contiguous rank parts (``rank_span``,
``equalize``) and each rank part into worker parts (``worker_span``, ``batch_size``); a worker's
part becomes the shard slices it reads (``plan_epoch``, ``positions_to_slices``).

``worker_plan`` and ``mix_worker_plan`` give one worker's plan, fresh or continuing a
checkpoint: the slices, the buffer generator and where the buffer stands. A mixed, subset, split
or sized epoch's slices are made in pieces (``PlanPiece``, ``PLAN_PIECE`` drawn samples at a
time) as the reader reaches them, so a worker holds one piece's plan, never its whole part's.
The checkpoint itself (its state, the replay of the shuffle buffer on positions) is
``stream.resume``'s; reading and decoding the slices is ``stream.stages``'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputError, check_choice
from ..records import ShardInfo, ShardSlice, ShardTable
from .resume import (
    Arrangement,
    EpochState,
    Progress,
    Segment,
    buffer_point,
    progress_at,
    segment_streams,
)
from .shuffle import EQUALIZE_MODES, buffer_rng, rng_for, shard_order
from .world import World

if TYPE_CHECKING:
    from .mix import MixedSource

__all__ = [
    "rank_span",
    "rank_samples",
    "sample_counts",
    "worker_span",
    "plan_epoch",
    "EpochLayout",
    "positions_to_slices",
    "WorkerPlan",
    "worker_plan",
    "MixLayout",
    "PLAN_PIECE",
    "PlanPiece",
    "SourcePlan",
    "MixPlan",
    "mix_worker_plan",
]

#: Holes of at most this many samples between wanted samples are read through rather than
#: sought over: each seek re-opens the shard, lands on an index entry (every 64 samples) and
#: refills the tar reader's window, which costs about what reading ~30 LFW-sized samples does.
_MERGE_GAP = 32

#: Drawn samples a worker plans at once. A mixed, subset, split or sized epoch's part is turned
#: into slices a piece at a time as the reader reaches it: ~100 bytes a sample of the piece at
#: its peak (~13 MB), whatever the part's length (5.6M samples a worker at LAION-400M).
PLAN_PIECE = 1 << 17

# Domain tags (``stream.mix`` has the subset's): the draws and the per-source buffers never
# share a random stream.
_DRAW, _MIXBUF = 0x3D1C, 0x3B0F


# --- one epoch's stream, cut into rank and worker parts ----------------------------------------


def rank_span(total: int, rank: int, world_size: int, equalize: str) -> tuple[int, int]:
    """[start, stop) of this rank's part of the epoch stream; stop may exceed ``total`` (pad)."""
    check_choice("equalize", equalize, EQUALIZE_MODES)
    if equalize == "pad":
        per = -(-total // world_size)
        return rank * per, (rank + 1) * per
    if equalize == "drop":
        per = total // world_size
        return rank * per, (rank + 1) * per
    return rank * total // world_size, (rank + 1) * total // world_size  # "none"


def rank_samples(total: int, rank: int, world_size: int, equalize: str) -> int:
    """Samples rank ``rank`` yields per epoch: ``len(ds)``."""
    start, stop = rank_span(total, rank, world_size, equalize)
    return stop - start


def sample_counts(shards: Sequence[ShardInfo]) -> np.ndarray:
    """Per-shard sample counts as an int64 array, the form ``plan_epoch`` does arithmetic on.

    A ``ShardTable`` (what datasets hold) gives its column, copied (so the caller may edit it),
    without making an object a shard."""
    if isinstance(shards, ShardTable):
        return shards.samples.copy()
    return np.fromiter((s.samples for s in shards), dtype=np.int64, count=len(shards))


def worker_span(
    length: int, worker: int, num_workers: int, batch_size: int | None = None
) -> tuple[int, int]:
    """[lo, hi) of worker ``worker``'s contiguous part of a rank part of ``length`` samples.

    ``batch_size`` None: parts differ by at most one sample. Otherwise parts are cut at multiples
    of ``batch_size`` the way a DataLoader draws batches from an IterableDataset's workers: batch
    k of the rank comes from worker ``k % num_workers``, only the rank's last batch is short,
    so the rank yields exactly ceil(length / batch_size) batches (not up to one short batch per
    worker) and ranks with equal ``length`` take equal steps.
    """
    if not batch_size:
        return worker * length // num_workers, (worker + 1) * length // num_workers
    batches = -(-length // batch_size)
    short_owner = (batches - 1) % num_workers  # holds the rank's last, possibly short, batch
    deficit = batches * batch_size - length

    def start(w: int) -> int:
        full = sum((batches - v + num_workers - 1) // num_workers for v in range(w))
        return full * batch_size - (deficit if short_owner < w else 0)

    return start(worker), start(worker + 1)


def plan_epoch(
    shards: Sequence[ShardInfo] | np.ndarray,
    order: Sequence[int] | np.ndarray,
    *,
    rank: int,
    world_size: int,
    worker: int,
    num_workers: int,
    equalize: str = "pad",
    batch_size: int | None = None,
) -> list[ShardSlice]:
    """The slices worker ``worker`` of rank ``rank`` reads this epoch, in reading order.

    The shards, taken in ``order``, are laid end to end as one stream of N samples. It is cut into
    ``world_size`` contiguous rank parts (``equalize``: "pad" gives every rank ceil(N/W) samples,
    the surplus re-read from the start of the stream; "drop" gives floor(N/W), the tail unread;
    "none" gives parts differing by at most one), then each rank part into ``num_workers``
    contiguous worker parts whose sizes differ by at most one and are the same on every rank
    (with ``batch_size``, cut at multiples of it: see ``worker_span``). Parts are cut at sample
    boundaries, not shard boundaries, so a single shard can feed many workers and no worker idles
    while another has work. ``shards`` may also be their ``sample_counts`` array, computed once
    by a caller that plans many epochs.
    """
    counts = shards if isinstance(shards, np.ndarray) else sample_counts(shards)
    order = np.asarray(order, dtype=np.int64)
    ordered = counts[order]
    total = int(ordered.sum())
    start, stop = rank_span(total, rank, world_size, equalize)
    lo, hi = worker_span(stop - start, worker, num_workers, batch_size)
    lo, hi = start + lo, start + hi
    if lo >= hi:
        return []
    ends = np.cumsum(ordered)  # ends[i]: stream position just after the i-th shard read
    slices: list[ShardSlice] = []
    pos = lo
    while pos < hi:  # wraps past N only under "pad"
        p = pos % total
        q = min(total, p + (hi - pos))
        i = int(np.searchsorted(ends, p, side="right"))
        while p < q:
            end = int(ends[i])
            if end > p:  # empty shards have end == p: nothing to read there
                first = end - int(ordered[i])
                take = min(q, end)
                slices.append(ShardSlice(int(order[i]), p - first, take - first))
                pos += take - p
                p = take
            i += 1
    return slices


# --- epoch geometry on positions ------------------------------------------------------------


@dataclass(frozen=True)
class EpochLayout:
    """What planning an epoch needs: shard counts and the settings that shape the order."""

    counts: np.ndarray
    seed: int
    epoch: int
    shuffle: bool
    buffer_size: int
    equalize: str
    order: np.ndarray = field(init=False)
    ends: np.ndarray = field(init=False)

    def __post_init__(self):
        order = shard_order(len(self.counts), self.seed, self.epoch, self.shuffle)
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "ends", np.cumsum(np.asarray(self.counts)[order]))

    @property
    def total(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def buffered(self) -> int:
        """The buffer size in effect (0: no buffer)."""
        return self.buffer_size if self.shuffle and self.buffer_size > 1 else 0

    def span(self, total: int, rank: int, seg: Segment, worker: int) -> tuple[int, int]:
        """[lo, hi) of a worker's part of a stream of ``total`` (past ``total``: wraps)."""
        start, stop = rank_span(total, rank, seg.world_size, self.equalize)
        lo, hi = worker_span(stop - start, worker, seg.num_workers, seg.batch_size)
        return start + lo, start + hi

    def finished(self, total: int, seg: Segment, worker: int) -> int:
        """The count a rank saves for worker ``worker`` once its part is done: its longest part
        over the ranks. A rank's state stands for every rank, and under ``equalize="none"``
        another rank's part may be a sample longer; a loop that ended on the saving rank ended
        on every rank, so that sample must not be delivered again."""
        spans = (self.span(total, r, seg, worker) for r in range(seg.world_size))
        return max(hi - lo for lo, hi in spans)

    def planned(self, total: int, world_size: int) -> int:
        """How much of a stream of ``total`` a world plans to deliver (``drop`` cuts the tail)."""
        return world_size * (total // world_size) if self.equalize == "drop" else total

    def consumed(self, stream, idx, rank: int, worker: int, segment: int, delivered: int):
        """Entries of ``idx`` (a worker's part of ``stream``) it delivered after ``delivered``
        outputs of its buffer (a mixture replays one buffer per source: stream.mix)."""
        rng = _segment_rng(self, rank, worker, segment)
        return idx[buffer_point(len(idx), self.buffered, rng, delivered).consumed()]


def _segment_rng(layout: EpochLayout, rank: int, worker: int, segment: int):
    return buffer_rng(layout.seed, layout.epoch, rank, worker, segment)


def positions_to_slices(
    layout: EpochLayout, positions: np.ndarray
) -> tuple[list[ShardSlice], np.ndarray]:
    """Slices that read ``positions`` (epoch stream positions) in the given order, and a mask
    over the records they yield of those wanted (small holes are read through, not sought)."""
    if not len(positions):
        return [], np.zeros(0, dtype=bool)
    shard_at, starts = _slice_starts(layout, positions)
    first = layout.ends[shard_at] - np.asarray(layout.counts)[layout.order[shard_at]]
    offsets = positions - first
    stops = np.concatenate((starts[1:], [len(positions)]))
    slices, masks = [], []
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
        lo, hi = int(offsets[a]), int(offsets[b - 1]) + 1
        slices.append(ShardSlice(int(layout.order[shard_at[a]]), lo, hi))
        mask = np.zeros(hi - lo, dtype=bool)
        mask[offsets[a:b] - lo] = True
        masks.append(mask)
    return slices, np.concatenate(masks)


def _slice_starts(layout: EpochLayout, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each position's place in ``layout.order`` and the indices where a slice of
    ``positions_to_slices`` starts: a new shard, a step back, or a hole over ``_MERGE_GAP``.
    Each start depends on two neighbours alone, so positions cut at a start plan as a whole."""
    shard_at = np.searchsorted(layout.ends, positions, side="right")
    step = np.diff(positions)
    cut = (np.diff(shard_at) != 0) | (step < 1) | (step > _MERGE_GAP)
    return shard_at, np.concatenate(([0], np.flatnonzero(cut) + 1))


@dataclass(frozen=True)
class PlanPiece:
    """Consecutive slices of a source's plan and the mask over their records of those wanted
    (``positions_to_slices``'), cut where a slice starts: a plan's pieces laid end to end are
    the slices and mask its positions give at once."""

    slices: list[ShardSlice]
    keep: np.ndarray


def plan_pieces(layout: EpochLayout, chunks: Iterator[np.ndarray]) -> Iterator[PlanPiece]:
    """``positions_to_slices`` of ``chunks`` (arrays of positions) laid end to end, a piece at
    a time: each piece ends before the last slice start seen, the rest carried on, so the
    slices are those of the whole (a carry is at most one slice: one shard's samples)."""
    carry = np.empty(0, dtype=np.int64)
    for chunk in chunks:
        carry = np.concatenate((carry, chunk)) if len(carry) else chunk
        if len(carry) < 2:
            continue
        cut = int(_slice_starts(layout, carry)[1][-1])
        if cut:
            yield PlanPiece(*positions_to_slices(layout, carry[:cut]))
            carry = carry[cut:].copy()  # not a view holding the piece's array
    if len(carry):
        yield PlanPiece(*positions_to_slices(layout, carry))


# --- one worker's plan -------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker reads and how: the pipeline in ShardDataset.__iter__ follows it."""

    slices: list[ShardSlice]
    rng: np.random.Generator
    buffer: tuple[int, int]
    arrangement: Arrangement | None
    progress: Progress


def worker_plan(
    layout: EpochLayout,
    world: World,
    facts: dict,
    state: EpochState | None = None,
    *,
    batch_size: int | None = None,
    in_worker: bool = False,
) -> WorkerPlan:
    """The plan of worker ``world.worker`` for ``layout.epoch``, continuing ``state`` if given;
    ``batch_size``: cut worker parts at its multiples (``stream.worker_span``)."""
    if state is None:
        slices = plan_epoch(
            layout.counts,
            layout.order,
            rank=world.rank,
            world_size=world.world_size,
            worker=world.worker,
            num_workers=world.num_workers,
            equalize=layout.equalize,
            batch_size=batch_size,
        )
        start = EpochState.start(
            layout.epoch, world.rank, facts, world.world_size, world.num_workers, batch_size
        )
        rng = buffer_rng(layout.seed, layout.epoch, world.rank, world.worker)
        progress = progress_at(layout, start, layout.total, world.worker, in_worker, 0)
        return WorkerPlan(slices, rng, (0, 0), None, progress)
    state = state.on_world(world.world_size, world.num_workers, batch_size)
    state = replace(state, rank=world.rank)
    seg, number = state.segments[-1], len(state.segments) - 1
    # One segment: the stream is every position in order (not an array of the whole epoch).
    stream = segment_streams(layout, state.segments) if number else None
    total = layout.total if stream is None else len(stream)
    worker = (seg.slot0 + world.worker) % world.num_workers
    lo, hi = layout.span(total, world.rank, seg, worker)
    n = hi - lo
    done = seg.delivered[worker]
    if done is None:
        raise InputError(
            f"state holds no count for DataLoader worker {worker}: it was saved by another "
            "worker; load each worker's state into its own worker (StatefulDataLoader does)"
        )
    done = min(done, n)
    size = layout.buffered
    point = buffer_point(n, size, _segment_rng(layout, world.rank, worker, number), done)
    held = np.flatnonzero(point.slots >= 0)
    by_position = np.argsort(point.slots[held], kind="stable")
    wanted = np.concatenate(
        (point.slots[held][by_position], np.arange(point.frontier, n, dtype=np.int64))
    )
    positions = (lo + wanted) % max(total, 1) if total else wanted
    if stream is not None and total:
        positions = stream[positions]
    slices, keep = positions_to_slices(layout, positions)
    how = Arrangement(keep, held[by_position].tolist(), len(point.slots) if size else 0)
    rng = _segment_rng(layout, world.rank, worker, number)
    progress = progress_at(layout, state, total, worker, in_worker, done)
    return WorkerPlan(slices, rng, (point.steps, point.flushed), how, progress)


# --- a mixed epoch -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MixLayout(EpochLayout):
    """One epoch's mixed stream: ``source[p]`` and ``ids[p]`` (global sample id) of position p.

    An ``EpochLayout`` of one pseudo-shard of ``epoch_size`` positions, so rank and worker spans,
    ``equalize`` and the resume arithmetic of ``stream.resume`` apply unchanged; ``consumed``
    replays one buffer per source instead of one per worker.
    """

    source: np.ndarray = field(default=None)
    ids: np.ndarray = field(default=None)
    num_sources: int = 1

    @classmethod
    def build(
        cls,
        sources: Sequence[MixedSource],
        shares: Sequence[int],
        *,
        seed: int,
        epoch: int,
        shuffle: bool,
        buffer_size: int,
        equalize: str,
    ) -> MixLayout:
        total = int(sum(shares))
        kind = np.uint8 if len(sources) < 256 else np.int64  # a source's number: 1 byte
        if len(sources) == 1:  # one source's times ascend: the stream is its draw as drawn,
            # answered for the positions a worker asks (``DrawnIds``), never held whole
            ids = DrawnIds(sources[0], total, rng_for(seed, epoch, _DRAW, 0), shuffle)
            return cls(
                np.asarray([total], dtype=np.int64), seed, epoch, shuffle, buffer_size,
                equalize, source=np.broadcast_to(kind(0), (total,)), ids=ids, num_sources=1,
            )  # fmt: skip
        ids, times, src = [], [], []
        for i, (s, n) in enumerate(zip(sources, shares, strict=True)):
            drawn = _draw(s, n, rng_for(seed, epoch, _DRAW, i), shuffle)
            ids.append(drawn + s.offset)
            times.append((np.arange(n, dtype=np.float64) + 0.5) / max(n, 1))
            src.append(np.full(n, i, dtype=kind))
        order = np.argsort(np.concatenate(times), kind="stable")  # ties: earlier source first
        return cls(
            np.asarray([total], dtype=np.int64), seed, epoch, shuffle, buffer_size, equalize,
            source=np.concatenate(src)[order], ids=np.concatenate(ids)[order],
            num_sources=len(sources),
        )  # fmt: skip

    def buffer_rng(self, rank: int, worker: int, segment: int, source: int):
        return rng_for(self.seed, self.epoch, _MIXBUF, rank, worker, segment, source)

    def consumed(self, stream, idx, rank, worker, segment, delivered) -> np.ndarray:
        """Entries of ``idx`` (a worker's part of ``stream``) delivered after ``delivered``
        outputs: per source, the count the source sequence gives, replayed on its own buffer."""
        src = self.source[stream[idx]]
        out = []
        for i in range(self.num_sources):
            sel = np.flatnonzero(src == i)
            c = int(np.count_nonzero(src[:delivered] == i))
            rng = self.buffer_rng(rank, worker, segment, i)
            out.append(idx[sel[buffer_point(len(sel), self.buffered, rng, c).consumed()]])
        return np.concatenate(out) if out else np.empty(0, np.int64)


def _draw(s: MixedSource, n: int, rng: np.random.Generator, shuffle: bool) -> np.ndarray:
    """``n`` positions of source ``s``: whole passes over its members, then a draw without
    replacement; each pass in a fresh shard order (stored order without ``shuffle``), positions
    ascending within a shard so reading stays sequential. A whole pass is written shard by
    shard from ``s.members`` (``stream.members``): the members are never held as one array
    beside the draw."""
    members = s.members
    m = len(members)
    passes, rest = divmod(n, m)
    out = np.empty(n, dtype=np.int64)
    at = 0
    for p in range(passes + (1 if rest else 0)):
        rank = rng.permutation(len(s.shards)) if shuffle else np.arange(len(s.shards))
        if p == passes:  # the partial pass: a draw without replacement, kept in stored order
            chosen = members.take(np.sort(rng.choice(m, size=rest, replace=False)))
            shard_of = np.searchsorted(members.starts[1:], chosen, side="right")
            out[at : at + rest] = chosen[np.argsort(rank[shard_of], kind="stable")]
            at += rest
            continue
        for i in np.argsort(rank, kind="stable").tolist():  # shards by rank: a pass's order
            if members.per_shard[i]:
                got = members.shard(i)
                out[at : at + len(got)] = got
                at += len(got)
    return out


class DrawnIds:
    """``_draw(s, n, rng, shuffle) + s.offset`` answered for the positions asked (``ids[p]``),
    the draw never held whole: each whole pass is its shard order and the running count of
    members along it (16 bytes a shard), the partial pass its drawn members (8 bytes each, as
    ``_draw``). A worker asks for its part: the shards that part covers are expanded, one at a
    time. The random draws are ``_draw``'s, in its order, so the ids are the same."""

    def __init__(self, s: MixedSource, n: int, rng: np.random.Generator, shuffle: bool):
        self.members, self.offset, self.n = s.members, s.offset, n
        m = len(self.members)
        passes, rest = divmod(n, m)
        self.passes: list[tuple[np.ndarray, np.ndarray]] = []  # (shard order, member ends)
        self.partial = np.empty(0, dtype=np.int64)
        for p in range(passes + (1 if rest else 0)):
            rank = rng.permutation(len(s.shards)) if shuffle else np.arange(len(s.shards))
            if p == passes:  # a draw without replacement, kept in stored order: as _draw
                chosen = self.members.take(np.sort(rng.choice(m, size=rest, replace=False)))
                shard_of = np.searchsorted(self.members.starts[1:], chosen, side="right")
                self.partial = chosen[np.argsort(rank[shard_of], kind="stable")]
                continue
            order = np.argsort(rank, kind="stable")
            self.passes.append((order, np.cumsum(self.members.per_shard[order])))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, positions) -> np.ndarray:
        p = np.asarray(positions, dtype=np.int64)
        m = len(self.members)
        out = np.empty(p.shape, dtype=np.int64)
        pass_of, within = np.divmod(p, m)
        for q in np.unique(pass_of).tolist():
            sel = np.flatnonzero(pass_of == q)
            if q == len(self.passes):
                out[sel] = self.partial[within[sel]]
                continue
            order, ends = self.passes[q]
            k = within[sel]
            j = np.searchsorted(ends, k, side="right")  # the j-th shard of this pass's order
            # the positions grouped by shard in one sort, not one scan of them a shard (which
            # cost shards x positions: 0.1 s a 10% epoch at 1,444 shards, 28x that at 40,000)
            by = np.argsort(j, kind="stable")
            cuts = np.flatnonzero(np.diff(j[by])) + 1
            for at in np.split(by, cuts) if len(by) else ():
                jj = int(j[at[0]])
                shard = int(order[jj])
                first = int(ends[jj] - self.members.per_shard[shard])
                out[sel[at]] = self.members.shard(shard)[k[at] - first]
        return out + self.offset


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


def mix_worker_plan(
    layout: MixLayout,
    sources: Sequence[MixedSource],
    world: World,
    facts: dict,
    state: EpochState | None = None,
    *,
    batch_size: int | None = None,
    in_worker: bool = False,
) -> MixPlan:
    """The plan of worker ``world.worker`` for ``layout.epoch``, continuing ``state`` if given
    (the same arithmetic as ``worker_plan``, one buffer per source). Only the buffers' points
    are worked out here; each source's slices and the schedule are made in pieces as they are
    read (``SourcePlan.pieces``, ``MixPlan.schedule``): O(``PLAN_PIECE``) at a time."""
    if state is None:
        state = EpochState.start(
            layout.epoch, world.rank, facts, world.world_size, world.num_workers, batch_size
        )
    state = replace(
        state.on_world(world.world_size, world.num_workers, batch_size), rank=world.rank
    )
    seg, number = state.segments[-1], len(state.segments) - 1
    # One segment (no checkpoint of another world): the stream is every position in order, and
    # this worker's part is its span alone, not an array of the whole epoch's positions.
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
    done = min(done, hi - lo)
    hi = hi if total else lo
    part = partial(_part_chunks, lo, hi, total, stream)  # each call: the part afresh
    counts = _source_counts(layout, part, hi - lo, done)
    plans = []
    size = layout.buffered
    for i, (s, (n, c)) in enumerate(zip(sources, counts, strict=True)):
        point = buffer_point(n, size, layout.buffer_rng(world.rank, worker, number, i), c)
        held = np.flatnonzero(point.slots >= 0)
        by_position = np.argsort(point.slots[held], kind="stable")
        residents = point.slots[held][by_position]
        pieces = partial(_source_pieces, layout, s, part, i, residents, point.frontier)
        how = Arrangement(None, held[by_position].tolist(), len(point.slots) if size else 0)
        rng = layout.buffer_rng(world.rank, worker, number, i)
        plans.append(SourcePlan(pieces, how, (point.steps, point.flushed), rng))
    progress = progress_at(layout, state, total, worker, in_worker, done)
    return MixPlan(plans, partial(_schedule, layout, part, done), progress)
