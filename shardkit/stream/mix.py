"""Choosing what an epoch reads: weighted mixtures of sources, subsets, splits and epoch size.

A plain ``ShardDataset`` reads every sample of its shards once per epoch. With ``Source`` objects
(``Source(path, subset=...)``, ``Source(path, split="val")``, several weighted ones) or
``epoch_size=`` the epoch becomes a *mixed stream* of exactly
``epoch_size`` positions, a pure function of (seed, epoch), the same on every rank:

1. Shares: source i gets ``n_i`` positions, the largest-remainder apportionment of the epoch size
   by weight (weights omitted: by source size), so the counts are exact and sum to the epoch.
2. Draws: source i's ``n_i`` samples are whole passes over its (subset of) samples plus, for the
   remainder, a draw without replacement; each pass follows a fresh shard permutation and the
   draw is fresh each epoch. A source smaller than its share repeats: each sample ``n_i // m_i``
   or one more times (``m_i``: its samples).
3. Interleave: sample k of source i is placed at time ``(k + 1/2) / n_i`` and the epoch is the
   sources' samples sorted by time (stratified): any window of the stream holds each source's
   share within about one sample, so every batch follows the weights, not only the epoch.

Ranks and workers cut the mixed stream into contiguous parts exactly as a plain stream
(``partition.plan_epoch``; the stream is ``partition.MixLayout``, planned by
``planner.worker_plan`` as every epoch is), so ``len``, ``equalize`` and ``batch_size`` mean what
they always do. A worker reads each source's positions of its part sequentially (a reader per
source), passes each source through its own shuffle buffer and interleaves them by the stream's
source sequence; the buffers never mix sources, so the per-batch proportions survive shuffling.
Checkpoints reuse the plain states (``stream.resume``): a worker's delivered count splits into
per-source counts by the source sequence, and each source's buffer is recomputed from positions
alone.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..errors import InputError, ShardFormatError
from ..formats import FORMATS
from ..formats.key_file import shards_digest
from ..formats.sample_index import SPLIT_SALT, ShardSides, key_hashes
from ..records import Record, ShardInfo
from .members import KeyedMembers, ListedMembers, Members, ShardSideMembers
from .partition import EpochLayout, MixLayout, PlanPiece, sample_counts
from .planner import MixPlan, arrange
from .resume import Later
from .shuffle import Order, rng_for, shuffle_buffer
from .stages import check_labels, manifest_unchanged, read_batches
from .storage import Storage

__all__ = [
    "LABEL_MODES",
    "SPLITS",
    "Source",
    "MixedSource",
    "MixLayout",
    "apportion",
    "SPLIT_SALT",
    "key_hashes",
    "split_members",
    "missing_keys",
    "subset_members",
    "subset_ranks",
    "mix_records",
]

LABEL_MODES = ("keep", "union")
SPLITS = ("train", "val")

# Domain tag of the subset draw (``stream.partition`` has the draws' and the buffers'): they
# never share a random stream.
_SUBSET = 0x5B5E


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture: ``ShardDataset([Source("a/", weight=0.7), Source(...)])``.

    ``path``: anything ``ShardDataset`` takes as a source (directory, manifest, glob, list, URL).
    ``weight``: its share of every epoch (relative; all sources give one or none does, then
    shares follow source sizes). ``subset``: a fraction in (0, 1] of its samples, drawn once
    from ``seed`` (the same samples every epoch), or a list of keys. ``split``: "train" or
    "val", by a hash of each key alone (``split_members``): the same for every seed, after a
    re-pack and after the dataset grows; about ``val_fraction`` of the samples are "val"
    (default 0.1; another value without ``split=`` is refused, as it would change nothing).
    ``storage_options``: fsspec options for URLs. ``fields``: the dataset's ``fields=`` this
    source carries (None: all of them, a sample lacking one is an error); one it leaves out is
    None in its samples, through ``ShardLoader`` too: a captioned set mixes with a classification
    set (``Source("cls/", fields=())`` beside ``Source("clip/")`` under ``fields=("txt",)``).
    """

    path: str | os.PathLike | Sequence[str | os.PathLike]
    weight: float | None = None
    subset: float | Sequence[str] | None = None
    split: str | None = None
    val_fraction: float = 0.1
    storage_options: dict | None = None
    fields: Sequence[str] | None = None

    def __post_init__(self):
        self._check_where()
        f = self.fields
        if f is not None:
            if isinstance(f, str) or not all(isinstance(n, str) for n in f):
                raise InputError(
                    f"{self.name}: fields={f!r}: give a list of field names (or None: all)"
                )
            object.__setattr__(self, "fields", tuple(n.lower() for n in f))
        # Numbers are stored as Python floats: numpy scalars (np.float32 ...) are numbers too,
        # and the checkpoint facts are JSON.
        w = self.weight
        if w is not None:
            if not is_number(w) or not np.isfinite(w) or w <= 0:
                raise InputError(f"{self.name}: weight={w!r} must be a finite number > 0")
            object.__setattr__(self, "weight", float(w))
        if self.split is not None and self.split not in SPLITS:
            raise InputError(f'{self.name}: split={self.split!r}: use "train" or "val"')
        f = self.val_fraction
        if not is_number(f) or not 0 < f < 1:
            raise InputError(f"{self.name}: val_fraction={f!r} must be a number in (0, 1)")
        if f != 0.1 and self.split is None:
            raise InputError(
                f'{self.name}: val_fraction={f!r} sizes a split: give split="train" or '
                '"val" too, or leave val_fraction out'
            )
        object.__setattr__(self, "val_fraction", float(f))
        s = self.subset
        if isinstance(s, (str, bytes, bool, np.bool_)):
            raise InputError(f"{self.name}: subset={s!r}: give a fraction or a list of keys")
        if is_number(s):
            if not 0 < s <= 1:
                raise InputError(f"{self.name}: subset={s!r}: a fraction must be in (0, 1]")
            object.__setattr__(self, "subset", float(s))

    def _check_where(self) -> None:
        """The path and its fsspec options have the types they are read as."""
        p = self.path
        if isinstance(p, Sequence) and any(isinstance(x, Source) for x in p):
            raise InputError(
                "Source() takes paths, not Source()s: give a list of Source()s to ShardDataset, "
                "with subset= and split= on each Source"
            )
        if not isinstance(p, (str, os.PathLike)) and not (
            isinstance(p, Sequence) and all(isinstance(x, (str, os.PathLike)) for x in p)
        ):
            raise InputError(
                f"Source({p!r}): give a directory, manifest, glob, URL or a list of shard paths"
            )
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise InputError(
                f"{self.name}: storage_options={self.storage_options!r}: give a dict of fsspec "
                "options (or None)"
            )

    @property
    def name(self) -> str:
        p = self.path
        return os.fspath(p) if isinstance(p, (str, os.PathLike)) else f"[{len(p)} shards]"


