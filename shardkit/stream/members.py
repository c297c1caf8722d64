"""The samples a ``Source`` may draw, held shard by shard: a split as its val bits, not positions.

A source's *members* are positions in its shards laid end to end, ascending. An array of them
costs 8 bytes a member in every process that builds the dataset: 7.2 bytes a sample of the whole
dataset for the train side of a 10% split, ~2.9 GB per process at LAION-400M. Here they are held
as what they are made of, and each shard's members are produced when an epoch's draw reaches the
shard:

- ``AllMembers``: every sample (no split, no subset): the shard counts alone.
- ``SideMembers``: one side of a split: the val/train bits (``np.packbits`` of every sample's
  side, 1/8 byte a sample of the dataset) and each shard's count of members.
- ``ListedMembers``: a subset: its positions (8 bytes a drawn member).
- ``ShardSideMembers``: one side of a split whose per-shard counts came from the dataset's
  key file (``stream.lookup.split_counts``): a shard's sides are read from its own index only
  when an epoch's draw first reaches it (``load(i)``), so a rank, and each of its workers,
  reads the index heads of the shards it reads, not every shard's.
- ``KeyedMembers``: a subset by keys whose shards the dataset's key file named
  (``stream.lookup.key_shards``): each shard's wanted keys, their positions found in the
  shard's own index only when an epoch's draw first reaches it (``find(i, keys)``).
- ``RankedMembers``: a fraction subset of such a side: the drawn ranks into it (8 bytes a
  drawn member), a shard's positions made when it is reached.

Each answers ``len``, ``shard(i)`` (shard i's members, int64 positions, ascending), ``take``
(the members at given ranks), ``isin`` and ``chunks`` (the members shard by shard, for the
checkpoint digest); ``array()`` is all of them at once, for small sets and tests. ``nbytes``
is what one holds: what the construction memory law counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

__all__ = [
    "Members",
    "AllMembers",
    "SideMembers",
    "ListedMembers",
    "ShardSideMembers",
    "KeyedMembers",
    "RankedMembers",
]


class Members:
    """Positions a source draws from, produced shard by shard (see the module docstring)."""

    def __init__(self, counts: np.ndarray, per_shard: np.ndarray):
        counts = np.asarray(counts, dtype=np.int64)
        #: starts[i]: the first position of shard i; starts[-1]: the source's samples.
        self.starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        #: members[i]: the members of shard i; ends: their running total.
        self.per_shard = np.asarray(per_shard, dtype=np.int64)
        self.ends = np.cumsum(self.per_shard)
        self._len = int(self.ends[-1]) if len(self.ends) else 0

    def __len__(self) -> int:
        return self._len

    def shard(self, i: int) -> np.ndarray:
        """Shard ``i``'s members: int64 positions, ascending."""
        raise NotImplementedError

    def chunks(self) -> Iterator[np.ndarray]:
        """The members shard by shard, in stored order (``array()`` without holding it)."""
        for i in range(len(self.per_shard)):
            if self.per_shard[i]:
                yield self.shard(i)

    def array(self) -> np.ndarray:
        """Every member at once (8 bytes each): for small sets and tests."""
        parts = list(self.chunks())
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def take(self, ranks: np.ndarray) -> np.ndarray:
        """The members at ``ranks`` (ascending ranks into the members): their positions,
        ascending; each shard that holds one is expanded once."""
        ranks = np.asarray(ranks, dtype=np.int64)
        out = np.empty(len(ranks), dtype=np.int64)
        shard_of = np.searchsorted(self.ends, ranks, side="right")
        cuts = np.flatnonzero(np.diff(shard_of)) + 1
        for a, b in zip(
            np.concatenate(([0], cuts)).tolist(),
            np.concatenate((cuts, [len(ranks)])).tolist(),
            strict=True,
        ):
            if a == b:
                continue
            i = int(shard_of[a])
            first = int(self.ends[i] - self.per_shard[i])
            out[a:b] = self.shard(i)[ranks[a:b] - first]
        return out

    def isin(self, positions: np.ndarray) -> np.ndarray:
        """Which of ``positions`` are members."""
        raise NotImplementedError

    def _isin_by_shard(self, positions: np.ndarray) -> np.ndarray:
        """``isin`` through ``shard(i)`` of only the shards ``positions`` fall in: for members
        read a shard at a time when first needed (a keyed split's, a key subset's)."""
        p = np.asarray(positions, dtype=np.int64)
        inside = (p >= 0) & (p < self.starts[-1])
        out = np.zeros(len(p), dtype=bool)
        shard_of = np.searchsorted(self.starts, p, side="right") - 1
        for i in np.unique(shard_of[inside]).tolist():
            at = np.flatnonzero(inside & (shard_of == i))
            out[at] = np.isin(p[at], self.shard(i))
        return out

    @property
    def nbytes(self) -> int:
        """The bytes this holds (its arrays'): what the construction memory law counts."""
        return self.starts.nbytes + self.per_shard.nbytes + self.ends.nbytes


