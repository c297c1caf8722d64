"""The benchmark runs: folder-of-files vs shards, across DataLoader worker counts.

How one run is measured (``run_once``):

1. ``--cold``: the files this format reads (the image folder, or the shard files) are evicted from
   the page cache with ``shardkit.bench.pagecache.evict`` and their residency is checked with
   ``resident_fraction`` (recorded per run). ``--warm``: every file is read once before the first
   run of that format.
2. A fresh ``torch.utils.data.DataLoader`` is built with the run's ``num_workers``; the clock
   starts, and the time until the first batch arrives is the *first-batch time* (worker start-up,
   shard opening, the shuffle buffer filling).
3. The first ``max(1, workers)`` batches are warm-up: the workers all started together, so their
   first batches arrive back to back and timing them would inflate the rate. Then batches are
   timed until the run has ``min_samples`` samples and ``min_seconds`` seconds (or exactly
   ``batches`` batches, if given), at most ``max_seconds``, or the epoch ends (``RunResult.stopped``
   says which): samples/s = timed samples / timed wall time. Each timed iteration is
   ``next(loader)`` (the wait) then the consumer's step (``workloads.step``, a sleep of
   ``step_ms``); the wait fraction is total wait / timed wall time.
4. The loader is shut down (workers exit); the next run starts from nothing.

Runs are ordered repeat-major (every configuration once, then again ``repeats`` times), so that
noise from other processes on the machine spreads over all configurations instead of landing on
one. The folder baseline is ``FolderDataset`` shuffled by the DataLoader's sampler; shards use
``ShardDataset`` with shard + buffer shuffling and a new epoch every run.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..errors import InputError, OutputError
from ..extras import require
from .config import DEFAULT_SIZE, MIN_TIMED_BATCHES, SHARD_FORMATS, BenchConfig, say
from .estimate import Estimate, clock_text, estimate
from .pagecache import evict_until_cold, prime, residency
from .results import BenchResult, Load, Row, RunContext, RunResult, Timeline
from .sources import (
    bytes_per_sample,
    check_enough,
    check_one_size,
    image_size,
    make_dataset,
    packed_skips,
    pending,
    plan_sources,
    read_paths,
    sample_bytes,
)
from .workloads import (
    DATASET_DECODE,
    Augment,
    Collate,
    CountingStorage,
    TimedIterable,
    TimedMap,
    clock,
    sample_decoder,
    step,
)

__all__ = ["cores", "machine_facts", "make_loader", "measure_ceiling", "run_bench", "run_once"]


@contextlib.contextmanager
def one_thread():
    """Run torch ops in this process on one intra-op thread, as in a DataLoader worker.

    DataLoader workers set ``torch.set_num_threads(1)``; the main process keeps one thread per
    core. For one small image's resize that parallelism only costs: measured on the 2-core VM
    at load 7, ``TensorDecoder(Geometry(224))`` on the ImageNet-shaped set ran 53-63 images/s
    with 2 threads and 195-261 with 1, since the OpenMP threads wait for cores that other
    processes hold. The ceiling ("one process") and the runs at 0 workers (loading in this
    process) therefore use one thread, like every worker they are compared with.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_ceiling(
    samples: Sequence[bytes], mode: str, seconds: float = 1.0, size: int | None = None
) -> float:
    """Samples/s of one process doing the mode's per-sample work on in-memory image bytes.

    ``decode``: the datasets' own decode (``decode_image(data, "tensor")``, or with ``size`` the
    fixed-size centre crop); ``augment``: PIL decode then ``Augment``. No reading, no DataLoader:
    the best a single core can do.
    """
    decode = sample_decoder(DATASET_DECODE[mode], size)
    aug = Augment() if mode == "augment" else None
    with one_thread():
        return _decode_rate(samples, decode, aug, seconds)


def _decode_rate(samples, decode, aug, seconds: float) -> float:
    n, t0 = 0, clock()
    while True:
        for data in samples:
            img = decode(data)
            if aug is not None:
                img = aug(img)
            n += 1
        elapsed = clock() - t0
        if elapsed >= seconds:
            return n / elapsed


