"""The streaming pipeline's stages, each testable alone on a list.

The order ``ShardDataset`` runs them in is drawn in ``shardkit.stream``'s docstring; what each
worker reads (its slices) is planned in ``stream.planner``. The stages are generators
``stage(iterable, ...) -> Iterator``. Hot loops stay lean: no per-sample dicts, logging or
re-planning.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..errors import (
    InputError,
    SampleError,
    ShardFormatError,
    ShardkitError,
    StorageError,
    TransformError,
    check_choice,
)
from ..formats import FORMATS
from ..formats.sample_index import ShardSides
from ..images.crops import CropError
from ..images.decode import DCT_MODES, DECODE_MODES
from ..images.options import Decode
from ..records import Record, ShardInfo, ShardSlice
from ..urls import is_url
from .fields import decode_field_image
from .shuffle import EQUALIZE_MODES
from .storage import Storage

__all__ = [
    "EQUALIZE_MODES",
    "DCT_MODES",
    "DECODE_MODES",
    "ON_ERROR_MODES",
    "sample_error",
    "undecodable",
    "transform_error",
    "file_identity",
    "manifest_unchanged",
    "read_slices",
    "check_labels",
    "decode_records",
    "apply_transforms",
    "decoded_fields",
]

ON_ERROR_MODES = ("raise", "skip")


# --- reading ----------------------------------------------------------------------------------


def read_slices(
    slices: Sequence[ShardSlice],
    shards: Sequence[ShardInfo],
    fmt,
    storage: Storage,
    fields: Sequence[str] = (),
    unchanged: Callable[[], None] | None = None,
    keep: np.ndarray | None = None,
    unindexed: frozenset[str] = frozenset(),
    drop: bool = False,
    sides: Callable[[int], ShardSides] | None = None,
) -> Iterator[Record]:
    """Records of each slice in turn, read by the format ``fmt`` through ``storage``.

    ``keep`` (one flag per record the slices hold, as ``positions_to_slices`` gives; subsets,
    splits, mixtures): where a shard has a sample index (or is LMDB) and a slice wants at most
    half of its samples (tar; LMDB: a quarter; ``ranges.RANGED_SHARE``), only the wanted ones
    are read, as exact byte ranges or lookups (``stream.ranges``), the others stand as
    ``SKIPPED``; ``drop``: only the records ``keep`` wants are yielded (the others are not even
    parsed where read as ranges), so the consumer does not pass nine unwanted records per
    wanted one of a 10% split, and consecutive ranged slices of a shard are read as one.
    Without ``keep`` (a plain epoch) every slice streams, as do the shards in ``unindexed``
    (their index was refused when the dataset was built).

    ``shards[s.shard]`` is the shard a slice reads; its manifest facts (size and sha256 for
    remote verification, the offset index for a mid-shard start) travel with it.

    Errors name the shard. A slice that yields fewer records than planned raises: the shard is
    shorter than the manifest (or the count taken at construction) says, and a silently short
    epoch would desynchronise DDP ranks. A slice that ends at its shard's end (by the shard's
    ``samples``) reads on to the real end, and a shard holding more samples than that raises
    too, instead of dropping them silently. ``fields``: extra members to carry (tar only).
    ``unchanged()`` runs before each shard is opened and raises if the dataset was re-packed
    since it was planned (``manifest_unchanged``).

    ``sides`` (a split's: ``sides(i)``, shard i's ``ShardSides``): every sample read, streamed
    or as a range, is checked by its own key against the side the split put it on (a tar
    streamed in C as it is parsed; a range by the key hash its index stores, which is the
    split's; LMDB by each value's key); one on the other side is a ``ShardFormatError`` naming
    the shard and the key, never a sample handed to the other side. The split's bits may come
    from a hash column whose checksums agree with the manifest: nothing but the keys vouches
    for it. A slice of a partial read (``keep``) that streams a local tar shard checks each
    sample's digest too, as ranges do; a sample with other bytes is ``altered``'s error.

    ``storage.close()`` runs when the read ends, fails or is abandoned (``break``, an exception
    in the consumer, the generator collected, a DataLoader worker shutting down), so prefetch
    threads and fetched shards never outlive the iteration.
    """
    return _read(slices, shards, fmt, storage, fields, unchanged, keep, unindexed, drop, sides)


def read_batches(
    slices: Sequence[ShardSlice],
    shards: Sequence[ShardInfo],
    fmt,
    storage: Storage,
    fields: Sequence[str] = (),
    unchanged: Callable[[], None] | None = None,
    keep: np.ndarray | None = None,
    unindexed: frozenset[str] = frozenset(),
    sides: Callable[[int], ShardSides] | None = None,
) -> Iterator[list[Record]]:
    """``read_slices(..., drop=True)``'s records in lists (ranges: as their parse made them,
    ``RangeReader.batches``; streamed slices: up to ``BATCH`` at a time), each list checked as
    ``read_slices`` checks its records before it is handed out. A sparse epoch's stages then
    run a list at a time, and its records are laid end to end in C
    (``itertools.chain.from_iterable``), not passed up through a generator a stage."""
    return _read(slices, shards, fmt, storage, fields, unchanged, keep, unindexed, True, sides,
                 batched=True)  # fmt: skip


#: The most records ``read_batches`` gathers into one list from a streamed slice.
BATCH = 64


def _read(
    slices, shards, fmt, storage, fields, unchanged, keep, unindexed, drop, sides, batched=False
):
    """``read_slices`` (``batched``: ``read_batches``)."""
    from ..formats.tar.reader import SampleAltered
    from .ranges import RangeReader, altered

    exact = RangeReader(getattr(fmt, "name", ""), storage, unindexed)
    # each shard's ShardInfo made once (a ShardTable makes one each time it is indexed), not
    # three times a slice: a sparse epoch's plan has a slice every few wanted samples
    shards = {i: shards[i] for i in {sl.shard for sl in slices}}
    slices, masks, spans = _ranged(slices, shards, keep, exact, drop)
    upcoming = [shards[s.shard] for s in slices]
    # remote: the GETs of the ranged slices start ahead of the reader, in its order
    exact.plan([(sl, upcoming[n], masks[n]) for n, sl in enumerate(slices) if spans[n]])
    streamed = [u for u, span in zip(upcoming, spans, strict=True) if span is None]
    k = 0  # slices streamed so far
    try:
        for n, sl in enumerate(slices):
            shard = upcoming[n]
            if spans[n] is None:
                storage.prefetch(streamed[k:])  # this shard first: it is opened next
                k += 1
            got = 0
            want, flags = _dropping(sl, masks[n] if drop else None, spans[n] is not None)
            stop = None if sl.stop == shard.samples else sl.stop
            side = None if sides is None else sides(sl.shard)
            records = None
            if unchanged is not None:
                unchanged()
            try:
                ranged = spans[n] is not None
                records = _records_of(fmt, storage, exact, shard, sl, stop, fields, side, keep,
                                      masks[n], ranged, drop, batched)  # fmt: skip
                if batched:
                    got = yield from (
                        _counted(records, want, shard.url, sl.stop)
                        if ranged
                        else _kept_lists(records, flags, want, shard.url, sl.stop)
                    )
                else:
                    for rec in records:
                        if got == want:
                            _more_than_counted(shard.url, sl.stop)
                        if flags is None or flags[got]:
                            yield rec
                        got += 1
            except SampleAltered as exc:
                raise altered(shard, int(exc.args[0]), storage) from None
            except ShardkitError:
                raise
            except OSError as exc:
                raise StorageError(f"{shard.url}: read failed: {exc}") from exc
            finally:
                if records is not None:
                    records.close()  # the shard's file or mapping, before the storage closes
            _all_read(shard.url, sl, got, want)
    finally:
        exact.close()
        storage.close()


def _all_read(url: str, sl: ShardSlice, got: int, want: int) -> None:
    """A slice that yielded fewer records than planned: its shard is shorter than counted."""
    if got != want:
        raise ShardFormatError(
            f"{url}: expected samples {sl.start}..{sl.stop - 1} but the shard ended "
            f"after {sl.start + got}: it is shorter than its manifest or count says "
            "(truncated or replaced after packing?); re-pack it or rebuild the manifest"
        )


def _records_of(fmt, storage, exact, shard, sl, stop, fields, side, keep, mask, ranged, drop,
                batched):  # fmt: skip
    """What ``_read`` reads a slice through: its ranges' lists (``batched``, ``drop``), its
    ranges' records, or its stream."""
    if ranged and drop and batched:
        return exact.batches(sl, shard, mask, fields, side)
    if ranged:
        return exact.records(sl, shard, mask, fields, not drop, side)
    return _streamed(fmt, storage, shard, sl, stop, fields, side, exact, keep)


