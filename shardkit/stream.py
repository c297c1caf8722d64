"""The streaming pipeline as small stages, each testable alone on a list.

``ShardDataset.__iter__`` composes them in one place::

    plan_epoch -> read_slices -> shuffle_buffer -> decode_records -> apply_transforms

``plan_epoch`` is plain arithmetic on sample counts. The other stages are generators
``stage(iterable, ...) -> Iterator``. Hot loops stay lean: no per-sample dicts, logging or
re-planning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from .errors import SampleError, ShardFormatError, ShardkitError, StorageError
from .images import decode_image
from .records import Record, ShardSlice
from .storage import Storage

__all__ = [
    "EQUALIZE_MODES",
    "DECODE_MODES",
    "rank_samples",
    "plan_epoch",
    "read_slices",
    "check_labels",
    "decode_records",
    "apply_transforms",
]

EQUALIZE_MODES = ("pad", "drop", "none")
DECODE_MODES = ("pil", "tensor", "raw")


# --- planning ---------------------------------------------------------------------------------


def _rank_span(total: int, rank: int, world_size: int, equalize: str) -> tuple[int, int]:
    """[start, stop) of this rank's part of the epoch stream; stop may exceed ``total`` (pad)."""
    if equalize == "pad":
        per = -(-total // world_size)
        return rank * per, (rank + 1) * per
    if equalize == "drop":
        per = total // world_size
        return rank * per, (rank + 1) * per
    if equalize == "none":
        return rank * total // world_size, (rank + 1) * total // world_size
    raise ValueError(f"equalize must be one of {EQUALIZE_MODES}, got {equalize!r}")


def rank_samples(total: int, rank: int, world_size: int, equalize: str) -> int:
    """Samples rank ``rank`` yields per epoch: ``len(ds)``."""
    start, stop = _rank_span(total, rank, world_size, equalize)
    return stop - start


def plan_epoch(
    counts: Sequence[int] | np.ndarray,
    order: Sequence[int] | np.ndarray,
    *,
    rank: int,
    world_size: int,
    worker: int,
    num_workers: int,
    equalize: str = "pad",
) -> list[ShardSlice]:
    """The slices worker ``worker`` of rank ``rank`` reads this epoch, in reading order.

    The shards, taken in ``order``, are laid end to end as one stream of N samples. It is cut into
    ``world_size`` contiguous rank parts (``equalize``: "pad" gives every rank ceil(N/W) samples,
    the surplus re-read from the start of the stream; "drop" gives floor(N/W), the tail unread;
    "none" gives parts differing by at most one), then each rank part into ``num_workers``
    contiguous worker parts whose sizes differ by at most one and are the same on every rank.
    Parts are cut at sample boundaries, not shard boundaries, so a single shard can feed many
    workers and no worker idles while another has work.
    """
    counts = np.asarray(counts, dtype=np.int64)
    order = np.asarray(order, dtype=np.int64)
    ordered = counts[order]
    total = int(ordered.sum())
    start, stop = _rank_span(total, rank, world_size, equalize)
    length = stop - start
    lo = start + worker * length // num_workers
    hi = start + (worker + 1) * length // num_workers
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


# --- reading ----------------------------------------------------------------------------------


def read_slices(
    slices: Sequence[ShardSlice],
    urls: Sequence[str],
    fmt,
    storage: Storage,
    indexes: Sequence[Sequence[int]] = (),
    counts: Sequence[int] = (),
    fields: Sequence[str] = (),
) -> Iterator[Record]:
    """Records of each slice in turn, opened through ``storage``.

    ``indexes[i]`` is shard i's sparse byte-offset index from the manifest (if any), so a slice
    that starts mid-shard seeks near its start instead of reading the shard's prefix.

    Errors name the shard. A slice that yields fewer records than planned raises: the shard is
    shorter than the manifest (or the count taken at construction) says, and a silently short
    epoch would desynchronise DDP ranks. With ``counts`` (the per-shard counts the plan used), a
    slice that ends at its shard's end reads on to the real end, and a shard holding more
    samples than its count raises too, instead of dropping them silently.
    """
    upcoming = [urls[s.shard] for s in slices]
    for n, sl in enumerate(slices):
        url = urls[sl.shard]
        index = indexes[sl.shard] if indexes else ()
        storage.prefetch(upcoming[n:])  # this shard first: it is opened next
        got = 0
        want = sl.stop - sl.start
        to_end = bool(counts) and sl.stop == counts[sl.shard]
        stop = None if to_end else sl.stop
        try:
            if fmt.needs_local_file:
                records = fmt.iter_records(
                    storage.local_path(url), shard=url, start=sl.start, stop=stop, index=index,
                    fields=fields,
                )
                for rec in records:
                    if got == want:
                        _more_than_counted(url, sl.stop)
                    yield rec
                    got += 1
            else:
                with storage.open(url) as stream:
                    records = fmt.iter_records(
                        stream, shard=url, start=sl.start, stop=stop, index=index, fields=fields
                    )
                    for rec in records:
                        if got == want:
                            _more_than_counted(url, sl.stop)
                        yield rec
                        got += 1
        except ShardkitError:
            raise
        except OSError as exc:
            raise StorageError(f"{url}: read failed: {exc}") from exc
        if got != want:
            raise ShardFormatError(
                f"{url}: expected samples {sl.start}..{sl.stop - 1} but the shard ended after "
                f"{sl.start + got}: it is shorter than its manifest or count says (truncated or "
                "replaced after packing?); re-pack it or rebuild the manifest"
            )


def _more_than_counted(url: str, count: int):
    raise ShardFormatError(
        f"{url}: the shard holds more samples than the {count} its manifest (or count) says; "
        "the manifest belongs to another version of the shard: rebuild it (`shardkit index`) "
        "or re-pack"
    )


def check_labels(records: Iterable[Record], num_classes: int) -> Iterator[Record]:
    """Pass records through, refusing a label outside ``0..num_classes-1`` (or -1, "none").

    A damaged or hand-edited shard could otherwise feed a class index the model has no output
    for, which fails far away (a CUDA assert in the loss) or silently trains on garbage.
    """
    for rec in records:
        if not -1 <= rec.label < num_classes:
            raise SampleError(
                f"{rec.shard}: sample {rec.key!r} has label {rec.label}, outside the "
                f"{num_classes} classes of the manifest; the shard is damaged, re-pack it",
                shard=rec.shard,
                key=rec.key,
            )
        yield rec


# --- decoding ---------------------------------------------------------------------------------


def decode_records(
    records: Iterable[Record],
    mode: str = "pil",
    *,
    on_error: str = "raise",
    with_keys: bool = False,
    skipped: Callable[[], None] | None = None,
    fields: Sequence[str] = (),
) -> Iterator[tuple]:
    """``(image, label)`` (or ``(image, label, key)``) tuples from records.

    ``on_error="raise"`` raises ``SampleError`` naming shard and key; ``"skip"`` warns, calls
    ``skipped()`` (the dataset counts) and goes on. ``fields``: each sample gains the raw bytes
    of these extra members, in this order, after the key (None where a sample has none).
    """
    if mode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {DECODE_MODES}, got {mode!r}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    names = [f.lower() for f in fields]
    if mode == "raw" and not names:  # nothing can fail: skip the try block entirely
        if with_keys:
            for rec in records:
                yield rec.data, rec.label, rec.key
        else:
            for rec in records:
                yield rec.data, rec.label
        return
    for rec in records:
        try:
            img = decode_image(rec.data, mode)
        except Exception as exc:
            err = SampleError(
                f"{rec.shard}: sample {rec.key!r} ({rec.ext}) cannot be decoded: {exc}; "
                'remove it and re-pack, or pass on_error="skip"',
                shard=rec.shard,
                key=rec.key,
            )
            if on_error == "raise":
                raise err from exc
            warnings.warn(f"skipped: {err}", RuntimeWarning, stacklevel=2)
            if skipped is not None:
                skipped()
            continue
        yield _sample(img, rec, with_keys, names)


def _sample(img, rec: Record, with_keys: bool, names: Sequence[str]) -> tuple:
    """``(image, label[, key], *fields)``: the sample shape ShardDataset documents."""
    head = (img, rec.label, rec.key) if with_keys else (img, rec.label)
    if names:
        extra = rec.fields or {}
        return head + tuple(extra.get(n) for n in names)
    return head


def apply_transforms(
    samples: Iterable[tuple],
    transform: Callable | None = None,
    target_transform: Callable | None = None,
) -> Iterator[tuple]:
    """Apply ``transform`` to the image and ``target_transform`` to the label, as torch datasets."""
    for sample in samples:
        img, label, *rest = sample
        if transform is not None:
            img = transform(img)
        if target_transform is not None:
            label = target_transform(label)
        yield (img, label, *rest)
