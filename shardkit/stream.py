"""The streaming pipeline as small stages, each testable alone on a list.

``ShardDataset.__iter__`` composes them in one place::

    plan_epoch -> read_slices -> shuffle_buffer -> decode_records -> apply_transforms

``plan_epoch`` is plain arithmetic on sample counts. The other stages are generators
``stage(iterable, ...) -> Iterator``. Hot loops stay lean: no per-sample dicts, logging or
re-planning.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from .errors import SampleError, ShardFormatError, ShardkitError, StorageError
from .records import Record, ShardSlice
from .storage import Storage

__all__ = [
    "EQUALIZE_MODES",
    "DECODE_MODES",
    "rank_samples",
    "plan_epoch",
    "read_slices",
    "check_labels",
    "decode_image",
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
) -> Iterator[Record]:
    """Records of each slice in turn, opened through ``storage``.

    ``indexes[i]`` is shard i's sparse byte-offset index from the manifest (if any), so a slice
    that starts mid-shard seeks near its start instead of reading the shard's prefix.

    Errors name the shard. A slice that yields fewer records than planned raises: the shard is
    shorter than the manifest (or the count taken at construction) says, and a silently short
    epoch would desynchronise DDP ranks.
    """
    upcoming = [urls[s.shard] for s in slices]
    for n, sl in enumerate(slices):
        url = urls[sl.shard]
        index = indexes[sl.shard] if indexes else ()
        storage.prefetch(upcoming[n:])  # this shard first: it is opened next
        got = 0
        try:
            if fmt.needs_local_file:
                records = fmt.iter_records(
                    storage.local_path(url),
                    shard=url,
                    start=sl.start,
                    stop=sl.stop,
                    index=index,
                    samples=int(counts[sl.shard]) if len(counts) else None,
                )
                for rec in records:
                    yield rec
                    got += 1
            else:
                with storage.open(url) as stream:
                    records = fmt.iter_records(
                        stream, shard=url, start=sl.start, stop=sl.stop, index=index
                    )
                    for rec in records:
                        yield rec
                        got += 1
        except ShardkitError:
            raise
        except OSError as exc:
            raise StorageError(f"{url}: read failed: {exc}") from exc
        want = sl.stop - sl.start
        if got != want:
            raise ShardFormatError(
                f"{url}: expected samples {sl.start}..{sl.stop - 1} but the shard ended after "
                f"{sl.start + got}: it is shorter than its manifest or count says (truncated or "
                "replaced after packing?); re-pack it or rebuild the manifest"
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


def decode_image(data: bytes, mode: str):
    """Decode one stored image: "pil" (RGB PIL image), "tensor" (uint8 CHW RGB), "raw" (bytes).

    Shared by ShardDataset and FolderDataset so both pay exactly the same decode cost.
    """
    if mode == "raw":
        return data
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    if img.mode != "RGB":
        img = img.convert("RGB")
    else:
        img.load()
    if mode == "pil":
        return img
    import torch

    # Planar copy band by band straight into a contiguous CHW tensor. A permuted view of the
    # HWC array would cost the same here but make the DataLoader's collate a strided transpose
    # of every image (measured: ~40 us more per 250x250 image in the workers).
    width, height = img.size
    out = torch.empty((3, height, width), dtype=torch.uint8)
    planes = out.numpy()
    for c, band in enumerate(img.split()):
        planes[c] = np.asarray(band)
    return out


def decode_records(
    records: Iterable[Record],
    mode: str = "pil",
    *,
    on_error: str = "raise",
    with_keys: bool = False,
    skipped: Callable[[], None] | None = None,
) -> Iterator[tuple]:
    """``(image, label)`` (or ``(image, label, key)``) tuples from records.

    ``on_error="raise"`` raises ``SampleError`` naming shard and key; ``"skip"`` warns, calls
    ``skipped()`` (the dataset counts) and goes on.
    """
    if mode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {DECODE_MODES}, got {mode!r}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if mode == "raw":  # nothing can fail: skip the try block entirely
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
        if with_keys:
            yield img, rec.label, rec.key
        else:
            yield img, rec.label


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