def _kept_lists(records, flags, want: int, url: str, stop: int):
    """A streamed slice's records that ``flags`` keeps (None: all) in lists of at most
    ``BATCH``, each record checked as ``read_slices`` checks it (no more than ``want``);
    returns how many were read. The records kept before an error are handed out before it,
    as one by one."""
    got, out = 0, []
    try:
        for rec in records:
            if got == want:
                _more_than_counted(url, stop)
            if flags is None or flags[got]:
                out.append(rec)
                if len(out) == BATCH:
                    yield out
                    out = []
            got += 1
    except Exception:
        if out:
            yield out
        raise
    if out:
        yield out
    return got


def _counted(lists, want: int, url: str, stop: int):
    """``lists`` handed on, their records counted (returned); past ``want`` of them, the
    shard holds more than counted."""
    got = 0
    for batch in lists:
        got += len(batch)
        if got > want:
            _more_than_counted(url, stop)
        yield batch
    return got


def _streamed(fmt, storage, shard, sl, stop, fields, side, exact, keep) -> Iterator[Record]:
    """A streamed slice's records: a split's checks each key (``side``); a partial read's (a
    split, subset or mixture: ``keep``) each sample's digest, as ranges are (a local tar shard
    with a digest index: ``RangeReader.digests``); a plain epoch's neither (whole shards)."""
    kw: dict = {} if side is None else {"sides": side}
    sums = None if keep is None else exact.digests(shard)
    if sums is not None:
        kw["digests"] = sums
    return fmt.records(storage, shard, sl.start, stop, fields, **kw)


