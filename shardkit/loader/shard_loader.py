"""``ShardLoader``: the surface a training loop sees, a drop-in for ``DataLoader(ShardDataset)``.

Worker ``w`` (a process) reads exactly what DataLoader worker ``w`` would and decodes straight into
its slots of a ring of batch buffers shared with the training process (``ring.py``); per batch
the training process receives only (worker, slot, count, labels, keys) and hands out a view of
the slot, or copies it to the GPU from the slot itself (page-locked in place). Processes, not
threads: on a 16-core GPU node, decode threads sharing one GIL stopped scaling at 4-8 cores and
fed ResNet-50 at 0.60 of the GPU's speed, while processes into a reused pinned ring fed it at
1.00 (see docs/loader.md for the measurements).
"""

from __future__ import annotations

import math
import os
import resource
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import InputError, ShardkitError, check_choice, check_int
from ..images.device import DeviceDecoder
from ..stream.dataset import ShardDataset
from ..stream.fields import decode_field_image
from ..stream.stages import extras_of
from .epoch import Balance, Epoch, FeedCounts, Position, slots_per_worker
from .fill import FillSpec
from .ring import Ring
from .stats import LoaderStats, StatsOptions, gather_stats
from .workers import ForeignLoaderError, LocalWorkers, ProcessWorkers, default_start_method

__all__ = ["ShardLoader", "default_workers"]

#: Where a batch is decoded: in the worker processes (pixels in the ring), or in the training
#: process on its device by nvImageCodec (the stored bytes in the ring; ``shardkit.images.device``).
DECODE_ON = ("workers", "device", "auto")
_FDS_PER_WORKER = 8  # a worker's pipe, its process sentinel and room for the loader's files
#: Workers done with their part of an epoch fill the next epoch's first batches meanwhile (see
#: ``epoch.py``). Off: each epoch starts with the caller waiting for every worker's first batch
#: (the benchmarks' comparison; a loader's own ``_overlap_epochs`` is read at each ``iter()``).
OVERLAP_EPOCHS = True
#: What the workers, their slots and the batches' layout are built from: fixed once the loader
#: is (a changed one would meet workers filling for the old one: wrong pixels, lost samples).
_FIXED = frozenset(
    {"dataset", "seam", "batch_size", "num_workers", "drop_last", "device", "normalize",
     "channels_last", "extras", "with_keys", "prefetch_factor", "start_method", "decode_on"}
)  # fmt: skip