class AllMembers(Members):
    """Every sample of the shards: nothing held beyond the counts."""

    def __init__(self, counts: np.ndarray):
        super().__init__(counts, counts)

    def shard(self, i: int) -> np.ndarray:
        return np.arange(self.starts[i], self.starts[i + 1], dtype=np.int64)

    def take(self, ranks: np.ndarray) -> np.ndarray:
        return np.array(ranks, dtype=np.int64)  # every sample: a rank is its position

    def isin(self, positions: np.ndarray) -> np.ndarray:
        p = np.asarray(positions)
        return (p >= 0) & (p < self.starts[-1])


class SideMembers(Members):
    """One side of a split: ``val_bits`` (``np.packbits`` of every sample's "is val", most
    significant bit first) and ``val`` (True: the val side, False: train)."""

    def __init__(self, counts: np.ndarray, val_bits: np.ndarray, val_per_shard, val: bool):
        counts = np.asarray(counts, dtype=np.int64)
        val_per_shard = np.asarray(val_per_shard, dtype=np.int64)
        super().__init__(counts, val_per_shard if val else counts - val_per_shard)
        self.val_bits, self.val = val_bits, bool(val)

    def sides(self, lo: int, hi: int) -> np.ndarray:
        """The "is val" bit (uint8 0/1) of positions [lo, hi)."""
        at = lo & 7
        return np.unpackbits(self.val_bits[lo >> 3 : (hi + 7) >> 3])[at : at + hi - lo]

    def shard(self, i: int) -> np.ndarray:
        lo, hi = int(self.starts[i]), int(self.starts[i + 1])
        bits = self.sides(lo, hi)
        return (bits if self.val else bits == 0).nonzero()[0].astype(np.int64, copy=False) + lo

    def isin(self, positions: np.ndarray) -> np.ndarray:
        p = np.asarray(positions, dtype=np.int64)
        inside = (p >= 0) & (p < self.starts[-1])
        q = np.where(inside, p, 0)
        bit = (self.val_bits[q >> 3] >> (7 - (q & 7))) & 1
        return inside & (bit == (1 if self.val else 0))

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.val_bits.nbytes


class ListedMembers(Members):
    """Members listed one by one (a subset's): ``positions``, int64, ascending."""

    def __init__(self, counts: np.ndarray, positions: np.ndarray):
        counts = np.asarray(counts, dtype=np.int64)
        self.positions = np.asarray(positions, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(counts)))
        bounds = np.searchsorted(self.positions, starts)
        super().__init__(counts, np.diff(bounds))
        self._bounds = bounds

    def shard(self, i: int) -> np.ndarray:
        return self.positions[self._bounds[i] : self._bounds[i + 1]]

    def array(self) -> np.ndarray:
        return self.positions

    def take(self, ranks: np.ndarray) -> np.ndarray:
        return self.positions[np.asarray(ranks, dtype=np.int64)]

    def isin(self, positions: np.ndarray) -> np.ndarray:
        return np.isin(positions, self.positions)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.positions.nbytes + self._bounds.nbytes


