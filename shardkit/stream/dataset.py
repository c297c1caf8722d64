"""``ShardDataset`` streams packed shards into PyTorch (``FolderDataset``, the per-file baseline,
is in ``shardkit.stream.folder`` and re-exported here).

Splitting (``shardkit.stream.partition``, planned by ``shardkit.stream.planner``): every epoch
the shard list is permuted from (seed, epoch) identically on every rank, laid end to end as one
stream of N samples, and cut into ``world_size`` contiguous rank parts, each into
``num_workers`` contiguous worker parts. Cuts fall between samples, not shards, so one shard can
feed several workers: no worker idles and no rank is empty even with a single shard.
``equalize`` makes ranks equal for DDP:

- ``"pad"`` (default, like DistributedSampler): every rank yields ceil(N / world_size); the few
  extra samples are re-read from the start of the epoch's stream.
- ``"drop"``: every rank yields floor(N / world_size); the tail of the epoch's stream (a different
  one each epoch when shuffling) is skipped.
- ``"none"``: ranks yield parts differing by at most one sample; for evaluation, where every
  sample must be seen exactly once and ranks need not step in lockstep.

``len(ds)`` is what this rank yields per epoch, all its DataLoader workers together.
"""

from __future__ import annotations

import os
import secrets
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import InputError, check_choice, check_int
from ..formats import FORMATS
from ..images.geometry import Decode, Geometry, TensorDecoder, sample_seed
from ..records import Record, ShardSlice, ShardTable
from .fields import Boxes, field_spec, sample_geometry
from .folder import FolderDataset  # the per-file baseline, re-exported
from .mix import (
    MixedSource,
    Source,
    apportion,
    check_weights,
    mix_facts,
    mix_records,
)
from .partition import EpochLayout, MixLayout, rank_samples, sample_counts
from .planner import (
    MixPlan,
    arrange,
    rank_state,
    samples_left,
    worker_counts_state,
    worker_left,
    worker_plan,
)
from .resume import EpochState, Facts, count_delivered, dataset_facts
from .retired import translate
from .selection import Selection, mixed_classes, resolve_mixed, resolve_plain, select
from .shuffle import Order, shuffle_buffer
from .stages import (
    EXTRAS,
    ON_ERROR_MODES,
    apply_transforms,
    check_labels,
    decode_records,
    extras_of,
    file_identity,
    manifest_unchanged,
    read_slices,
)
from .storage import Storage
from .world import World, current_world, distributed_rank

__all__ = ["DatasetSeam", "Decode", "FolderDataset", "Order", "ShardDataset", "Source"]


def _pil_collate(batch, *, collate_fn_map=None):
    raise InputError(
        'DataLoader cannot batch PIL images: ShardDataset/FolderDataset decode="pil" (the '
        'default, for PIL transforms) yields PIL images; pass decode="tensor" for uint8 CHW '
        "tensors, or a transform= that returns tensors (or a collate_fn of your own)"
    )


def _hint_pil_collate() -> None:
    """torch's default_collate meets a PIL image with its own TypeError, which does not say
    what to change here; teach it our hint for that one type (nothing else changes)."""
    try:
        from PIL import Image
        from torch.utils.data._utils.collate import default_collate_fn_map
    except ImportError:  # pragma: no cover - a torch without the registry: its own error stays
        return
    default_collate_fn_map.setdefault(Image.Image, _pil_collate)


_hint_pil_collate()

# Layout of the shared int64 state tensor (shared memory, so persistent workers see updates).
_EPOCH, _LAST_STARTED, _WARNED, _SKIPPED = 0, 1, 2, 3
_SKIP_SLOTS = 256  # one skip counter per worker id (mod 256): no lost updates between workers
# Per worker id: the token of the loaded state it resumed from, so each resumes only once.
_RESUMED = _SKIPPED + _SKIP_SLOTS
_IN_WORKERS = _RESUMED + _SKIP_SLOTS  # 1 once DataLoader workers iterated this dataset
_STATE_LEN = _IN_WORKERS + 1


