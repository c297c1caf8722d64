"""``ShardDataset`` streams packed shards into PyTorch (``FolderDataset``, the per-file baseline,
is in ``shardkit.stream.folder`` and re-exported here).

Splitting (see ``shardkit.stream.stages.plan_epoch``): every epoch the shard list is permuted from
(seed, epoch) identically on every rank, laid end to end as one stream of N samples, and cut into
``world_size`` contiguous rank parts, each into ``num_workers`` contiguous worker parts. Cuts fall
between samples, not shards, so one shard can feed several workers: no worker idles and no rank is
empty even with a single shard. ``equalize`` makes ranks equal for DDP:

- ``"pad"`` (default, like DistributedSampler): every rank yields ceil(N / world_size); the few
  extra samples are re-read from the start of the epoch's stream.
- ``"drop"``: every rank yields floor(N / world_size); the tail of the epoch's stream (a different
  one each epoch when shuffling) is skipped.
- ``"none"``: ranks yield parts differing by at most one sample; for evaluation, where every
  sample must be seen exactly once and ranks need not step in lockstep.

``len(ds)`` is what this rank yields per epoch, all its DataLoader workers together.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import InputError, ShardkitError, StorageError, check_choice
from ..formats import FORMATS
from ..images.decode import DEFAULT_MAX_PIXELS
from ..images.geometry import Geometry, TensorDecoder, sample_seed
from ..paths import check_source
from ..records import UNKNOWN, Record, ShardInfo, ShardSlice
from ..sizes import parse_size
from .fields import Boxes, field_spec, sample_geometry
from .folder import FolderDataset  # the per-file baseline, re-exported
from .indexes import all_keys, split_hashes, split_positions, warn_unindexed
from .mix import (
    LABEL_MODES,
    MixedSource,
    MixLayout,
    Source,
    apportion,
    check_weights,
    key_hashes,
    mix_facts,
    mix_records,
    mix_worker_plan,
    subset_members,
)
from .resume import (
    EpochLayout,
    EpochState,
    arrange,
    count_delivered,
    dataset_facts,
    rank_state,
    samples_left,
    worker_counts_state,
    worker_left,
    worker_plan,
)
from .shuffle import DEFAULT_BUFFER_SIZE, shard_order, shuffle_buffer
from .sources import resolve_source
from .stages import (
    DCT_MODES,
    DECODE_MODES,
    EQUALIZE_MODES,
    EXTRAS,
    ON_ERROR_MODES,
    apply_transforms,
    check_labels,
    decode_records,
    extras_of,
    file_identity,
    manifest_unchanged,
    plan_epoch,
    rank_samples,
    read_slices,
    sample_counts,
)
from .storage import Storage, storage_for
from .world import World, current_world, distributed_rank

__all__ = ["ShardDataset", "FolderDataset", "Source"]


def _geometry(decode: str, size, crop, flip) -> Geometry | None:
    """The fixed-size output asked for: ``size=`` with a shorthand crop, or a crop object."""
    if size is None and isinstance(crop, str):
        return None
    if decode != "tensor":
        what = f"size={size}" if size is not None else f"crop={crop!r}"
        raise InputError(f'{what} needs decode="tensor" (got decode={decode!r})')
    return Geometry(None if size is None else int(size), crop, bool(flip))


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


class ShardDataset(IterableDataset):
    """Stream tar or LMDB shards across DataLoader workers and DDP ranks, shuffled per epoch.

    ::

        ds = ShardDataset("out/*.tar", transform=my_transform)
        loader = DataLoader(ds, batch_size=64, num_workers=4, persistent_workers=True)
        for epoch in range(10):
            ds.set_epoch(epoch)
            for images, labels in loader: ...

    ``source``: glob, brace pattern, list of shards, shard directory or its manifest.json (local
    or URL). ``decode``: "pil" (RGB PIL image), "tensor" (uint8 CHW RGB tensor) or "raw" (stored
    bytes). ``shuffle=False`` reads shards in order with no buffer (evaluation). ``buffer_size``:
    samples held per worker for the sample-level shuffle. ``with_keys=True`` yields ``(image, label,
    key)``; ``with_keys=("key", "source")`` adds after the key the position of the sample's
    ``Source`` in a mixture (0 without one; ``ds.source_names`` names them). ``fields=("txt",
    "json", "seg.png")`` (tar and LMDB): each sample gains those fields after the key, decoded by
    extension (``txt`` str, ``json`` object, ``cls`` int, image types uint8 CHW tensors with their
    stored channels, ``npy`` arrays; others bytes); a mapping chooses per field (``{"json":
    "raw"}``, a callable on the bytes; see shardkit.stream.fields); a sample lacking one is an error
    naming shard and key (skipped under ``on_error="skip"``). With ``decode="raw"`` a sequence gives
    the stored bytes, None where a sample has none. ``on_error="skip"`` warns and counts undecodable
    samples in ``ds.skipped`` instead of raising (that rank then yields fewer than ``len(ds)``).
    ``max_pixels``: an image whose header declares more pixels is undecodable, refused before any
    pixel is decoded (default 100 megapixels; None: no limit). ``dct="fast"`` (``decode="tensor"``):
    libjpeg-turbo's fast integer IDCT for JPEGs, FFCV's default: faster, pixels within
    ``images.decode.FAST_DCT_DIFFERENCE`` levels of the accurate default (see docs/loader.md).
    ``rank``/``world_size`` override distributed discovery (which happens here, at construction,
    like DistributedSampler: build the dataset after ``init_process_group`` or under torchrun).
    ``storage`` overrides how shards are opened (see shardkit.stream.storage); ``storage_options``,
    ``cache_dir``, ``cache_limit`` (bytes or a size string such as "10GB") and ``prefetch`` (shards
    fetched ahead per worker, 0: none) configure the remote storage built for URL sources; with
    ``storage`` given, ``cache_dir``/``cache_limit`` are refused (pass them to it).

    ``size`` (with ``decode="tensor"``) gives ``size`` x ``size`` uint8 CHW images in one pass
    (see shardkit.images.geometry): ``crop="center"`` (resize the shorter side, center-crop) or
    ``"random"`` (RandomResizedCrop, scale 0.08-1, ratio 3/4-4/3), ``flip=True`` mirrors half of
    them. ``crop`` may instead be a crop object (shardkit.images.crops: ``RandomResizedCrop(224,
    scale=(0.9, 1.0), interpolation="bicubic")``, ``CenterCrop(224, resize_short=256)``,
    ``RandomCrop``, or any object with ``size`` and ``box(height, width, uniforms)``), which
    gives the size; its box is chosen from the header in the workers and only it is decoded.
    The randomness is a function of (seed, epoch, rank, key), so runs repeat. Image
    fields (masks, ``seg.png``) get the image's crop, a nearest-neighbour resize and its flip; a
    mask of another size than its image is an error naming shard and key (a skip under
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
    follows the weights; ``epoch_size`` fixes the samples per epoch (any dataset); ``subset`` (a
    fraction or a list of keys) and ``split`` ("train"/"val", about ``val_fraction`` of the
    keys in "val", by a hash of the key alone: the same for every seed, across re-packs and as
    the dataset grows) narrow one source (with ``Source``s, give them per ``Source``).
    ``labels="union"`` maps the sources' labels onto the union of their class names; "keep"
    (default) leaves each source's stored labels.
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str | os.PathLike] | Source | Sequence[Source],
        *,
        decode: str = "pil",
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        shuffle: bool = True,
        seed: int = 0,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        equalize: str = "pad",
        with_keys: bool | str | Sequence[str] = False,
        on_error: str = "raise",
        fields: Sequence[str] | Mapping[str, str | Callable] = (),
        boxes: Boxes | None = None,
        sample_transform: Callable[[dict], object] | None = None,
        storage: Storage | None = None,
        storage_options: dict | None = None,
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        prefetch: int = 2,
        rank: int | None = None,
        world_size: int | None = None,
        batch_size: int | None = None,
        size: int | None = None,
        crop: str | object = "center",
        flip: bool = False,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        dct: str = "accurate",
        epoch_size: int | None = None,
        subset: float | Sequence[str] | None = None,
        split: str | None = None,
        val_fraction: float = 0.1,
        labels: str = "keep",
    ):
        super().__init__()
        check_choice("decode", decode, DECODE_MODES)
        self.geometry = _geometry(decode, size, crop, flip)
        check_choice("equalize", equalize, EQUALIZE_MODES)
        check_choice("on_error", on_error, ON_ERROR_MODES)
        if buffer_size < 0:
            raise InputError(f"buffer_size={buffer_size} must be >= 0 (0 or 1: no buffer)")
        if max_pixels is not None and (
            isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1
        ):
            raise InputError(f"max_pixels={max_pixels!r} must be an int >= 1, or None (no limit)")
        self.max_pixels = max_pixels
        check_choice("dct", dct, DCT_MODES)
        self.dct = dct
        if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
            raise InputError(f"batch_size must be a whole number >= 1 or None, got {batch_size!r}")
        self.batch_size = None if batch_size is None else int(batch_size)
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise InputError(f"prefetch={prefetch!r} must be an int >= 0 (0: no prefetch)")
        if cache_limit is not None:
            cache_limit = parse_size(cache_limit, "cache_limit", minimum=0)
        if storage is not None and (cache_dir is not None or cache_limit is not None):
            raise InputError(
                "cache_dir/cache_limit configure the storage shardkit builds; with storage= pass "
                "them to that storage instead (e.g. RemoteStorage(cache_dir=...))"
            )
        self.decode = decode
        self.transform = transform
        self.target_transform = target_transform
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.buffer_size = int(buffer_size)
        self.equalize = equalize
        #: what follows the label: ("key",) for with_keys=True, ("key", "source") ...
        self.extras = extras_of(with_keys)
        self.with_keys = "key" in self.extras
        self.on_error = on_error
        self.fields, self.field_decoders = field_spec(fields, decode)
        self.boxes = boxes
        if boxes is not None and (self.geometry is None or self.field_decoders is None):
            raise InputError(
                'boxes= moves boxes with the image\'s crop: pass decode="tensor" and size= (and '
                "crop=, flip=), with the boxes' field in fields="
            )
        if sample_transform is not None and (transform is not None or target_transform):
            raise InputError(
                "sample_transform= takes the whole sample (image, label, key, fields); give it "
                "alone, not with transform=/target_transform= (do both in it)"
            )
        self.sample_transform = sample_transform
        self.rank, self.world_size = distributed_rank(rank, world_size)
        self.sources: tuple[MixedSource, ...] = ()
        self.shares: tuple[int, ...] = ()
        self._layouts: dict[int, MixLayout] = {}
        mixed = _chosen(source, subset, split, val_fraction, storage_options, epoch_size, labels)
        self.labels = labels
        if mixed is not None:
            if storage is not None:
                raise InputError(
                    "storage= is for one plain source; a mixture, subset, split or epoch_size "
                    "builds a storage per source (give storage_options= or cache_dir= instead)"
                )
            self._init_mix(mixed, epoch_size, cache_dir, cache_limit, prefetch)
            return

        check_source(source, storage_options)  # "no such file", "no such bucket": named first
        resolved = resolve_source(source, storage_options=storage_options)
        self.shard_format: str = resolved.format
        self.classes: list[str] | None = list(resolved.classes) if resolved.classes else None
        self.manifest_path = resolved.manifest_path
        self._manifest_identity = file_identity(self.manifest_path)
        self.storage: Storage = storage or storage_for(
            list(resolved.urls),
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            prefetch=prefetch,
        )
        # Counted once here, in the main process, so workers never open a shard just to plan.
        self.shards: tuple[ShardInfo, ...] = _counted(
            resolved.shards, resolved.format, self.storage
        )
        self.counts: np.ndarray = sample_counts(self.shards)
        self.num_samples = int(self.counts.sum())
        self._finish_init(_describe(source))

    def _init_mix(self, mixed, epoch_size, cache_dir, cache_limit, prefetch) -> None:
        """Resolve each ``Source``: shards, storage, the samples it may draw, its share."""
        resolved: list[MixedSource] = []
        offset = 0
        for src in mixed:
            check_source(src.path, src.storage_options)
            r = resolve_source(src.path, storage_options=src.storage_options)
            store = storage_for(
                list(r.urls), storage_options=src.storage_options, cache_dir=cache_dir,
                cache_limit=cache_limit, prefetch=prefetch,
            )  # fmt: skip
            shards = _counted(r.shards, r.format, store)
            size = int(sum(s.samples for s in shards))
            members = np.arange(size, dtype=np.int64)
            opts = src.storage_options
            by_keys = src.subset is not None and _is_keys(src.subset)
            if src.split is not None or src.subset is not None:
                warn_unindexed(shards, r.format, src.name, "split" if src.split else "subset")
            keys = all_keys(shards, r.format, store, opts) if by_keys else None
            if src.split is not None:  # the indexes' hashes: no key read where they exist
                hashes = split_hashes(shards, r.format, store, opts) if keys is None else None
                hashes = key_hashes(keys) if hashes is None else hashes
                members = split_positions(hashes, src.split, src.val_fraction)
            members = subset_members(members, src.subset, self.seed, keys, src.name)
            if len(members) == 0:
                raise InputError(f"{src.name}: no samples to draw (empty shards, subset or split)")
            classes = tuple(r.classes) if r.classes else None
            mixed_source = MixedSource(src, shards, r.format, store, classes, members, offset)
            mixed_source.manifest = (r.manifest_path, file_identity(r.manifest_path))
            resolved.append(mixed_source)
            offset += size
        weights = [s.source.weight for s in resolved]
        if any(w is None for w in weights) and any(w is not None for w in weights):
            raise InputError(
                "give every Source a weight= or none (then shares follow the sources' sizes)"
            )
        if weights[0] is None:
            weights = [len(s.members) for s in resolved]
        check_weights(weights, [s.source.name for s in resolved])
        total = int(epoch_size) if epoch_size is not None else sum(len(s.members) for s in resolved)
        shares = apportion(total, weights)
        self.classes = _mixed_classes(resolved, self.labels)
        self.sources, self.shares = tuple(resolved), tuple(shares)
        self.shards = tuple(s for m in resolved for s in m.shards)
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
        if self.equalize != "pad" and self.num_samples < self.world_size:
            raise InputError(
                f"{where}: {self.num_samples} samples cannot give each of "
                f'{self.world_size} ranks one with equalize="{self.equalize}"; use equalize="pad"'
            )
        self._state = torch.zeros(_STATE_LEN, dtype=torch.int64).share_memory_()
        self._state[_LAST_STARTED] = -1
        self._facts = dataset_facts(
            self.urls,
            self.counts.tolist(),
            self.shard_format,
            seed=self.seed,
            shuffle=self.shuffle,
            buffer_size=self.buffer_size,
            equalize=self.equalize,
        )
        self._resume: EpochState | None = None  # a loaded state, until each worker resumed it
        self._resume_token = 0
        self._resume_local = False  # loaded inside a DataLoader worker (StatefulDataLoader)
        self._progress = None  # this process's live position (shardkit.stream.resume.Progress)

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
        return tuple(s.url for s in self.shards)

    def __len__(self) -> int:
        return rank_samples(self.num_samples, self.rank, self.world_size, self.equalize)

    def plan(
        self, world: World | None = None, epoch: int | None = None, batch_size: int | None = None
    ) -> list[ShardSlice]:
        """The slices one worker reads in an epoch (default: the caller's, current epoch);
        ``batch_size`` cuts worker parts at its multiples (``stream.worker_span``)."""
        if self.sources:
            raise InputError(
                "plan(): a mixture, subset or epoch_size reads positions of several sources, not "
                "one slice list; iterate the dataset (or use ds.state_dict()) instead"
            )
        world = world or current_world(self.rank, self.world_size)
        epoch = self.epoch if epoch is None else epoch
        order = shard_order(len(self.shards), self.seed, epoch, self.shuffle)
        return plan_epoch(
            self.counts,
            order,
            rank=world.rank,
            world_size=world.world_size,
            worker=world.worker,
            num_workers=world.num_workers,
            equalize=self.equalize,
            batch_size=batch_size or self.batch_size,
        )

    def _start_epoch(self, world: World, *, mark: bool = True) -> int:
        """The epoch an iteration reads, warning once when it repeats one already read.
        ``mark=False`` (a plain iteration): the epoch counts as read only once the iteration
        ends, so peeking at a sample (``next(iter(ds))``) before a loader warns of nothing."""
        epoch = int(self._state[_EPOCH])
        if world.worker == 0 and self.shuffle:
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
        decoder = self.tensor_decoder(epoch) if self.decode == "tensor" else None
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
            max_pixels=self.max_pixels,
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
        return TensorDecoder(
            self.geometry, self.seed, epoch, self.rank, self.max_pixels, self.dct == "fast"
        )

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
        if self.sources:
            mixplan = mix_worker_plan(
                self._layout(epoch), self.sources, world, self._facts, resume,
                batch_size=batch_size or self.batch_size, in_worker=in_worker,
            )  # fmt: skip
            self._progress = mixplan.progress
            records = mix_records(
                mixplan, self.sources, fields=self.fields, buffer_size=self.buffer_size,
                shuffle=self.shuffle,
            )  # fmt: skip
            return count_delivered(records, mixplan.progress)
        plan = worker_plan(
            self._layout(epoch), world, self._facts, resume,
            batch_size=batch_size or self.batch_size, in_worker=in_worker,
        )  # fmt: skip
        self._progress = plan.progress
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
        if self.shuffle and self.buffer_size > 1:
            records = shuffle_buffer(records, self.buffer_size, plan.rng, resume=plan.buffer)
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
                    self.sources, self.shares, seed=self.seed, epoch=epoch,
                    shuffle=self.shuffle, buffer_size=self.buffer_size, equalize=self.equalize,
                )  # fmt: skip
                self._layouts = {epoch: layout}  # one epoch at a time: bounded memory
            return layout
        return EpochLayout(
            self.counts, self.seed, epoch, self.shuffle, self.buffer_size, self.equalize
        )

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
            f"ShardDataset({what}, rank {self.rank}/{self.world_size}, decode={self.decode!r}, "
            f"shuffle={self.shuffle}, buffer_size={self.buffer_size}, "
            f"equalize={self.equalize!r}"
            + (f", batch_size={self.batch_size})" if self.batch_size else ")")
        )


