"""Mid-epoch checkpoints: where an epoch stands, recomputed from sample positions alone.

An epoch's plan is a pure function of (seed, epoch, world) (``stream.partition``) and the shuffle
buffer's choices depend only on its generator and on positions, never on bytes
(``shuffle.shuffle_buffer``). So "worker w has delivered c samples" is enough to know, without
reading a byte, which samples it delivered, which sit in its buffer and where its reading stops.
A resumed worker reads the buffer's residents and then the unread rest, seeking through the
shards' offset index; the consumed prefix is neither read nor decoded.

The plan of a resumed worker is ``partition.worker_plan``'s; this module keeps the state and the
replay of the shuffle buffer it needs. A state is plain data (ints, strings, lists, None): ``json``
and ``torch.save`` both round-trip it. It holds the epoch, a fingerprint of the dataset, and one
*segment* per world the epoch was played on: world size, DataLoader workers, samples delivered by
each worker. DDP ranks step together, so one rank's segment describes every rank. Loading it on
another world (elastic) freezes the segment: the samples the old world planned but did not
deliver become the stream of a new segment, split over the new world with the usual rules
(``equalize``, ``batch_size``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputError
from ..records import Record, ShardTable
from .shuffle import draw_block
from .world import World

if TYPE_CHECKING:  # the plan imports the state, not the other way round
    from .partition import EpochLayout

__all__ = [
    "STATE_FORMAT",
    "Segment",
    "EpochState",
    "Progress",
    "dataset_facts",
    "progress_at",
    "rank_state",
    "worker_counts_state",
    "round_robin",
    "arrange",
    "count_delivered",
    "merge_worker_states",
    "samples_left",
    "worker_left",
]

STATE_FORMAT = "shardkit.resume/1"

# --- the state ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """Part of an epoch played on one world.

    ``batch_size``: the multiple worker parts were cut at (None: not cut at batches).
    ``delivered[w]``: samples worker w's stream has delivered (None where unknown: a DataLoader
    worker knows only its own); a finished worker's count may exceed the saving rank's part, so
    that it reads as finished on every rank (``EpochLayout.finished``). ``slot0``: the plan
    worker that DataLoader worker 0 plays, so that a DataLoader, whose round robin always starts
    at worker 0, continues where the old one was.
    """

    world_size: int
    num_workers: int
    batch_size: int | None
    delivered: tuple[int | None, ...]
    slot0: int = 0

    def world(self) -> tuple[int, int, int | None]:
        return self.world_size, self.num_workers, self.batch_size

    def fresh(self) -> bool:
        return all(c == 0 for c in self.delivered)


@dataclass(frozen=True)
class EpochState:
    """Where an epoch stands: the parsed form of ``ShardDataset.state_dict()``."""

    epoch: int
    rank: int
    dataset: dict
    segments: tuple[Segment, ...]

    def to_dict(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "dataset": dict(self.dataset),
            "epoch": self.epoch,
            "rank": self.rank,
            "segments": [
                {
                    "world_size": s.world_size,
                    "num_workers": s.num_workers,
                    "batch_size": s.batch_size,
                    "slot0": s.slot0,
                    "delivered": list(s.delivered),
                }
                for s in self.segments
            ],
        }

    @classmethod
    def start(
        cls,
        epoch: int,
        rank: int,
        dataset: dict,
        world_size: int,
        num_workers: int = 1,
        batch_size: int | None = None,
    ) -> EpochState:
        """The state at the start of an epoch: nothing delivered."""
        first = Segment(world_size, num_workers, batch_size, (0,) * num_workers)
        return cls(epoch, rank, dataset, (first,))

    @classmethod
    def from_dict(cls, state, facts: dict) -> EpochState:
        """Parse and check a saved state against this dataset's ``facts``; InputError if wrong."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise InputError(
                f"state is not a ShardDataset state (no 'format': {STATE_FORMAT!r}); pass what "
                "ds.state_dict() (or ShardLoader.state_dict()) returned"
            )
        saved = state.get("dataset")
        if not isinstance(saved, dict):
            raise InputError("state has no 'dataset' facts; pass what ds.state_dict() returned")
        if "mix" in saved and "mix" not in facts:  # a mixture's plan, not the plain epoch's
            raise InputError(
                "state was saved for a mixture's epoch (a Source with subset=, split= or "
                "epoch_size=, or, before one Source alone read as its path, a lone Source) and "
                "this dataset reads the plain epoch: resuming would silently give another order; "
                f"build it with epoch_size={saved.get('epoch_size')!r} to continue that state"
            )
        for key, value in facts.items():
            if key == "fingerprint":
                continue
            if saved.get(key) != value:
                raise InputError(
                    f"state was saved for a dataset with {key}={saved.get(key)!r}, this one has "
                    f"{key}={value!r}: resuming would silently give another order; build the "
                    "dataset with the settings the state was saved with"
                )
        if saved.get("fingerprint") != facts["fingerprint"]:
            raise InputError(
                "state was saved for other shards (their names or sample counts differ from "
                "this dataset's): resuming would silently give another order; load it into a "
                "dataset over the shards it was saved with"
            )
        try:
            epoch, rank = _nonneg(state["epoch"]), _nonneg(state["rank"])
            segments = tuple(_segment(s) for s in state["segments"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(
                f"state is malformed ({exc}); pass what ds.state_dict() returned"
            ) from None
        if not segments:
            raise InputError("state is malformed (no segments); pass what ds.state_dict() returned")
        return cls(epoch, rank, dict(saved), segments)

    def on_world(
        self, world_size: int, num_workers: int, batch_size: int | None = None
    ) -> EpochState:
        """This state continued on a (possibly) different world: same world, same segment;
        else the current segment is frozen and a fresh one starts (elastic resume)."""
        cur = self.segments[-1]
        if cur.world() == (world_size, num_workers, batch_size):
            return self
        segments = self.segments[:-1] if cur.fresh() else self.segments
        if any(c is None for c in cur.delivered):
            raise InputError(
                f"state describes one DataLoader worker of {cur.num_workers} on world size "
                f"{cur.world_size}; it resumes only there. To resume on another world, save a "
                "whole rank's state: ShardLoader.state_dict(), ds.state_dict(batches=...), or "
                "shardkit.stream.resume.merge_worker_states"
            )
        fresh = Segment(world_size, num_workers, batch_size, (0,) * num_workers)
        return replace(self, segments=segments + (fresh,))


def _nonneg(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _segment(d: dict) -> Segment:
    world_size, num_workers = _nonneg(d["world_size"]), _nonneg(d["num_workers"])
    slot0 = _nonneg(d.get("slot0", 0))
    batch_size = None if d.get("batch_size") is None else _nonneg(d["batch_size"])
    delivered = tuple(None if c is None else _nonneg(c) for c in d["delivered"])
    if world_size < 1 or num_workers < 1 or len(delivered) != num_workers or slot0 >= num_workers:
        raise ValueError(f"segment {d!r} is inconsistent")
    return Segment(world_size, num_workers, batch_size or None, delivered, slot0)


def dataset_facts(
    urls: Sequence[str] | ShardTable,
    counts: Sequence[int] | np.ndarray,
    shard_format: str,
    *,
    seed: int,
    shuffle: bool,
    buffer_size: int,
    equalize: str,
) -> dict:
    """What a state must agree on with the dataset it is loaded into.

    The fingerprint covers shard file names (not directories: a dataset moved or mounted
    elsewhere still resumes) and their sample counts, in order.
    """
    ints = counts.tolist() if isinstance(counts, np.ndarray) else [int(c) for c in counts]
    blob = json.dumps([shard_format, _file_names(urls), ints]).encode()
    return {
        "shards": len(urls),
        "samples": sum(ints),
        "seed": int(seed),
        "shuffle": bool(shuffle),
        "buffer_size": int(buffer_size),
        "equalize": equalize,
        "fingerprint": hashlib.sha256(blob).hexdigest()[:32],
    }


def _file_names(urls: Sequence[str] | ShardTable) -> list[str]:
    """Each shard's file name: a table of plain names under one directory gives its names
    column as it is (the manifest checked them: no separator in any), not a split a shard."""
    if isinstance(urls, ShardTable):
        if not urls.tail and urls.head[-1:] in ("/", "\\"):
            return urls.names
        urls = urls.urls
    return [u.replace("\\", "/").rstrip("/").rpartition("/")[2] for u in urls]


@dataclass(frozen=True)
class BufferPoint:
    """A shuffle buffer after delivering some items, worked out on stream indices.

    ``slots[j]``: stream index resident in slot j (-1: already emitted by the final flush).
    ``frontier``: first stream index not read yet. ``steps``/``flushed``: see shuffle_buffer.
    """

    slots: np.ndarray
    frontier: int
    steps: int
    flushed: int

    def consumed(self) -> np.ndarray:
        """Stream indices delivered so far."""
        done = np.ones(self.frontier, dtype=bool)
        done[self.slots[self.slots >= 0]] = False
        return np.flatnonzero(done)


def buffer_point(n: int, size: int, rng: np.random.Generator, delivered: int) -> BufferPoint:
    """Replay ``shuffle_buffer`` over a stream of ``n`` items, on indices, for ``delivered``
    outputs. Mirrors it draw for draw; tests check the two agree."""
    if size <= 1:
        return BufferPoint(np.empty(0, np.int64), delivered, 0, 0)
    fill = min(n, size)
    total_steps = n - size if n >= size else 0
    steps = min(delivered, total_steps)
    last = np.full(fill, -1, dtype=np.int64)  # each slot's last replacement, block by block:
    for at in range(0, steps, 4096):  # O(the buffer), not a draw kept for every step replayed
        k = min(4096, steps - at)
        np.maximum.at(last, draw_block(rng, size)[:k], np.arange(at, at + k, dtype=np.int64))
    slots = np.where(last >= 0, size + last, np.arange(fill, dtype=np.int64))
    flushed = delivered - steps
    if flushed:
        slots[rng.permutation(fill)[:flushed]] = -1
    return BufferPoint(slots, fill + steps, steps, flushed)


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


# --- one worker's iteration -----------------------------------------------------------------


@dataclass(frozen=True)
class Arrangement:
    """How a resumed worker's records become the shuffle buffer's input: drop the records read
    only to bridge small holes (``keep``; None where the reader dropped them already, as a pieced
    plan's reads do: ``partition.SourcePlan``), put the first ``len(slots)`` kept ones in their
    buffer slots (``fill`` slots, None where the flush already emitted), pass the rest through."""

    keep: np.ndarray | None
    slots: list[int]
    fill: int


def arrange(
    records: Iterable[Record], how: Arrangement, dropped: bool = False
) -> Iterator[Record | None]:
    """``records`` as ``how`` arranges them; ``dropped``: they are the kept ones already
    (``read_slices(drop=True)``)."""
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


@dataclass
class Progress:
    """The live count of one worker's deliveries, from which ``state_dict`` is written."""

    state: EpochState
    worker: int  # the plan worker this process plays
    in_worker: bool  # a DataLoader worker: it knows only its own count
    delivered: int = 0
    part: int | None = None  # this worker's part on this rank (None: not known)
    finished: int = 0  # the count saved once the part is done (``EpochLayout.finished``)

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def snapshot(self) -> EpochState:
        seg = self.state.segments[-1]
        counts = [None if self.in_worker else c for c in seg.delivered]
        done = self.part is not None and self.delivered >= self.part
        counts[self.worker] = max(self.finished, self.delivered) if done else self.delivered
        last = replace(seg, delivered=tuple(counts))
        return replace(self.state, segments=self.state.segments[:-1] + (last,))


def progress_at(
    layout: EpochLayout, state: EpochState, total: int, worker: int, in_worker: bool, done: int
) -> Progress:
    """The progress of plan worker ``worker`` of ``state.rank`` on the last segment of
    ``state`` (whose stream holds ``total`` positions), ``done`` samples delivered."""
    seg = state.segments[-1]
    lo, hi = layout.span(total, state.rank, seg, worker)
    finished = layout.finished(total, seg, worker)
    return Progress(state, worker, in_worker, done, part=hi - lo, finished=finished)


def count_delivered(records: Iterable, progress: Progress) -> Iterator:
    """Count what leaves the shuffle buffer (before decoding, so skipped samples count too)."""
    for rec in records:
        progress.delivered += 1
        yield rec


# --- a whole rank's position from a batch count ------------------------------------------------


def round_robin(batches: Sequence[int], k: int) -> tuple[list[int], int]:
    """How many of ``k`` batches come from each DataLoader worker, and whose batch is next.

    A DataLoader over an IterableDataset asks its workers in turn and skips those that are
    exhausted, so the first k batches are this fixed deal.
    """
    taken = [0] * len(batches)
    while True:
        active = [i for i, b in enumerate(batches) if b > taken[i]]
        if k == 0:
            return taken, (active[0] if active else 0)
        if not active:
            raise InputError(
                f"batches is {sum(taken) + k}, but this rank has only {sum(batches)} batches "
                "left in the epoch; pass the batches delivered since the loop started"
            )
        m = min(batches[i] - taken[i] for i in active)
        if k >= m * len(active):
            for i in active:
                taken[i] += m
            k -= m * len(active)
        else:
            rounds, extra = divmod(k, len(active))
            for j, i in enumerate(active):
                taken[i] += rounds + (j < extra)
            return taken, active[extra]


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


def merge_worker_states(states: Iterable[dict] | dict) -> dict:
    """One rank's state from its DataLoader workers' states, so it can resume on another world.

    ``states``: the workers' ``ds.state_dict()`` results, or a torchdata ``StatefulDataLoader``'s
    ``state_dict()`` (its per-worker dataset states are taken from it).
    """
    if isinstance(states, dict):
        if states.get("format") == STATE_FORMAT:
            return states
        if isinstance(states.get("dataset_state"), dict):  # StatefulDataLoader, no workers
            return states["dataset_state"]
        try:
            snapshots = states["_snapshot"]["_worker_snapshots"]
            states = [snapshots[key]["dataset_state"] for key in sorted(snapshots)]
        except (KeyError, TypeError):
            raise InputError(
                "not a StatefulDataLoader state or a list of ShardDataset worker states"
            ) from None
    merged = None
    for st in states:
        if not isinstance(st, dict) or st.get("format") != STATE_FORMAT:
            raise InputError(f"not a ShardDataset state: {str(st)[:80]}")
        if merged is None:
            merged = json.loads(json.dumps(st))
            continue
        if len(st["segments"]) != len(merged["segments"]) or st["epoch"] != merged["epoch"]:
            raise InputError("worker states from different epochs or worlds cannot be merged")
        last = merged["segments"][-1]
        for i, c in enumerate(st["segments"][-1]["delivered"]):
            if c is not None:
                last["delivered"][i] = c
    if merged is None:
        raise InputError("no worker states to merge")
    return merged