@dataclass
class MixedSource:
    """A resolved ``Source``: its shards (counted), format, storage, the samples it may draw
    (``members``: positions in its shards laid end to end, ascending, held shard by shard:
    ``stream.members``) and its label table."""

    source: Source
    shards: Sequence[ShardInfo]  # a ShardTable: shards[i] made when read
    format: str
    storage: Storage
    classes: tuple[str, ...] | None
    members: Members
    offset: int = 0  # first global sample id (sources' shards laid end to end)
    labels: np.ndarray | None = None  # stored label -> dataset label ("union"), None: kept
    #: (manifest path, its identity when the dataset was built): a re-pack under the reader's
    #: feet is refused (``stages.manifest_unchanged``); (None, None) without a local manifest.
    manifest: tuple[str | None, tuple | None] = (None, None)
    #: With ``split=``: which samples the index's split hashes put in "val" (``np.packbits``),
    #: so each sample read is checked against its own key's hash (``sides``).
    val_bits: np.ndarray | None = None
    #: Shards whose index the split (or a key subset) refused (damaged, stale, hashes not its
    #: keys'): streamed. A ``side``'s: filled as its shards are reached.
    unindexed: frozenset[str] | set[str] = frozenset()
    #: With ``split=`` counted by the key file: the side, whose shards' bits are read when
    #: reached (``members.ShardSideMembers``); ``val_bits`` is then None.
    side: ShardSideMembers | None = None

    @property
    def size(self) -> int:
        return int(sample_counts(self.shards).sum())

    def sides(self) -> Callable[[int], ShardSides] | None:
        """With ``split=``: shard i's ``ShardSides``, what its reader checks each sample's own
        key against (``read_slices``). Every sample read is checked, whatever vouched for the
        index the bits came from: a manifest's ``columns_sha256`` or ``index_sha256`` may have
        been computed again from an edited file, and only the keys are the shard's."""
        threshold = math.ceil(self.source.val_fraction * 2**64)
        if self.side is not None:
            side = self.side
            return lambda i: ShardSides(side.bits(i), 0, threshold)
        if self.val_bits is None:
            return None
        bits = self.val_bits
        starts = np.concatenate(([0], np.cumsum(sample_counts(self.shards)))).tolist()
        return lambda i: ShardSides(bits, starts[i], threshold)

    def layout(self) -> EpochLayout:
        """The source's shards in stored order: what turns positions into slices."""
        return EpochLayout(sample_counts(self.shards), 0, 0, Order.sequential())


