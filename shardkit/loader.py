"""``ShardLoader``: decoded batches from a ``ShardDataset`` without DataLoader's process hop.

Why threads: libjpeg-turbo (simplejpeg) and torch's resize release the GIL, so decode threads
use every core, and they write each image straight into a reused, preallocated batch buffer. A
DataLoader worker instead builds every batch in fresh shared memory and ships it to the main
process (measured: ~124 us of page faults per 250x250 image, half the cost of decoding it).

Each decode thread plays the part of the DataLoader worker with its id: it iterates exactly that
worker's part of the epoch (``ShardDataset.records``: the same plan, shard order, shuffle buffer,
rank split and ``equalize``), with worker parts cut at multiples of ``batch_size``
(``stream.worker_span``), and batches are drawn from the threads in turn as DataLoader draws
them from its workers. So a ShardLoader yields the batches ``DataLoader(ds, batch_size,
num_workers)`` would, and ``len(loader)`` is exact and equal on every rank.

Buffers: each thread owns ``prefetch_factor`` batch buffers and reuses them. A yielded batch on
the CPU is a view of one; before a buffer is written again the loader checks whether anything
outside still refers to it (a batch you kept, a view or a numpy array of it), and if so leaves it
to you and allocates a new one: the loop ``for x, y in loader`` costs no copy or allocation, and
a batch you keep stays valid, as with DataLoader. With ``device="cuda"`` the buffers are pinned,
each batch is copied ``non_blocking`` on a side stream one batch ahead (apex's
data_prefetcher), and converted and normalised there; ``device="cpu"`` runs the same steps.
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import zip_longest

import torch

from .errors import InputError, ShardkitError
from .images.geometry import ShapeError
from .records import Record
from .stream import sample_error
from .stream.dataset import ShardDataset
from .stream.storage import LocalStorage
from .stream.world import World

__all__ = ["ShardLoader"]

_POLL_S = 0.05  # how often a blocked thread looks at the stop flag


@dataclass
class _Buffer:
    """One batch buffer of a decode thread: ``images`` (N, 3, H, W) uint8, NHWC in memory for
    the device path and channels_last; ``targets[i]``: what image i is decoded into (an HWC
    numpy view when a JPEG can land there as decoded, a (3, H, W) numpy view when ``planar``
    (a contiguous batch: decoded, then transposed into the planes), else a (3, H, W) tensor
    view); ``baseline``: the storage's use count with only the loader's own references;
    ``copied``: CUDA event after which the host copy may be overwritten."""

    images: torch.Tensor
    targets: list
    baseline: int
    planar: bool = False
    copied: object | None = None


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@dataclass
class _Batch:
    worker: int
    slot: int
    count: int
    labels: list
    keys: list


class _SharedStorage:
    """A storage read by several decode threads. A remote storage's prefetcher has a single
    consumer (``remote/prefetch.py``), so calls are serialised, and the upcoming shards of all
    threads are interleaved into one prefetch list instead of each thread's replacing the
    other's."""

    def __init__(self, storage):
        self.storage = storage
        self._lock = threading.Lock()
        self._wants: dict[int, list[str]] = {}

    def prefetch(self, urls) -> None:
        with self._lock:
            self._wants[threading.get_ident()] = list(urls)
            merged = [u for group in zip_longest(*self._wants.values()) for u in group if u]
            self.storage.prefetch(merged)

    def done(self) -> None:
        """The calling thread reads no more: its upcoming shards are no longer wanted."""
        with self._lock:
            self._wants.pop(threading.get_ident(), None)

    def open(self, url: str):
        with self._lock:
            return self.storage.open(url)

    def local_path(self, url: str) -> str:
        with self._lock:
            return self.storage.local_path(url)

    def __getattr__(self, name: str):
        return getattr(self.storage, name)


