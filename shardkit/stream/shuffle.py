"""The two levels of shuffling: a per-epoch shard permutation and a bounded sample buffer.

Shards are read sequentially (that is what makes them fast), so the randomness comes from:

1. ``shard_order``: the shard list permuted from (seed, epoch), identical on every rank, before
   the epoch is split. Which worker reads which shard therefore changes every epoch.
2. ``shuffle_buffer``: a reservoir of ``size`` samples per worker; each incoming sample replaces a
   uniformly chosen resident, which is emitted. A sample stays in the buffer a geometric number of
   steps with mean ``size``, so it moves about ``size`` positions from where it was packed (see
   benchmarks/bench_stream.py for measured displacement). Memory per worker is ``size`` stored
   samples, encoded: about 13 MB for LFW-sized JPEGs (~13 KB) at the default 1000, ~110 MB for
   ImageNet-sized ones (~110 KB).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ..errors import InputError, check_choice, check_int

__all__ = [
    "BufferPoint",
    "DEFAULT_BUFFER_SIZE",
    "EQUALIZE_MODES",
    "Order",
    "buffer_point",
    "buffer_rng",
    "draw_block",
    "rng_for",
    "shard_order",
    "shuffle_buffer",
]

T = TypeVar("T")

#: Samples held per worker. 1000 keeps encoded memory near 13 MB (LFW) to 110 MB (ImageNet) per
#: worker while moving samples ~1000 positions, i.e. across ~15 batches of 64.
DEFAULT_BUFFER_SIZE = 1000

#: The most samples a buffer may hold: each is held in memory, per worker; past this a value is
#: a slip (``2**63`` failed only at iteration, in numpy), not a buffer any machine holds.
MAX_BUFFER_SIZE = 2**31 - 1

#: How ranks are made equal for DDP (see ``shardkit.stream.dataset``): pad, drop, or none.
EQUALIZE_MODES = ("pad", "drop", "none")


@dataclass(frozen=True)
class Order:
    """How an epoch is ordered and cut; with the dataset's seed, the order half of a checkpoint's
    facts (a state saved under one ``Order`` is refused under another).

    ``shuffle``: permute the shards per epoch and pass samples through a buffer of
    ``buffer_size`` per worker (0 or 1: no buffer; default 1000). Without a shuffle nothing is
    buffered, so another ``buffer_size`` than the default is refused there rather than kept
    unused in the checkpoint (the default is what ``Order(shuffle=False)`` records).
    ``equalize``: "pad" (every rank yields ceil(N / world_size), like DistributedSampler), "drop"
    (floor) or "none" (parts differ by at most one; every sample once). ``Order.sequential()``:
    every sample once, in packed order (evaluation).
    """

    shuffle: bool = True
    buffer_size: int = DEFAULT_BUFFER_SIZE
    equalize: str = "pad"

    def __post_init__(self) -> None:
        if not isinstance(self.shuffle, (bool, np.bool_)):
            raise InputError(f"shuffle={self.shuffle!r} must be True or False")
        object.__setattr__(self, "shuffle", bool(self.shuffle))
        hint = " (0 or 1: no buffer)"
        b = check_int("buffer_size", self.buffer_size, 0, MAX_BUFFER_SIZE, hint=hint)
        if b != DEFAULT_BUFFER_SIZE and not self.shuffle:
            raise InputError(
                f"Order(shuffle=False, buffer_size={b!r}): without a shuffle nothing is buffered; "
                "leave buffer_size out (or give shuffle=True)"
            )
        object.__setattr__(self, "buffer_size", b)
        check_choice("equalize", self.equalize, EQUALIZE_MODES)

    def __repr__(self) -> str:  # what differs from the defaults: a spelling to copy
        parts = [
            f"{name}={getattr(self, name)!r}"
            for name, default in (("shuffle", True), ("buffer_size", DEFAULT_BUFFER_SIZE),
                                  ("equalize", "pad"))
            if getattr(self, name) != default
        ]  # fmt: skip
        return f"Order({', '.join(parts)})"

    @classmethod
    def sequential(cls) -> Order:
        """Every sample once, in packed order, ranks differing by at most one: evaluation."""
        return cls(shuffle=False, equalize="none")


# Domain tags keep the shard permutation and the per-worker buffers on unrelated streams even
# when (rank, worker) happen to equal other seed words.
_SHARDS, _BUFFER = 0x5A4D, 0xB0FF

_DRAW_BLOCK = 4096  # random indices drawn per numpy call: one call per sample would dominate


def rng_for(seed: int, epoch: int, *words: int) -> np.random.Generator:
    """A numpy Generator determined by (seed, epoch, *words) only: same inputs, same stream."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, *words])))


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Indices of the shards in the order this epoch reads them: identical on every rank."""
    if not shuffle:
        return np.arange(num_shards, dtype=np.int64)
    return rng_for(seed, epoch, _SHARDS).permutation(num_shards).astype(np.int64)


def buffer_rng(
    seed: int, epoch: int, rank: int, worker: int, segment: int = 0
) -> np.random.Generator:
    """The buffer's generator: distinct per (rank, worker) so workers do not mirror each other.

    ``segment`` > 0 numbers the worlds an epoch was re-split over after an elastic resume
    (shardkit.stream.planner); segment 0 is the ordinary epoch.
    """
    if segment:
        return rng_for(seed, epoch, _BUFFER, rank, worker, segment)
    return rng_for(seed, epoch, _BUFFER, rank, worker)


def draw_block(rng: np.random.Generator, size: int) -> np.ndarray:
    """The next ``_DRAW_BLOCK`` slot choices; shuffle_buffer and its index-only replay
    (``buffer_point``) both draw through here, so they consume the generator identically."""
    return rng.integers(0, size, _DRAW_BLOCK)


def shuffle_buffer(
    items: Iterable[T], size: int, rng: np.random.Generator, *, resume: tuple[int, int] = (0, 0)
) -> Iterator[T]:
    """Yield ``items`` locally shuffled through a buffer of at most ``size`` items.

    ``size`` <= 1 passes items through unchanged. The first item comes out after ``size`` have
    been read; at the end the remaining buffer is emitted in a random order. Every item is emitted
    exactly once. The choices depend only on ``rng`` and on positions, never on the items, which
    is what lets ``buffer_point`` recompute a mid-epoch buffer from indices alone.

    ``resume=(steps, flushed)`` continues a buffer that had made ``steps`` replacements and
    emitted ``flushed`` items of its final flush: ``items`` then starts with the buffer's
    residents in slot order (placeholders where the flush already emitted), followed by the
    unread items.
    """
    it = iter(items)
    if size <= 1:
        yield from it
        return
    steps, flushed = resume
    buf = list(itertools.islice(it, size))
    if len(buf) == size:
        draws: Iterator[int] = _skip_draws(rng, size, steps)
        for item in it:
            j = next(draws, -1)
            if j < 0:
                draws = iter(draw_block(rng, size).tolist())
                j = next(draws)
            out = buf[j]
            buf[j] = item
            yield out
    for j in rng.permutation(len(buf)).tolist()[flushed:]:
        yield buf[j]


def _skip_draws(rng: np.random.Generator, size: int, steps: int) -> Iterator[int]:
    """Advance ``rng`` past the draws of ``steps`` replacements; the rest of the current block."""
    full, part = divmod(steps, _DRAW_BLOCK)
    for _ in range(full):
        draw_block(rng, size)
    return iter(draw_block(rng, size)[part:].tolist()) if part else iter(())


# --- the buffer replayed on indices (checkpoints) -------------------------------------------


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
