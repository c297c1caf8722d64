"""One iteration of a ShardLoader: batch order, device staging, and every slot's way back.

Batches are drawn from the workers in turn, one each, skipping workers that are done: the order
in which DataLoader draws from its workers, so a ShardLoader yields what ``DataLoader(ds,
batch_size, num_workers)`` would and ``len(loader)`` is exact.

This is the one place that decides when a slot may be written again (``_give_back``):

- the batch is a view of its slot (a uint8 batch on the CPU): two draws after it was yielded,
  when the caller's loop variable has moved on; a slot still reached then (the tensor, a view,
  its storage, a numpy array over it: ``Ring.kept``) was kept by the caller and gets fresh
  memory instead (``Ring.replace``);
- the batch was copied to the device: once the copy's event has completed (one step after it was
  staged: the copy runs on a side stream while the caller's step runs, apex's prefetcher);
- the batch was converted on the CPU (normalised, made contiguous): right after staging.

A worker needs as many slots as the consumer can hold of its batches at once plus the ones it
may fill ahead (``slots_per_worker``); the consumer checks before every wait that the worker it
waits on has a slot to fill, so a miscount is an error, never a hang. When an iteration ends,
every slot it still holds is given back (freed, or given fresh memory if the caller kept it).

No bubble between epochs: each ``Start`` also names the epoch the workers fill ahead once their
part is done (``next_epoch``: the one after, or the same one again for a loop that never calls
``set_epoch``), under a generation of its own. The next iteration takes those batches only if it
starts exactly that epoch from its beginning (no loaded state): it then uses that generation, so
the batches are the ones the workers would fill for it anyway; any other start (another
``set_epoch``, ``load_state_dict``) has a new generation, and the workers drop what they filled.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError, ShardkitError
from ..images.device import versions_text
from ..stream.world import World
from .device_feed import DECODE_THREADS, Balance, DeviceFeed, pinned
from .fill import BOX_COLUMNS, unbatch_arrays
from .messages import Batch, End

__all__ = ["Balance", "Epoch", "FeedCounts", "Position", "next_epoch", "slots_per_worker"]


@dataclass
class FeedCounts:
    """What a loader's iterations cost the training process (``ShardLoader.feed_counts``):
    images delivered and the training thread's CPU seconds inside the loader (drawing, staging,
    device decode and resize); with decode_on="device"/"auto", where each device-side image was
    decoded: as its crop's region, whole on the device (region declined), or on this process's
    CPU (declined whole: counted and warned about once)."""

    delivered: int = 0
    trainer_cpu_s: float = 0.0
    region: int = 0
    whole: int = 0
    cpu: int = 0
    warned: bool = False

    def as_dict(self) -> dict:
        per = self.trainer_cpu_s / self.delivered * 1e6 if self.delivered else None
        return {
            "delivered": self.delivered,
            "trainer_cpu_us_per_image": per,
            "device_region": self.region,
            "device_whole": self.whole,
            "device_cpu_fallback": self.cpu,
        }


@dataclass
class Position:
    """How far the caller is in ``epoch``: records each worker's yielded batches took from its
    stream (skipped samples included) and the worker whose batch is due next."""

    epoch: int
    consumed: list[int]
    next_worker: int = 0


def next_epoch(previous: int | None, current: int) -> int:
    """The epoch the iteration after one of ``current`` most likely starts: ``current + 1`` (the
    loop calls ``set_epoch`` each epoch), or ``current`` again where the iteration before also
    started ``current`` from its beginning (a loop that never calls it repeats its epoch)."""
    return current if previous == current else current + 1


def slots_per_worker(prefetch_factor: int, ahead: int) -> int:
    """Batches a worker may have ready (``prefetch_factor``), plus those the consumer holds:
    ``ahead`` staged, the one yielded and the one before it (still the caller's loop variable
    when the next is drawn)."""
    return prefetch_factor + ahead + 2


class Epoch(DeviceFeed):
    """The consumer side of one iteration over ``loader``'s workers."""

    def __init__(self, loader, workers, ring, ahead: int):
        ds = loader.seam
        self.loader, self.workers, self.ring = loader, workers, ring
        self.ahead = ahead
        self.n = max(1, loader.num_workers)
        self.epoch = ds.start_epoch(World(ds.rank, ds.world_size, 0, 1))
        resumes = [
            ds.take_resume(World(ds.rank, ds.world_size, w, self.n), self.epoch)
            for w in range(self.n)
        ]
        self.gen, fill_ahead = self._generations(resumes)
        # What the caller has received, for state_dict: records taken per worker, who is next.
        self.position = loader._position = Position(self.epoch, [0] * self.n)
        device = loader.device
        self.cuda = device is not None and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.nhwc = loader._nhwc
        # Encoded slots (decode_on="device", "auto"): decoded here, never lent to the caller, by
        # lanes (a decoder and its stream) that the decode threads take in turn.
        self.decoder = loader._device_decoder() if loader.decode_on != "workers" else None
        self._lanes: queue.SimpleQueue = queue.SimpleQueue()
        if self.decoder is not None:
            for decoder in loader._device_decoders(max(1, DECODE_THREADS)):
                self._lanes.put((decoder, torch.cuda.Stream(device) if self.cuda else None))
        self._lock = threading.Lock()  # the counts the decode threads add to
        # A decoded slot goes to the caller itself (no conversion, no device): give it back late.
        self.view = (
            not self.cuda and loader.normalize is None and (loader.channels_last or not self.nhwc)
        )
        if loader.normalize is not None:
            mean, std = loader.normalize
            target = device or torch.device("cpu")
            self.scale = (1.0 / (255.0 * std)).view(1, 3, 1, 1).to(target)
            self.shift = (-mean / std).view(1, 3, 1, 1).to(target)
        self.held: list[set[int]] = [set() for _ in range(self.n)]
        self._cpu = None  # the CPU decoder for what the device decoder declines
        self.balance = loader._balance if loader.decode_on == "auto" else None
        self._timing: deque = deque()  # CUDA decode events not yet read (auto)
        self._alive: dict = {}  # (worker, slot) -> nvImageCodec images the stream still reads
        # stored-byte batches decoding on the decode thread, in order
        self._pool = None
        if self.decoder is not None and DECODE_THREADS > 0:
            self._pool = ThreadPoolExecutor(DECODE_THREADS, "shardkit-device-decode")
        self._pending: deque = deque()
        # seconds the caller waited on the workers since the last draw (auto): whether the
        # workers keep up; a wait on the device's own decode is its measured rate's business
        self._waited = 0.0
        self._draws = 0
        self.done = False
        self.stats = loader._stats.begin(self.epoch, loader)  # stats.py
        workers.start(
            self.gen, self.epoch, [r.to_dict() if r else None for r in resumes], fill_ahead
        )
        if self.balance is not None:
            self.balance.last = None  # the pause between epochs is not a step
            workers.share(self.balance.sent)

    def _generations(self, resumes: list) -> tuple[int, tuple[int, int] | None]:
        """This iteration's generation: the one the workers filled ahead if it was for this
        epoch from its beginning, else a new one; and (generation, epoch) to fill ahead next."""
        loader, workers = self.loader, self.workers
        fresh = all(r is None for r in resumes)
        planned = workers.ahead
        if fresh and planned is not None and planned[1] == self.epoch:
            gen = planned[0]
        else:
            gen = loader._new_gen()
        fill_ahead = None
        if workers.fills_ahead and loader._overlap_epochs:
            fill_ahead = (loader._new_gen(), next_epoch(loader._started, self.epoch))
        loader._started = self.epoch if fresh else None
        return gen, fill_ahead

    # --- drawing -----------------------------------------------------------------------------

    def _ready(self) -> Iterator[Batch]:
        """Batches in DataLoader order: one from each live worker in turn."""
        live = list(range(self.n))
        while live:
            for w in list(live):
                if len(self.held[w]) >= self.ring.slots:
                    raise ShardkitError(
                        f"ShardLoader: waiting on worker {w} while holding all its "
                        f"{self.ring.slots} slots would never end (slot count bug)"
                    )
                t0 = time.perf_counter()
                msg = self.workers.next(w)
                if self._draws >= self.n:  # not the first round: workers starting, shards opening
                    self._waited += time.perf_counter() - t0
                self._draws += 1
                if isinstance(msg, End):
                    if msg.error is not None:
                        if msg.cause is not None:
                            raise msg.error from msg.cause
                        raise msg.error
                    live.remove(w)
                    continue
                if msg.epoch != self.epoch:  # never a batch of another epoch
                    raise ShardkitError(
                        f"ShardLoader: worker {w} sent a batch of epoch {msg.epoch} in epoch "
                        f"{self.epoch} (generation bug)"
                    )
                self.held[w].add(msg.slot)
                self.stats.worker_times(msg.times)
                for note in msg.notes:
                    warnings.warn(note, RuntimeWarning, stacklevel=4)
                yield msg

    def batches(self) -> Iterator[tuple]:
        """The caller's iterator: slots -> (device) batches, ``ahead`` staged in advance. The
        training thread's CPU between the caller's ``next`` and each batch is counted."""
        staged: deque = deque()
        drawn: deque = deque()
        counts, clock = self.loader.feed_counts, time.thread_time
        cpu0, seen0 = counts.cpu, counts.region + counts.whole + counts.cpu
        st, now = self.stats, time.perf_counter
        st.resumed(now())
        began = clock()
        try:
            for msg in self._ready():
                staged.append(self._stage(msg))
                while len(staged) > self.ahead:
                    item = self._staged(staged.popleft())
                    before = len(drawn)
                    out = self._finish(*item, drawn)
                    if out is None:  # nothing handed out: its slot, if viewed, is free now
                        if len(drawn) > before:
                            self._give_back(*drawn.pop())
                        continue
                    counts.delivered += item[1][0].shape[0]
                    counts.trainer_cpu_s += clock() - began
                    st.yielded(now(), item[1][0].shape[0])
                    yield out
                    st.resumed(now())
                    began = clock()
                    # back in the caller's next(): its loop variable still holds the batch just
                    # yielded; every one before it is free (handed back earlier, the caller's
                    # held batch got fresh memory: a page fault per write, every batch)
                    while len(drawn) > 1:
                        self._give_back(*drawn.popleft())
            while staged:
                item = self._staged(staged.popleft())
                out = self._finish(*item, drawn)
                if out is None:
                    continue
                counts.delivered += item[1][0].shape[0]
                counts.trainer_cpu_s += clock() - began
                st.yielded(now(), item[1][0].shape[0])
                yield out
                st.resumed(now())
                began = clock()
            self.done = True
            if counts.cpu > cpu0 and not counts.warned:
                counts.warned = True
                seen = counts.region + counts.whole + counts.cpu - seen0
                warnings.warn(
                    f"decode_on={self.loader.decode_on!r}: {counts.cpu - cpu0} of {seen} images "
                    "decoded on the device side this epoch went to the training process's CPU "
                    f"(nvImageCodec declined them whole; {versions_text()}); PNG, CMYK and "
                    "damaged files go this way, JPEGs should not: see docs/loader.md",
                    RuntimeWarning,
                    stacklevel=2,
                )
        except GeneratorExit:  # break, or the caller's own exception: the workers stay
            raise
        except BaseException:  # a worker's error, a dead worker, Ctrl-C: stop every worker,
            self._abandon()  # once the decode thread no longer reads (or copies from) a slot
            self.loader.close()
            raise
        finally:
            self._abandon()
            self.loader._stats.end(st, self.done, counts)  # the last next() included

    def _staged(self, item):
        """A staged batch, waiting for the decode thread where it is decoding there."""
        if isinstance(item, Future):
            self._pending.popleft()
            return item.result()
        return item

    def _stage(self, msg: Batch):
        """Start moving batch ``msg`` to the device and converting it there."""
        if msg.count == 0:  # records that gave no image: counted in their turn, not yielded
            self._give_back(msg.worker, msg.slot)
            return None, (), None, None, None, (msg.worker, msg.consumed)
        if self.balance is not None:
            self._rebalance(msg)
        if msg.offsets is not None:
            if self._pool is None:
                return self._stage_encoded(msg)
            future = self._pool.submit(self._stage_encoded, msg)
            self._pending.append(future)
            return future
        if msg.samples is not None:
            return self._stage_samples(msg)
        bs = self.loader.batch_size
        shape = (bs, msg.height, msg.width, 3) if self.nhwc else (bs, 3, msg.height, msg.width)
        images = self.ring.lend(msg.worker, msg.slot, shape)[: msg.count]
        if self.nhwc:
            images = images.permute(0, 3, 1, 2)
        labels = torch.tensor(msg.labels, dtype=torch.int64)
        tt = self.loader.seam.target_transform
        if tt is not None:
            labels = torch.utils.data.default_collate([tt(int(v)) for v in msg.labels])
        device, ready, copied = self.loader.device, None, None
        ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        t0 = time.perf_counter()
        with ctx:
            if device is not None:
                images = images.to(device, non_blocking=True)  # from the pinned slot: async
                if self.cuda:
                    copied = torch.cuda.Event()
                    copied.record(self.stream)
                labels = pinned(labels, device)
            t1 = time.perf_counter()
            images = self._convert(images)
            self.stats.stage_copy_s += t1 - t0
            self.stats.stage_normalize_s += time.perf_counter() - t1
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        out = self._output(images, labels, msg.keys, msg.fields, msg.sources)
        slot = (msg.worker, msg.slot)
        if not self.view and not self.cuda:  # converted into new memory: the slot is done
            self._give_back(*slot)
            slot = None
        return out, (images, labels), ready, copied, slot, (msg.worker, msg.consumed)

    def _stage_samples(self, msg: Batch):
        """A batch of ``sample_transform`` outputs (batched in the worker): its stacked columns
        are in the slot (views of it, lent as the images of the plain path are: the slot goes
        back once the caller no longer holds them), moved to the device; the image column
        normalised and laid out as the loader says (``_sample_images``), then ``collate``."""
        slot = None
        if msg.capacity:
            slot = self.ring.lend(msg.worker, msg.slot, (msg.capacity,))
        out = unbatch_arrays(msg.samples, self._on_device, slot)
        out = self._sample_images(out)
        if self.loader.collate is not None:
            out = self.loader.collate(out)
        held = None
        if slot is not None and not self.cuda:  # views of the slot: held as a lent batch's
            held = (msg.worker, msg.slot)
        else:  # nothing over the slot (a CUDA device copied it through pinned memory)
            self._give_back(msg.worker, msg.slot)
        labels = torch.tensor(msg.labels, dtype=torch.int64)  # counts the batch's samples
        return out, (labels,), None, None, held, (msg.worker, msg.consumed)

    def _sample_images(self, out):
        """``normalize=``/``channels_last=`` on a ``sample_transform`` batch: applied to its
        image column (a dict's "image", a tuple's first, or the one column) where that is a
        uint8 (N, 3, H, W) tensor; anything else is refused naming the option, never a batch
        silently left uint8."""
        loader = self.loader
        if loader.normalize is None and not loader.channels_last:
            return out
        if isinstance(out, dict):
            where, images = '"image"', out.get("image")
        elif isinstance(out, tuple):
            where, images = "its first column", out[0] if out else None
        else:
            where, images = "the batch", out
        ok = isinstance(images, torch.Tensor) and images.dtype == torch.uint8
        if not (ok and images.dim() == 4 and images.shape[1] == 3):
            options = [o for o, on in (("normalize", loader.normalize is not None),
                                       ("channels_last", loader.channels_last)) if on]  # fmt: skip
            got = (
                f"a {images.dtype} tensor of shape {tuple(images.shape)}"
                if isinstance(images, torch.Tensor)
                else f"a {type(images).__name__}"
            )
            raise InputError(
                f"ShardLoader({'=, '.join(options)}=) applies to the sample_transform's images, "
                f"a uint8 (N, 3, H, W) batch under {where}, but it is {got}: return the uint8 "
                'image as "image" (or first), or normalise in the sample_transform and drop '
                f"{'=/'.join(options)}="
            )
        fmt = torch.channels_last if loader.channels_last else torch.contiguous_format
        if loader.normalize is not None:
            converted = torch.empty(
                images.shape, dtype=torch.float32, device=images.device, memory_format=fmt
            )
            torch.addcmul(self.shift, images, self.scale, out=converted)
        else:
            converted = images.contiguous(memory_format=fmt)
        if isinstance(out, dict):
            return {**out, "image": converted}
        if isinstance(out, tuple):
            return (converted, *out[1:])
        return converted

    def _output(self, images, labels, keys: list, fields: list | None, sources=None):
        """The caller's batch: ``(images, labels[, keys][, sources])``, or with the dataset's
        ``fields=`` a dict of "image", "label", ("key", "source") and one list per field, shaped
        by ``collate``. Sources are an int64 tensor (positions in ``dataset.source_names``)."""
        loader = self.loader
        extra = {"key": keys}
        if "source" in loader.extras:
            extra["source"] = self._on_device(torch.tensor(sources or [], dtype=torch.int64))
        if fields is None:
            return (images, labels, *(extra[e] for e in loader.extras))
        out = {"image": images, "label": labels}
        out.update((e, extra[e]) for e in loader.extras)
        names = loader.seam.fields + (BOX_COLUMNS if loader.seam.boxes is not None else ())
        for name, value in zip(names, fields, strict=True):
            if isinstance(value, np.ndarray):  # masks: one (N, C, H, W) array per batch
                value = self._on_device(torch.from_numpy(value))
            elif name in BOX_COLUMNS:  # boxes: a (K, 4) array per image
                value = [self._on_device(torch.from_numpy(v)) for v in value]
            out[name] = value
        return out if loader.collate is None else loader.collate(out)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        device = self.loader.device
        return t if device is None else pinned(t, device)

    def _convert(self, images: torch.Tensor) -> torch.Tensor:
        loader = self.loader
        fmt = torch.channels_last if loader.channels_last else torch.contiguous_format
        if loader.normalize is not None:
            out = torch.empty(
                images.shape, dtype=torch.float32, device=images.device, memory_format=fmt
            )
            # One pass: x * (1 / (255 std)) - mean / std  ==  (x / 255 - mean) / std.
            return torch.addcmul(self.shift, images, self.scale, out=out)
        if self.nhwc and not loader.channels_last:
            return images.contiguous()  # a uint8 batch moved to a device as NHWC
        return images

    def _finish(self, out, tensors, ready, copied, slot, took, drawn: deque):
        """Make the caller's stream wait for this batch only (not the one staged behind it);
        a slot whose device copy has completed goes back now, a viewed one two draws later."""
        worker, consumed = took
        self.position.consumed[worker] += consumed
        self.position.next_worker = (worker + 1) % self.n
        if ready is not None:
            current = torch.cuda.current_stream(self.loader.device)
            current.wait_event(ready)
            for t in tensors:
                t.record_stream(current)
        if slot is not None:
            if copied is not None:
                copied.synchronize()  # issued a step ago: done, or nearly
                self._give_back(*slot)
            else:
                drawn.append(slot)
        return out

    def _give_back(self, worker: int, slot: int) -> None:
        self._alive.pop((worker, slot), None)
        self.held[worker].discard(slot)
        if self.ring.kept(worker, slot):
            self.workers.replace(worker, slot)
        else:
            self.ring.returned(worker, slot)
            self.workers.free(worker, slot)

    def _abandon(self) -> None:
        """The iteration ended (done, break, error): every slot it holds goes back now (given
        fresh memory if the caller keeps its batch), so the workers filling the next epoch
        ahead have it, and the next ``Start`` finds every slot free. The decode thread ends
        first: nothing may still read a slot."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pending.clear()
        if self.stream is not None:
            self.stream.synchronize()
        lanes = []
        while not self._lanes.empty():  # every lane is back: the decode threads have ended
            lanes.append(self._lanes.get())
        for lane in lanes:
            if lane[1] is not None:
                lane[1].synchronize()
            self._lanes.put(lane)
        self._alive.clear()
        try:
            for w, slots in enumerate(self.held):
                for slot in list(slots):
                    self._give_back(w, slot)
        except Exception:  # the workers are gone (closed, or one died): nothing to give back
            pass
        for slots in self.held:
            slots.clear()
        if not self.done:
            self.workers.abandon()
