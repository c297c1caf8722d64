"""The fill loop: one worker's part of an epoch, decoded batch by batch into its ring slots.

The same code runs in a worker process and, for ``num_workers=0``, in the caller. Worker ``w``
iterates exactly what DataLoader worker ``w`` would (``ShardDataset.records_from`` with worker
parts cut at whole batches), so every guarantee of the dataset holds: split, shuffle, exact and
equal ``len``, ``equalize``, resume.

Whole images (no crop, transform or fields) decode a batch at a time: the batch's records are
taken, then their JPEGs decoded in one native call (``TensorDecoder.into_batch``); at 250x250 a
decode takes ~150 us, and each microsecond of per-image Python was a point of efficiency lost.
Everything else is a flat loop over records with everything bound once per batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError, SampleError
from ..images.decode import image_size
from ..images.geometry import ShapeError, sample_seed
from ..stream.fields import decode_field_image, sample_geometry
from ..stream.resume import EpochState
from ..stream.stages import decoded_fields, transform_error, undecodable
from ..stream.world import World
from .messages import Batch, Start
from .ring import MappedSlots
from .stats import WorkerClock

__all__ = ["Abandon", "FillSpec", "Filler"]


class Abandon(Exception):
    """Raised by ``acquire`` when the loader moved on (a new epoch, stop): fill no more."""


@dataclass(frozen=True, slots=True)
class FillSpec:
    """What every worker of a loader needs to know to fill slots the consumer can read."""

    batch_size: int
    num_workers: int
    drop_last: bool
    nhwc: bool  # slots hold (N, H, W, 3), else (N, 3, H, W)
    # "workers": pixels in the slots; "device": the samples' stored bytes, decoded by the
    # training process; "auto": each batch one or the other, ``Filler.share`` of them pixels
    decode_on: str = "workers"
    # batches a worker fills of the next epoch while the consumer drains this one: the loader's
    # prefetch_factor (what a worker may have ready at any time)
    fill_ahead: int = 2
    # batches report each sample's source (the loader's ``with_keys`` names "source")
    sources: bool = False


class Filler:
    """Worker ``worker``'s batches of ``dataset`` decoded into ``slots``."""

    def __init__(self, dataset, spec: FillSpec, worker: int, slots: MappedSlots):
        #: the dataset's options and epoch calls, through its one door (``DatasetSeam``)
        self.ds = ds = dataset.seam()
        self.spec, self.worker, self.slots = spec, worker, slots
        self.hw: tuple[int, int] | None = None
        if ds.geometry is not None:
            self.hw = (ds.geometry.size, ds.geometry.size)
        self._targets: dict[int, tuple[np.ndarray, list]] = {}
        self._capacity = 0  # encoded slots: bytes each one maps (grown for a larger batch)
        # decode_on="auto": the fraction of batches decoded here (set by the loader from both
        # sides' measured rates, ``Share``), and its running sum (which batch is whose)
        self.share, self._owed = 0.5, 0.0
        self._moved = None  # per epoch: the dataset's mover of masks and boxes (or None)
        self._sources = spec.sources  # the loader's with_keys, not the dataset's
        self.clock = WorkerClock()  # where this worker's time goes, per batch (stats.py)

    def run(self, start: Start, acquire: Callable[[], int]) -> Iterator[Batch]:
        """The batches of ``start``'s epoch; ``acquire()`` gives a free slot (or raises
        ``Abandon``). The slot of a yielded batch is the consumer's until it is given back."""
        ds, spec, bs = self.ds, self.spec, self.spec.batch_size
        world = World(ds.rank, ds.world_size, self.worker, spec.num_workers)
        resume = EpochState.from_dict(start.resume, ds.facts) if start.resume else None
        records = ds.records_from(world, start.epoch, resume, bs)
        decoder = ds.tensor_decoder(start.epoch)
        self._epoch = start.epoch
        names, decoders = self._fields()
        # masks and boxes moved with their image (the dataset's own function), for this epoch
        self._moved = None
        if ds.geometry is not None and names:
            self._moved = sample_geometry(decoder, names, decoders, ds.boxes)
        clock, first = self.clock, True
        try:
            while True:
                t0 = time.perf_counter()
                slot = acquire()
                t1 = time.perf_counter()
                resized, source = decoder.resize_s, clock.source(records, first)
                first = False
                batch = self._pick()(slot, source, decoder)
                batch.fill_s = time.perf_counter() - t1
                clock.idle += t1 - t0
                batch.times = clock.batch(batch.fill_s, decoder.resize_s - resized)
                batch.epoch = start.epoch
                if batch.count == 0 or (batch.count < bs and spec.drop_last):
                    if batch.consumed:  # skipped samples, a dropped batch: counted, no image
                        yield _taken_only(batch)
                    return
                yield batch
                if batch.count < bs:
                    return
        finally:
            close = getattr(records, "close", None)
            if close is not None:
                close()

    def _pick(self):
        """This batch's fill: pixels here, or stored bytes for the training process."""
        mode = self.spec.decode_on
        if mode == "auto":
            self._owed += self.share
            if self._owed >= 1.0:
                self._owed -= 1.0
                return self._fill_pixels
            return self._fill_encoded
        return self._fill_encoded if mode == "device" else self._fill_pixels

    def _fill_pixels(self, slot: int, records: Iterator, decoder) -> Batch:
        """Whole images without a transform or fields once the slots are sized: a batch at a
        time (``_fill_whole``); anything else image by image (``_fill``)."""
        ds = self.ds
        if ds.sample_transform is not None:
            return self._fill_samples(slot, records, decoder)
        if self.hw is not None and ds.geometry is None and ds.transform is None and not ds.fields:
            return self._fill_whole(slot, records, decoder)
        return self._fill(slot, records, decoder)

    def _fill(self, slot: int, records: Iterator, decoder) -> Batch:
        """Decode up to a batch of ``records`` into ``slot``."""
        ds, bs = self.ds, self.spec.batch_size
        targets = self._slot_targets(slot) if self.hw is not None else None
        planar = not self.spec.nhwc and ds.geometry is None
        transform = self.clock.timed(ds.transform)
        names, decoders = self._fields()
        masks = [j for j, d in enumerate(decoders) if d is decode_field_image]
        values: list[list] = [[] for _ in names + (BOX_COLUMNS if ds.boxes is not None else ())]
        labels: list[int] = []
        keys: list[str] = []
        sources: list[int] = []
        notes: list[str] = []
        n = 0
        for rec in records:
            img = None
            try:
                box = self._box(rec, decoder)
                extra = self._sample_fields(rec, names, decoders, masks, box)
                if transform is not None or targets is None:
                    img = decoder(rec.data, rec.key, box=box)  # for the transform or sizing
                elif planar:
                    decoder.into_planes(rec.data, rec.key, targets[n])
                else:
                    decoder(rec.data, rec.key, targets[n], box=box)
            except ShapeError as exc:
                raise ShapeError(f"{rec.shard}: {exc}") from None
            except Exception as exc:  # decoders raise many types for bad data
                self._bad(rec, exc, notes)
                continue
            for column, value in zip(values, extra, strict=False):
                column.append(value)
            if img is not None:  # the transform's errors are the transform's, not bad data
                if transform is not None:
                    try:
                        out = transform(img)
                    except Exception as exc:
                        raise transform_error(rec, exc) from exc
                    img = _transformed(out, rec, self.hw)
                if targets is None:  # the first image of this worker sizes its slots
                    targets = self._first(slot, img)
                else:
                    targets[n].copy_(img)
            labels.append(rec.label)
            keys.append(rec.key)
            sources.append(rec.source)
            n += 1
            if n == bs:
                break
        height, width = self.hw or (0, 0)
        consumed = n + len(notes)
        batch = Batch(0, self.worker, slot, n, height, width, labels, keys, notes, consumed)
        batch.fields = _batch_fields(values, names, masks, keys)
        batch.sources = sources if self._sources else None
        return batch

    def _fill_samples(self, slot: int, records: Iterator, decoder) -> Batch:
        """The dataset's ``sample_transform`` on each whole sample (the dict ``ShardDataset``
        gives it: image, label, key, fields, boxes, seed), its outputs batched here
        (``batch_samples``); each column stacked into one array (tensors of one shape, numbers)
        is written into the slot and named by place (``InRing``), as the images of the plain
        path are: only what does not stack (strings, lists of boxes) goes through the pipe."""
        ds, bs = self.ds, self.spec.batch_size
        names, decoders = self._fields()
        masks = [j for j, d in enumerate(decoders) if d is decode_field_image]
        columns = ("image", "label", "key", "source", *names)
        columns += BOX_COLUMNS if ds.boxes is not None else ()
        sample_transform = self.clock.timed(ds.sample_transform)
        outputs, labels, keys, notes = [], [], [], []
        for rec in records:
            try:
                box = self._box(rec, decoder)
                extra = self._sample_fields(rec, names, decoders, masks, box)
                img = decoder(rec.data, rec.key, box=box)
            except Exception as exc:  # decoders raise many types for bad data
                self._bad(rec, exc, notes)
                continue
            item = dict(zip(columns, (img, rec.label, rec.key, rec.source, *extra), strict=True))
            item["seed"] = sample_seed(ds.seed, self._epoch, rec.key)
            try:
                outputs.append(sample_transform(item))
            except Exception as exc:
                raise transform_error(rec, exc) from exc
            labels.append(rec.label)
            keys.append(rec.key)
            if len(outputs) == bs:
                break
        n = len(outputs)
        batch = Batch(0, self.worker, slot, n, 0, 0, labels, keys, notes, n + len(notes))
        if outputs:
            batch.samples, batch.capacity = self._in_ring(slot, batch_samples(outputs))
        return batch

    def _in_ring(self, slot: int, samples) -> tuple[object, int]:
        """``samples`` with each stacked column's array written into ``slot`` (64-byte aligned)
        and replaced by its place; the bytes the slot maps (0: nothing placed)."""
        stacked = [a for a in _arrays(samples) if a.array.dtype in _RING_DTYPES]
        if not stacked:
            return samples, 0
        at, places = 0, {}
        for a in stacked:
            places[id(a)] = at
            at += -(-a.array.nbytes // 64) * 64
        if at > self._capacity:  # the slots grow to the largest batch, in powers of 2
            self._capacity = 1 << max(20, (at - 1).bit_length())
        arr = self.slots.array(slot, (self._capacity,))
        for a in stacked:
            lo = places[id(a)]
            arr[lo : lo + a.array.nbytes] = np.ascontiguousarray(a.array).reshape(-1).view(np.uint8)
        return _placed(samples, places), self._capacity

    def _fill_whole(self, slot: int, records: Iterator, decoder) -> Batch:
        """``_fill`` for whole images without a transform or fields (the plain full decode):
        the batch's records are taken first and decoded in one native call per run of plain
        JPEGs (``TensorDecoder.into_batch``), not one Python call chain per image; a record it
        does not take goes through the per-image decode, which decides as in ``_fill``. A read
        error is raised after the records read before it were decoded (their errors first)."""
        bs, planar = self.spec.batch_size, not self.spec.nhwc
        arr, targets = self._array(slot), self._slot_targets(slot)
        taken: list = []
        notes: list[str] = []
        failed: BaseException | None = None
        while len(taken) < bs and failed is None:
            recs: list = []
            try:
                for rec in records:
                    recs.append(rec)
                    if len(taken) + len(recs) == bs:
                        break
            except Exception as exc:  # the stream's own error, raised once these are decoded
                failed = exc
            if not recs:
                break
            datas = [rec.data for rec in recs]
            i = 0
            while i < len(recs):
                done = decoder.into_batch(datas[i:] if i else datas, arr, len(taken), planar)
                taken.extend(recs[i : i + done])
                i += done
                if i == len(recs):
                    break
                rec = recs[i]
                i += 1
                try:
                    if planar:
                        decoder.into_planes(rec.data, rec.key, targets[len(taken)])
                    else:
                        decoder(rec.data, rec.key, targets[len(taken)])
                except ShapeError as exc:
                    raise ShapeError(f"{rec.shard}: {exc}") from None
                except Exception as exc:  # decoders raise many types for bad data
                    self._bad(rec, exc, notes)
                    continue
                taken.append(rec)
        if failed is not None:
            raise failed
        n = len(taken)
        height, width = self.hw
        labels, keys = [r.label for r in taken], [r.key for r in taken]
        batch = Batch(0, self.worker, slot, n, height, width, labels, keys, notes, n + len(notes))
        batch.sources = [r.source for r in taken] if self._sources else None
        return batch

    def _box(self, rec, decoder):
        """The sample's crop box, asked once (None without ``Decode(crop=)``): its image, masks and
        boxes are all cut at it."""
        return decoder.crop_box(rec.data, rec.key) if self.ds.geometry is not None else None

    def _sample_fields(self, rec, names, decoders, masks: list[int], box) -> tuple:
        """The sample's fields, decoded, with its masks (and boxes: two more columns) moved like
        its image (cut at ``box``, the image's); without ``Decode(crop=)``, masks must have their
        image's size."""
        if not names:
            return ()
        extra = decoded_fields(rec, names, decoders, self.ds.decode)
        if self._moved is not None:
            return self._moved(rec, extra, box)
        height, width = image_size(rec.data) if masks else (0, 0)
        for j in masks:
            if tuple(extra[j].shape[-2:]) != (height, width):
                raise SampleError(
                    f"{rec.shard}: sample {rec.key!r}: field {names[j]!r} is "
                    f"{extra[j].shape[-1]}x{extra[j].shape[-2]} but its image is "
                    f"{width}x{height}; a mask must have its image's size: fix it and re-pack, "
                    'or pass on_error="skip"',
                    shard=rec.shard,
                    key=rec.key,
                )
        return extra

    def _bad(self, rec, exc: Exception, notes: list[str]) -> None:
        """An undecodable sample: raised under ``on_error="raise"``, else noted. Counted in
        ``ds.skipped`` when its batch is handed over (``count_skips``), not here: a batch filled
        ahead for an epoch that does not come is never counted."""
        err = undecodable(rec, exc)
        if self.ds.on_error == "raise":
            raise err from exc
        notes.append(f"skipped: {err}")

    def _fields(self) -> tuple[tuple[str, ...], tuple]:
        """The dataset's ``fields=`` and their decoders (None: the stored bytes)."""
        names = tuple(self.ds.fields)
        return names, self.ds.field_decoders or (None,) * len(names)

    def _fill_encoded(self, slot: int, records: Iterator, decoder) -> Batch:
        """Copy up to a batch of ``records``' stored bytes into ``slot``, with each sample's crop
        box from its header (``decode_on="device"``: the training process decodes). A header
        that cannot be read is an undecodable sample here, as in ``_fill``."""
        ds, bs = self.ds, self.spec.batch_size
        names, decoders = self._fields()
        values: list[list] = [[] for _ in names]
        taken, boxes, notes = [], [], []
        for rec in records:
            try:
                extra = decoded_fields(rec, names, decoders, self.ds.decode) if names else ()
                box = decoder.crop_box(rec.data, rec.key) if ds.geometry is not None else None
            except Exception as exc:
                self._bad(rec, exc, notes)
                continue
            for column, value in zip(values, extra, strict=False):
                column.append(value)
            taken.append(rec)
            boxes.append(box)
            if len(taken) == bs:
                break
        if not taken:  # the part has ended: nothing to place (an unsized slot maps no memory)
            return Batch(0, self.worker, slot, 0, 0, 0, [], [], notes, len(notes))
        offsets = [0]
        for rec in taken:
            offsets.append(offsets[-1] + len(rec.data))
        if offsets[-1] > self._capacity:  # the slots grow to the largest batch, in powers of 2
            self._capacity = 1 << max(20, (offsets[-1] - 1).bit_length())
        t0 = time.perf_counter()
        arr = self.slots.array(slot, (self._capacity,))
        for rec, lo, hi in zip(taken, offsets, offsets[1:], strict=False):
            arr[lo:hi] = np.frombuffer(rec.data, np.uint8)
        self.clock.copy += time.perf_counter() - t0
        n = len(taken)
        batch = Batch(
            0, self.worker, slot, n, 0, 0, [r.label for r in taken], [r.key for r in taken],
            notes, n + len(notes), offsets, boxes, [r.shard for r in taken], self._capacity,
        )  # fmt: skip
        batch.fields = values if names else None
        batch.sources = [r.source for r in taken] if self._sources else None
        return batch

    def _first(self, slot: int, img: torch.Tensor) -> list:
        self.hw = (int(img.shape[-2]), int(img.shape[-1]))
        targets = self._slot_targets(slot)
        stored = img.permute(1, 2, 0) if self.spec.nhwc else img
        torch.from_numpy(self._array(slot)[0]).copy_(stored)
        return targets

    def _array(self, slot: int) -> np.ndarray:
        h, w = self.hw
        bs = self.spec.batch_size
        return self.slots.array(slot, (bs, h, w, 3) if self.spec.nhwc else (bs, 3, h, w))

    def _slot_targets(self, slot: int) -> list:
        """Where image i of the slot is decoded to: HWC numpy views when JPEG rows can land as
        decoded, (3, H, W) numpy planes for a contiguous batch of whole images (decoded, then
        transposed: no tensor call per image), else (3, H, W) tensor views."""
        arr = self._array(slot)
        cached = self._targets.get(slot)
        if cached is not None and cached[0] is arr:
            return cached[1]
        geometry = self.ds.geometry is not None or self.ds.transform is not None
        if geometry:
            images = torch.from_numpy(arr)
            targets = list((images.permute(0, 3, 1, 2) if self.spec.nhwc else images).unbind(0))
        else:
            targets = list(arr)  # HWC rows or CHW planes
        self._targets[slot] = (arr, targets)
        return targets

    def forget(self, slot: int) -> None:
        """The slot's memory was replaced (the caller kept its batch)."""
        self._targets.pop(slot, None)

    def count_skips(self, batch: Batch) -> None:
        """``batch`` is handed over: its skipped samples (one note each) count in ``ds.skipped``."""
        if batch.notes:
            skipped = self.ds.skip_counter(self.worker)
            for _ in batch.notes:
                skipped()


def _taken_only(batch: Batch) -> Batch:
    """The end of a part whose last records give no image (all skipped, or a short batch under
    ``drop_last``): a batch of none that still warns of the skipped samples, counts them and
    the records taken (``state_dict``), in its turn."""
    empty = Batch(batch.gen, batch.worker, batch.slot, 0, 0, 0, [], [], batch.notes)
    empty.consumed, empty.epoch = batch.consumed, batch.epoch
    return empty


#: The two columns ``boxes=`` adds after the fields: (K, 4) xyxy boxes and their stored index.
BOX_COLUMNS = ("boxes", "box_index")


def _batch_fields(values: list[list], names, masks: list[int], keys: list[str]):
    """The batch's field columns (None without fields); each mask field as one array, so the
    pipe carries one array per field and batch, not one per sample; boxes as numpy arrays
    (a tensor would travel through shared memory, one segment per box list)."""
    if not names:
        return None
    for j in masks:
        values[j] = _stacked(values[j], names[j], keys)
    for j in range(len(names), len(values)):
        values[j] = [v.numpy() for v in values[j]]
    return values


def _stacked(masks: list, name: str, keys: list[str]) -> np.ndarray:
    """A batch's masks of one field as one (N, C, H, W) uint8 array."""
    if not masks:
        return np.zeros((0, 1, 0, 0), np.uint8)
    first = masks[0].shape
    for m, key in zip(masks, keys, strict=True):
        if m.shape != first:
            raise InputError(
                f"fields=: {name!r} of sample {key!r} is {tuple(m.shape)} but its batch holds "
                f"{tuple(first)}: give the dataset decode=Decode(crop=...) (masks are then cut "
                "with it), and store every mask with the same channels"
            )
    return torch.stack(masks).numpy()


def _transformed(img, rec, hw: tuple[int, int] | None) -> torch.Tensor:
    """The transform's output, checked: uint8 (3, H, W) of the batch's size."""
    ok = isinstance(img, torch.Tensor) and img.dtype == torch.uint8 and img.dim() == 3
    ok = ok and img.shape[0] == 3 and (hw is None or tuple(img.shape[1:]) == hw)
    if not ok:
        got = (
            f"{img.dtype} tensor of shape {tuple(img.shape)}"
            if isinstance(img, torch.Tensor)
            else type(img).__name__
        )
        want = f"(3, {hw[0]}, {hw[1]})" if hw else "(3, H, W)"
        raise InputError(
            f"{rec.shard}: sample {rec.key!r}: the dataset's transform returned a {got}; "
            f"ShardLoader batches need a uint8 tensor of shape {want} (convert to float and "
            "normalise on the batch, or use ShardLoader(normalize=...))"
        )
    return img


# --- whole samples (sample_transform): batched in the worker, rebuilt in the caller ----------


@dataclass(frozen=True, slots=True)
class Stacked:
    """A column of tensors of one shape and dtype, stacked: one array through the pipe."""

    array: np.ndarray


@dataclass(frozen=True, slots=True)
class Array:
    """One tensor of a list column, as an array (a tensor would travel through shared memory,
    one segment per tensor)."""

    array: np.ndarray


#: What a stacked column may be in the ring: numpy dtypes torch views alike (native order).
_RING_DTYPES = tuple(
    np.dtype(t) for t in (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64,
                          np.float16, np.float32, np.float64)
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class InRing:
    """A stacked column written into the batch's slot: its bytes at ``offset``, as an array of
    ``shape`` and ``dtype`` (numpy's name)."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


def _arrays(batch) -> list[Stacked]:
    """The stacked columns of ``batch_samples``' batch, in order."""
    if isinstance(batch, dict):
        return [a for v in batch.values() for a in _arrays(v)]
    if isinstance(batch, tuple):
        return [a for v in batch for a in _arrays(v)]
    return [batch] if isinstance(batch, Stacked) else []


def _placed(batch, places: dict[int, int]):
    """``batch`` with each stacked column written at ``places[id(column)]`` named by place."""
    if isinstance(batch, dict):
        return {k: _placed(v, places) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_placed(v, places) for v in batch)
    if isinstance(batch, Stacked) and id(batch) in places:
        return InRing(places[id(batch)], batch.array.shape, batch.array.dtype.str)
    return batch


def _column(values: list):
    first = values[0]
    if isinstance(first, torch.Tensor) and all(
        isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype
        for v in values
    ):
        stacked = torch.stack(values)
        return Stacked(stacked.numpy()) if stacked.dtype != torch.bfloat16 else stacked
    numbers = _numbers(values)
    if numbers is not None:
        return Stacked(numbers)
    return [
        Array(v.numpy()) if isinstance(v, torch.Tensor) and v.dtype != torch.bfloat16 else v
        for v in values
    ]


#: Python numbers as ``default_collate`` makes them: bool, int64, float64.
_PY_NUMBERS = ((bool, np.bool_), (int, np.int64), (float, np.float64))


def _numbers(values: list) -> np.ndarray | None:
    """A column of numbers, or of numpy arrays of one shape and dtype, as one array, as
    ``DataLoader``'s ``default_collate`` batches them (a passed-on label stays a tensor); None
    for anything else, and for ints past int64 (``default_collate`` would fail on them)."""
    first = values[0]
    if isinstance(first, (np.ndarray, np.generic)):
        same = all(
            type(v) is type(first) and v.shape == first.shape and v.dtype == first.dtype
            for v in values
        )
        return np.stack(values) if same and first.dtype.kind in "biufc" else None
    for kind, dtype in _PY_NUMBERS:
        if type(first) is kind and all(type(v) is kind for v in values):
            try:
                return np.array(values, dtype=dtype)
            except OverflowError:
                return None
    return None


def batch_samples(outputs: list):
    """``sample_transform``'s outputs as one batch: a dict per sample gives a dict of columns, a
    tuple or list a tuple of columns, anything else one column; a column of tensors of one shape
    is stacked, so are numbers (bool, int64, float64) and numpy arrays of one shape and dtype
    (as ``DataLoader``'s ``default_collate``), any other a list."""
    first = outputs[0]
    if isinstance(first, dict):
        keys = list(first)
        for out in outputs:
            if not isinstance(out, dict) or list(out) != keys:
                raise InputError(
                    f"sample_transform returned {_what(out)} after a dict with keys {keys}: "
                    "every sample of a batch must have the same keys"
                )
        return {k: _column([o[k] for o in outputs]) for k in keys}
    if isinstance(first, (tuple, list)):
        for out in outputs:
            if not isinstance(out, (tuple, list)) or len(out) != len(first):
                raise InputError(
                    f"sample_transform returned {_what(out)} after a {len(first)}-tuple: every "
                    "sample of a batch must have the same length"
                )
        return tuple(_column(list(col)) for col in zip(*outputs, strict=True))
    return _column(outputs)


def _what(out) -> str:
    if isinstance(out, dict):
        return f"a dict with keys {list(out)}"
    if isinstance(out, (tuple, list)):
        return f"a {len(out)}-tuple"
    return f"a {type(out).__name__}"


def unbatch_arrays(batch, to_tensor: Callable[[torch.Tensor], torch.Tensor], slot=None):
    """``batch_samples``' batch in the caller: stacked columns as tensors through ``to_tensor``
    (the loader's device), list columns' arrays as tensors. ``slot``: the batch's slot as a
    uint8 tensor (lent by the ring), over which columns written there (``InRing``) are views."""
    if isinstance(batch, dict):
        return {k: unbatch_arrays(v, to_tensor, slot) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(unbatch_arrays(v, to_tensor, slot) for v in batch)
    if isinstance(batch, InRing):
        dtype = torch.from_numpy(np.empty(0, np.dtype(batch.dtype))).dtype
        nbytes = int(np.prod(batch.shape, dtype=np.int64)) * np.dtype(batch.dtype).itemsize
        view = slot[batch.offset : batch.offset + nbytes].view(dtype).view(batch.shape)
        return to_tensor(view)
    if isinstance(batch, Stacked):
        return to_tensor(torch.from_numpy(batch.array))
    if isinstance(batch, torch.Tensor):
        return to_tensor(batch)
    return [torch.from_numpy(v.array) if isinstance(v, Array) else v for v in batch]