def is_number(value) -> bool:
    """A real number, numpy scalars included; not a bool (``True`` is no weight or fraction)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def check_weights(weights: Sequence[float], names: Sequence[str]) -> None:
    """Weights whose sum is a finite number: each finite one may still overflow the sum."""
    with np.errstate(over="ignore"):
        total = np.sum(np.asarray(weights, dtype=np.float64))
    if not np.isfinite(total):
        raise InputError(
            f"the weights of {', '.join(names)} sum to more than a float holds ({weights!r}); "
            "weights are relative: scale them down (e.g. 0.7 and 0.3)"
        )


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Largest-remainder shares of ``total`` by ``weights``: exact ints summing to ``total``
    (ties go to the earlier source, so the result is deterministic)."""
    w = np.asarray(weights, dtype=np.float64)
    ideal = total * (w / w.sum())  # normalised first: a huge weight cannot overflow
    base = np.floor(ideal).astype(np.int64)
    rest = total - int(base.sum())
    order = np.argsort(-(ideal - base), kind="stable")
    base[order[:rest]] += 1
    return base.tolist()


def split_members(keys: Sequence[str], split: str, val_fraction: float) -> np.ndarray:
    """Positions of the ``split`` part, ascending: a key is "val" when its hash is below
    ``val_fraction * 2**64``, else "train". The side of a key depends on the key alone (not the
    seed, its position or the other keys), so a re-pack keeps every sample on its side and a
    grown dataset keeps every old one there; "val" holds about ``val_fraction`` of the keys
    (exactly the count of hashes under the threshold)."""
    from .indexes import split_positions

    return split_positions(key_hashes(keys), split, val_fraction)


def subset_ranks(members: Members, fraction: float, seed: int) -> np.ndarray:
    """The ranks into ``members`` a ``fraction`` subset draws, ascending: ``round(f * m)``, at
    least 1, seeded (the same every epoch)."""
    n = max(1, int(round(float(fraction) * len(members))))
    rng = rng_for(seed, 0, _SUBSET)
    return np.sort(rng.choice(len(members), size=n, replace=False))


def subset_members(
    members: Members, subset, seed: int, keys: Sequence[str] | None, where: str
) -> Members:
    """``members`` narrowed to ``subset``: a fraction (``round(f * m)``, at least 1, seeded) or a
    list of keys (every key must exist). The draw is of ranks into the members, which are
    ascending, so the positions are the members at the sorted ranks: only the shards a drawn
    member lies in are expanded."""
    if subset is None:
        return members
    counts = np.diff(members.starts)
    if isinstance(subset, (int, float)):
        return ListedMembers(counts, members.take(subset_ranks(members, subset, seed)))
    wanted = list(subset)
    at = {k: i for i, k in enumerate(keys or ())}
    missing = [k for k in wanted if k not in at]
    if missing:
        raise missing_keys(where, missing)
    chosen = np.unique(np.asarray([at[k] for k in wanted], dtype=np.int64))
    return ListedMembers(counts, chosen[members.isin(chosen)])


def missing_keys(where: str, missing: Sequence[str]) -> InputError:
    """The error of a subset naming keys the shards do not hold."""
    return InputError(
        f"{where}: subset names {len(missing)} key(s) the shards do not hold, e.g. "
        f"{missing[0]!r}; list keys as `shardkit ls` or with_keys=True show them"
    )


