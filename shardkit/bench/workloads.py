"""What one benchmark run asks of the data pipeline, and the probes that measure it.

Everything here crosses into DataLoader worker processes, so it is made of picklable classes with
no open handles. Times are ``time.monotonic()``: on Linux that is CLOCK_MONOTONIC, one clock for
every process on the machine, so a worker's stamps and the main loop's stamps share one timeline
(``perf_counter``'s reference point is not promised to be shared).

- ``raw`` mode: the dataset yields the stored JPEG bytes; ``Collate`` keeps a batch as
  ``(list of bytes, labels)``: storage and transport only, no decoding.
- ``decode`` mode: the dataset decodes with ``decode="tensor"`` (uint8 CHW, the same
  ``shardkit.images.decode.decode_image`` both datasets use); batches are stacked ``(B, 3, H, W)``.
- ``augment`` mode: ``decode="pil"`` then ``Augment``, a CPU-heavy PIL/numpy augmentation.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from ..errors import check_choice
from ..stream.storage import LocalStorage
from ..stream.world import WorkerCounter, dataloader_worker, worker_slot

__all__ = [
    "MODES",
    "DATASET_DECODE",
    "Augment",
    "Collate",
    "CountingStorage",
    "MemoryDataset",
    "TimedIterable",
    "TimedMap",
    "sample_decoder",
    "stack_images",
    "step",
    "worker_id",
]

MODES = ("raw", "decode", "augment")
#: The ``decode=`` each mode asks the datasets for; ``augment`` adds ``Augment`` as transform.
DATASET_DECODE = {"raw": "raw", "decode": "tensor", "augment": "pil"}

clock = time.monotonic


def worker_id() -> int:
    """The DataLoader worker id of this process, -1 in the main process (``num_workers=0``)."""
    worker = dataloader_worker()
    return -1 if worker is None else worker


# --- storage probe ---------------------------------------------------------------------------


class CountingStorage(LocalStorage):
    """``LocalStorage`` (latency included) that also counts ``open``/``local_path`` calls.

    Those two calls are exactly where ``LocalStorage`` charges ``latency_ms``, so ``opens()`` is
    the number of times the latency was paid: per image for a folder, per shard slice for shards.
    The counter is a ``world.WorkerCounter`` (a shared-memory slot per worker), readable from the
    main process after the workers are gone.
    """

    def __init__(self, latency_ms: float = 0.0, **kwargs):
        super().__init__(latency_ms=latency_ms, **kwargs)
        self._opens = WorkerCounter()

    def _count(self) -> None:
        self._opens.add()

    def open(self, url: str):
        self._count()
        return super().open(url)

    def local_path(self, url: str) -> str:
        self._count()
        return super().local_path(url)

    def opens(self) -> int:
        """Opens (latency charges) so far, all processes together."""
        return self._opens.total()


# --- timing wrappers -------------------------------------------------------------------------


class TimedIterable(IterableDataset):
    """Yields ``(image, label, t)`` where ``t`` is when the DataLoader asked for the sample.

    The stamp of a batch's first sample is the moment its worker started producing that batch,
    which ``Collate`` turns into the batch's (worker, start, end) for the timeline.
    """

    def __init__(self, inner: IterableDataset):
        super().__init__()
        self.inner = inner

    def __iter__(self):
        t = clock()
        it = iter(self.inner)
        while True:
            try:
                sample = next(it)
            except StopIteration:
                return
            yield sample[0], sample[1], t
            t = clock()


class TimedMap(Dataset):
    """Map-style counterpart of ``TimedIterable`` (the folder baseline)."""

    def __init__(self, inner: Dataset):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        t = clock()
        sample = self.inner[index]
        return sample[0], sample[1], t


class Collate:
    """Batch ``(image, label, t)`` samples into ``(images, labels, (worker, start, end))``.

    Runs in the worker that produced the batch (in the main process when ``num_workers=0``), so
    ``end`` is when the batch was ready to be sent. In ``raw`` mode ``images`` is the list of
    the batch's JPEG ``bytes``, pickled through the worker's pipe: what a consumer of raw bytes
    gets. Measured on the 2-core VM this was written on (tar shards, 2-4 workers, warm): a list
    crossed at 37-47k samples/s, one uint8 tensor per batch through shared memory at 45-55k.
    Both are capped by the DataLoader's per-batch hand-over, which the table's stall column
    exposes (stall well below wait: the batches were ready, the hand-over was not).
    """

    def __init__(self, mode: str):
        check_choice("mode", mode, MODES)
        self.mode = mode

    def __call__(self, samples: list[tuple]):
        start = samples[0][2]
        labels = torch.tensor([s[1] for s in samples], dtype=torch.int64)
        if self.mode == "raw":
            images = [s[0] for s in samples]
        else:
            images = stack_images([s[0] for s in samples])
        return images, labels, (worker_id(), start, clock())


def stack_images(images: list[torch.Tensor]) -> torch.Tensor:
    """Stack CHW uint8 images into a (B, C, H, W) batch, in shared memory inside a worker.

    Contiguous CHW images (what ``decode="tensor"`` yields) are stacked as they are, like
    ``default_collate``. CHW *views* of HWC memory (PIL's layout; ``Augment`` returns those to
    skip a transpose) are stacked as HWC, a plain copy, and the batch is the NCHW-shaped
    channels-last view of it, which convolutions accept as is: stacking them into contiguous
    NCHW is a strided uint8 transpose that torch does slowly (measured 8-14 ms per
    64 x 250 x 250 batch, a third of the decode time). Like ``default_collate``, the batch is
    allocated in shared memory inside a worker so it leaves the worker without another copy.
    """
    first = images[0]
    hwc = first.dim() == 3 and first.permute(1, 2, 0).is_contiguous()
    parts = [im.permute(1, 2, 0) for im in images] if hwc else images
    shape = (len(parts), *parts[0].shape)
    if dataloader_worker() is not None:
        numel = len(parts) * parts[0].numel()
        storage = first._typed_storage()._new_shared(numel, device=first.device)
        out = first.new(storage).resize_(shape)
    else:
        out = torch.empty(shape, dtype=first.dtype)
    torch.stack(parts, out=out)
    return out.permute(0, 3, 1, 2) if hwc else out


class MemoryDataset(IterableDataset):
    """The same JPEG bytes held in memory: the bench's no-storage reference ("memory" format).

    Decodes exactly as the datasets do and goes through the same DataLoader, so what separates
    a format from this reference is its storage and reading cost, and what separates this
    reference from the decode ceiling is the DataLoader itself (moving batches between
    processes) and core sharing. Bytes live in one numpy array with offsets, so forked workers
    share them without copying pages. Shuffled per epoch; worker ``k`` of ``n`` takes every n-th.
    """

    def __init__(
        self,
        blobs: list[bytes],
        labels: list[int],
        *,
        decode: str,
        transform=None,
        seed: int = 0,
        size: int | None = None,
    ):
        super().__init__()
        lengths = np.fromiter((len(b) for b in blobs), dtype=np.int64, count=len(blobs))
        self.offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.offsets[1:])
        self.blob = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.decode = decode
        self.transform = transform
        self.seed = int(seed)
        self.epoch = 0
        self.size = size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.labels)

    def __iter__(self):
        k, n = worker_slot()
        decode = sample_decoder(self.decode, self.size)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.labels))
        blob, offsets, labels = self.blob, self.offsets, self.labels
        for i in order[k::n].tolist():
            img = decode(blob[offsets[i] : offsets[i + 1]].tobytes())
            if self.transform is not None:
                img = self.transform(img)
            yield img, int(labels[i])


def sample_decoder(decode: str, size: int | None):
    """Bytes -> what the datasets yield in this mode: ``decode_image``, or with ``size`` the
    fixed-size ``TensorDecoder`` of ``Decode(crop=CenterCrop(size, size))`` (a centre crop)."""
    from ..images.decode import decode_image

    if size is None:
        return lambda data: decode_image(data, decode)
    from ..images.geometry import Geometry, TensorDecoder

    return TensorDecoder(Geometry(size, "center"))


# --- the consumer's step ---------------------------------------------------------------------


def step(step_ms: float) -> None:
    """The training step: a sleep of ``step_ms``.

    A sleep, not a CPU loop, because it models what usually happens: the step runs on a GPU while
    the CPU waits for it. A CPU-burning step would also steal the cores the loader workers need
    (on 2 cores it halves them), which measures CPU contention rather than whether the loader
    keeps up with the step.
    """
    if step_ms > 0:
        time.sleep(step_ms / 1000.0)


# --- augmentation ----------------------------------------------------------------------------


class Augment:
    """A CPU-heavy training augmentation with PIL and numpy (no torchvision here).

    Random resized crop to ``size`` (area ``scale``, aspect ``ratio``), random affine (rotation
    within +-``degrees``, shear within +-``shear`` degrees, bicubic), colour jitter (brightness,
    contrast, saturation each by a factor in 1 +- ``jitter``, in float32) and a horizontal flip
    half the time. Returns a uint8 CHW tensor, a view of HWC memory (see ``stack_images``).
    Each process draws from its own generator, seeded from ``torch.initial_seed()``, which
    DataLoader makes distinct per worker and per epoch.
    """

    def __init__(
        self,
        size: int = 224,
        scale: tuple[float, float] = (0.35, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        degrees: float = 15.0,
        shear: float = 10.0,
        jitter: float = 0.4,
    ):
        self.size = int(size)
        self.scale = scale
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.degrees = float(degrees)
        self.shear = float(shear)
        self.jitter = float(jitter)
        self._pid = -1
        self._rng: np.random.Generator | None = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_pid", "_rng")} | {
            "_pid": -1,
            "_rng": None,
        }

    def _generator(self) -> np.random.Generator:
        if self._pid != os.getpid() or self._rng is None:
            self._pid = os.getpid()
            self._rng = np.random.default_rng(torch.initial_seed() % (1 << 63))
        return self._rng

    def _crop_box(self, rng: np.random.Generator, w: int, h: int) -> tuple[int, int, int, int]:
        area = w * h
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*self.log_ratio))
            cw = int(round(math.sqrt(target * aspect)))
            ch = int(round(math.sqrt(target / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                x = int(rng.integers(0, w - cw + 1))
                y = int(rng.integers(0, h - ch + 1))
                return x, y, x + cw, y + ch
        return 0, 0, w, h

    def _affine(self, rng: np.random.Generator) -> tuple[float, ...]:
        """Inverse map (output -> input pixel) of a rotation and shear about the centre."""
        angle = math.radians(rng.uniform(-self.degrees, self.degrees))
        sh = math.radians(rng.uniform(-self.shear, self.shear))
        cos, sin, tan = math.cos(angle), math.sin(angle), math.tan(sh)
        # forward = rotation @ shear_x; Image.transform wants its inverse.
        a, b, d, e = cos, cos * tan - sin, sin, sin * tan + cos
        det = a * e - b * d
        ia, ib, id_, ie = e / det, -b / det, -d / det, a / det
        c = self.size / 2.0
        return (ia, ib, c - ia * c - ib * c, id_, ie, c - id_ * c - ie * c)

    def __call__(self, img) -> torch.Tensor:
        from PIL import Image

        rng = self._generator()
        size = (self.size, self.size)
        img = img.resize(size, Image.BILINEAR, box=self._crop_box(rng, *img.size))
        img = img.transform(size, Image.AFFINE, self._affine(rng), resample=Image.BICUBIC)
        arr = np.asarray(img, dtype=np.float32)
        lo, hi = 1.0 - self.jitter, 1.0 + self.jitter
        arr *= rng.uniform(lo, hi)  # brightness
        mean = float(arr.mean())
        arr = (arr - mean) * rng.uniform(lo, hi) + mean  # contrast
        gray = (arr @ np.array([0.299, 0.587, 0.114], dtype=np.float32))[..., None]
        arr = (arr - gray) * rng.uniform(lo, hi) + gray  # saturation
        if rng.random() < 0.5:
            arr = arr[:, ::-1]
        out = np.ascontiguousarray(np.clip(arr, 0, 255).astype(np.uint8))
        return torch.from_numpy(out).permute(2, 0, 1)  # CHW view of HWC memory
