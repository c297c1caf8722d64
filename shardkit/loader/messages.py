"""The plain messages between ShardLoader and its worker processes.

Small picklable records over one duplex pipe per worker: the pixels never travel, they are in the
ring (``ring.py``); a batch is announced by its slot. Every epoch start carries a generation
number and every reply echoes it, so replies of an abandoned iteration (break, a new ``iter()``)
are recognised and dropped.

A ``Start`` may name the generation and epoch to fill *ahead*: once its part of this epoch is done,
the worker fills that epoch's first batches into the slots given back meanwhile and keeps their
messages. A later ``Start`` of exactly that generation (which the loader sends only when the
epoch is the one it would start, from its beginning) sends them; any other discards them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Batch", "End", "Free", "Replace", "Share", "Start", "Stop"]


# --- loader -> worker ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """Fill this worker's part of ``epoch`` (abandoning any earlier generation); every slot is
    free, except those of batches filled ahead for this very generation. ``resume``: the
    worker's loaded state as plain data (``EpochState.to_dict``). ``ahead``: (generation, epoch)
    to fill ahead once this part is done (None: wait for the next ``Start``)."""

    gen: int
    epoch: int
    resume: dict | None = None
    ahead: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Free:
    """Slot ``slot`` may be written again."""

    slot: int


@dataclass(frozen=True, slots=True)
class Replace:
    """Slot ``slot`` was kept by the caller: its memory is theirs now. A descriptor of fresh
    memory for the slot follows on the pipe (``multiprocessing.reduction.send_handle``); the slot
    is free."""

    slot: int


@dataclass(frozen=True, slots=True)
class Share:
    """``decode_on="auto"``: decode ``fraction`` of the batches in the worker, hand over the
    rest as stored bytes."""

    fraction: float


@dataclass(frozen=True, slots=True)
class Stop:
    """Exit."""


# --- worker -> loader ----------------------------------------------------------------------------


@dataclass(slots=True)
class Batch:
    """``count`` images of ``height`` x ``width`` are in ``slot`` of ``worker``; ``consumed``:
    the records the batch took from the worker's stream (``count`` plus the samples skipped
    under ``on_error="skip"``: what a checkpoint must count); ``notes``: the warnings raised
    while filling it (skipped samples), re-issued in the caller."""

    gen: int
    worker: int
    slot: int
    count: int
    height: int
    width: int
    labels: list[int]
    keys: list[str]
    notes: list[str] = field(default_factory=list)
    consumed: int = 0
    # decode_on="device": the slot holds the samples' stored bytes, sample i at
    # [offsets[i], offsets[i + 1]) of a ``capacity``-byte slot, with its crop box and shard
    offsets: list[int] | None = None
    boxes: list | None = None
    shards: list[str] | None = None
    capacity: int = 0
    fill_s: float = 0.0  # the worker's time filling the slot (decode_on="auto" balances on it)
    # the dataset's fields= (decoded: str, objects, arrays), one list per field, a value per image
    fields: list[list] | None = None
    epoch: int = -1  # the epoch it was filled for (the consumer checks it against its own)
    # the dataset's sample_transform: its outputs batched in the worker (fill.batch_samples)
    samples: object = None
    # each sample's source in a mixture (``Record.source``), where the batch reports it
    sources: list[int] | None = None
    # where the worker's time went for this batch (``stats.WORKER_PARTS``: read, decode, ...)
    times: tuple | None = None


@dataclass(slots=True)
class End:
    """The worker's part of generation ``gen`` is done; ``error``: why it stopped early, and
    ``cause`` its cause (a transform's own exception: a pickled exception loses its chain)."""

    gen: int
    worker: int
    error: BaseException | None = None
    cause: BaseException | None = None
