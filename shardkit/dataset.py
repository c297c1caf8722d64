"""``ShardDataset`` streams packed shards into PyTorch; ``FolderDataset`` is the per-file baseline.

Splitting (see ``shardkit.stream.plan_epoch``): every epoch the shard list is permuted from
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
import warnings
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from .errors import InputError, SampleError, ShardkitError, StorageError
from .formats import FORMATS
from .geometry import Geometry, TensorDecoder
from .images import IMAGE_EXTENSIONS, decode_image
from .records import UNKNOWN, Record, ShardInfo, ShardSlice
from .scan import StrTable, scan_source
from .shuffle import DEFAULT_BUFFER_SIZE, buffer_rng, shard_order, shuffle_buffer
from .sizes import parse_size
from .sources import resolve_source
from .storage import LocalStorage, Storage, storage_for
from .stream import (
    DECODE_MODES,
    EQUALIZE_MODES,
    apply_transforms,
    check_labels,
    decode_records,
    plan_epoch,
    rank_samples,
    read_slices,
    sample_counts,
)
from .world import World, current_world, distributed_rank

__all__ = ["ShardDataset", "FolderDataset"]

# Layout of the shared int64 state tensor (shared memory, so persistent workers see updates).
_EPOCH, _LAST_STARTED, _WARNED, _SKIPPED = 0, 1, 2, 3
_SKIP_SLOTS = 256  # one skip counter per worker id (mod 256): no lost updates between workers
_STATE_LEN = _SKIPPED + _SKIP_SLOTS


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise InputError(f"{name}={value!r} is not one of: {', '.join(map(repr, choices))}")


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
    samples held per worker for the sample-level shuffle. ``with_keys=True`` yields
    ``(image, label, key)``. ``fields=("json", ...)`` (tar): each sample gains the raw bytes of
    those extra members after the key, None where a sample has none. ``on_error="skip"`` warns
    and counts undecodable samples in ``ds.skipped`` instead of raising (that rank then yields
    fewer than ``len(ds)``).
    ``rank``/``world_size`` override distributed discovery (which happens here, at construction,
    like DistributedSampler: build the dataset after ``init_process_group`` or under torchrun).
    ``storage`` overrides how shards are opened (see shardkit.storage); ``storage_options``,
    ``cache_dir``, ``cache_limit`` (bytes or a size string such as "10GB") and ``prefetch``
    (shards fetched ahead per worker, 0: none) configure the remote storage built for URL
    sources; with ``storage`` given, ``cache_dir``/``cache_limit`` are refused (pass them to it).

    ``size`` (with ``decode="tensor"``) gives ``size`` x ``size`` uint8 CHW images in one pass
    (see shardkit.geometry): ``crop="center"`` (resize the shorter side, center-crop) or
    ``"random"`` (RandomResizedCrop, scale 0.08-1, ratio 3/4-4/3), ``flip=True`` mirrors half of
    them; the randomness is a function of (seed, epoch, rank, key), so runs repeat.
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        decode: str = "pil",
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        shuffle: bool = True,
        seed: int = 0,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        equalize: str = "pad",
        with_keys: bool = False,
        on_error: str = "raise",
        fields: Sequence[str] = (),
        storage: Storage | None = None,
        storage_options: dict | None = None,
        cache_dir: str | None = None,
        cache_limit: int | str | None = None,
        prefetch: int = 2,
        rank: int | None = None,
        world_size: int | None = None,
        size: int | None = None,
        crop: str = "center",
        flip: bool = False,
    ):
        super().__init__()
        _check_choice("decode", decode, DECODE_MODES)
        if size is not None and decode != "tensor":
            raise InputError(f'size={size} needs decode="tensor" (got decode={decode!r})')
        self.geometry = Geometry(int(size), crop, bool(flip)) if size is not None else None
        _check_choice("equalize", equalize, EQUALIZE_MODES)
        _check_choice("on_error", on_error, ("raise", "skip"))
        if buffer_size < 0:
            raise InputError(f"buffer_size={buffer_size} must be >= 0 (0 or 1: no buffer)")
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
        self.with_keys = bool(with_keys)
        self.on_error = on_error
        self.fields: tuple[str, ...] = (fields,) if isinstance(fields, str) else tuple(fields)
        self.rank, self.world_size = distributed_rank(rank, world_size)

        resolved = resolve_source(source, storage_options=storage_options)
        self.shard_format: str = resolved.format
        if self.fields and self.shard_format != "tar":
            raise InputError(
                f"fields={self.fields!r}: only tar shards carry extra members; drop fields= "
                f"for {self.shard_format} shards"
            )
        self.classes: list[str] | None = list(resolved.classes) if resolved.classes else None
        self.manifest_path = resolved.manifest_path
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
        if self.num_samples == 0:
            raise InputError(f"{_describe(source)}: the shards hold no samples")
        if equalize != "pad" and self.num_samples < self.world_size:
            raise InputError(
                f"{_describe(source)}: {self.num_samples} samples cannot give each of "
                f'{self.world_size} ranks one with equalize="{equalize}"; use equalize="pad"'
            )
        self._state = torch.zeros(_STATE_LEN, dtype=torch.int64).share_memory_()
        self._state[_LAST_STARTED] = -1

    # --- epochs -------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows (persistent workers too)."""
        if epoch < 0:
            raise InputError(f"epoch must be >= 0, got {epoch}")
        self._state[_EPOCH] = int(epoch)

    @property
    def epoch(self) -> int:
        return int(self._state[_EPOCH])

    @property
    def skipped(self) -> int:
        """Samples skipped by ``on_error="skip"`` so far, summed over all workers."""
        return int(self._state[_SKIPPED:].sum())

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
            batch_size=batch_size,
        )

    def _start_epoch(self, world: World) -> int:
        epoch = int(self._state[_EPOCH])
        if world.worker == 0 and self.shuffle:
            if int(self._state[_LAST_STARTED]) == epoch and not int(self._state[_WARNED]):
                self._state[_WARNED] = 1
                warnings.warn(
                    f"ShardDataset iterated epoch {epoch} again: the order repeats. Call "
                    "ds.set_epoch(epoch) before each epoch to get a new order.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self._state[_LAST_STARTED] = epoch
        return epoch

    # --- the pipeline ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple]:
        world = current_world(self.rank, self.world_size)
        epoch = self._start_epoch(world)
        records = self.records(world, epoch)
        samples = decode_records(
            records,
            self.decode,
            on_error=self.on_error,
            with_keys=self.with_keys,
            skipped=self._skip_counter(world.worker),
            fields=self.fields,
            decoder=self.tensor_decoder(epoch) if self.geometry is not None else None,
        )
        if self.transform is not None or self.target_transform is not None:
            samples = apply_transforms(samples, self.transform, self.target_transform)
        return samples

    def records(
        self, world: World, epoch: int, batch_size: int | None = None
    ) -> Iterator[Record]:
        """The stored records worker ``world.worker`` reads in ``epoch``, in order: plan -> read
        -> label check -> shuffle buffer. ``ShardLoader``'s decode threads each iterate one."""
        slices = self.plan(world, epoch, batch_size)
        records = read_slices(
            slices, self.shards, FORMATS[self.shard_format], self.storage, fields=self.fields
        )
        if self.classes:
            records = check_labels(records, len(self.classes))
        if self.shuffle and self.buffer_size > 1:
            rng = buffer_rng(self.seed, epoch, world.rank, world.worker)
            records = shuffle_buffer(records, self.buffer_size, rng)
        return records

    def tensor_decoder(self, epoch: int) -> TensorDecoder:
        """Bytes -> uint8 CHW tensor with this dataset's geometry, bound to ``epoch``."""
        return TensorDecoder(self.geometry, self.seed, epoch, self.rank)

    def _skip_counter(self, worker: int) -> Callable[[], None]:
        state, slot = self._state, _SKIPPED + worker % _SKIP_SLOTS

        def skipped() -> None:
            state[slot] += 1

        return skipped

    def __repr__(self) -> str:
        return (
            f"ShardDataset({len(self.shards)} {self.shard_format} shards, {self.num_samples} "
            f"samples, rank {self.rank}/{self.world_size}, decode={self.decode!r}, "
            f"shuffle={self.shuffle}, buffer_size={self.buffer_size}, "
            f"equalize={self.equalize!r})"
        )


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


class FolderDataset(Dataset):
    """Map-style dataset over a class-per-folder tree: the per-file baseline shards are measured
    against, decoding exactly as ``ShardDataset`` does.

    Listed by ``shardkit.scan``, the scanner ``pack`` uses: the same classes, labels and skipped
    entries (FIFOs, broken links: warned about, never opened). Labels are the indices of the
    sorted class folder names (``.classes``). Relative paths live in
    one numpy byte blob with int64 offsets, not a Python list: forked DataLoader workers touching
    a list of str objects write their refcounts and so copy every page; numpy arrays stay shared.
    Files are read through ``storage`` (a ``LocalStorage(latency_ms=...)`` charges per image).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        decode: str = "pil",
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        storage: Storage | None = None,
        extensions: Sequence[str] = tuple(sorted(IMAGE_EXTENSIONS)),
        with_keys: bool = False,
    ):
        _check_choice("decode", decode, DECODE_MODES)
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise InputError(f"{self.root}: not a directory; pass a class-per-folder image tree")
        self.decode = decode
        self.transform = transform
        self.target_transform = target_transform
        self.storage: Storage = storage or LocalStorage()
        self.with_keys = bool(with_keys)
        exts = {e.lower().lstrip(".") for e in extensions}
        scan = scan_source(self.root)  # pack's scanner: same classes, labels, skips
        self.classes: list[str] = list(scan.classes)
        keep = np.fromiter((e in exts for e in scan.exts), dtype=bool, count=len(scan.exts))
        if not keep.any():
            raise InputError(
                f"{self.root}: no images (.{', .'.join(sorted(exts))}) in class folders; "
                "expected root/<class>/<image>"
            )
        if scan.errors:
            first = scan.errors[0]
            warnings.warn(
                f"{self.root}: skipped {len(scan.errors)} unreadable image entries (first: "
                f"{first.path}: {first.reason})",
                stacklevel=2,
            )
        files = scan.files
        if not keep.all():
            files = StrTable(f for f, k in zip(scan.files, keep, strict=True) if k)
        self.path_bytes, self.offsets = files.blob, files.offsets
        self.targets = scan.labels[keep]

    def __len__(self) -> int:
        return len(self.targets)

    def relpath(self, index: int) -> str:
        """Path of sample ``index`` relative to the root (also its key)."""
        blob = self.path_bytes[self.offsets[index] : self.offsets[index + 1]]
        return blob.tobytes().decode("utf-8", "surrogateescape")

    def __getitem__(self, index: int):
        if index < 0:
            index += len(self.targets)
        rel = self.relpath(index)
        path = os.path.join(self.root, rel)
        with self.storage.open(path) as f:
            data = f.read()
        try:
            img = decode_image(data, self.decode)
        except Exception as exc:
            raise SampleError(
                f"{path}: cannot be decoded ({exc}); remove or replace the file",
                shard=self.root,
                key=rel,
            ) from exc
        label = int(self.targets[index])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return (img, label, rel) if self.with_keys else (img, label)

    def __repr__(self) -> str:
        return f"FolderDataset({self.root!r}, {len(self)} images, {len(self.classes)} classes)"