@dataclass(frozen=True)
class DatasetSeam:
    """What a reader that runs a dataset's stages in its own workers (``ShardLoader``) reads of
    the dataset: the option groups whole, and the dataset's epoch bookkeeping as calls. The one
    door (``ShardDataset.seam()``), so such a reader touches no loose or private attribute and
    a change inside the dataset shows here first."""

    decode: Decode
    order: Order
    seed: int
    rank: int
    world_size: int
    extras: tuple[str, ...]
    fields: tuple[str, ...]
    field_decoders: tuple | None
    boxes: Boxes | None
    transform: Callable | None
    target_transform: Callable | None
    sample_transform: Callable | None
    on_error: str
    #: what a checkpoint must agree on (``stream.resume.dataset_facts``)
    facts: dict
    #: ``(world, mark=True) -> epoch``: the epoch an iteration reads (warns on a repeat)
    start_epoch: Callable
    #: ``(world, epoch) -> EpochState | None``: the loaded state, once per worker
    take_resume: Callable
    #: ``(worker) -> () -> None``: counts one sample skipped under ``on_error="skip"``
    skip_counter: Callable
    #: ``(world, epoch, resume, batch_size) -> records``: the stored records a worker reads
    records_from: Callable
    #: ``(epoch) -> TensorDecoder``: bytes -> uint8 CHW tensor for ``decode``, bound to epoch
    tensor_decoder: Callable

    @property
    def geometry(self) -> Geometry | None:
        return self.decode.geometry