def _ranged(slices, shards, keep, exact, drop: bool) -> tuple[list, list, list]:
    """(slices, their masks, which are read as exact ranges: True, or None: streamed, as a
    plan's) for ``read_slices``; ``drop``: consecutive ranged slices of a shard joined."""
    cuts = np.cumsum([0, *(len(sl) for sl in slices)])
    masks = [None if keep is None else keep[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    wanted = [0] * len(slices)
    if keep is not None:  # each slice's wanted count, from one running sum
        total = np.concatenate(([0], np.cumsum(keep, dtype=np.int64)))
        wanted = (total[cuts[1:]] - total[cuts[:-1]]).tolist()
    # remote: the indexes the slices below need, fetched together rather than one by one
    exact.preload(
        [
            (sl, shards[sl.shard], w)
            for sl, m, w in zip(slices, masks, wanted, strict=True)
            if m is not None
        ]
    )
    spans = [  # few wanted samples of a shard: exact ranges (None: streamed, as a plan's)
        True if m is not None and exact.exact(sl, shards[sl.shard], w) else None
        for sl, m, w in zip(slices, masks, wanted, strict=True)
    ]
    if drop:
        return _joined(slices, masks, spans)
    return list(slices), masks, spans


def _joined(slices: Sequence[ShardSlice], masks: list, spans: list) -> tuple[list, list, list]:
    """Consecutive ranged slices of one shard, each past the last, read as one (their masks
    laid on the samples between them): the wanted records are the same, in the same order, and
    a shard's wanted samples cost one range reader's call, not one a slice. (A plan cuts a
    shard's slices at holes of more than a few samples: at a 10% split, about five a shard,
    each paying the reader's fixed cost for some twenty samples.) Only where ``read_slices``
    drops the unwanted: the records between the slices are then never seen."""
    out_slices: list[ShardSlice] = []
    out_masks: list = []
    out_spans: list = []
    group: list[int] = []

    def close() -> None:
        first, last = slices[group[0]], slices[group[-1]]
        if len(group) == 1:
            out_slices.append(first), out_masks.append(masks[group[0]])
        else:
            mask = np.zeros(last.stop - first.start, bool)
            for i in group:
                mask[slices[i].start - first.start : slices[i].stop - first.start] = masks[i]
            out_slices.append(ShardSlice(first.shard, first.start, last.stop))
            out_masks.append(mask)
        out_spans.append(spans[group[0]])
        group.clear()

    for i, sl in enumerate(slices):
        if group:
            prev = slices[group[-1]]
            if (
                spans[i] is None
                or spans[group[-1]] is None
                or sl.shard != prev.shard
                or (sl.start < prev.stop)
            ):
                close()
        group.append(i)
    if group:
        close()
    return out_slices, out_masks, out_spans


def _dropping(sl: ShardSlice, mask: np.ndarray | None, ranged: bool) -> tuple[int, list | None]:
    """(records the slice's reader yields, which of them to yield on: None, all) where
    ``read_slices`` drops the unwanted: a range reader reads the wanted alone; a streamed
    slice reads every record and the mask picks."""
    if mask is None:
        return sl.stop - sl.start, None
    if ranged:
        return int(mask.sum()), None
    return sl.stop - sl.start, mask.tolist()


def file_identity(path: str | None) -> tuple[int, int, int] | None:
    """(inode, mtime in ns, size) of a local file, None for a URL or no file."""
    if path is None or is_url(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def manifest_unchanged(path: str, identity: tuple[int, int, int]) -> Callable[[], None]:
    """A check that the manifest at ``path`` is still the file the dataset was built from.

    A re-pack into the same folder replaces manifest and shards (new files under the same names,
    often of the same sizes: tar pads to whole blocks); reading on with the old plan would hand
    out duplicates and skip samples without an error. One stat per shard opened."""

    def check() -> None:
        if file_identity(path) != identity:
            raise ShardFormatError(
                f"{path}: the dataset was re-packed (its manifest changed) after this "
                "ShardDataset was built; the epoch's plan no longer matches the shards: build "
                "the ShardDataset again"
            )

    return check


def count_samples(fmt, storage: Storage, shard: ShardInfo) -> int:
    """The samples ``shard`` holds, by reading it (``fmt.count``); a read failure names it."""
    try:
        return fmt.count(storage, shard)
    except ShardkitError:
        raise
    except OSError as exc:
        raise StorageError(f"{shard.url}: cannot count samples ({exc})") from exc


def empty_as_said(table, format: str, storage: Storage) -> None:
    """Each shard whose entry says 0 samples, read and found empty: no plan gives such a shard
    a slice, so one that holds samples all the same would never be opened and every epoch
    (and a view) would be short by them without a word, where a count too high fails when its
    slice reads on past it. The same error as that one; one read of a shard that should be
    empty (a few kilobytes)."""
    empty = np.flatnonzero(table.samples == 0).tolist()
    if not empty:
        return
    try:
        for i in empty:
            shard = table[i]
            if count_samples(FORMATS[format], storage, shard):
                _more_than_counted(shard.url, 0)
    finally:
        storage.close()


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


def sample_error(rec: Record, exc: BaseException) -> SampleError:
    """The error for a record that cannot be decoded: names shard and key, and the way out."""
    ext = f" ({rec.ext})" if rec.ext else ""  # the device path knows the bytes, not the name
    return SampleError(
        f"{rec.shard}: sample {rec.key!r}{ext} cannot be decoded: {exc}; "
        'remove it and re-pack, or pass on_error="skip"',
        shard=rec.shard,
        key=rec.key,
    )


def undecodable(rec: Record, exc: BaseException) -> SampleError:
    """``sample_error`` for what a decoder raised on ``rec``; a crop policy's own error (user
    code, as a transform's) is raised instead, with the shard named, whatever ``on_error``."""
    if isinstance(exc, CropError):
        raise CropError(f"{rec.shard}: {exc}", shard=rec.shard, key=rec.key) from exc.__cause__
    return exc if isinstance(exc, SampleError) else sample_error(rec, exc)


def transform_error(rec: Record, exc: BaseException) -> TransformError:
    """The error for a transform that raised on a record: names shard and key and the
    transform's exception (raise it ``from exc``: the original stays its cause)."""
    return TransformError(
        f"{rec.shard}: sample {rec.key!r}: the dataset's transform raised "
        f"{type(exc).__name__}: {exc}",
        shard=rec.shard,
        key=rec.key,
    )


def decode_records(
    records: Iterable[Record],
    decode: Decode | str = "pil",
    *,
    on_error: str = "raise",
    with_keys: bool | Sequence[str] = False,
    skipped: Callable[[], None] | None = None,
    fields: Sequence[str] = (),
    decoder: Callable[[bytes, str], object] | None = None,
    field_decoders: Sequence[Callable[[bytes], object] | None] | None = None,
    geometry: Callable[[Record, tuple], tuple] | None = None,
) -> Iterator[tuple]:
    """``(image, label)`` (or ``(image, label, key)``) tuples from records; ``with_keys`` may
    instead name what follows the label, from ``EXTRAS`` (``("key", "source")``).

    ``on_error="raise"`` raises ``SampleError`` naming shard and key; ``"skip"`` warns, calls
    ``skipped()`` (the dataset counts) and goes on. ``fields``: each sample gains the raw bytes
    of these extra members, in this order, after the key (None where a sample has none).
    ``decode``: a ``shardkit.Decode`` (or its mode alone: ``Decode.of``), whose mode says what
    an image becomes and whose ``max_pixels`` makes images declaring more undecodable samples
    (refused from the header). ``decoder(data, key)`` replaces ``decode_image(data, mode)`` (the
    fixed-size tensor decoder of ``shardkit.images.geometry``, whose randomness depends on the
    key).
    ``field_decoders`` (one per field, None: the stored bytes; see shardkit.stream.fields):
    fields are decoded and required: a sample without one, or whose field does not decode, is
    an error naming shard, key and field (a skip under ``on_error="skip"``).
    ``geometry(rec, fields, box)`` moves the decoded fields with the image's crop (masks,
    boxes: ``shardkit.stream.fields.sample_geometry``); ``decoder`` is then a ``TensorDecoder``
    whose ``crop_box`` is asked once per sample, the box given to both.
    """
    decode = Decode.of(decode)
    check_choice("on_error", on_error, ON_ERROR_MODES)
    extras = extras_of(with_keys)
    kw = dict(
        on_error=on_error, skipped=skipped, fields=[f.lower() for f in fields], decoder=decoder,
        field_decoders=field_decoders, geometry=geometry,
    )  # fmt: skip
    if extras in ((), ("key",)):
        return _decoded(records, decode, extras == ("key",), False, **kw)
    return _with_extras(_decoded(records, decode, False, True, **kw), extras)


def _with_extras(samples: Iterator[tuple], extras: tuple[str, ...]) -> Iterator[tuple]:
    """Samples carrying their record after the label, as ``extras`` name: key, source."""
    for img, label, rec, *rest in samples:
        yield (img, label, *(rec.key if e == "key" else rec.source for e in extras), *rest)


def _decoded(
    records, decode: Decode, with_keys, keep_record, *, on_error, skipped, fields, decoder,
    field_decoders, geometry,
) -> Iterator[tuple]:  # fmt: skip
    """``decode_records``' samples, the key (``with_keys``) or the record (``keep_record``)
    after the label."""
    names = fields
    if decode.mode == "raw" and not names and not keep_record:  # nothing can fail: no try block
        if with_keys:
            for rec in records:
                yield rec.data, rec.label, rec.key
        else:
            for rec in records:
                yield rec.data, rec.label
        return
    for rec in records:
        try:
            if field_decoders is not None:
                extra = decoded_fields(rec, names, field_decoders, decode)
            if geometry is None:
                img = _image(rec, decode, decoder)
            else:  # one box for the image and its masks and boxes: the crop is asked once
                box = decoder.crop_box(rec.data, rec.key)
                img = decoder(rec.data, rec.key, box=box)
                extra = geometry(rec, extra, box)
        except Exception as exc:
            err = undecodable(rec, exc)
            if on_error == "raise":
                raise err from exc
            warnings.warn(f"skipped: {err}", RuntimeWarning, stacklevel=2)
            if skipped is not None:
                skipped()
            continue
        if field_decoders is None:
            yield _sample(img, rec, with_keys, names, keep_record)
        else:
            yield _head(img, rec, with_keys, keep_record) + extra


def _image(rec: Record, decode: Decode, decoder):
    if decode.mode == "raw":
        return rec.data
    if decoder is None:
        return decode.image(rec.data)
    return decoder(rec.data, rec.key)


def decoded_fields(
    rec: Record,
    names: Sequence[str],
    decoders: Sequence,
    image: Decode,
) -> tuple:
    """The sample's fields, each decoded; a missing or undecodable one is a ``SampleError``.
    An image field (a mask) is held to the ``max_pixels`` of ``image``, the ``Decode`` of the
    sample's image, as the image is."""
    have = rec.fields or {}
    out = []
    for name, decode_field in zip(names, decoders, strict=True):
        data = have.get(name)
        if data is None and name in have:  # its Source carries no such field: None
            out.append(None)
            continue
        if data is None:
            raise SampleError(
                f"{rec.shard}: sample {rec.key!r} has no {name!r} field; pack it with one, drop "
                'it from fields=, or pass on_error="skip"',
                shard=rec.shard,
                key=rec.key,
            )
        if decode_field is None:
            out.append(data)
            continue
        try:
            if decode_field is decode_field_image:
                out.append(decode_field(data, image.max_pixels))
            else:
                out.append(decode_field(data))
        except Exception as exc:
            raise SampleError(
                f"{rec.shard}: sample {rec.key!r}: field {name!r} cannot be decoded "
                f"({type(exc).__name__}: {exc}); fix it and re-pack, read it raw "
                f'(fields={{{name!r}: "raw"}}), or pass on_error="skip"',
                shard=rec.shard,
                key=rec.key,
            ) from exc
    return tuple(out)


#: What may follow a sample's label (``with_keys=``): its key, and the position of its source in
#: a mixture (0 without one).
EXTRAS = ("key", "source")


def extras_of(with_keys: bool | str | Sequence[str]) -> tuple[str, ...]:
    """``with_keys`` as the names that follow the label: True is ("key",)."""
    if isinstance(with_keys, (bool, np.bool_)) or with_keys is None:
        return ("key",) if with_keys else ()
    if isinstance(with_keys, str):
        names: tuple = (with_keys,)
    elif isinstance(with_keys, (tuple, list)):
        names = tuple(with_keys)
    else:
        raise InputError(
            f"with_keys={with_keys!r}: give True, False or names from {EXTRAS} such as "
            '("key", "source")'
        )
    for name in names:
        check_choice("with_keys", name, EXTRAS)
    if len(set(names)) != len(names):
        raise InputError(f"with_keys={with_keys!r} names one thing twice")
    return names


def _head(img, rec: Record, with_keys: bool, keep_record: bool = False) -> tuple:
    if keep_record:
        return (img, rec.label, rec)
    return (img, rec.label, rec.key) if with_keys else (img, rec.label)


def _sample(
    img, rec: Record, with_keys: bool, names: Sequence[str], keep_record: bool = False
) -> tuple:
    """``(image, label[, key], *fields)``: the sample shape ShardDataset documents (the record
    itself in the key's place with ``keep_record``)."""
    head = _head(img, rec, with_keys, keep_record)
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