def _is_keys(subset) -> bool:
    return not isinstance(subset, (int, float))


def _chosen(source, subset, split, val_fraction, storage_options, epoch_size, labels):
    """The ``Source`` list to mix, or None for one plain source read whole (checks the knobs)."""
    check_choice("labels", labels, LABEL_MODES)
    whole = isinstance(epoch_size, (int, np.integer)) and not isinstance(epoch_size, bool)
    if epoch_size is not None and (not whole or epoch_size < 1):
        raise InputError(
            f"epoch_size={epoch_size!r} must be a whole number >= 1 (an int, samples per epoch) "
            "or None (the sources' sizes)"
        )
    mixed = _as_sources(source, subset, split, val_fraction, storage_options)
    if mixed is None and epoch_size is not None:
        mixed = [Source(source, storage_options=storage_options)]
    if mixed is None and labels != "keep":
        raise InputError(
            'labels="union" maps the class lists of several Source()s; a single source keeps '
            "its labels"
        )
    return mixed


def _as_sources(source, subset, split, val_fraction, storage_options) -> list[Source] | None:
    """The ``Source`` list a dataset mixes, or None for one plain source (no subset/split)."""
    if isinstance(source, Source):
        source = [source]
    many = (
        not isinstance(source, (str, os.PathLike))
        and len(source) > 0
        and all(isinstance(s, Source) for s in source)
    )
    if many:
        if subset is not None or split is not None:
            raise InputError("with Source()s, give subset= and split= to each Source")
        return list(source)
    if not isinstance(source, (str, os.PathLike)) and any(isinstance(s, Source) for s in source):
        raise InputError("a source list mixes Source()s and paths: wrap every path in Source()")
    if subset is None and split is None:
        return None
    return [Source(source, subset=subset, split=split, val_fraction=val_fraction,
                   storage_options=storage_options)]  # fmt: skip