class ShardDataset(IterableDataset):
    """Stream tar or LMDB shards across DataLoader workers and DDP ranks, shuffled per epoch.

    ::

        ds = ShardDataset("out/*.tar", transform=my_transform)
        loader = DataLoader(ds, batch_size=64, num_workers=4, persistent_workers=True)
        for epoch in range(10):
            ds.set_epoch(epoch)
            for images, labels in loader: ...

    ``source``: glob, brace pattern, list of shards, shard directory or its manifest.json (local
    or URL), or ``Source``s (what to read: subsets, splits, weights; below). The options come in
    groups, each one value checked at construction:

    - ``decode``: what a stored image becomes, a ``shardkit.Decode`` (shardkit.images.geometry)
      or its mode alone: "pil" (RGB PIL image), "tensor" (uint8 CHW RGB tensor) or "raw" (stored
      bytes). ``Decode(crop=RandomResizedCrop(224), flip=True)`` gives fixed-size images in one
      pass: the crop object (``CenterCrop(224, resize_short=256)``, ``RandomCrop``, or any object
      with ``size`` and ``box(height, width, uniforms)``) chooses its box from the header in the
      workers and only it is decoded; the randomness is a function of (seed, epoch, rank, key),
      so runs repeat. ``max_pixels``: an image whose header declares more is undecodable (default
      100 megapixels; None: no limit). ``dct="fast"``: libjpeg-turbo's fast integer IDCT, FFCV's
      default, within ``images.decode.FAST_DCT_DIFFERENCE`` levels of the accurate one.
    - ``order``: a ``shardkit.Order(shuffle, buffer_size, equalize)`` (shardkit.stream.shuffle);
      ``Order.sequential()`` reads every sample once in packed order (evaluation). With ``seed``
      it is what a checkpoint must agree on. ``seed`` also seeds crops and subsets.
    - ``storage``: how shards are opened (see shardkit.stream.storage): ``RemoteStorage(
      storage_options=, cache_dir=, cache_limit=, prefetch=)`` configures URL sources (local
      ones are read by ``LocalStorage``); a mixture gives each ``Source`` its own copy.

    ``with_keys=True`` yields ``(image, label, key)``; ``with_keys=("key", "source")`` adds after
    the key the position of the sample's ``Source`` in a mixture (0 without one;
    ``ds.source_names`` names them). ``fields=("txt", "json", "seg.png")`` (tar and LMDB): each
    sample gains those fields after the key, decoded by extension (``txt`` str, ``json`` object,
    ``cls`` int, image types uint8 CHW tensors with their stored channels, ``npy`` arrays;
    others bytes); a mapping chooses per field (``{"json": "raw"}``, a callable on the bytes;
    see shardkit.stream.fields); a sample lacking one is an error naming shard and key (skipped
    under ``on_error="skip"``), except a field its ``Source(fields=...)`` leaves out: None. With
    ``decode="raw"`` a sequence gives the stored bytes, None where a sample has none.
    ``on_error="skip"`` warns and counts undecodable samples in ``ds.skipped`` instead of raising
    (that rank then yields fewer than ``len(ds)``). ``rank``/``world_size`` override distributed
    discovery (which happens here, at construction, like DistributedSampler: build the dataset
    after ``init_process_group`` or under torchrun).

    Image fields (masks, ``seg.png``) get the image's crop, a nearest-neighbour resize and its
    flip; a mask of another size than its image is an error naming shard and key (a skip under
    ``on_error="skip"``). ``boxes=Boxes("json", key="boxes", format="xywh")`` (see
    shardkit.stream.fields) reads pixel boxes from a requested field and moves them likewise:
    each sample ends with ``boxes``, float32 (K, 4) xyxy in output pixels (boxes cut to nothing
    dropped), and ``box_index``, the int64 (K,) positions of the kept boxes in the stored list.

    ``sample_transform``: instead of ``transform``, a callable taking the whole sample as a dict
    (``image``, ``label``, ``key``, ``source``, each field by name, ``boxes``/``box_index``, and
    ``seed``, a 63-bit int from (seed, epoch, key) only, for ``torch.Generator().manual_seed``);
    what it returns is the sample. Its augmentations repeat whatever the number of workers.

    ``batch_size``: give the DataLoader's batch size and worker parts are cut at whole batches, so
    ``DataLoader(ds, batch_size=B, num_workers=N)`` yields exactly ``len(loader)`` batches, at
    most one of them partial, the same number on every rank.

    ``state_dict()`` / ``load_state_dict(state)`` checkpoint the position in the epoch (plain
    data; see shardkit.stream.resume): resuming reads and decodes nothing already delivered,
    continues in the same order, and may change the world size (the rest of the epoch is re-split).

    Choosing what to read (shardkit.stream.mix, docs/mixing.md): ``source`` may be a list of
    ``Source(path, weight=...)``, mixed with exact per-epoch shares and stratified so every batch
    follows the weights; ``epoch_size`` fixes the samples per epoch (any dataset); a ``Source``'s
    ``subset`` (a fraction or a list of keys) and ``split`` ("train"/"val", about
    ``val_fraction`` of the keys in "val", by a hash of the key alone: the same for every seed,
    across re-packs and as the dataset grows) narrow it: ``ShardDataset(Source("out/",
    split="val"))``. ``labels="union"`` maps the sources' labels onto the union of their class
    names; "keep" (default) leaves each source's stored labels.

    The keywords these groups replaced (``size``, ``crop``, ``flip``, ``max_pixels``, ``dct``,
    ``shuffle``, ``buffer_size``, ``equalize``, ``subset``, ``split``, ``val_fraction``,
    ``storage_options``, ``cache_dir``, ``cache_limit``, ``prefetch``) still work for one
    release, with a ``FutureWarning`` that prints the new spelling (shardkit.stream.retired).
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str | os.PathLike] | Source | Sequence[Source],
        *,
        decode: str | Decode = "pil",
        order: Order | None = None,
        seed: int = 0,
        fields: Sequence[str] | Mapping[str, str | Callable] = (),
        boxes: Boxes | None = None,
        with_keys: bool | str | Sequence[str] = False,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        sample_transform: Callable[[dict], object] | None = None,
        on_error: str = "raise",
        storage: Storage | None = None,
        epoch_size: int | None = None,
        labels: str = "keep",
        batch_size: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        **retired,
    ):
        super().__init__()
        source, decode, order, storage = translate(
            retired, source=source, decode=decode, order=order, storage=storage
        )
        #: what a stored image becomes (``shardkit.Decode``); a mode string stands for Decode(mode)
        self.decode: Decode = Decode.of(decode)
        if order is not None and not isinstance(order, Order):
            raise InputError(f"order={order!r}: give a shardkit.Order (or Order.sequential())")
        #: how an epoch is ordered and cut (``shardkit.Order``)
        self.order: Order = order if order is not None else Order()
        check_choice("on_error", on_error, ON_ERROR_MODES)
        self.batch_size = check_int("batch_size", batch_size, 1, none=True, hint=" or None")
        self.transform = transform
        self.target_transform = target_transform
        self.seed = check_int("seed", seed, 0)
        #: what follows the label: ("key",) for with_keys=True, ("key", "source") ...
        self.extras = extras_of(with_keys)
        self.with_keys = "key" in self.extras
        self.on_error = on_error
        self.fields, self.field_decoders = field_spec(fields, self.decode.mode)
        self.boxes = boxes
        if boxes is not None and (self.geometry is None or self.field_decoders is None):
            raise InputError(
                "boxes= moves boxes with the image's crop: pass decode=Decode(crop=...), with "
                "the boxes' field in fields="
            )
        if sample_transform is not None and (transform is not None or target_transform):
            raise InputError(
                "sample_transform= takes the whole sample (image, label, key, fields); give it "
                "alone, not with transform=/target_transform= (do both in it)"
            )
        self.sample_transform = sample_transform
        self.rank, self.world_size = distributed_rank(
            check_int("rank", rank, 0, none=True), check_int("world_size", world_size, 1, none=True)
        )
        self.sources: tuple[MixedSource, ...] = ()
        self.shares: tuple[int, ...] = ()
        self._layouts: dict[int, MixLayout] = {}
        self.labels = labels
        #: what is read (``stream.selection``): a path and its one ``Source`` read alike
        self.selection: Selection = select(
            source, epoch_size=epoch_size, labels=labels, fields=self.fields
        )
        if not self.selection.plain:
            self._init_mix(self.selection, storage)
            return
        resolved, storage, shards = resolve_plain(self.selection, storage)
        self.storage: Storage = storage
        #: the shard list as columns (``ShardTable``): ``shards[i]`` is shard i's ``ShardInfo``
        self.shards: ShardTable = shards
        self.shard_format: str = resolved.format
        self.classes: list[str] | None = list(resolved.classes) if resolved.classes else None
        self.manifest_path = resolved.manifest_path
        self._manifest_identity = file_identity(self.manifest_path)
        self.counts: np.ndarray = sample_counts(self.shards)
        self.num_samples = int(self.counts.sum())
        self._finish_init(self.selection.name)

    def _init_mix(self, selection: Selection, storage) -> None:
        """Resolve each ``Source`` (``stream.selection.resolve_mixed``) and its share."""
        resolved: list[MixedSource] = []
        offset = 0
        for src in selection.sources:
            mixed = resolve_mixed(
                src, storage, seed=self.seed, offset=offset, fields=self.fields,
                field_decoders=self.field_decoders, boxes=self.boxes,
            )  # fmt: skip
            resolved.append(mixed)
            offset += int(mixed.shards.samples.sum())
        weights = [s.source.weight for s in resolved]
        if any(w is None for w in weights) and any(w is not None for w in weights):
            raise InputError(
                "give every Source a weight= or none (then shares follow the sources' sizes)"
            )
        if weights[0] is None:
            weights = [len(s.members) for s in resolved]
        check_weights(weights, [s.source.name for s in resolved])
        epoch_size = selection.epoch_size
        total = int(epoch_size) if epoch_size is not None else sum(len(s.members) for s in resolved)
        shares = apportion(total, weights)
        self.classes = mixed_classes(resolved, self.labels)
        self.sources, self.shares = tuple(resolved), tuple(shares)
        self.shards = ShardTable.concat(m.shards for m in resolved)
        formats = {m.format for m in resolved}
        self.shard_format = formats.pop() if len(formats) == 1 else "mixed"
        self.storage = resolved[0].storage
        self.manifest_path = None
        self._manifest_identity = None  # each source checks its own manifest (MixedSource)
        self.counts = sample_counts(self.shards)
        self.num_samples = total
        self._finish_init(", ".join(m.source.name for m in resolved))
        self._facts.update(mix_facts(resolved, shares, self.labels))

    def _finish_init(self, where: str) -> None:
        self._where = where
        if self.num_samples == 0:
            raise InputError(f"{where}: the shards hold no samples")
        if self.order.equalize != "pad" and self.num_samples < self.world_size:
            raise InputError(
                f"{where}: {self.num_samples} samples cannot give each of {self.world_size} "
                f'ranks one with Order(equalize="{self.order.equalize}"); use equalize="pad"'
            )
        self._state = torch.zeros(_STATE_LEN, dtype=torch.int64).share_memory_()
        self._state[_LAST_STARTED] = -1
        self._facts = Facts(
            dataset_facts(
                self.shards, self.counts, self.shard_format, seed=self.seed, order=self.order
            )
        )
        self._resume: EpochState | None = None  # a loaded state, until each worker resumed it
        self._resume_token = 0
        self._resume_local = False  # loaded inside a DataLoader worker (StatefulDataLoader)
        self._progress = None  # this process's live position (shardkit.stream.resume.Progress)

    # --- the option groups, read whole by readers (ShardLoader) ------------------------------

    def seam(self) -> DatasetSeam:
        """What ``ShardLoader`` reads of this dataset (see ``DatasetSeam``)."""
        return DatasetSeam(
            decode=self.decode, order=self.order, seed=self.seed, rank=self.rank,
            world_size=self.world_size, extras=self.extras, fields=tuple(self.fields),
            field_decoders=self.field_decoders, boxes=self.boxes, transform=self.transform,
            target_transform=self.target_transform, sample_transform=self.sample_transform,
            on_error=self.on_error, facts=self._facts, start_epoch=self._start_epoch,
            take_resume=self._take_resume, skip_counter=self._skip_counter,
            records_from=self.records_from, tensor_decoder=self.tensor_decoder,
        )  # fmt: skip

    @property
    def geometry(self) -> Geometry | None:
        """The fixed-size output of ``decode`` (None: each image keeps its size)."""
        return self.decode.geometry

    # The flat attributes of before the groups, read from them: the stages inside this module
    # use them, and user code reading ``ds.shuffle`` keeps working.

    @property
    def shuffle(self) -> bool:
        return self.order.shuffle

    @property
    def buffer_size(self) -> int:
        return self.order.buffer_size

    @property
    def equalize(self) -> str:
        return self.order.equalize

    @property
    def max_pixels(self) -> int | None:
        return self.decode.max_pixels

    @property
    def dct(self) -> str:
        return self.decode.dct

    @property
    def source_names(self) -> tuple[str, ...]:
        """What a sample's ``source`` (``with_keys=("key", "source")``) indexes: each
        ``Source``'s path in a mixture, else the one source."""
        if self.sources:
            return tuple(s.source.name for s in self.sources)
        return (self._where,)

    # --- epochs -------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows (persistent workers too)."""
        if epoch < 0:
            raise InputError(f"epoch must be >= 0, got {epoch}")
        self._state[_EPOCH] = int(epoch)
        if self._resume is not None and self._resume.epoch != epoch:
            self._resume = None  # a loaded state continues its own epoch only

    @property
    def epoch(self) -> int:
        return int(self._state[_EPOCH])

    @property
    def skipped(self) -> int:
        """Samples skipped by ``on_error="skip"`` so far, summed over all workers."""
        return int(self._state[_SKIPPED:_RESUMED].sum())

    @property
    def urls(self) -> tuple[str, ...]:
        """The shard URLs (or paths), in the dataset's shard order."""
        return tuple(self.shards.urls)

    def __len__(self) -> int:
        return rank_samples(self.num_samples, self.rank, self.world_size, self.order.equalize)

    def plan(
        self, world: World | None = None, epoch: int | None = None, batch_size: int | None = None
    ) -> list[ShardSlice]:
        """The slices one worker reads in an epoch (default: the caller's, current epoch);
        ``batch_size`` cuts worker parts at its multiples (``stream.worker_span``). A mixture
        (or a subset, split, epoch_size) reads each source's slices in turn, interleaved by
        its schedule: they are listed source by source, shard numbers in ``ds.shards``; a
        subset's slices are the runs read, which may hold samples it passes over."""
        world = world or current_world(self.rank, self.world_size)
        epoch = self.epoch if epoch is None else epoch
        plan = worker_plan(
            self._layout(epoch), world, self._facts, batch_size=batch_size or self.batch_size
        )
        if not isinstance(plan, MixPlan):
            return plan.slices
        out, first = [], 0
        for s, p in zip(self.sources, plan.sources, strict=True):
            out += [ShardSlice(first + sl.shard, sl.start, sl.stop) for sl in p.slices]
            first += len(s.shards)
        return out

    def _start_epoch(self, world: World, *, mark: bool = True) -> int:
        """The epoch an iteration reads, warning once when it repeats one already read.
        ``mark=False`` (a plain iteration): the epoch counts as read only once the iteration
        ends, so peeking at a sample (``next(iter(ds))``) before a loader warns of nothing."""
        epoch = int(self._state[_EPOCH])
        if world.worker == 0 and self.order.shuffle:
            if int(self._state[_LAST_STARTED]) == epoch and not int(self._state[_WARNED]):
                self._state[_WARNED] = 1
                warnings.warn(
                    f"ShardDataset iterated epoch {epoch} again: the order repeats. Call "
                    "ds.set_epoch(epoch) before each epoch to get a new order.",
                    RuntimeWarning,
                    stacklevel=4 if not mark else 3,
                )
            if mark:
                self._state[_LAST_STARTED] = epoch
        return epoch

    def _read_to_the_end(self, samples: Iterator, world: World, epoch: int) -> Iterator:
        yield from samples
        if world.worker == 0:
            self._state[_LAST_STARTED] = epoch

    # --- the pipeline ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple]:
        world = current_world(self.rank, self.world_size)
        epoch = self._start_epoch(world, mark=False)
        return self._read_to_the_end(self._samples(world, epoch), world, epoch)

    def _samples(self, world: World, epoch: int) -> Iterator[tuple]:
        records = self.records(world, epoch)
        decoder = self.tensor_decoder(epoch) if self.decode.mode == "tensor" else None
        geometry = None
        if self.geometry is not None and self.field_decoders is not None:
            geometry = sample_geometry(decoder, self.fields, self.field_decoders, self.boxes)
        samples = decode_records(
            records,
            self.decode,
            on_error=self.on_error,
            with_keys=EXTRAS if self.sample_transform is not None else self.extras,
            skipped=self._skip_counter(world.worker),
            fields=self.fields,
            decoder=decoder,
            field_decoders=self.field_decoders,
            geometry=geometry,
        )
        if self.sample_transform is not None:
            return self._whole_samples(samples, epoch)
        if self.transform is not None or self.target_transform is not None:
            samples = apply_transforms(samples, self.transform, self.target_transform)
        return samples

    def _whole_samples(self, samples: Iterator[tuple], epoch: int) -> Iterator:
        """``sample_transform(dict)`` per sample: its image, label, key, fields by name
        (``boxes``/``box_index`` with ``boxes=``) and ``seed``, a function of (seed, epoch, key)
        only, so its augmentation repeats whatever worker or worker count reads the sample."""
        names = ("image", "label", *EXTRAS, *self.fields)
        if self.boxes is not None:
            names += ("boxes", "box_index")
        for sample in samples:
            item = dict(zip(names, sample, strict=True))
            item["seed"] = sample_seed(self.seed, epoch, item["key"])
            yield self.sample_transform(item)

    def tensor_decoder(self, epoch: int) -> TensorDecoder:
        """Bytes -> uint8 CHW tensor with this dataset's geometry, bound to ``epoch``."""
        return TensorDecoder.of(self.decode, self.seed, epoch, self.rank)

    def records(self, world: World, epoch: int, batch_size: int | None = None) -> Iterator[Record]:
        """The stored records worker ``world.worker`` delivers in ``epoch``, in order: plan ->
        read -> (resumed: arrange) -> shuffle buffer -> count. ``batch_size`` (default: the
        dataset's) cuts worker parts at whole batches. A loaded state is continued once per
        worker; what leaves the buffer is counted for ``state_dict``."""
        return self.records_from(world, epoch, self._take_resume(world, epoch), batch_size)

    def records_from(
        self,
        world: World,
        epoch: int,
        resume: EpochState | None,
        batch_size: int | None = None,
    ) -> Iterator[Record]:
        """``records`` continuing ``resume`` (None: from the epoch's start) as told, not taken
        from this process's loaded state: ShardLoader's worker processes persist across
        ``load_state_dict`` calls, so the loader takes each worker's state and sends it."""
        in_worker = get_worker_info() is not None
        if in_worker:
            self._state[_IN_WORKERS] = 1
        epoch = epoch if resume is None else resume.epoch
        plan = worker_plan(
            self._layout(epoch), world, self._facts, resume,
            batch_size=batch_size or self.batch_size, in_worker=in_worker,
        )  # fmt: skip
        self._progress = plan.progress
        if isinstance(plan, MixPlan):
            records = mix_records(plan, self.sources, fields=self.fields, order=self.order)
            return count_delivered(records, plan.progress)
        unchanged = None
        if self._manifest_identity is not None:
            unchanged = manifest_unchanged(self.manifest_path, self._manifest_identity)
        records = read_slices(
            plan.slices, self.shards, FORMATS[self.shard_format], self.storage,
            fields=self.fields, unchanged=unchanged,
        )  # fmt: skip
        if self.classes:
            records = check_labels(records, len(self.classes))
        if plan.arrangement is not None:  # resumed: buffer residents first, then the unread rest
            records = arrange(records, plan.arrangement)
        if self.order.shuffle and self.order.buffer_size > 1:
            records = shuffle_buffer(records, self.order.buffer_size, plan.rng, resume=plan.buffer)
        return count_delivered(records, plan.progress)

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(
        self,
        *,
        batches: int | None = None,
        num_workers: int = 0,
        batch_size: int | None = None,
    ) -> dict:
        """The position in the current epoch, as plain data (``json`` / ``torch.save``).

        Without arguments: what this process has delivered (``num_workers=0``, or called inside
        a DataLoader worker, as torchdata's ``StatefulDataLoader`` does). A plain DataLoader's
        workers are other processes: pass ``batches`` (batches the loop has taken since it
        started, e.g. ``enumerate``'s count), the loader's ``num_workers`` and, unless the
        dataset has one, ``batch_size``; the position is then worked out, not observed.
        """
        epoch = self.epoch
        resume = self._resume if self._resume is not None and self._resume.epoch == epoch else None
        if batches is not None:
            size = batch_size or self.batch_size
            if not size:
                raise InputError("state_dict(batches=...) needs batch_size= (the DataLoader's)")
            return self.position(
                batches, num_workers=max(1, num_workers), batch_size=size, cut=self.batch_size
            )
        progress = self._progress
        if progress is not None and (progress.epoch == epoch or get_worker_info() is not None):
            return progress.snapshot().to_dict()  # a worker's progress is its iteration's
        if resume is not None:
            return resume.to_dict()
        if int(self._state[_IN_WORKERS]):
            raise InputError(
                "ShardDataset.state_dict(): DataLoader worker processes iterated this dataset "
                "and this process cannot see how far; pass batches= and num_workers= (and "
                "batch_size=), or use torchdata's StatefulDataLoader or shardkit.ShardLoader"
            )
        start = EpochState.start(epoch, self.rank, self._facts, self.world_size)
        return start.to_dict()

    def position(self, batches: int, *, num_workers: int, batch_size: int, cut: int | None) -> dict:
        """The state after ``batches`` batches of ``batch_size`` were dealt, DataLoader-style
        (in turn, skipping exhausted streams), from ``num_workers`` worker streams whose parts
        were cut at multiples of ``cut`` (``records(batch_size=cut)``), counted from the loaded
        state or the epoch's start. ``ShardLoader.state_dict`` is this with its batch size."""
        if batches < 0:
            raise InputError(f"batches={batches} must be >= 0")
        epoch = self.epoch
        resume = self._resume if self._resume is not None and self._resume.epoch == epoch else None
        state = rank_state(
            self._layout(epoch), self._facts, resume, rank=self.rank, world_size=self.world_size,
            num_workers=num_workers, batch_size=batch_size, batches=batches, cut=cut,
        )  # fmt: skip
        return state.to_dict()

    def worker_position(
        self, consumed: Sequence[int], next_worker: int, *, cut: int | None
    ) -> dict:
        """The state after DataLoader-numbered worker ``i`` took ``consumed[i]`` records of this
        epoch (skipped ones included) and worker ``next_worker`` is due next, counted from the
        loaded state or the epoch's start. ``ShardLoader.state_dict``: its workers report every
        record a batch took, so a checkpoint after skipped samples replays nothing."""
        epoch = self.epoch
        resume = self._resume if self._resume is not None and self._resume.epoch == epoch else None
        state = worker_counts_state(
            self._layout(epoch), self._facts, resume, rank=self.rank, world_size=self.world_size,
            num_workers=len(consumed), cut=cut, consumed=consumed, next_worker=next_worker,
        )  # fmt: skip
        return state.to_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue the epoch ``state`` was saved in, from where it stood, on the next iteration:
        no ``set_epoch`` needed. A state from another world size re-splits what is left."""
        parsed = EpochState.from_dict(state, self._facts)
        if parsed.segments[-1].world_size != self.world_size:
            parsed.on_world(self.world_size, 1, None)  # raises now if it cannot re-split
        self._state[_LAST_STARTED] = -1
        self._resume_token = secrets.randbits(62) + 1
        self._progress = None
        layout = self._layout(parsed.epoch)
        if get_worker_info() is not None:
            # StatefulDataLoader hands each worker its own state. It resumes the saved epoch
            # whatever the shared epoch says; only a worker with samples left writes the epoch,
            # so a state saved at an epoch's end cannot undo the set_epoch of the next one.
            self._resume, self._resume_local = parsed, True
            world = current_world(self.rank, self.world_size)
            if worker_left(layout, parsed, world, self.batch_size) != 0:
                self._state[_EPOCH] = parsed.epoch
            return
        self._resume_local = False
        if samples_left(layout, parsed) == 0:  # saved at the epoch's end: the next one follows
            self._resume = None
            self._state[_EPOCH] = parsed.epoch + 1
            return
        self._resume = parsed
        self._state[_EPOCH] = parsed.epoch

    def _take_resume(self, world: World, epoch: int) -> EpochState | None:
        """The loaded state if this worker has not resumed from it yet (then it has)."""
        if self._resume is None or (self._resume.epoch != epoch and not self._resume_local):
            return None
        slot = _RESUMED + world.worker % _SKIP_SLOTS
        if int(self._state[slot]) == self._resume_token:
            return None
        self._state[slot] = self._resume_token
        return self._resume

    def _layout(self, epoch: int) -> EpochLayout:
        if self.sources:
            layout = self._layouts.get(epoch)
            if layout is None:
                layout = MixLayout.build(
                    self.sources, self.shares, seed=self.seed, epoch=epoch, order=self.order
                )
                self._layouts = {epoch: layout}  # one epoch at a time: bounded memory
            return layout
        return EpochLayout(self.counts, self.seed, epoch, self.order)

    def _skip_counter(self, worker: int) -> Callable[[], None]:
        state, slot = self._state, _SKIPPED + worker % _SKIP_SLOTS

        def skipped() -> None:
            state[slot] += 1

        return skipped

    def __repr__(self) -> str:
        what = f"{len(self.shards)} {self.shard_format} shards, {self.num_samples} samples"
        if self.sources:
            what = f"{len(self.sources)} sources {list(self.shares)} of " + what.replace(
                " samples", " per epoch"
            )
        return (
            f"ShardDataset({what}, rank {self.rank}/{self.world_size}, "
            f"decode={self.decode!r}, order={self.order!r}"
            + (f", batch_size={self.batch_size})" if self.batch_size else ")")
        )