class _End:
    """A decode thread's last message; ``error`` is raised in the caller's thread."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


class ShardLoader:
    """Iterate a ``ShardDataset`` (``decode="tensor"``) as ``(images, labels[, keys])`` batches.

    ::

        ds = ShardDataset("shards/", decode="tensor", size=224, crop="random", flip=True)
        loader = ShardLoader(ds, batch_size=256, num_workers=8, device="cuda",
                             normalize=((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))
        for epoch in range(90):
            loader.set_epoch(epoch)
            for images, labels in loader: ...   # float32 (256, 3, 224, 224) on the GPU

    Images are uint8 (N, 3, H, W) unless ``normalize=(mean, std)`` (0-1 scale, as torchvision)
    gives float32 ``(x / 255 - mean) / std``; all images of a batch must have one size (give the
    dataset ``size=``). ``num_workers``: decode threads, each reading the part a DataLoader
    worker with its id would (0: decode in the caller's thread; default: usable CPUs).
    ``prefetch_factor``: batch buffers per thread. ``device``: where batches go (None: stay on
    the CPU). ``channels_last``: that memory format (free on the CPU: it is how JPEG decodes).
    ``with_keys`` (default: the dataset's) adds the list of sample keys. ``drop_last`` drops the
    rank's one short batch. ``len(loader)`` is the batches per epoch on this rank; under
    ``on_error="skip"`` a worker whose samples were skipped ends its last batch early.
    """

    def __init__(
        self,
        dataset: ShardDataset,
        batch_size: int,
        *,
        num_workers: int | None = None,
        drop_last: bool = False,
        device: str | torch.device | None = None,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        channels_last: bool = False,
        with_keys: bool | None = None,
        prefetch_factor: int = 2,
    ):
        if not isinstance(dataset, ShardDataset):
            raise InputError(f"dataset must be a ShardDataset, got {type(dataset).__name__}")
        if dataset.decode != "tensor":
            raise InputError(
                f'ShardLoader batches decoded tensors: build the dataset with decode="tensor" '
                f"(got decode={dataset.decode!r})"
            )
        if dataset.transform is not None:
            raise InputError(
                "ShardLoader decodes straight into batch buffers, so the dataset's per-sample "
                "transform cannot run; use size=/crop=/flip= on the dataset, transform the "
                "batch, or use a DataLoader"
            )
        if getattr(dataset, "fields", ()):
            raise InputError(
                f"ShardLoader yields images, labels and keys; the dataset's fields="
                f"{dataset.fields!r} would be dropped: use a DataLoader for extra members"
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
        if num_workers is None:
            num_workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
        if num_workers < 0:
            raise InputError(f"num_workers must be >= 0, got {num_workers}")
        if prefetch_factor < 1:
            raise InputError(f"prefetch_factor must be >= 1, got {prefetch_factor}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = int(num_workers)
        self.drop_last = bool(drop_last)
        self.device = torch.device(device) if device is not None else None
        self.channels_last = bool(channels_last)
        self.with_keys = dataset.with_keys if with_keys is None else bool(with_keys)
        self.prefetch_factor = int(prefetch_factor)
        self.normalize = None
        if normalize is not None:
            mean, std = (torch.as_tensor(v, dtype=torch.float32) for v in normalize)
            if mean.shape != (3,) or std.shape != (3,) or bool((std == 0).any()):
                raise InputError(
                    "normalize must be ((m, m, m), (s, s, s)) in the 0-1 scale with s != 0, "
                    f"got {normalize!r}"
                )
            self.normalize = (mean, std)
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"device={device!r} but CUDA is not available; use device='cpu'")
        self._current: weakref.ref | None = None
        self._yielded = [-1, 0]  # [epoch, batches yielded by its latest iteration] (state_dict)
        # Batch buffers per thread, kept across epochs: pinned memory is slow to allocate, and
        # fresh pages fault in on first touch. Only one iteration runs at a time.
        self._buffers: list[list] = []

    # --- the DataLoader-like surface -----------------------------------------------------------

    def __len__(self) -> int:
        samples = len(self.dataset)
        if self.drop_last:
            return samples // self.batch_size
        return -(-samples // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Same as ``dataset.set_epoch``: the order (and crops) of the next iteration."""
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple]:
        self.close()  # one live iteration at a time, like a DataLoader without persistent workers
        batches = _Epoch(self).batches()
        # Weak: dropping the iterator (break, an exception) must be what stops its threads.
        self._current = weakref.ref(batches)
        return batches

    def state_dict(self) -> dict:
        """The position in the epoch as plain data (``json``, ``torch.save``): the batches this
        iteration has yielded. Threads deal batches as DataLoader workers do, so the dataset
        works out from that count alone which samples were delivered (shardkit.resume)."""
        epoch, batches = self._yielded
        return self.dataset.position(
            batches if epoch == self.dataset.epoch else 0,
            num_workers=max(1, self.num_workers),
            batch_size=self.batch_size,
            cut=self.batch_size,
        )

    def load_state_dict(self, state: dict) -> None:
        """Continue the epoch ``state`` was saved in on the next iteration, in the same order and
        reading nothing already delivered; no ``set_epoch`` needed. A state saved on another
        world size (or worker count) re-splits what is left (``ShardDataset.load_state_dict``)."""
        self.close()
        self._yielded = [-1, 0]
        self.dataset.load_state_dict(state)

    def close(self) -> None:
        """Stop the current iteration's threads now (also done on break, errors and exit)."""
        batches = self._current() if self._current is not None else None
        self._current = None
        if batches is not None:
            batches.close()

    def __repr__(self) -> str:
        return (
            f"ShardLoader({self.dataset!r}, batch_size={self.batch_size}, "
            f"num_workers={self.num_workers}, device={self.device}, drop_last={self.drop_last})"
        )


class _Epoch:
    """One iteration: the decode threads, their buffers and queues, the hand-off to the device.

    The threads refer to this object, never to the generator ``batches()`` handed to the
    caller, so dropping that generator (break, an exception unwinding the loop, garbage
    collection) or ``ShardLoader.close`` closes it: its ``finally`` sets the stop flag and joins
    every thread, and each thread closes its record stream (its shard files) on the way out.
    """

    def __init__(self, loader: ShardLoader):
        ds = loader.dataset
        self.loader = loader
        self.batch_size = loader.batch_size
        self.threads_n = max(1, loader.num_workers)
        self.epoch = ds._start_epoch(World(ds.rank, ds.world_size, 0, 1))
        self.decoder = ds.tensor_decoder(self.epoch)
        self.yielded = loader._yielded = [self.epoch, 0]  # counted as batches reach the caller
        # The threads read through one storage; all but the stateless local one take a single
        # consumer (remote prefetch), so they share it through a serialising proxy.
        self.view = ds
        if loader.num_workers > 1 and type(ds.storage) is not LocalStorage:
            self.view = copy.copy(ds)
            self.view.storage = _SharedStorage(ds.storage)
        device = loader.device
        self.cuda = device is not None and device.type == "cuda"
        self.pin = self.cuda
        # NHWC buffers (decode writes rows as JPEG produces them) unless the output is a plain
        # contiguous uint8 CPU batch, where each thread transposes its own images instead.
        self.nhwc = loader.channels_last or device is not None or loader.normalize is not None
        self.stop = threading.Event()
        # One buffer per batch a thread may have ready ahead, plus the one the caller holds.
        self.slots = loader.prefetch_factor + 1
        if len(loader._buffers) != self.threads_n or len(loader._buffers[0]) != self.slots:
            loader._buffers = [[None] * self.slots for _ in range(self.threads_n)]
        self.buffers: list[list[_Buffer | None]] = loader._buffers
        self.free = [threading.Semaphore(self.slots) for _ in range(self.threads_n)]
        self.queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(self.threads_n)]
        self.skipped = [ds._skip_counter(w) for w in range(self.threads_n)]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if loader.normalize is not None:
            mean, std = loader.normalize
            target = device or torch.device("cpu")
            self.scale = (1.0 / (255.0 * std)).view(1, 3, 1, 1).to(target)
            self.shift = (-mean / std).view(1, 3, 1, 1).to(target)
        self.threads: list[threading.Thread] = []
        if loader.num_workers > 0:
            for w in range(self.threads_n):
                t = threading.Thread(
                    target=self._run, args=(w,), name=f"shardkit-decode-{w}", daemon=True
                )
                self.threads.append(t)
                t.start()

    # --- producer side (decode threads, or the caller's thread when num_workers=0) -------------

    def _run(self, w: int) -> None:
        torch.set_num_threads(1)  # per thread: one core each for the resize, no oversubscription
        try:
            for batch in self._fill(w):
                self.queues[w].put(batch)
            self.queues[w].put(_End())
        except BaseException as exc:  # re-raised in the caller's thread
            self.queues[w].put(_End(exc))

    def _fill(self, w: int) -> Iterator[_Batch]:
        """Worker ``w``'s batches, decoded into its buffers, in its stream's order."""
        ds, loader, bs = self.loader.dataset, self.loader, self.batch_size
        world = World(ds.rank, ds.world_size, w, self.threads_n)
        records = self.view.records(world, self.epoch, bs)
        on_error, skipped = ds.on_error, self.skipped[w]
        try:
            slot = 0
            while not self.stop.is_set():
                if not self._acquire(w):
                    return
                buf = self.buffers[w][slot]
                labels: list = []
                keys: list = []
                n = 0
                for rec in records:
                    if buf is not None and n == 0:
                        buf = self._reusable(w, slot, buf)
                    img = self._decode(rec, buf, n, on_error, skipped)
                    if img is None:
                        continue
                    if buf is None:  # this thread's first image: its size sizes the buffer
                        buf = self._new_buffer(w, slot, img.shape[-2:])
                        buf.images[0].copy_(img)
                    labels.append(rec.label)
                    keys.append(rec.key)
                    n += 1
                    if n == bs or self.stop.is_set():
                        break
                if n == 0 or (n < bs and loader.drop_last):
                    return
                yield _Batch(w, slot, n, labels, keys)
                if n < bs:
                    return
                slot = (slot + 1) % self.slots
        finally:
            close = getattr(records, "close", None)
            if close is not None:
                close()
            if isinstance(self.view.storage, _SharedStorage):
                self.view.storage.done()

    def _decode(self, rec: Record, buf: _Buffer | None, n: int, on_error: str, skipped):
        """Decode ``rec`` into image ``n`` of ``buf`` (None: a new tensor); None if skipped."""
        try:
            if buf is None:
                return self.decoder(rec.data, rec.key)
            if buf.planar:
                return self.decoder.into_planes(rec.data, rec.key, buf.targets[n])
            return self.decoder(rec.data, rec.key, buf.targets[n])
        except ShapeError as exc:
            raise ShapeError(f"{rec.shard}: {exc}") from None
        except Exception as exc:  # decoders raise many types for bad data
            err = sample_error(rec, exc)
            if on_error == "raise":
                raise err from exc
            warnings.warn(f"skipped: {err}", RuntimeWarning, stacklevel=2)
            skipped()
            return None

    def _acquire(self, w: int) -> bool:
        """Wait for a free buffer of thread ``w``; False once the iteration is stopping."""
        if self.loader.num_workers == 0:
            return True  # filling and consuming alternate in one thread: the next slot is free
        while not self.stop.is_set():
            if self.free[w].acquire(timeout=_POLL_S):
                return True
        return False

    def _new_buffer(self, w: int, slot: int, size: tuple[int, int]) -> _Buffer:
        height, width = size
        # a plain contiguous batch without geometry: numpy planes, no tensor calls per image
        planar = not self.nhwc and self.decoder.geometry is None
        if self.nhwc:
            raw = torch.empty(
                (self.batch_size, height, width, 3), dtype=torch.uint8, pin_memory=self.pin
            )
            images = raw.permute(0, 3, 1, 2)
            if self.decoder.geometry is None:  # JPEG rows land in place: hand the decoder numpy
                targets = list(raw.numpy())
            else:
                targets = list(images.unbind(0))
        else:
            images = torch.empty((self.batch_size, 3, height, width), dtype=torch.uint8)
            targets = list(images.numpy()) if planar else list(images.unbind(0))
        # after the targets exist: the baseline counts their references to the storage
        buf = _Buffer(images, targets, _use_count(images), planar=planar)
        self.buffers[w][slot] = buf
        return buf

    def _reusable(self, w: int, slot: int, buf: _Buffer) -> _Buffer:
        """``buf`` if nothing outside the loader still refers to its memory, else a fresh one."""
        if buf.copied is not None:
            buf.copied.synchronize()  # the device copy of its last batch has finished
            buf.copied = None
        if _use_count(buf.images) <= buf.baseline:
            return buf
        # A kept batch (or a view or numpy array of it): it is the caller's now.
        return self._new_buffer(w, slot, buf.images.shape[-2:])

    # --- consumer side (the caller's thread) ----------------------------------------------------

    def _ready(self) -> Iterator[_Batch]:
        """Batches in DataLoader order: one from each live worker in turn."""
        if self.loader.num_workers == 0:
            yield from self._fill(0)
            return
        live = list(range(self.threads_n))
        while live:
            for w in list(live):
                item = self._get(w)
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    live.remove(w)
                    continue
                yield item

    def _get(self, w: int):
        q = self.queues[w]
        while True:
            try:
                return q.get(timeout=1.0)
            except queue.Empty:
                if not self.threads[w].is_alive() and q.empty():
                    raise ShardkitError(f"decode thread {w} ended without a result") from None

    def batches(self) -> Iterator[tuple]:
        """The caller's iterator: host batches -> (device) output.

        On CUDA one batch is staged ahead, so its copy overlaps the caller's step. A buffer goes
        back to its thread two draws after its batch was yielded: by then the caller's loop
        variable has moved on, so a still-referenced buffer really was kept (``_reusable``).
        """
        ahead = 1 if self.cuda else 0
        staged: deque = deque()
        drawn: deque = deque()
        try:
            for batch in self._ready():
                staged.append(self._stage(batch))
                while len(staged) > ahead:
                    out, ready, release = staged.popleft()
                    yield self._finish(out, ready)
                    out = None
                    drawn.append(release)
                    if len(drawn) > 1:
                        drawn.popleft()()
            while staged:
                out, ready, _ = staged.popleft()
                yield self._finish(out, ready)
                out = None
        finally:
            self._shutdown()

    def _stage(self, batch: _Batch):
        """Start moving ``batch`` to the device and converting it there.

        Returns (output, ready event or None, release): ``release`` gives the host buffer back
        to its thread.
        """
        buf = self.buffers[batch.worker][batch.slot]
        images = buf.images[: batch.count]
        labels = torch.tensor(batch.labels, dtype=torch.int64)
        tt = self.loader.dataset.target_transform
        if tt is not None:
            labels = torch.utils.data.default_collate([tt(int(v)) for v in batch.labels])
        device, ready = self.loader.device, None
        ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        with ctx:
            if device is not None:
                images = images.to(device, non_blocking=True)  # from pinned memory: async
                if self.cuda:
                    buf.copied = torch.cuda.Event()
                    buf.copied.record(self.stream)
                labels = labels.to(device, non_blocking=True)
            images = self._convert(images)
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        out = (images, labels, batch.keys) if self.loader.with_keys else (images, labels)
        worker = batch.worker

        def release() -> None:
            self.free[worker].release()

        return out, ready, release

    def _convert(self, images: torch.Tensor) -> torch.Tensor:
        fmt = torch.channels_last if self.loader.channels_last else torch.contiguous_format
        if self.loader.normalize is not None:
            out = torch.empty(
                images.shape, dtype=torch.float32, device=images.device, memory_format=fmt
            )
            # One pass: x * (1 / (255 std)) - mean / std  ==  (x / 255 - mean) / std.
            return torch.addcmul(self.shift, images, self.scale, out=out)
        if self.nhwc and not self.loader.channels_last:
            return images.contiguous()  # a uint8 batch moved to a device as NHWC
        return images

    def _finish(self, out: tuple, ready) -> tuple:
        """Make the caller's stream wait for this batch only (not the one staged behind it)."""
        self.yielded[1] += 1
        if ready is not None:
            current = torch.cuda.current_stream(self.loader.device)
            current.wait_event(ready)
            for t in out[:2]:
                t.record_stream(current)
        return out

    def _shutdown(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        self.threads = []