class ShardSideMembers(Members):
    """One side of a split (``val``: True for "val") with each shard's count of val samples
    given (``val_per_shard``: the key file's) and each shard's "is val" mask read when first
    needed (``load(i)``: shard i's, bool, one a sample; it checks the count). The masks read
    are held packed (1/8 byte a sample of the shards reached). ``loaded``: the shards read."""

    def __init__(
        self, counts: np.ndarray, val_per_shard, val: bool, load: Callable[[int], np.ndarray]
    ):
        counts = np.asarray(counts, dtype=np.int64)
        val_per_shard = np.asarray(val_per_shard, dtype=np.int64)
        super().__init__(counts, val_per_shard if val else counts - val_per_shard)
        self.val, self.load = bool(val), load
        self._bits: dict[int, np.ndarray] = {}

    @property
    def loaded(self) -> list[int]:
        return sorted(self._bits)

    def bits(self, i: int) -> np.ndarray:
        """Shard ``i``'s "is val" bits, ``np.packbits`` of its samples' (read once)."""
        got = self._bits.get(i)
        if got is None:
            got = self._bits[i] = np.packbits(self.load(i))
        return got

    def shard(self, i: int) -> np.ndarray:
        n = int(self.starts[i + 1] - self.starts[i])
        if not self.per_shard[i]:
            return np.empty(0, np.int64)
        bits = np.unpackbits(self.bits(i))[:n]
        got = (bits if self.val else bits == 0).nonzero()[0].astype(np.int64, copy=False)
        return got + self.starts[i]

    def isin(self, positions: np.ndarray) -> np.ndarray:
        return self._isin_by_shard(positions)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(b.nbytes for b in self._bits.values())


class RankedMembers(Members):
    """The members of ``base`` at ``ranks`` (ascending): a fraction subset of a lazily read
    side, whose positions are made a shard at a time, when it is reached."""

    def __init__(self, base: Members, ranks: np.ndarray):
        self.base = base
        self.ranks = np.asarray(ranks, dtype=np.int64)
        bounds = np.searchsorted(self.ranks, np.concatenate(([0], base.ends)))
        super().__init__(np.diff(base.starts), np.diff(bounds))
        self._bounds = bounds

    def shard(self, i: int) -> np.ndarray:
        mine = self.ranks[self._bounds[i] : self._bounds[i + 1]]
        if not len(mine):
            return np.empty(0, np.int64)
        first = int(self.base.ends[i] - self.base.per_shard[i])
        return self.base.shard(i)[mine - first]

    def isin(self, positions: np.ndarray) -> np.ndarray:
        p = np.asarray(positions, dtype=np.int64)
        shard_of = np.searchsorted(self.starts, p, side="right") - 1
        out = np.zeros(len(p), dtype=bool)
        for i in np.unique(shard_of).tolist():
            if 0 <= i < len(self.per_shard):
                at = np.flatnonzero(shard_of == i)
                out[at] = np.isin(p[at], self.shard(i))
        return out

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.ranks.nbytes + self._bounds.nbytes + self.base.nbytes


class KeyedMembers(Members):
    """A subset by keys: ``wanted[i]``, the keys the dataset's key file puts in shard i (their
    count is the shard's members), found in the shard's own index when first needed
    (``find(i, keys)``: their positions in the shard, ascending; a key it does not hold is an
    error there). The positions found are held (8 bytes a member of the shards reached)."""

    def __init__(
        self,
        counts: np.ndarray,
        wanted: dict[int, list[str]],
        find: Callable[[int, list[str]], np.ndarray],
    ):
        counts = np.asarray(counts, dtype=np.int64)
        per_shard = np.zeros(len(counts), dtype=np.int64)
        for i, keys in wanted.items():
            per_shard[i] = len(keys)
        super().__init__(counts, per_shard)
        self.wanted, self.find = wanted, find
        self._at: dict[int, np.ndarray] = {}

    @property
    def loaded(self) -> list[int]:
        return sorted(self._at)

    def narrowed(self, keep: Callable[[list[str]], list[str]]) -> KeyedMembers:
        """The same subset with each shard's keys narrowed by ``keep`` (a split's side)."""
        wanted = {i: kept for i, keys in self.wanted.items() if (kept := keep(keys))}
        return KeyedMembers(np.diff(self.starts), wanted, self.find)

    def shard(self, i: int) -> np.ndarray:
        got = self._at.get(i)
        if got is None:
            keys = self.wanted.get(i)
            if not keys:
                return np.empty(0, np.int64)
            found = np.asarray(self.find(i, keys), dtype=np.int64)
            got = self._at[i] = found + self.starts[i]
        return got

    def isin(self, positions: np.ndarray) -> np.ndarray:
        return self._isin_by_shard(positions)

    @property
    def nbytes(self) -> int:
        keys = sum(len(k) + 56 for ks in self.wanted.values() for k in ks)
        return super().nbytes + keys + sum(a.nbytes for a in self._at.values())