def _mixed_classes(sources: Sequence[MixedSource], labels: str) -> list[str] | None:
    """The dataset's class list. "keep": stored labels as they are, so the sources' class lists
    must agree label by label (a longer list may add classes at the end, as ``merge`` allows;
    the longest is the dataset's; a source without a list, e.g. foreign tars or captions, is
    not compared, and then there is none); two that disagree are refused, naming both.
    "union": names merged in source order; labels mapped to it."""
    if labels == "keep":
        return _kept_classes(sources)
    missing = [s.source.name for s in sources if not s.classes]
    if missing:
        raise InputError(
            f'labels="union" maps class names, but {missing[0]} has no class list (no manifest); '
            'pack it with shardkit or use labels="keep"'
        )
    union: dict[str, int] = {}
    for s in sources:
        for name in s.classes:
            union.setdefault(name, len(union))
        s.labels = np.asarray([union[n] for n in s.classes], dtype=np.int64)
    return list(union)


def _kept_classes(sources: Sequence[MixedSource]) -> list[str] | None:
    named = [s for s in sources if s.classes]
    longest = max(named, key=lambda s: len(s.classes), default=None)
    for s in named:
        if tuple(longest.classes[: len(s.classes)]) != tuple(s.classes):
            raise InputError(
                f"{s.source.name} and {longest.source.name} store labels under other class "
                f"lists ({_shown(s.classes)} and {_shown(longest.classes)}), so a stored label "
                'would mean two classes: pass labels="union" (maps them by name)'
            )
    if longest is None or len(named) < len(sources):
        return None
    return list(longest.classes)


def _shown(classes: Sequence[str], most: int = 6) -> str:
    names = ", ".join(map(repr, classes[:most]))
    return f"[{names}{', ...' if len(classes) > most else ''}]"


def _describe(source) -> str:
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    return f"the list of {len(source)} shards"


def _counted(shards: Sequence[ShardInfo], format: str, storage: Storage) -> tuple[ShardInfo, ...]:
    """The shards with every count known: shards no manifest covers are counted by reading."""
    if all(s.samples != UNKNOWN for s in shards):
        return tuple(shards)
    fmt = FORMATS[format]
    out = list(shards)
    try:
        for i, shard in enumerate(shards):
            if shard.samples != UNKNOWN:
                continue
            try:
                out[i] = dataclasses.replace(shard, samples=fmt.count(storage, shard))
            except ShardkitError:
                raise
            except OSError as exc:
                raise StorageError(f"{shard.url}: cannot count samples ({exc})") from exc
    finally:
        storage.close()
    return tuple(out)
