"""The state format of mid-epoch checkpoints: what a state holds and what it must agree on.

An epoch's plan is a pure function of (seed, epoch, world) (``stream.planner``) and the shuffle
buffer's choices depend only on its generator and on positions, never on bytes
(``shuffle.shuffle_buffer``). So "worker w has delivered c samples" is enough to know, without
reading a byte, which samples it delivered, which sit in its buffer and where its reading stops:
``stream.planner`` works that out, and plans a resumed worker that reads the buffer's residents
and then the unread rest, seeking through the shards' offset index.

This module keeps the state alone. A state is plain data (ints, strings, lists, None): ``json``
and ``torch.save`` both round-trip it. It holds the epoch, the facts of the dataset it was saved
for (``dataset_facts``: its order and a fingerprint of its shards), and one *segment* per world
the epoch was played on: world size, DataLoader workers, samples delivered by each worker. DDP
ranks step together, so one rank's segment describes every rank. Loading it on another world
(elastic) freezes the segment: the samples the old world planned but did not deliver become the
stream of a new segment, split over the new world with the usual rules (``equalize``,
``batch_size``). A worker's live count (``Progress``) is written as a state; a DataLoader's deal
of batches (``round_robin``) and its workers' states (``merge_worker_states``) are counted here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..errors import InputError
from ..records import ShardTable
from .shuffle import Order

__all__ = [
    "STATE_FORMAT",
    "Segment",
    "EpochState",
    "Progress",
    "dataset_facts",
    "Facts",
    "Later",
    "round_robin",
    "count_delivered",
    "merge_worker_states",
]

STATE_FORMAT = "shardkit.resume/1"


class Later:
    """A fact worked out only when a state is saved, loaded or compared (``Facts``): ``make()``
    gives it. A mixture's digest of its members may read every shard's index; no epoch needs
    it, only a checkpoint does.

    ``kinds``: the same fact as other kinds of it give it (a ``Later`` each, by the prefix before
    ``:`` of the string they make, "" for none): a state saved with another kind of the fact
    is compared with that kind, worked out only then (``EpochState.from_dict``). A split's
    digest of what vouches for its members (``k1:``) beside the older digest of every position,
    so a state saved before or after either loads."""

    def __init__(self, make: Callable[[], object], kinds: Mapping[str, Later] | None = None):
        self.make, self.kinds = make, dict(kinds or {})


class Facts(Mapping):
    """A dataset's facts (``dataset_facts``, a mixture's ``mix`` and ``epoch_size``), the
    ``Later`` ones worked out once, when first read: a state is built with them (``EpochState
    .start``) at every plan, but they are read only where a state is saved or loaded
    (``EpochState.to_dict``, ``from_dict``). Pickled as it stands (a DataLoader worker works a
    ``Later`` out itself, where a checkpoint asks it for one)."""

    def __init__(self, facts: Mapping | None = None):
        self._facts: dict = {}
        self._kinds: dict[str, dict[str, Later]] = {}
        self.update(facts or {})

    def update(self, facts: Mapping) -> None:
        self._facts.update(facts)
        for key, value in facts.items():
            self._kinds[key] = dict(value.kinds) if isinstance(value, Later) else {}

    def __getitem__(self, key):
        value = self._facts[key]
        if isinstance(value, Later):
            value = self._facts[key] = value.make()
        return value

    def __iter__(self) -> Iterator:
        return iter(self._facts)

    def __len__(self) -> int:
        return len(self._facts)

    def other_kind(self, key, kind: str):
        """Fact ``key`` as its ``kind`` gives it (``Later.kinds``, worked out once), or None."""
        kinds = self._kinds.get(key, {})
        value = kinds.get(kind)
        if isinstance(value, Later):
            value = kinds[kind] = value.make()
        return value


def _kind(value) -> str | None:
    """A fact's kind: the prefix before ``:`` of a string ("" for none); None: not a string."""
    if not isinstance(value, str):
        return None
    head, colon, _ = value.partition(":")
    return head if colon else ""


def _agrees(facts: Mapping, key, saved, value) -> bool:
    """A saved fact is this dataset's: equal, or equal to the fact as its own kind gives it."""
    if saved == value:
        return True
    kind = _kind(saved)
    if kind is None or kind == _kind(value) or not isinstance(facts, Facts):
        return False
    other = facts.other_kind(key, kind)
    return other is not None and other == saved


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
            if not _agrees(facts, key, saved.get(key), value):
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
    order: Order,
) -> dict:
    """What a state must agree on with the dataset it is loaded into: the ``Order`` with the
    seed, and the shards.

    The fingerprint covers shard file names (not directories: a dataset moved or mounted
    elsewhere still resumes) and their sample counts, in order.
    """
    ints = counts.tolist() if isinstance(counts, np.ndarray) else [int(c) for c in counts]
    blob = json.dumps([shard_format, _file_names(urls), ints]).encode()
    return {
        "shards": len(urls),
        "samples": sum(ints),
        "seed": int(seed),
        "shuffle": bool(order.shuffle),
        "buffer_size": int(order.buffer_size),
        "equalize": order.equalize,
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


# --- one worker's live count ------------------------------------------------------------------


@dataclass
class Progress:
    """The live count of one worker's deliveries, from which ``state_dict`` is written."""

    state: EpochState
    worker: int  # the plan worker this process plays
    in_worker: bool  # a DataLoader worker: it knows only its own count
    delivered: int = 0
    part: int | None = None  # this worker's part on this rank (None: not known)
    finished: int = 0  # the count saved once the part is done (``partition.EpochLayout.finished``)

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


def count_delivered(records: Iterable, progress: Progress) -> Iterator:
    """Count what leaves the shuffle buffer (before decoding, so skipped samples count too)."""
    for rec in records:
        progress.delivered += 1
        yield rec


# --- a DataLoader's deal and its workers' states -------------------------------------------------


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