def default_workers() -> int:
    """Usable CPUs less one: the training process keeps a core for its own Python."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, (cpus or 1) - 1)


class _Resources:
    """What outlives an iteration: the ring and the worker processes. Closed by
    ``ShardLoader.close``, by the loader's garbage collection and at interpreter exit (a
    ``weakref.finalize`` holds this object, never the loader)."""

    def __init__(self):
        self.ring: Ring | None = None
        self.workers: LocalWorkers | ProcessWorkers | None = None
        self.owner = os.getpid()

    def close(self) -> None:
        """Stop the workers and free the ring; in a forked child (whose copies these are) only
        the child's own descriptors and mappings go: the parent's workers are left alone."""
        workers, ring = self.workers, self.ring
        self.workers = self.ring = None
        if workers is not None:
            workers.close()
        if ring is not None:
            ring.close()


class ShardLoader:
    """Iterate a ``ShardDataset`` (``decode="tensor"``) as ``(images, labels[, keys])`` batches.

    ::

        ds = ShardDataset("shards/", decode=Decode(crop=RandomResizedCrop(224), flip=True))
        loader = ShardLoader(ds, batch_size=256, device="cuda",
                             normalize=((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))
        for epoch in range(90):
            loader.set_epoch(epoch)
            for images, labels in loader: ...   # float32 (256, 3, 224, 224) on the GPU

    Images are uint8 (N, 3, H, W) unless ``normalize=(mean, std)`` (0-1 scale, as torchvision)
    gives float32 ``(x / 255 - mean) / std``; all images of a batch must have one size (give the
    dataset ``decode=Decode(crop=...)``). The dataset's ``transform`` runs in the workers on
    each decoded uint8 (3, H, W) tensor and must return one of the same shape. ``num_workers``:
    worker processes, each reading the part a DataLoader worker with its id would (0: decode in
    the caller; default: usable CPUs less one). They start on the first iteration and stay until
    ``close()`` or the loader is collected; a worker done with its part of an epoch fills the
    first batches of the next (``set_epoch``'s next epoch, checked at ``iter()``: dropped if
    another starts). ``prefetch_factor``: batches each worker may have ready. The loader's
    settings are fixed once it is built (another dataset or batch size: another ShardLoader),
    and the workers keep the dataset as it was at their start (a changed ``transform`` reaches
    them after ``close()``).
    ``device``: where batches go (None: stay on the CPU). ``channels_last``: that memory format
    (free on the CPU: it is how JPEG decodes). ``with_keys`` (default: the dataset's) adds the
    list of sample keys; ``("key", "source")`` also each sample's source in a mixture (an int64
    tensor of positions in ``dataset.source_names``). ``drop_last`` drops the rank's one short
    batch. ``start_method``: "fork" (default where available), "spawn" or "forkserver".
    ``timeout``: seconds to wait for a worker's batch before raising (0: forever; a dead worker
    is reported at once anyway).
    ``decode_on="device"``: workers read, shuffle and choose crops as usual but hand over the
    stored bytes; the training process decodes each batch with nvImageCodec on ``device``
    (nvJPEG's hardware engine on a GPU; its CPU backend without one), for models faster than the
    CPUs can feed (``pip install 'shardkit[gpu-cu13]'``, or ``gpu-cu12`` for a CUDA 12 torch;
    see docs/loader.md). ``"auto"``: each batch is decoded by its worker or on the device, in
    the proportion of their measured rates.
    With the dataset's ``fields=`` (text, objects, arrays), each batch is a dict: "image",
    "label", "key" (``with_keys``) and one list per field, decoded in the workers;
    ``collate(batch_dict)`` reshapes it.
    With the dataset's ``sample_transform`` (``decode_on="workers"`` only), each whole sample
    (the dict ``ShardDataset`` gives it: image, label, key, source, fields, boxes, seed) goes
    through it in the workers and its outputs are batched there: a dict per sample gives a dict
    of columns, a tuple a tuple of columns; a column of tensors of one shape is stacked (and
    moved to ``device``), numbers and numpy arrays of one shape become tensors as
    ``default_collate`` makes them, any other is a list; ``collate`` then reshapes that batch.
    ``len(loader)`` is the batches per epoch on this rank; under ``on_error="skip"`` a worker
    whose samples were skipped ends its last batch early.
    ``stats()`` says who waits for whom (the share of the loop's time blocked on batches, a
    verdict, where the workers' and the training process's time goes); an input-bound epoch is
    warned about once, naming a knob: ``stats=False`` (or ``StatsOptions(logger=True)``: as a
    ``logging`` record) changes that.
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
        with_keys: bool | str | Sequence[str] | None = None,
        prefetch_factor: int = 2,
        start_method: str | None = None,
        timeout: float = 0,
        decode_on: str = "workers",
        collate: Callable[[dict], Any] | None = None,
        stats: StatsOptions | bool = True,
        _decoder_factory: Callable[..., Any] | None = None,
    ):
        _check_dataset(dataset)
        seam = dataset.seam()  # the dataset's options, read whole through its one door
        batch_size = check_int("batch_size", batch_size, 1)
        if dataset.batch_size is not None and dataset.batch_size != batch_size:
            raise InputError(
                f"ShardDataset(batch_size={dataset.batch_size}) counts a DataLoader's batches; "
                f"ShardLoader batches by its own batch_size={batch_size}: give one (drop the "
                "dataset's, or make them equal)"
            )
        num_workers = default_workers() if num_workers is None else num_workers
        num_workers = check_int("num_workers", num_workers, 0)
        prefetch_factor = check_int("prefetch_factor", prefetch_factor, 1)
        for name, flag in (("drop_last", drop_last), ("channels_last", channels_last)):
            if not isinstance(flag, bool):
                raise InputError(f"{name} must be True or False, got {flag!r}")
        check_choice("decode_on", decode_on, DECODE_ON)
        _check_masks(seam, decode_on)
        _check_sample_extras(seam, decode_on)
        if decode_on != "workers" and seam.transform is not None:
            raise InputError(
                f"decode_on={decode_on!r} decodes in the training process, after the workers: "
                "a per-sample transform= has no pixels to run on there; apply it to the batch"
            )
        start_method = start_method or default_start_method()
        if start_method not in ("fork", "spawn", "forkserver"):
            raise InputError(f"start_method={start_method!r}: use 'fork', 'spawn' or 'forkserver'")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout < 0
        ):
            raise InputError(f"timeout must be seconds >= 0 (0: wait forever), got {timeout!r}")
        self.dataset = dataset
        self.seam = seam
        self.batch_size = batch_size
        self.num_workers = int(num_workers)
        self.drop_last = bool(drop_last)
        self.device = torch.device(device) if device is not None else None
        self.channels_last = bool(channels_last)
        self.extras = seam.extras if with_keys is None else extras_of(with_keys)
        self.with_keys = "key" in self.extras
        self.prefetch_factor = int(prefetch_factor)
        self.start_method = start_method
        self.timeout = float(timeout)
        self.decode_on = decode_on
        if collate is not None and not callable(collate):
            raise InputError(f"collate must be a callable taking the batch dict, got {collate!r}")
        self.collate = collate
        self._stats = LoaderStats(stats)  # who waits for whom, per epoch (``stats()``)
        self._decoder = None  # decode_on="device": one nvImageCodec decoder for the loader's life
        # An internal seam for tests and benchmarks only (never a default): builds the device
        # decoders instead of ``DeviceDecoder``, e.g. ``images.device.StandInDecoder``.
        self._decoder_factory = _decoder_factory or DeviceDecoder
        self._balance = Balance()  # decode_on="auto": both sides' measured rates
        #: What the iterations cost the training process, and where device-side images were
        #: decoded (region, whole on the device, the CPU): ``feed_counts.as_dict()``.
        self.feed_counts = FeedCounts()
        if decode_on != "workers":
            self._device_decoder()  # the missing extra is an error now, not at the first batch
        self.normalize = None
        if normalize is not None:
            mean, std = (torch.as_tensor(v, dtype=torch.float32) for v in normalize)
            finite = bool(torch.isfinite(mean).all() and torch.isfinite(std).all())
            if mean.shape != (3,) or std.shape != (3,) or not finite or bool((std == 0).any()):
                raise InputError(
                    "normalize must be ((m, m, m), (s, s, s)): finite, in the 0-1 scale, s != 0, "
                    f"got {normalize!r}"
                )
            self.normalize = (mean, std)
        cuda = self.device is not None and self.device.type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise InputError(f"device={device!r} but CUDA is not available; use device='cpu'")
        # Batches staged ahead of the one yielded: one with CUDA, so its copy overlaps the step;
        # two where the training process decodes (its decode thread works during the step).
        self._ahead = (2 if decode_on != "workers" else 1) if cuda else 0
        self._current: weakref.ref | None = None
        self._thread: weakref.ref | None = None  # the thread of the current iteration
        self._lock = threading.Lock()
        self._gen = 0  # the last generation number given out (an iteration's, or filled ahead)
        self._overlap_epochs = OVERLAP_EPOCHS
        self._started: int | None = None  # the epoch the last iteration started from its beginning
        self._position: Position | None = None  # what the latest iteration yielded (state_dict)
        self._res = _Resources()
        weakref.finalize(self, self._res.close)

    def __setattr__(self, name: str, value) -> None:
        if name in _FIXED and "_res" in self.__dict__:
            raise InputError(
                f"ShardLoader.{name} cannot change once the loader is built (its workers and "
                f"ring follow it): build another ShardLoader (and close() this one)"
            )
        super().__setattr__(name, value)

    @property
    def _nhwc(self) -> bool:
        """Slots hold NHWC batches (what JPEG decodes to) unless the output is a plain
        contiguous uint8 CPU batch, which the workers transpose into place instead."""
        return self.channels_last or self.device is not None or self.normalize is not None

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
        with self._lock:
            return self._iterate()

    def _iterate(self) -> Iterator[tuple]:
        res = self._res
        if res.workers is not None and res.owner != os.getpid():
            raise ForeignLoaderError(
                f"this ShardLoader's workers were started by process {res.owner}, of which this "
                f"process ({os.getpid()}) is a fork: build a new ShardLoader (and ShardDataset) "
                "here; the parent's loader keeps working"
            )
        current = self._current() if self._current is not None else None
        thread = self._thread() if self._thread is not None else None
        if (
            current is not None
            and current.gi_frame is not None  # not finished
            and thread is not None
            and thread is not threading.current_thread()
            and thread.is_alive()
        ):
            raise ShardkitError(
                f"ShardLoader is being iterated by another thread ({thread.name}); a loader "
                "serves one loop at a time: give each thread its own ShardLoader (and "
                "ShardDataset, with its own rank or part), or finish that loop first"
            )
        self._abandon()  # one live iteration at a time; the workers stay
        if res.workers is None:
            self._start_workers()
        try:
            epoch = Epoch(self, res.workers, res.ring, self._ahead)
        except BaseException:  # a worker died while idle: the next iteration starts afresh
            res.close()
            raise
        batches = epoch.batches()
        # Weak: dropping the iterator (break, an exception) is what ends the iteration.
        self._current = weakref.ref(batches)
        self._thread = weakref.ref(threading.current_thread())
        return batches

    def state_dict(self) -> dict:
        """The position in the epoch as plain data (``json``, ``torch.save``): the records each
        worker's yielded batches took from its stream (skipped samples included) and whose batch
        is next. Workers deal batches as DataLoader workers do, so the dataset works out from
        that alone which samples were delivered (shardkit.resume)."""
        n = max(1, self.num_workers)
        pos = self._position
        if pos is None or pos.epoch != self.dataset.epoch:
            pos = Position(self.dataset.epoch, [0] * n)
        return self.dataset.worker_position(pos.consumed, pos.next_worker, cut=self.batch_size)

    def load_state_dict(self, state: dict) -> None:
        """Continue the epoch ``state`` was saved in on the next iteration, in the same order and
        reading nothing already delivered; no ``set_epoch`` needed. A state saved on another
        world size (or worker count) re-splits what is left (``ShardDataset.load_state_dict``)."""
        self._abandon()
        self._position = None
        self.dataset.load_state_dict(state)

    def close(self) -> None:
        """End the current iteration and stop the worker processes (also done when the loader
        is garbage-collected and at exit); the next iteration starts new ones."""
        self._abandon()
        self._res.close()

    def stats(self, *, last: bool = False, all_ranks: bool = False, group=None) -> dict:
        """Who waits for whom: a flat dict of numbers and short strings for any logger, for the
        epoch in progress (after it, the one just finished; ``last=True``: the last finished).

        ``wait_s``: the training process's time blocked in ``next()`` after the first batch
        (``first_wait_s``: the workers' start), ``step_s``: its time between batches,
        ``wait_share`` = wait / (wait + step) and its ``verdict`` ("not input-bound" under 5%,
        "partly input-bound" to 20%, "input-bound"), ``images_per_s`` (after the first
        batch), the per-batch wait's ``wait_p50_s``/``wait_p95_s``/``wait_max_s``; where the
        workers' time went
        (``worker_{read,decode,resize,transform,copy,idle}_s`` and ``_share``: summed over the
        workers; idle is waiting for a free slot, the ring full) and the training process's
        (``trainer_copy_s``, ``trainer_normalize_s``, ``trainer_device_decode_s``); with
        ``decode_on="device"``/``"auto"``, the device decodes per path and the CPU fallbacks
        with their reason. ``all_ranks=True`` (a collective: every rank calls it) adds each
        rank's ``rank{r}_wait_share``, ``max_wait_share`` and ``slowest_rank`` over
        ``torch.distributed`` (see docs/loader.md, "Is my training input-bound?")."""
        out = self._stats.report(last, self)
        return gather_stats(out, group) if all_ranks else out

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids (empty before the first iteration and after ``close``)."""
        return self._res.workers.pids if self._res.workers is not None else []

    @property
    def overlap_epochs(self) -> bool:
        """Whether the workers fill the next epoch's first batches while this one drains (on
        by default; set False to measure what the overlap gives: benchmarks/bench_epochs.py)."""
        return self._overlap_epochs

    @overlap_epochs.setter
    def overlap_epochs(self, on: bool) -> None:
        self._overlap_epochs = bool(on)

    @property
    def balance(self) -> Balance:
        """``decode_on="auto"``'s measured rates of both sides and the share sent to workers."""
        return self._balance

    @property
    def ring(self):
        """The shared batch ring (None before the first iteration and after ``close``)."""
        return self._res.ring

    def __repr__(self) -> str:
        ring = self._res.ring
        decode = f"{self.decode_on!r}" + (
            f" ({self._decoder.backend})" if self._decoder is not None else ""
        )
        return (
            f"ShardLoader({self.dataset!r}, batch_size={self.batch_size}, "
            f"num_workers={self.num_workers}, device={self.device}, drop_last={self.drop_last}, "
            f"decode_on={decode}, "
            f"ring={ring if ring is not None else 'not allocated (first iteration)'})"
        )

    # --- internals ----------------------------------------------------------------------------

    def _start_workers(self) -> None:
        n = max(1, self.num_workers)
        slots = slots_per_worker(self.prefetch_factor, self._ahead)
        pin = self.device is not None and self.device.type == "cuda"
        spec = FillSpec(
            self.batch_size,
            n,
            self.drop_last,
            self._nhwc,
            decode_on=self.decode_on,
            fill_ahead=self.prefetch_factor,
            sources="source" in self.extras,
        )
        self._check_descriptors(n, slots)
        res = self._res
        try:
            res.ring = Ring(n, slots, shared=self.num_workers > 0, pin=pin)
            if self.num_workers == 0:
                res.workers = LocalWorkers(self.dataset, spec, res.ring)
            else:
                res.workers = ProcessWorkers(
                    self.dataset, spec, res.ring, self.start_method, self.timeout
                )
        except BaseException:  # nothing of a failed start stays open (descriptors, processes)
            res.close()
            raise

    def _new_gen(self) -> int:
        """A generation number never used before by this loader's workers."""
        self._gen += 1
        return self._gen

    def _device_decoder(self) -> DeviceDecoder:
        if self._decoder is None:
            self._decoder = self._decoder_factory(self.device)
        return self._decoder

    def _device_decoders(self, count: int) -> list[DeviceDecoder]:
        """``count`` decoders, one per decode thread (the first is ``_device_decoder()``),
        kept for the loader's life."""
        have = self.__dict__.setdefault("_more_decoders", [])
        while len(have) < count - 1:
            first = self._device_decoder()
            have.append(self._decoder_factory(self.device, upsampling=first.upsampling))
        return [self._device_decoder(), *have[: count - 1]]

    def _check_descriptors(self, workers: int, slots: int) -> None:
        """The ring holds a descriptor per slot (and each worker a pipe and a few files): refuse
        a ring the process's descriptor limit cannot hold, naming the setting, before opening
        one (not a raw EMFILE halfway through)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return
        try:
            open_now = len(os.listdir("/proc/self/fd"))
        except OSError:
            open_now = 0
        need = workers * (slots + _FDS_PER_WORKER)
        if open_now + need > soft:
            raise InputError(
                f"prefetch_factor={self.prefetch_factor} with num_workers={self.num_workers} "
                f"needs {need} descriptors ({workers} x {slots} ring slots and pipes), and this "
                f"process has {open_now} of its descriptor limit of {soft} open: lower "
                "prefetch_factor (2-4 keeps any GPU fed) or raise the limit (ulimit -n)"
            )

    def _abandon(self) -> None:
        """End the current iteration (its generator's ``finally`` gives the slots back)."""
        batches = self._current() if self._current is not None else None
        self._current = None
        if batches is not None:
            try:
                batches.close()
            except ValueError:  # closing from inside the iteration itself (Ctrl-C): it unwinds
                pass


def _check_dataset(dataset) -> None:
    if not isinstance(dataset, ShardDataset):
        raise InputError(f"dataset must be a ShardDataset, got {type(dataset).__name__}")
    if dataset.decode.mode != "tensor":
        raise InputError(
            f'ShardLoader batches decoded tensors: build the dataset with decode="tensor" or '
            f"a shardkit.Decode(crop=...) (got decode={dataset.decode.mode!r})"
        )


def _check_sample_extras(seam, decode_on: str) -> None:
    """``sample_transform`` takes the decoded sample, which only the workers have."""
    if seam.sample_transform is not None and decode_on != "workers":
        raise InputError(
            f"sample_transform= runs on each decoded sample in the workers: it needs "
            f'decode_on="workers" (got decode_on={decode_on!r}); decode_on="device" decodes '
            "after them, in the training process"
        )


def _check_masks(seam, decode_on: str) -> None:
    for name, decode in zip(seam.fields, seam.field_decoders or (), strict=False):
        if decode is decode_field_image and decode_on != "workers":
            raise InputError(
                f"fields=: {name!r} is image-shaped (a mask): it is cut with its image in the "
                f'workers, so it needs decode_on="workers" (got {decode_on!r})'
            )
    if seam.boxes is not None and decode_on != "workers":
        raise InputError(
            f'boxes= are moved with their image in the workers: use decode_on="workers" (got '
            f"{decode_on!r})"
        )
