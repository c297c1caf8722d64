"""Who waits for whom, during training: what ``ShardLoader.stats()`` reports.

The training process blocks in the loader's ``next()``; the time it spends there (``wait_s``)
against the time it spends on its own step between batches (``step_s``) is the share of training
lost to input (``wait_share``), the figure Ray Train's "exposed data loading time", Fast-LLM's
``data_wait_time_ms`` and TF Profiler's input-pipeline verdict report. The verdict's words and
thresholds are defined here once (``verdict_of``) and used by ``shardkit bench`` as well.

The counters are cheap on purpose: two clock readings per batch on the training side, a handful
per batch in each worker (read, transform, copy and resize totals, sent with the ``Batch``
message the worker sends anyway); nothing is locked and nothing is sent on its own. Where a
worker's time goes is summed over every worker, so its shares are of the workers' whole time.

``replay`` measures the ideal: the caller's step on batches already delivered, with loading
taken out (DALI's ``LoaderEvaluator``), so a user sees the speed a faster loader could give.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..errors import InputError

__all__ = [
    "BOUND_AT",
    "INPUT_BOUND",
    "NOT_INPUT_BOUND",
    "PARTLY_AT",
    "PARTLY_INPUT_BOUND",
    "Replay",
    "StatsOptions",
    "WorkerClock",
    "gather_stats",
    "replay",
    "verdict_of",
]

log = logging.getLogger("shardkit.loader")

#: The three verdicts, shared by the loader's run-time stats and ``shardkit bench``: waiting less
#: than ``PARTLY_AT`` of the time for input is not input-bound, ``BOUND_AT`` or more is (TF
#: Profiler's input-pipeline analysis draws the lines at 5% and 20%; torch-tb-profiler flags 5%).
NOT_INPUT_BOUND = "not input-bound"
PARTLY_INPUT_BOUND = "partly input-bound"
INPUT_BOUND = "input-bound"
PARTLY_AT = 0.05
BOUND_AT = 0.20
#: An epoch is judged for the warning after this many batches (or at its end, if sooner): an
#: hour-long epoch should not wait an hour to say so, and a few batches are not a rate.
WARN_AFTER = 100


def verdict_of(wait_share: float | None) -> str | None:
    """The words for a wait share (None: nothing measured yet)."""
    if wait_share is None or math.isnan(wait_share):
        return None
    if wait_share >= BOUND_AT:
        return INPUT_BOUND
    if wait_share >= PARTLY_AT:
        return PARTLY_INPUT_BOUND
    return NOT_INPUT_BOUND


@dataclass(frozen=True)
class StatsOptions:
    """``ShardLoader(stats=...)``: ``warn``: one warning per input-bound epoch naming the
    figure and the knob (False: silent; ``stats()`` still reports); ``logger``: send it as a
    ``logging`` record (``shardkit.loader``) instead of ``warnings.warn``; ``min_wait_s``: the
    least time an epoch must have lost waiting to be warned about (a few seconds lost is not
    worth a knob; short loops, tests and evaluation passes stay silent)."""

    warn: bool = True
    logger: bool = False
    min_wait_s: float = 2.0

    def __post_init__(self):
        ok = isinstance(self.min_wait_s, (int, float)) and not isinstance(self.min_wait_s, bool)
        if not ok or not self.min_wait_s >= 0:
            raise InputError(
                f"StatsOptions(min_wait_s=) must be seconds >= 0, got {self.min_wait_s!r}"
            )


# --- the workers' side ---------------------------------------------------------------------------

#: The worker's per-batch totals sent in ``Batch.times``, in this order.
WORKER_PARTS = ("read", "decode", "resize", "transform", "copy", "idle")


#: Reading is timed record by record in one batch of this many (the first of each epoch
#: included), and the others get that batch's share: a wrapper around every record costs
#: 0.2-2.5 us (quiet, loaded), a measured 0.90x the rate of whole 8x8 JPEGs (where a record's
#: read and decode take tens of microseconds).
READ_SAMPLE = 16


class WorkerClock:
    """A worker's seconds per part for the batch being filled: ``read`` (records from the
    shards; timed in one batch of ``READ_SAMPLE``, its share of the rest applied to the
    others), ``transform`` (the dataset's transform or sample_transform), ``copy`` (into the
    ring where it is a copy of its own), ``resize`` (crop/resize, read off the decoder's own
    total), ``idle`` (waiting for a free slot: the ring is full, the trainer has not taken the
    batches), ``decode`` (the rest of the fill). One object per worker, reset per batch."""

    __slots__ = ("read", "transform", "copy", "idle", "count", "sampled", "read_share")

    def __init__(self):
        self.read = self.transform = self.copy = self.idle = 0.0
        self.count, self.sampled, self.read_share = 0, False, 0.0

    def source(self, records: Iterator, first: bool) -> Iterator:
        """What this batch reads from: ``records`` itself, or, in one batch of
        ``READ_SAMPLE`` (``first``: a new epoch's first), a wrapper timing each record."""
        self.count = 0 if first else self.count + 1
        self.sampled = self.count % READ_SAMPLE == 0
        return self.records(records) if self.sampled else records

    def records(self, records: Iterable) -> Iterator:
        """``records``, the time taken to produce each added to ``read``."""
        clock = time.perf_counter
        it = iter(records)
        while True:
            t0 = clock()
            try:
                rec = next(it)
            except StopIteration:
                self.read += clock() - t0
                return
            self.read += clock() - t0
            yield rec

    def timed(self, fn: Callable | None) -> Callable | None:
        """``fn`` (a transform) with its time added to ``transform``."""
        if fn is None:
            return None
        clock = time.perf_counter

        def run(x):
            t0 = clock()
            try:
                return fn(x)
            finally:
                self.transform += clock() - t0

        return run

    def batch(self, fill_s: float, resize_s: float) -> tuple[float, ...]:
        """This batch's totals (``WORKER_PARTS``), and a fresh start for the next."""
        rest = max(0.0, fill_s - self.transform - self.copy - resize_s)  # read and decode
        if self.sampled:
            self.read_share = min(1.0, self.read / rest) if rest > 0 else 0.0
            read = self.read
        else:
            read = self.read_share * rest
        decode = max(0.0, rest - read)
        out = (read, decode, resize_s, self.transform, self.copy, self.idle)
        self.read = self.transform = self.copy = self.idle = 0.0
        return out


# --- the training process's side -----------------------------------------------------------------


@dataclass
class EpochStats:
    """One iteration's counters, kept by the loader (``stats()``)."""

    epoch: int
    batches: int = 0
    images: int = 0
    first_wait_s: float | None = None
    first_images: int = 0
    waits: list = field(default_factory=list)  # per batch after the first
    step_s: float = 0.0
    stage_copy_s: float = 0.0  # the training process moving batches to the device
    stage_normalize_s: float = 0.0  # ... converting them (normalise, contiguous)
    device_decode_s: float = 0.0  # ... decoding them there (decode_on="device"/"auto")
    device_batches: int = 0  # batches decoded on the device side (auto: the rest by workers)
    worker: list = field(default_factory=lambda: [0.0] * len(WORKER_PARTS))
    fallback0: tuple = (0, 0, 0)  # FeedCounts' (region, whole, cpu) at the start
    fallback: tuple = (0, 0, 0)
    finished: bool = False
    warned: bool = False
    loader: Callable | None = None  # a weak reference: the loader keeps its stats, not back
    _resumed: float | None = None  # when the caller last entered next()
    _yielded: float | None = None  # when the last batch was handed out

    # hooks, from ``Epoch.batches`` and ``Epoch._ready``
    def resumed(self, now: float) -> None:
        if self._yielded is not None:
            self.step_s += now - self._yielded
        self._resumed, self._yielded = now, None
        if self.batches == WARN_AFTER:
            self.judge()

    def judge(self) -> None:
        """Warn now if this epoch is input-bound (at most once per epoch: ``maybe_warn``)."""
        loader = self.loader() if self.loader is not None else None
        if loader is not None:
            maybe_warn(loader, self, loader._stats.options)

    def yielded(self, now: float, images: int) -> None:
        if self._resumed is not None:
            wait = now - self._resumed
            if self.first_wait_s is None:
                self.first_wait_s, self.first_images = wait, images
            else:
                self.waits.append(wait)
        self.batches += 1
        self.images += images
        self._resumed, self._yielded = None, now

    def ended(self, now: float, done: bool) -> None:
        """The iteration ended: ``done`` (the caller's last ``next()``: its wait counts) or
        abandoned (a break: the step after the last batch has no end)."""
        if done and self._resumed is not None and self.first_wait_s is not None:
            self.waits.append(now - self._resumed)
        self._resumed = self._yielded = None
        self.finished = done

    def worker_times(self, times) -> None:
        if times is not None:
            for i, t in enumerate(times):
                self.worker[i] += t

    # the report
    def as_dict(self, loader=None) -> dict:
        wait = sum(self.waits)
        total = wait + self.step_s
        share = wait / total if total > 0 else None
        ordered = sorted(self.waits)
        out = {
            "epoch": self.epoch,
            "finished": self.finished,
            "batches": self.batches,
            "images": self.images,
            "wait_s": wait,
            "step_s": self.step_s,
            "wait_share": share,
            "verdict": verdict_of(share),
            # the steady rate: after the first batch, as the wait share
            "images_per_s": (self.images - self.first_images) / total if total > 0 else None,
            "first_wait_s": self.first_wait_s,
            "wait_p50_s": _quantile(ordered, 0.50),
            "wait_p95_s": _quantile(ordered, 0.95),
            "wait_max_s": ordered[-1] if ordered else None,
        }
        busy = sum(self.worker)
        for name, t in zip(WORKER_PARTS, self.worker, strict=True):
            out[f"worker_{name}_s"] = t
        for name, t in zip(WORKER_PARTS, self.worker, strict=True):
            out[f"worker_{name}_share"] = t / busy if busy > 0 else None
        out["trainer_copy_s"] = self.stage_copy_s
        out["trainer_normalize_s"] = self.stage_normalize_s
        decode_on = getattr(loader, "decode_on", "workers")
        if decode_on != "workers":
            region, whole, cpu = (b - a for a, b in zip(self.fallback0, self.fallback, strict=True))
            out["trainer_device_decode_s"] = self.device_decode_s
            out["device_batches"] = self.device_batches
            out["device_region"] = region
            out["device_whole"] = whole
            out["device_cpu_fallback"] = cpu
            out["device_cpu_fallback_reason"] = (
                "nvImageCodec declined them whole (PNG, CMYK, damaged files)" if cpu else ""
            )
        return out


def _quantile(ordered: list, q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class LoaderStats:
    """What a loader keeps across its iterations: the epoch in progress and the last finished."""

    def __init__(self, options: StatsOptions | bool):
        if isinstance(options, bool):
            options = StatsOptions(warn=options)
        if not isinstance(options, StatsOptions):
            raise InputError(
                f"stats must be True, False (no input-bound warning) or StatsOptions(...), "
                f"got {options!r}"
            )
        self.options = options
        self.current: EpochStats | None = None
        self.last: EpochStats | None = None

    def begin(self, epoch: int, loader) -> EpochStats:
        if self.current is not None and self.current.finished:
            self.last = self.current
        seen = _fallbacks(loader.feed_counts)
        self.current = EpochStats(epoch, fallback0=seen, fallback=seen)
        self.current.loader = weakref.ref(loader)
        return self.current

    def end(self, stats: EpochStats, done: bool, counts) -> None:
        """The iteration ended (``done``: every batch delivered; else a break or an error)."""
        stats.ended(time.perf_counter(), done)
        stats.fallback = _fallbacks(counts)
        if done:
            self.last = stats
            stats.judge()

    def report(self, last: bool, loader) -> dict:
        chosen = self.last if last else (self.current or self.last)
        if chosen is None:
            return {"epoch": None, "finished": False, "batches": 0, "images": 0}
        return chosen.as_dict(loader)


def _fallbacks(counts) -> tuple:
    return (counts.region, counts.whole, counts.cpu)


# --- the warning -----------------------------------------------------------------------------


def knob(stats: dict, loader) -> str:
    """The setting most likely to help an input-bound loop, from where the time went."""
    cpu = stats.get("device_cpu_fallback") or 0
    seen = cpu + (stats.get("device_region") or 0) + (stats.get("device_whole") or 0)
    if seen and cpu / seen > 0.1:
        return (
            f'decode_on="workers" (the device decode sent {cpu} of {seen} images to the '
            "training process's CPU: "
            f"{stats.get('device_cpu_fallback_reason')}), or re-pack them as baseline JPEGs"
        )
    shares = {p: stats.get(f"worker_{p}_share") or 0.0 for p in WORKER_PARTS}
    trainer = stats["trainer_copy_s"] + stats["trainer_normalize_s"]
    trainer += stats.get("trainer_device_decode_s", 0.0)
    if shares["idle"] > 0.3:  # the workers wait on the ring: the training process's own staging
        if loader.decode_on == "device":
            return 'decode_on="auto" (the workers are idle while the device decodes)'
        if trainer > 0.5 * stats["wait_s"]:
            return _trainer_knob(stats, loader, torch.cuda.is_available())
        return f"a larger prefetch_factor (now {loader.prefetch_factor})"
    if shares["read"] >= 0.4:
        return (
            "more workers, or a bigger RemoteStorage(prefetch=) on remote shards (the workers "
            f"spend {shares['read']:.0%} of their time reading)"
        )
    if shares["transform"] >= 0.4:
        return f"a cheaper transform, or one on the batch on the GPU ({shares['transform']:.0%})"
    usable = _cpus()
    if loader.num_workers < usable - 1:
        return f"more workers (num_workers={loader.num_workers} of {usable} CPUs)"
    if loader.decode_on == "workers" and torch.cuda.is_available():
        return 'decode_on="auto" (a GPU is here to decode on)'
    if getattr(loader.dataset, "dct", "fast") != "fast":
        return 'decode=Decode(..., dct="fast") on the dataset (a cheaper JPEG decode)'
    return "pre-resizing at pack time (`shardkit pack --resize-short N`): fewer pixels to decode"


def _trainer_knob(stats: dict, loader, gpu: bool) -> str:
    """What takes the training process's own conversion (normalise, copy) off its CPU, on this
    machine: the GPU where there is one; without one, the normalisation folded into the model's
    first layer (a layer that is linear in its input absorbs ``(x / 255 - mean) / std`` into its
    weights and bias, so the training CPU no longer makes a float copy of every batch)."""
    on_gpu = loader.device is not None and loader.device.type == "cuda"
    spent = f"{stats['trainer_copy_s'] + stats['trainer_normalize_s']:.2f} s"
    if gpu and not on_gpu:
        what = "normalize= " if loader.normalize is not None else ""
        return (
            f'device="cuda" (the training CPU spent {spent} converting the batches; {what}on '
            "the GPU costs it nothing)"
        )
    if not gpu and loader.normalize is not None:
        return (
            f"normalize=None with (x / 255 - mean) / std folded into the model's first layer "
            f"(no GPU here: the training CPU spent {spent} normalising the batches; scale the "
            "first layer's weights by 1 / (255 * std) per input channel and take the mean's "
            "share from its bias)"
        )
    return f"a larger prefetch_factor (now {loader.prefetch_factor})"


def _cpus() -> int:
    import os

    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def maybe_warn(loader, stats: EpochStats, options: StatsOptions) -> None:
    """Once per epoch, when it is input-bound: the figure and the knob."""
    if not options.warn or stats.warned or len(stats.waits) < 1:
        return
    report = stats.as_dict(loader)
    if report["verdict"] != INPUT_BOUND or report["wait_s"] < options.min_wait_s:
        if stats.finished or stats.batches >= WARN_AFTER:
            stats.warned = True  # judged: silent for this epoch
        return
    stats.warned = True
    text = (
        f"ShardLoader: epoch {stats.epoch} is input-bound: the training loop waited "
        f"{report['wait_share']:.0%} of its time for batches ({report['wait_s']:.2f} s of "
        f"{report['wait_s'] + report['step_s']:.2f} s over {stats.batches} batches); try "
        f"{knob(report, loader)}. loader.stats() has the breakdown; "
        "ShardLoader(stats=StatsOptions(warn=False)) silences this"
    )
    if options.logger:
        log.warning(text)
    else:
        warnings.warn(text, RuntimeWarning, stacklevel=5)


# --- every rank ----------------------------------------------------------------------------------


def gather_stats(stats: dict, group=None) -> dict:
    """``stats`` (this rank's) with every rank's wait share over ``torch.distributed``: one
    collective call, so every rank must call it. Adds ``max_wait_share``,
    ``rank{r}_wait_share`` and ``slowest_rank`` (the rank that waited longest for its loader:
    in DDP the others wait on it at the next all-reduce)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return dict(stats, max_wait_share=stats.get("wait_share"), slowest_rank=0)
    world = dist.get_world_size(group)
    mine = [stats.get("wait_share"), stats.get("wait_s"), stats.get("images_per_s")]
    every: list = [None] * world
    dist.all_gather_object(every, mine, group=group)
    out = dict(stats)
    shares = [e[0] for e in every]
    for r, share in enumerate(shares):
        out[f"rank{r}_wait_share"] = share
    known = [(e[1] or 0.0, r) for r, e in enumerate(every)]
    out["max_wait_share"] = max((s for s in shares if s is not None), default=None)
    out["max_verdict"] = verdict_of(out["max_wait_share"])
    out["slowest_rank"] = max(known)[1]
    return out


# --- the ideal -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replay:
    """The step on batches already in memory: ``step_s`` per batch and ``images_per_s`` with
    loading taken out; ``speedup(stats)``: how much faster training would run with a free
    loader than it ran (``loader.stats()``'s ``images_per_s``)."""

    steps: int
    step_s: float
    images_per_s: float

    def speedup(self, stats: dict) -> float | None:
        rate = stats.get("images_per_s")
        return self.images_per_s / rate if rate else None


def replay(
    batches: Iterable, step: Callable, *, keep: int = 4, steps: int = 20, warmup: int = 2
) -> Replay:
    """Run ``step(batch)`` ``steps`` times over ``keep`` batches taken from ``batches`` (a
    loader: its batches are cloned, their slots go back) and time it: the training step with
    loading free. ``step`` should finish its work (``loss.item()``, or a CUDA synchronise is
    made here after the run). ``warmup`` steps are not timed."""
    cached = [_clone(b) for b in itertools.islice(iter(batches), keep)]
    if not cached:
        raise InputError("replay: the loader gave no batch to replay (an empty dataset?)")
    for i in range(warmup):
        step(cached[i % len(cached)])
    _sync()
    t0 = time.perf_counter()
    for i in range(steps):
        step(cached[i % len(cached)])
    _sync()
    took = time.perf_counter() - t0
    images = sum(_count(cached[i % len(cached)]) for i in range(steps))
    return Replay(steps, took / steps, images / took if took > 0 else math.inf)


def _clone(batch):
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: _clone(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_clone(v) for v in batch)
    return batch


def _count(batch) -> int:
    first = batch
    if isinstance(batch, dict):
        first = batch.get("image", next(iter(batch.values())))
    elif isinstance(batch, (tuple, list)):
        first = batch[0]
    return len(first) if hasattr(first, "__len__") else 1


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
