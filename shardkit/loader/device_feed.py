"""``decode_on="device"``/``"auto"``: batches of stored bytes decoded in the training process.

The workers send a batch's stored bytes instead of pixels; here they are decoded on the device
(``shardkit.images.device``: each sample's crop region, then the batch resized, flipped and
normalised in a few kernels), by decode threads of the training process, batches ahead of the
caller. What the device declines is decoded by the CPU decoder with the box the worker drew;
what neither can decode is an error naming shard and key, or a counted skip. ``Balance`` is
``"auto"``'s measured split of the batches between the workers and the device.

``DeviceFeed`` is the part of an iteration (``epoch.Epoch``) that does this: its methods run on
the iteration's state (the ring, the lanes of decoders and streams, the stats), kept in
``Epoch`` with the rest of the batch's way.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field

import torch

from ..images.device import groups, resize_batch
from ..images.geometry import ShapeError
from ..records import Record
from ..stream.stages import sample_error
from .messages import Batch

__all__ = ["DECODE_THREADS", "Balance", "DeviceFeed", "pinned"]

#: decode_on="auto" never gives either side less than this share of the batches, so that both
#: rates stay measured (a GPU busier with a larger model, a CPU freed by another job).
MIN_SHARE = 0.05
#: The device's share while the workers alone keep the caller fed: enough to keep its rate known.
IDLE_SHARE = 0.02
#: The caller waiting this share of its time for batches makes both sides decode...
WAIT_HIGH = 0.05
#: ... and waiting less than this, for ``PATIENCE`` batches or more, tries the workers alone.
WAIT_LOW = 0.01
PATIENCE = 20

#: decode_on="device"/"auto": stored-byte batches are decoded by threads of the training
#: process, batches ahead of the caller, not by the caller's own thread: nvImageCodec's calls
#: hold their thread for ~60-150 us per image (hardware engine, measured on an H200), which on
#: the training thread delays every step. ``DECODE_THREADS`` of them, each with its own decoder
#: and stream, take turns (batches stay in order). On an H200 one thread gave 0.92 of the rate of
#: decoding on the caller's thread, two 0.85 (the calls serialise): one. 0 (benchmarks only):
#: the caller's thread.
DECODE_THREADS = 1


@dataclass
class Balance:
    """``decode_on="auto"``: each side's measured seconds per image (exponential averages), the
    rate the caller takes images at and the share of its time it waits for them, and the share
    of batches the workers decode. The workers decode all but ``IDLE_SHARE`` until the caller
    waits (``WAIT_HIGH`` of its time): the device's decode and resize then take nothing from a
    model that bounds the step. Then both sides decode at their measured rates (``split``),
    until the caller no longer waits (``WAIT_LOW``) and the workers alone may keep up: that is
    tried again, after twice as many batches each time it failed. Kept by the loader across
    epochs."""

    worker_s: float | None = None  # one worker's time per image it decodes
    device_s: float | None = None  # the training process's time per image decoded on the device
    demand: float | None = None  # images per second the caller takes
    wait: float | None = None  # the share of the caller's time spent waiting for batches
    sent: float = 1.0 - IDLE_SHARE  # the share the workers were last told
    split: bool = False  # both sides at their rates (else the workers take nearly all)
    since: int = 1 << 30  # batches since ``split`` last changed (none yet: no probe failed)
    patience: int = PATIENCE  # batches split before the workers alone are tried again
    warm: set = field(default_factory=set)  # sides whose first (warm-up) batch has passed
    last: float | None = None  # when the caller last took a batch (None: a new epoch)

    def note(self, side: str, seconds: float, count: int) -> None:
        if count <= 0 or seconds <= 0:
            return
        if side not in self.warm:  # a first batch opens shards, starts the decoder: not a rate
            self.warm.add(side)
            return
        per = seconds / count
        old = getattr(self, side)
        setattr(self, side, per if old is None else 0.5 * old + 0.5 * per)

    def taken(self, count: int, now: float, waited: float = 0.0) -> None:
        """The caller took ``count`` images now, after waiting ``waited`` seconds for them
        (the time since the last batch is its step)."""
        if self.last is not None and now > self.last:
            period = now - self.last
            rate, share = count / period, min(1.0, waited / period)
            self.demand = rate if self.demand is None else 0.8 * self.demand + 0.2 * rate
            self.wait = share if self.wait is None else 0.8 * self.wait + 0.2 * share
        self.last = now
        self.since += 1
        if self.wait is None:
            return
        if not self.split and self.wait > WAIT_HIGH:
            if self.since < 2 * PATIENCE:  # the workers alone were tried and fell short
                self.patience = min(64 * PATIENCE, 2 * self.patience)
            self.split, self.since = True, 0
        elif self.split and self.wait < WAIT_LOW and self.since >= self.patience:
            self.split, self.since = False, 0

    def share(self, workers: int) -> float:
        if not self.split:
            return 1.0 - IDLE_SHARE
        if self.worker_s is None or self.device_s is None:
            return 0.5
        cpu, device = workers / self.worker_s, 1.0 / self.device_s
        return min(1.0 - MIN_SHARE, max(MIN_SHARE, cpu / (cpu + device)))


class DeviceFeed:
    """The device decode of an ``Epoch``: a base of ``Epoch``, on its state."""

    def _stage_encoded(self, msg: Batch):
        """Decode batch ``msg``'s stored bytes on the device (``shardkit.images.device``): each
        sample's crop region, then the batch resized, flipped and normalised in a few kernels
        there. What the device declines whole is decoded by the CPU decoder with the same box;
        what neither can decode is an error naming shard and key, or a counted skip."""
        loader, ds = self.loader, self.loader.seam
        arr = self.ring.array(msg.worker, msg.slot, (msg.capacity,))
        offsets = msg.offsets
        bufs = [arr[lo:hi] for lo, hi in zip(offsets, offsets[1:], strict=False)]
        size = ds.geometry.size if ds.geometry is not None else None
        target = loader.device or torch.device("cpu")
        decoder, stream = lane = self._lanes.get()
        t0 = time.perf_counter()
        try:
            return self._decode_batch(msg, bufs, size, target, decoder, stream)
        finally:
            self._lanes.put(lane)
            with self._lock:
                self.stats.device_decode_s += time.perf_counter() - t0
                self.stats.device_batches += 1

    def _decode_batch(self, msg: Batch, bufs, size, target, decoder, stream):
        loader, ds = self.loader, self.loader.seam
        ctx = torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()
        timed = self.balance is not None
        with ctx:
            if timed and self.cuda:
                began = torch.cuda.Event(enable_timing=True)
                began.record(stream)
            t0 = time.perf_counter()
            decoded = decoder.decode(bufs, msg.boxes, stream)
            pixels, kept = self._decoded(decoded, bufs, msg, target)
            if not kept:  # every sample skipped here: nothing to hand out, the slot goes back
                return None, (), None, None, (msg.worker, msg.slot), (msg.worker, msg.consumed)
            dtype = torch.float32 if loader.normalize is not None else torch.uint8
            shape = (size, size) if size is not None else _one_size(pixels, msg, kept)
            fmt = torch.channels_last if loader.channels_last else torch.contiguous_format
            images = torch.empty(
                (len(kept), 3, *shape), dtype=dtype, device=target, memory_format=fmt
            )
            if size is None:
                self._place_whole(decoder, pixels, images)
            else:
                self._place_resized(decoder, pixels, kept, msg, size, images)
            labels = torch.tensor([msg.labels[i] for i in kept], dtype=torch.int64)
            tt = ds.target_transform
            if tt is not None:
                labels = torch.utils.data.default_collate([tt(int(v)) for v in labels.tolist()])
            ready = copied = None
            if self.cuda:
                labels = pinned(labels, target)
                copied = torch.cuda.Event(enable_timing=timed)  # the decode read the slot
                copied.record(stream)
                ready = copied
                if timed:
                    self._timing.append((began, copied, len(kept), time.perf_counter() - t0))
                if self._pool is not None:  # on the decode thread: wait here, not the caller
                    copied.synchronize()
            elif timed:
                with self._lock:
                    self.balance.note("device_s", time.perf_counter() - t0, len(kept))
        keys = [msg.keys[i] for i in kept]
        fields = None if msg.fields is None else [[col[i] for i in kept] for col in msg.fields]
        sources = None if msg.sources is None else [msg.sources[i] for i in kept]
        out = self._output(images, labels, keys, fields, sources)
        slot = (msg.worker, msg.slot)
        if self.cuda:  # nvImageCodec's images live until the stream has read them
            self._alive[slot] = decoded
        # the slot goes back from the caller's thread (the workers' pipes are not shared
        # between threads): after the copy's event on CUDA, two draws later on the CPU
        return out, (images, labels), ready, copied, slot, (msg.worker, msg.consumed)

    def _decoded(self, decoded: list, bufs: list, msg: Batch, target) -> tuple[list, list]:
        """Each kept sample's ``Crop`` from the device decoder, or its finished CHW image from
        the CPU decoder where the device declined it whole; and the samples kept (not skipped
        under ``on_error="skip"``)."""
        pixels, kept, cpu = [], [], 0
        for i, crop in enumerate(decoded):
            if crop is None:  # declined whole by the device decoder: the CPU decodes it (or fails)
                cpu += 1
                img = self._decode_on_cpu(bufs[i], msg, i)
                if img is None:
                    continue
                pixels.append(pinned(img, target))
            else:
                pixels.append(crop)
            kept.append(i)
        whole = sum(1 for c in decoded if c is not None and c.whole)
        counts = self.loader.feed_counts
        with self._lock:  # decode threads add up
            counts.cpu += cpu
            counts.whole += whole
            counts.region += len(decoded) - cpu - whole
        return pixels, kept

    def _place_whole(self, decoder, pixels: list, images: torch.Tensor) -> None:
        """Full-size images (no ``size``): each copied as it is, then normalised."""
        for j, p in enumerate(pixels):
            if isinstance(p, torch.Tensor):
                images[j].copy_(p)
            else:
                images[j].copy_(decoder.tensor(p).permute(2, 0, 1))
        if self.loader.normalize is not None:
            images.mul_(self.scale).add_(self.shift)

    def _place_resized(self, decoder, pixels, kept: list, msg: Batch, size: int, images) -> None:
        """The device crops resized as one batch per group of similar sizes
        (``resize_batch``); the CPU decoder's finished images copied to their places."""
        scale = shift = None
        if self.loader.normalize is not None:
            scale, shift = self.scale, self.shift
        how = self.loader.seam.geometry.interpolation
        on_device = [j for j, p in enumerate(pixels) if not isinstance(p, torch.Tensor)]
        crops = [pixels[j] for j in on_device]
        for group in groups(crops):
            where = [on_device[g] for g in group]
            part = [crops[g] for g in group]
            flips = [bool(msg.boxes[kept[j]].flip) for j in where]
            padded = decoder.padded(part, images.device)
            hs, ws = [c.h for c in part], [c.w for c in part]
            if where == list(range(where[0], where[0] + len(where))):  # a run: in place
                dest = images[where[0] : where[0] + len(where)]
                resize_batch(padded, hs, ws, size, flips, dest, scale, shift, None, how)
                continue
            tmp = torch.empty(
                (len(where), *images.shape[1:]), dtype=images.dtype, device=images.device
            )
            resize_batch(padded, hs, ws, size, flips, tmp, scale, shift, None, how)
            images.index_copy_(0, pinned(where, images.device, torch.int64), tmp)
        for j, p in enumerate(pixels):
            if isinstance(p, torch.Tensor):
                if scale is not None:
                    images[j].copy_(torch.addcmul(shift[0], p.float(), scale[0]))
                else:
                    images[j].copy_(p)

    def _rebalance(self, msg: Batch) -> None:
        """decode_on="auto": take this batch's measurement (a worker's fill time for a decoded
        batch; device decodes whose events have completed) and tell the workers a new share
        when it moved."""
        bal = self.balance
        bal.taken(msg.count, time.perf_counter(), self._waited)
        self._waited = 0.0
        if msg.offsets is None:
            bal.note("worker_s", msg.fill_s, msg.count)
        while self._timing and self._timing[0][1].query():
            # the device's cost: its GPU time, or the training thread's (CPU fallbacks, nvImageCodec
            # calls, copies) where that is longer
            began, ended, count, host_s = self._timing.popleft()
            bal.note("device_s", max(began.elapsed_time(ended) / 1000.0, host_s), count)
        share = bal.share(self.n)
        if abs(share - bal.sent) >= 0.02:
            bal.sent = share
            self.workers.share(share)

    def _decode_on_cpu(self, buf, msg: Batch, i: int) -> torch.Tensor | None:
        """Sample ``i`` through the CPU path's decoder: its finished (3, S, S) uint8 image (a
        full-size one without ``size``), or None when skipped under ``on_error="skip"``."""
        ds = self.loader.seam
        if self._cpu is None:
            self._cpu = ds.tensor_decoder(self.epoch)
        key = msg.keys[i]
        box = msg.boxes[i] if msg.boxes is not None else None  # the worker's: asked once
        try:
            return self._cpu(buf.tobytes(), key, box=box)
        except Exception as exc:
            rec = Record(key=key, ext="", data=b"", label=msg.labels[i], shard=msg.shards[i])
            err = sample_error(rec, exc)
            if ds.on_error == "raise":
                raise err from exc
            warnings.warn(f"skipped: {err}", RuntimeWarning, stacklevel=5)
            ds.skip_counter(0)()
            return None


def _one_size(pixels: list, msg: Batch, kept: list[int]) -> tuple[int, int]:
    """The (H, W) every full-size image of a batch without ``size`` shares (or a ShapeError
    naming the first that differs): a CPU-decoded CHW tensor's or a device ``Crop``'s."""
    sizes = [tuple(p.shape[1:]) if isinstance(p, torch.Tensor) else (p.h, p.w) for p in pixels]
    if not sizes:
        return (0, 0)
    for i, hw in zip(kept, sizes, strict=True):
        if hw != sizes[0]:
            raise ShapeError(
                f"{msg.shards[i]}: sample {msg.keys[i]!r} is {hw[1]}x{hw[0]} but its batch holds "
                f"{sizes[0][1]}x{sizes[0][0]} images; pass decode=Decode(crop=...) to "
                "ShardDataset for fixed-size batches"
            )
    return sizes[0]


def pinned(values, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """Host values on ``device`` without stalling the host: a copy from pageable memory to a
    GPU first waits for everything queued on the stream (a whole batch's copy or decode)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