# --- one worker's records ----------------------------------------------------------------------


def mix_records(
    plan: MixPlan,
    sources: Sequence[MixedSource],
    *,
    fields: Sequence[str],
    order: Order,
) -> Iterator[Record]:
    """The records of ``plan``: each source read, label-mapped and shuffled on its own (through
    a buffer of ``order``'s size), then interleaved by the schedule."""
    streams = []
    for s, p in zip(sources, plan.sources, strict=True):
        path, identity = s.manifest
        unchanged = manifest_unchanged(path, identity) if identity is not None else None
        have = s.source.fields
        mine = [f for f in fields if have is None or f.lower() in have]
        # a source's records pass its stages a list at a time (as read: ``read_batches``) and
        # are laid end to end in C before its buffer: no generator resumed per record and stage
        lists: Iterable[list[Record]] = _read_pieces(p.pieces(), s, mine, unchanged)
        if len(mine) < len(fields):
            lists = _without(lists, [f.lower() for f in fields if f not in mine])
        if s.classes:
            lists = _labels_checked(lists, len(s.classes))
        if s.labels is not None:
            lists = _relabel(lists, s.labels)
        recs = arrange(itertools.chain.from_iterable(lists), p.arrangement, dropped=True)
        if order.shuffle and order.buffer_size > 1:
            recs = shuffle_buffer(recs, order.buffer_size, p.rng, resume=p.buffer)
        streams.append(recs)
    return interleave(streams, plan.schedule(), [s.source.name for s in sources])


def _read_pieces(
    pieces: Iterable[PlanPiece], s: MixedSource, fields: list[str], unchanged
) -> Iterator[list[Record]]:
    """The wanted records of a source's plan in lists (``read_batches``), read piece by piece
    as the plan makes them (each piece's slices and mask, then the next piece's: a worker
    never holds its whole part's). A split's: every sample read checked by its own key
    against its side (``s.sides``)."""
    sides = s.sides()
    for piece in pieces:
        yield from read_batches(
            piece.slices, s.shards, FORMATS[s.format], s.storage,
            fields=fields, unchanged=unchanged, keep=piece.keep,
            unindexed=s.unindexed, sides=sides,
        )  # fmt: skip


def _labels_checked(lists: Iterable[list[Record]], num_classes: int) -> Iterator[list[Record]]:
    """``check_labels`` a list at a time: the records before a bad label are handed out before
    its error, as one by one."""
    for got in lists:
        labels = [rec.label for rec in got]
        if labels and (min(labels) < -1 or max(labels) >= num_classes):
            bad = next(i for i, v in enumerate(labels) if not -1 <= v < num_classes)
            if bad:
                yield got[:bad]
            yield from check_labels(got[bad : bad + 1], num_classes)  # raises
        yield got


def _without(lists: Iterable[list[Record]], absent: list[str]) -> Iterator[list[Record]]:
    """The records of a source that carries none of ``absent``: those fields are None (a
    declared absence, decoded as None; a field merely missing from a sample is an error)."""
    none = dict.fromkeys(absent)
    for got in lists:
        for rec in got:
            rec.fields = {**(rec.fields or {}), **none}
        yield got


def _relabel(lists: Iterable[list[Record]], table: np.ndarray) -> Iterator[list[Record]]:
    lut = table.tolist()
    for got in lists:
        for rec in got:
            if rec.label >= 0:
                rec.label = lut[rec.label]
        yield got


def interleave(streams: list, schedule: Iterable[np.ndarray], names: Sequence[str]) -> Iterator:
    """Records of ``streams`` in the order ``schedule`` (arrays, a chunk at a time) names their
    stream, each marked with its stream's position (``Record.source``); every stream closes
    when this ends or is abandoned. One stream is its own order: its records come as they
    are (``source`` 0, as read), with no layer between it and the consumer (a split or a
    subset: the stream holds exactly the schedule's records, planned from the same positions,
    each of its slices checked for its count as read)."""
    if len(streams) == 1:
        return iter(streams[0])
    return _interleaved(streams, schedule, names)