# --- one run ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_worker_count():
    """Silence torch's "more workers than cores" warning: measuring that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="This DataLoader will create", category=UserWarning
        )
        yield


def make_loader(ds, fmt: str, workers: int, cfg: BenchConfig, epoch: int):
    """The iterable a run times, yielding ``(images, labels, (worker, start, end))`` batches.

    The one place a contender plugs in: a new entry of ``config.ALL_FORMATS`` gets its dataset
    from ``sources.make_dataset`` and, if it batches differently than a DataLoader over that
    dataset, its loader here (batches stamped as ``workloads.Collate`` stamps them).
    """
    if fmt == "loader":
        from ..loader import ShardLoader

        ds.set_epoch(epoch)
        return StampedBatches(ShardLoader(ds, cfg.batch_size, num_workers=workers), workers)
    shuffle_in_loader = fmt == "folder"
    if shuffle_in_loader:
        wrapped = TimedMap(ds)
        generator = torch.Generator()
        generator.manual_seed(cfg.seed * 1_000_003 + epoch)
    else:
        ds.set_epoch(epoch)
        wrapped, generator = TimedIterable(ds), None
    with _quiet_worker_count():
        return DataLoader(
            wrapped,
            batch_size=cfg.batch_size,
            shuffle=shuffle_in_loader,
            generator=generator,
            num_workers=workers,
            collate_fn=Collate(cfg.mode),
        )


def _stop(cfg: BenchConfig, batches: int, samples: int, seconds: float) -> str | None:
    """Why timing should end now (see ``RunResult.stopped``); None to go on."""
    if cfg.batches:
        if batches >= cfg.batches:
            return "target"
    elif samples >= cfg.min_samples and seconds >= cfg.min_seconds:
        return "target"
    if cfg.max_seconds and seconds >= cfg.max_seconds:
        return "max_seconds"
    return None


class StampedBatches:
    """ShardLoader batches stamped as ``workloads.Collate`` stamps DataLoader ones. Worker k
    fills batch k % workers; a batch counts as ready when it reaches the caller (the loader
    keeps no per-batch timestamps), so its stall is its whole wait."""

    def __init__(self, loader, workers: int):
        self.loader, self.workers = loader, max(1, workers)

    def __iter__(self):
        t = clock()
        for k, (images, labels) in enumerate(self.loader):
            now = clock()
            yield images, labels, (k % self.workers, t, now)
            t = now


def run_once(
    ds,
    fmt: str,
    workers: int,
    cfg: BenchConfig,
    *,
    epoch: int,
    repeat: int,
    bytes_per_sample: float | None,
    storage: CountingStorage | None,
    resident_before: float | None,
) -> tuple[RunResult, Timeline]:
    """One DataLoader run; see the module docstring for what is timed."""
    loader = make_loader(ds, fmt, workers, cfg, epoch)
    warmup = max(1, workers)
    opens0 = storage.opens() if storage is not None else 0
    batches: list[tuple[int, float, float, float]] = []
    waits: list[tuple[float, float]] = []
    steps: list[tuple[float, float]] = []
    samples = timed_batches = 0
    wait_total = stall_total = 0.0
    first = t_start = t_end = 0.0
    stopped = "data"
    t0 = clock()
    with _quiet_worker_count():
        it = iter(loader)
    started = clock() - t0
    try:
        k = 0
        while True:
            tw = clock()
            try:
                _images, labels, (wid, b0, b1) = next(it)
            except StopIteration:
                break
            except RuntimeError as exc:
                if "stack expects each tensor to be equal size" not in str(exc):
                    raise
                raise InputError(
                    f"{fmt}: images of different sizes cannot be batched as stored (size 0); "
                    f"pass size= N (default {DEFAULT_SIZE}: a centre crop)"
                ) from None
            tr = clock()
            if k == 0:
                first = tr - t0
            step(cfg.step_ms)
            te = clock()
            batches.append((wid, b0 - t0, b1 - t0, tr - t0))
            waits.append((tw - t0, tr - t0))
            if cfg.step_ms > 0:
                steps.append((tr - t0, te - t0))
            if k == warmup - 1:
                t_start = te
            elif k >= warmup:
                samples += len(labels)
                timed_batches += 1
                wait_total += tr - tw
                stall_total += max(0.0, min(b1, tr) - tw)
                t_end = te
                why = _stop(cfg, timed_batches, samples, te - t_start)
                if why:
                    stopped = why
                    break
            k += 1
    finally:
        del it  # shuts the workers down before the next run
    wall = clock() - t0
    if timed_batches == 0:
        raise InputError(
            f"{fmt} with {workers} workers delivered only {len(batches)} batches of "
            f"{cfg.batch_size}: the dataset is too small for {warmup} warm-up batches and a "
            "timed one; lower batch_size= or workers="
        )
    timed = t_end - t_start
    rate = samples / timed
    result = RunResult(
        repeat=repeat,
        samples_per_s=rate,
        mb_per_s=rate * bytes_per_sample / 1e6 if bytes_per_sample else None,
        first_batch_s=first,
        wait_fraction=wait_total / timed,
        stall_fraction=stall_total / timed,
        timed_batches=timed_batches,
        timed_samples=samples,
        timed_s=timed,
        opens=storage.opens() - opens0 if storage is not None else None,
        resident_before=resident_before,
        stopped=stopped,
        wall_s=wall,
    )
    timeline = Timeline(fmt, workers, repeat, cfg.step_ms, warmup, started, batches, waits, steps)
    return result, timeline


# --- the whole bench -------------------------------------------------------------------------


def cores() -> int:
    """CPUs this process may run on (what the workers share), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def machine_facts() -> dict:
    import PIL

    facts = {
        "cores": cores(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": None,
        "cpu": platform.processor() or None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
        "platform": platform.platform(),
    }
    try:
        facts["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    facts["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover
        pass
    return facts


def _timeline_choice(cfg: BenchConfig, formats: list[str]) -> tuple[str, int]:
    if cfg.timeline_config is not None:
        fmt, w = cfg.timeline_config
        if fmt not in formats:
            raise InputError(
                f"timeline_config ({fmt!r}, {w}): {fmt} is not among the benchmarked formats "
                f"{', '.join(formats)}"
            )
        return fmt, int(w)
    shard = [f for f in formats if f in SHARD_FORMATS]
    return (shard[0] if shard else formats[0]), max(cfg.workers)


COLD_NOTE = (
    "cold: file data pages are evicted before each run (posix_fadvise DONTNEED, checked with "
    "mincore); directory entries and inodes stay cached (dropping them needs root), so a "
    "folder's cold cost here is a lower bound of a truly cold one"
)


@dataclass
class _Prepared:
    """Per format: the dataset, its latency probe, the files it reads and its bytes per sample."""

    sources: dict[str, str]
    datasets: dict[str, object]
    storages: dict[str, CountingStorage | None]
    paths: dict[str, list[str] | None]
    per_sample: dict[str, float | None]
    notes: list[str]
    epochs: dict[str, int]

    @property
    def formats(self) -> list[str]:
        return list(self.sources)


def _prepare(cfg: BenchConfig, sources: dict[str, str], skip: list[str]) -> _Prepared:
    """Build every format's dataset and check it is big enough, before any run starts."""
    prep = _Prepared(dict(sources), {}, {}, {}, {}, [COLD_NOTE] if cfg.cold else [], {})
    for fmt, source in sources.items():
        storage = CountingStorage(latency_ms=cfg.latency_ms)
        ds = make_dataset(fmt, source, cfg, storage, skip if fmt in ("folder", "memory") else ())
        prep.storages[fmt] = storage if getattr(ds, "storage", None) is storage else None
        prep.datasets[fmt] = ds
        prep.paths[fmt] = read_paths(fmt, ds)
        prep.per_sample[fmt] = bytes_per_sample(fmt, ds, prep.paths[fmt])
        prep.epochs[fmt] = 0
        prep.notes.extend(_format_notes(cfg, fmt, prep))
        check_enough(cfg, len(ds), source)
    if skip and "folder" in sources:
        prep.notes.append(
            f"folder: {len(skip)} entries that pack skipped (see shardkit info) are left out, "
            "so the folder and the shards read the same samples"
        )
    return prep


def size_note(cfg: BenchConfig) -> str | None:
    """How decode mode sizes the images: said before the runs and under the table."""
    if cfg.mode != "decode":
        return None
    if image_size(cfg) is None:
        return "decode: images batched at their stored size (--size 0)"
    return (
        f"decode: every image resized and centre-cropped to {cfg.size}x{cfg.size} for every "
        f"format alike (--size, default {DEFAULT_SIZE}; --size 0 keeps stored sizes)"
    )


def _format_notes(cfg: BenchConfig, fmt: str, prep: _Prepared) -> list[str]:
    notes = []
    if fmt == "memory":
        notes.append(
            "memory: a reference, not a format: the same bytes held in RAM, decoded and "
            "batched through the same DataLoader; no storage, so no eviction or latency"
        )
    elif prep.paths[fmt] is None:
        notes.append(f"{fmt}: remote shards; not evicted (cold has no effect on them)")
    if prep.storages[fmt] is None and cfg.latency_ms and fmt != "memory":
        notes.append(f"{fmt}: remote shards; latency_ms not injected (real latency)")
    return notes


def _run(
    cfg: BenchConfig, prep: _Prepared, fmt: str, workers: int, repeat: int, resident=None
) -> tuple[RunResult, Timeline]:
    """One run of ``fmt`` at the format's next epoch."""
    with one_thread() if workers == 0 else contextlib.nullcontext():
        out = run_once(
            prep.datasets[fmt],
            fmt,
            workers,
            cfg,
            epoch=prep.epochs[fmt],
            repeat=repeat,
            bytes_per_sample=prep.per_sample[fmt],
            storage=prep.storages[fmt],
            resident_before=resident,
        )
    prep.epochs[fmt] += 1
    return out


def _measure(cfg: BenchConfig, prep: _Prepared) -> tuple[list[Row], Timeline | None]:
    """Every configuration ``repeats`` times, repeat-major; the chosen run's timeline."""
    formats = prep.formats
    rows = {(f, w): Row(f, w) for f in formats for w in cfg.workers}
    chosen = _timeline_choice(cfg, formats)
    timeline: Timeline | None = None
    total, done = len(rows) * cfg.repeats, 0
    started = clock()
    for repeat in range(cfg.repeats):
        for fmt in formats:
            for w in cfg.workers:
                fpaths = prep.paths[fmt]
                resident = None
                if fpaths:
                    # Written back once before the runs (``_write_back``): since then the
                    # files were only read, so eviction need not sync them again.
                    resident = (
                        evict_until_cold(fpaths, sync=False) if cfg.cold else residency(fpaths)
                    )
                if cfg.before_run is not None:
                    ds = prep.datasets[fmt]
                    cfg.before_run(RunContext(fmt, w, repeat, cfg.cold, list(fpaths or []), ds))
                result, tl = _run(cfg, prep, fmt, w, repeat, resident)
                rows[(fmt, w)].runs.append(result)
                if (fmt, w) == chosen and timeline is None:
                    timeline = tl
                done += 1
                elapsed = clock() - started
                left = elapsed / done * (total - done)
                cut = {"max_seconds": ", capped", "data": ", end of data"}.get(result.stopped, "")
                say(
                    cfg,
                    f"[{done}/{total}] repeat {repeat + 1}/{cfg.repeats} {fmt:>6} "
                    f"workers={w}: {result.samples_per_s:,.0f} samples/s "
                    f"({result.timed_samples:,} in {result.timed_s:.1f} s{cut}), first batch "
                    f"{result.first_batch_s:.2f} s, wait {result.wait_fraction:.0%}; "
                    f"{clock_text(elapsed)} elapsed, ~{clock_text(left)} left",
                )
    return list(rows.values()), timeline


def run_bench(config: BenchConfig) -> BenchResult:
    """Run every (format, workers) configuration ``repeats`` times; write what was asked for.

    Raises InputError (a ShardkitError) for unusable arguments or data, before any run starts.
    """
    cfg = config.resolved()
    _check_outputs(cfg)
    started = clock()
    load_before = Load.now(cores())
    steps, formats = pending(cfg)
    _timeline_choice(cfg, list(formats))  # a bad --timeline-config, before anything is packed
    est = estimate(cfg, steps, formats)
    say(
        cfg,
        f"{est.line(cfg, list(formats))}; load {load_before.load_1m:.2f} on "
        f"{load_before.cores} cores",
    )
    sources, data = plan_sources(cfg)
    prep = _prepare(cfg, sources, packed_skips(sources, data))
    note = size_note(cfg)
    if note:
        say(cfg, note)
        prep.notes.append(note)

    ceiling_single = None
    samples_for_ceiling: list[bytes] = []
    size = image_size(cfg)
    if cfg.mode in ("decode", "augment"):
        ref = next(f for f in prep.formats if f != "memory")
        samples_for_ceiling = sample_bytes(ref, prep.datasets[ref], 256, cfg.seed)
        if cfg.mode == "decode" and size is None:
            check_one_size(samples_for_ceiling, sources[ref])
        say(
            cfg,
            f"measuring the {cfg.mode} ceiling (1 process, {len(samples_for_ceiling)} images)",
        )
        ceiling_single = measure_ceiling(samples_for_ceiling, cfg.mode, cfg.ceiling_seconds, size)

    if cfg.cold:
        _write_back(cfg, prep)
    else:
        for fmt in prep.formats:
            if prep.paths[fmt]:
                left = prime(prep.paths[fmt])
                say(cfg, f"warm: read {sources[fmt]} once ({left:.0%} now cached)")

    # One untimed burn-in run: the first run in a process pays one-time costs (allocator growth,
    # decoder set-up); measured 429 samples/s for a first folder run vs ~2,000 for its repeats.
    burn = replace(cfg, batches=MIN_TIMED_BATCHES, max_seconds=0.2, min_seconds=0.0)
    _run(burn, prep, prep.formats[0], 0, repeat=-1)
    rows, timeline = _measure(cfg, prep)

    if ceiling_single is not None:  # again at the end: keep the better (the stricter ceiling)
        again = measure_ceiling(samples_for_ceiling, cfg.mode, cfg.ceiling_seconds, size)
        ceiling_single = max(ceiling_single, again)
    result = BenchResult(
        config=cfg,
        rows=rows,
        sources=dict(sources),
        bytes_per_sample=prep.per_sample,
        cores=cores(),
        ceiling_single=ceiling_single,
        timeline=timeline,
        machine=machine_facts(),
        seconds=clock() - started,
        notes=prep.notes,
        num_samples={f: len(ds) for f, ds in prep.datasets.items()},
        load_before=load_before,
        load_after=Load.now(cores()),
        estimate_s=est.total_s,
    )
    _say_done(cfg, result, est)
    for row in result.rows:
        row.ceiling = result.ceiling(row.workers)
    _write_outputs(result)
    return result


def _write_back(cfg: BenchConfig, prep: _Prepared) -> None:
    """Write back and evict every format's files once, before the timed runs and their clock.

    Freshly packed shards may still be dirty, and the kernel does not drop dirty pages; syncing
    13k files takes seconds under load, so it is done here once, not before every run.
    """
    for fmt in prep.formats:
        if prep.paths[fmt]:
            say(cfg, f"cold: writing back and evicting {prep.sources[fmt]} once")
            evict_until_cold(prep.paths[fmt], sync=True)


def _say_done(cfg: BenchConfig, result: BenchResult, est: Estimate) -> None:
    bound = f" (estimate: up to {clock_text(est.total_s)})" if est.total_s else ""
    say(cfg, f"done in {clock_text(result.seconds)}{bound}")


def _check_outputs(cfg: BenchConfig) -> None:
    """Make the output folders now: a bad path should fail before minutes of runs, not after."""
    if cfg.plot_path or cfg.timeline_path:
        require("bench", "plotting (--plot, --timeline)")
    for opt, path in (
        ("json_path", cfg.json_path),
        ("plot_path", cfg.plot_path),
        ("timeline_path", cfg.timeline_path),
    ):
        if not path:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"{opt}={path!r}: cannot create {parent} ({exc.strerror})") from None
        if os.path.isdir(path) or not os.access(parent, os.W_OK):
            raise OutputError(f"{opt}={path!r}: not a writable file path; choose another")


def _write_outputs(result: BenchResult) -> None:
    cfg = result.config
    if cfg.json_path:
        from .report import write_json

        write_json(result, cfg.json_path)
        say(cfg, f"wrote {cfg.json_path}")
    if cfg.plot_path:
        from .plot import plot_throughput

        plot_throughput(result, cfg.plot_path)
        say(cfg, f"wrote {cfg.plot_path}")
    if cfg.timeline_path and result.timeline is not None:
        from .plot import plot_timeline

        plot_timeline(result.timeline, cfg.timeline_path, result)
        say(cfg, f"wrote {cfg.timeline_path}")


# Documented internal seam for benchmarks/bench_run_length.py, which times single runs of the
# bench's own configurations at several lengths: the data prepared once, then one run.
prepare = _prepare
run_prepared = _run