def _interleaved(streams: list, schedule: Iterable[np.ndarray], names: Sequence[str]) -> Iterator:
    its = [iter(s) for s in streams]
    end = object()
    try:
        for chunk in schedule:
            for i in chunk.tolist():
                item = next(its[i], end)
                if item is end:
                    raise ShardFormatError(
                        f"{names[i]}: the source ended before its planned samples: its shards "
                        "are shorter than their manifest says; re-pack it or rebuild the manifest"
                    )
                item.source = i  # where it came from (``with_keys=("key", "source")``)
                yield item
    finally:
        for it in its:
            close = getattr(it, "close", None)
            if close is not None:
                close()


def mix_facts(sources: Sequence[MixedSource], shares: Sequence[int], labels: str) -> dict:
    """What a checkpoint must agree on beyond the shards: shares, subsets and label mapping.
    The digest of the members is ``Later`` (``resume.Facts``), worked out only at a checkpoint.
    A split counted by its key file (or a subset by keys found through it) reads a shard's
    index only when a reader reaches it, and a digest of every member's position needs them
    all; its digest is of what vouches for the
    members instead (``_vouched_digest``, kind ``k1:``), which reads no index. The other kind
    stays computable, so a state saved either way loads (``resume.Later``'s ``kinds``)."""
    args = (list(sources), list(shares), labels)
    positions = Later(partial(_mix_digest, *args))
    if not any(_vouched(s) for s in sources):
        return {"mix": positions, "epoch_size": int(sum(shares))}
    vouched = Later(partial(_vouched_digest, *args))
    if any(s.side is not None or isinstance(s.members, KeyedMembers) for s in sources):
        digest = Later(vouched.make, kinds={"": positions})
    else:  # every shard's index read already: the positions, as before, or a k1 state's
        digest = Later(positions.make, kinds={"k1": vouched})
    return {"mix": digest, "epoch_size": int(sum(shares))}


def _head(sources: Sequence[MixedSource], shares: Sequence[int], labels: str) -> bytes:
    return json.dumps(
        [
            [s.source.weight, len(s.members), int(n), s.size]
            for s, n in zip(sources, shares, strict=True)
        ]
        + [labels]
    ).encode()


def _mix_digest(sources: Sequence[MixedSource], shares: Sequence[int], labels: str) -> str:
    digest = hashlib.sha256(_head(sources, shares, labels))
    for s in sources:  # the members' int64 positions, a shard's at a time
        for chunk in s.members.chunks():
            digest.update(np.ascontiguousarray(chunk, dtype=np.int64).tobytes())
    return digest.hexdigest()[:32]


def _vouched(s: MixedSource) -> bool:
    """Whether what vouches for a source's members fixes them without reading them: a split's
    members are a pure function of its shards' keys (each key's hash alone puts it on a side),
    so of the shards' bytes, which the manifest names by sha256 with their sample counts, and
    of the split, its fraction and a fraction subset (drawn from the members' count by
    ``seed``, a fact of its own); a subset by keys is the positions of its keys in those
    shards (on its split's side). Neither a split nor a subset by keys, or a shard the
    manifest gives no sha256: False."""
    src = s.source
    by_keys = src.subset is not None and not isinstance(src.subset, float)
    if src.split is None and not by_keys:
        return False
    sha = s.shards.sha256 if hasattr(s.shards, "sha256") else [x.sha256 for x in s.shards]
    return all(isinstance(h, str) and len(h) == 64 for h in sha)


def _vouched_digest(sources: Sequence[MixedSource], shares: Sequence[int], labels: str) -> str:
    """The ``k1:`` digest: each split source by what vouches for its members (``_vouched``),
    reading no index; any other source by its members' positions (``_mix_digest``)."""
    digest = hashlib.sha256(b"k1" + _head(sources, shares, labels))
    for s in sources:
        if _vouched(s):
            src = s.source
            subset = src.subset
            if subset is not None and not isinstance(subset, float):  # keys: a set of them
                subset = sorted(set(subset))
            named = [s.format, src.split, src.val_fraction, subset, shards_digest(s.shards)]
            blob = json.dumps(named[:-1]).encode() + named[-1]
            digest.update(len(blob).to_bytes(8, "little") + blob)
            continue
        for chunk in s.members.chunks():
            digest.update(np.ascontiguousarray(chunk, dtype=np.int64).tobytes())
    return "k1:" + digest.hexdigest()[:32]
