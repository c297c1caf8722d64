"""The benchmark runs: folder-of-files vs shards, across DataLoader worker counts.

How one run is measured (``run_once``):

1. ``--cold``: the files this format reads (the image folder, or the shard files) are evicted from
   the page cache with ``shardkit.pagecache.evict`` and their residency is checked with
   ``resident_fraction`` (recorded per run). ``--warm``: every file is read once before the first
   run of that format.
2. A fresh ``torch.utils.data.DataLoader`` is built with the run's ``num_workers``; the clock
   starts, and the time until the first batch arrives is the *first-batch time* (worker start-up,
   shard opening, the shuffle buffer filling).
3. The first ``max(1, workers)`` batches are warm-up: the workers all started together, so their
   first batches arrive back to back and timing them would inflate the rate. Then ``batches``
   batches are timed: samples/s = timed samples / timed wall time. Each timed iteration is
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..errors import InputError, OutputError
from ..manifest import MANIFEST_NAME, read_manifest
from ..pagecache import evict, resident_fraction
from ..storage import is_url
from .workloads import (
    DATASET_DECODE,
    MODES,
    Augment,
    Collate,
    CountingStorage,
    MemoryDataset,
    TimedIterable,
    TimedMap,
    clock,
    step,
)

__all__ = [
    "ALL_FORMATS",
    "SHARD_FORMATS",
    "DEFAULT_DATA",
    "BenchConfig",
    "BenchResult",
    "Row",
    "RunContext",
    "RunResult",
    "Timeline",
    "parse_formats",
    "parse_workers",
    "run_bench",
    "measure_ceiling",
]

SHARD_FORMATS = ("tar", "lmdb")
#: "memory" is a reference, not a storage format: the same JPEG bytes held in RAM, decoded and
#: batched through the same DataLoader (``workloads.MemoryDataset``). Opt-in via --formats.
ALL_FORMATS = ("folder", *SHARD_FORMATS, "memory")
#: Where the embedded LFW-shaped set is made when no data is given (relative to the cwd).
DEFAULT_DATA = os.path.join("data", "lfw")
#: Timed batches per run when ``--batches`` is not given: enough for a few tenths of a second of
#: steady state at the rates each mode reaches on 2 cores (raw ~10^5, decode ~10^3, augment
#: ~10^2 samples/s), so that the default run of 60 runs takes a few minutes.
DEFAULT_BATCHES = {"raw": 150, "decode": 30, "augment": 12}
#: A run's timing also stops after ``max_seconds`` of timed wall time (once it has at least this
#: many timed batches), so slow configurations (a folder paying latency per image) do not
#: stretch the whole bench; the rate is samples over the window either way.
MIN_TIMED_BATCHES = 5
#: Shard size when the bench packs on the fly. Smaller than ``pack``'s 256 MB default because
#: LFW (176 MB) would fit one shard, and a worker whose slice starts mid-shard reads the tar from
#: the shard's start to reach it: 32 MB shards bound that start-up read.
BENCH_SHARD_SIZE = "32MB"


# --- configuration ---------------------------------------------------------------------------


def parse_workers(text: str | Sequence[int]) -> tuple[int, ...]:
    """``"0,2,4,8"`` -> ``(0, 2, 4, 8)``; duplicates dropped, order kept."""
    if isinstance(text, str):
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise InputError(
                f"--workers {text!r} is malformed: give comma-separated worker counts, e.g. 0,2,4,8"
            )
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise InputError(
                f"--workers {text!r} is malformed: {', '.join(parts)} are not all whole numbers; "
                "e.g. 0,2,4,8"
            ) from None
    else:
        values = [int(v) for v in text]
    if not values:
        raise InputError("--workers is empty: give at least one worker count, e.g. 0,2,4,8")
    bad = [v for v in values if v < 0 or v > 256]
    if bad:
        raise InputError(f"--workers: {bad[0]} is out of range; use counts from 0 to 256")
    return tuple(dict.fromkeys(values))


def parse_formats(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"folder,tar"`` -> ``("folder", "tar")``; unknown names raise InputError."""
    parts = [p.strip().lower() for p in (text.split(",") if isinstance(text, str) else text)]
    if not parts or any(not p for p in parts):
        raise InputError(
            f"--formats {text!r} is malformed: give comma-separated names from "
            f"{', '.join(ALL_FORMATS)}"
        )
    unknown = [p for p in parts if p not in ALL_FORMATS]
    if unknown:
        raise InputError(
            f"--formats: unknown format {unknown[0]!r}; choose from {', '.join(ALL_FORMATS)}"
        )
    return tuple(dict.fromkeys(parts))


@dataclass
class BenchConfig:
    """What to measure. Defaults give the few-minute default run on the LFW-shaped set.

    ``data``: image folder (class-per-folder); None with no ``shards`` means the embedded default
    set at ``default_data``, made (``synth.make_lfw``) and packed the first time. ``shards``: a
    packed dataset (directory, manifest, glob or URL) or a directory to pack into; ``{format}`` in
    it is replaced by each shard format (default: ``<data>-shards-{format}``). ``timeline_config``:
    ``(format, workers)`` whose first repeat is drawn by ``timeline_path`` (default: the first
    shard format at the largest worker count). ``max_seconds``: a run also stops timing after
    this long (at least ``MIN_TIMED_BATCHES`` batches); None or 0: only ``batches`` counts.
    ``before_run``: called with a ``RunContext`` after
    the cache step and right before the DataLoader starts (tests check eviction there).
    """

    data: str | None = None
    shards: str | None = None
    formats: tuple[str, ...] | None = None
    workers: tuple[int, ...] = (0, 2, 4, 8)
    batch_size: int = 64
    batches: int | None = None
    repeats: int = 5
    cold: bool = True
    latency_ms: float = 0.0
    mode: str = "decode"
    step_ms: float = 0.0
    seed: int = 0
    shard_size: str = BENCH_SHARD_SIZE
    timeline_config: tuple[str, int] | None = None
    max_seconds: float | None = 2.5
    ceiling_seconds: float = 1.0
    default_data: str = DEFAULT_DATA
    json_path: str | None = None
    plot_path: str | None = None
    timeline_path: str | None = None
    progress: Callable[[str], None] | None = None
    before_run: Callable[[RunContext], None] | None = None

    def check(self) -> None:
        """Raise InputError for values no run can use."""
        self.workers = parse_workers(self.workers)
        if self.formats is not None:
            self.formats = parse_formats(self.formats)
        if self.mode not in MODES:
            raise InputError(f"--mode {self.mode!r} is unknown; choose from {', '.join(MODES)}")
        if self.batches is None:
            self.batches = DEFAULT_BATCHES[self.mode]
        for name, value, least in (
            ("--batch-size", self.batch_size, 1),
            ("--batches", self.batches, 1),
            ("--repeats", self.repeats, 1),
        ):
            if not isinstance(value, int) or value < least:
                raise InputError(f"{name} must be a whole number >= {least}, got {value!r}")
        if self.max_seconds is not None and self.max_seconds < 0:
            raise InputError(f"--max-seconds must be >= 0 (0: no limit), got {self.max_seconds}")
        if self.latency_ms < 0 or self.step_ms < 0:
            raise InputError("--latency-ms and --step-ms must be >= 0")
        if self.timeline_config is not None:
            fmt, w = self.timeline_config
            if fmt not in ALL_FORMATS:
                raise InputError(
                    f"--timeline-config: unknown format {fmt!r}; use FORMAT:WORKERS, e.g. tar:4"
                )
            if int(w) not in self.workers:
                raise InputError(
                    f"--timeline-config {fmt}:{w}: {w} is not among --workers "
                    f"{','.join(map(str, self.workers))}"
                )

    def as_dict(self) -> dict:
        skip = {"progress", "before_run"}
        out = {k: v for k, v in self.__dict__.items() if k not in skip}
        out["workers"] = list(self.workers)
        out["formats"] = list(self.formats) if self.formats else None
        out["timeline_config"] = list(self.timeline_config) if self.timeline_config else None
        return out


# --- results ---------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One DataLoader run.

    ``wait_fraction``: share of the timed wall time spent in ``next(loader)``. ``stall_fraction``:
    the part of it before the batch was even ready in its worker (collated), i.e. waiting on
    loading; the rest of the wait is receiving a ready batch (the DataLoader's transfer).
    ``opens``: latency charges paid during the run (workers' prefetch included);
    ``resident_before``: page-cache residency of the read files as the run started.
    """

    repeat: int
    samples_per_s: float
    mb_per_s: float | None
    first_batch_s: float
    wait_fraction: float
    stall_fraction: float
    timed_batches: int
    timed_samples: int
    timed_s: float
    opens: int | None
    resident_before: float | None


@dataclass
class Row:
    """One (format, workers) configuration over its repeats."""

    format: str
    workers: int
    runs: list[RunResult] = field(default_factory=list)
    ceiling: float | None = None  # decode ceiling at this worker count, samples/s

    def _values(self, name: str) -> np.ndarray:
        return np.array([getattr(r, name) for r in self.runs], dtype=np.float64)

    @property
    def mean(self) -> float:
        return float(self._values("samples_per_s").mean())

    @property
    def std(self) -> float:
        """Sample standard deviation over the repeats (0 with one repeat)."""
        v = self._values("samples_per_s")
        return float(v.std(ddof=1)) if len(v) > 1 else 0.0

    @property
    def first_batch_s(self) -> float:
        return float(self._values("first_batch_s").mean())

    @property
    def wait_fraction(self) -> float:
        return float(self._values("wait_fraction").mean())

    @property
    def stall_fraction(self) -> float:
        return float(self._values("stall_fraction").mean())

    @property
    def mb_per_s(self) -> float | None:
        if any(r.mb_per_s is None for r in self.runs):
            return None
        return float(self._values("mb_per_s").mean())

    @property
    def ceiling_fraction(self) -> float | None:
        return self.mean / self.ceiling if self.ceiling else None


@dataclass
class Timeline:
    """Measured stamps of one run, in seconds from the moment the DataLoader was started.

    ``batches``: (worker, start, end, received) per consumed batch, worker -1 being the main
    process (``num_workers=0``); ``waits`` and ``steps``: the main loop's (start, end) intervals.
    The first ``warmup`` batches are untimed; ``started`` is when ``iter(loader)`` returned
    (the worker processes had been forked).
    """

    format: str
    workers: int
    repeat: int
    step_ms: float
    warmup: int
    started: float
    batches: list[tuple[int, float, float, float]]
    waits: list[tuple[float, float]]
    steps: list[tuple[float, float]]


@dataclass
class RunContext:
    """What ``BenchConfig.before_run`` is told: the run about to start and the files it reads."""

    format: str
    workers: int
    repeat: int
    cold: bool
    paths: list[str]
    dataset: object


@dataclass
class BenchResult:
    config: BenchConfig
    rows: list[Row]
    sources: dict[str, str]
    bytes_per_sample: dict[str, float | None]
    cores: int
    ceiling_single: float | None
    timeline: Timeline | None
    machine: dict
    seconds: float
    notes: list[str] = field(default_factory=list)

    def row(self, fmt: str, workers: int) -> Row:
        for r in self.rows:
            if r.format == fmt and r.workers == workers:
                return r
        raise KeyError((fmt, workers))

    def formats(self) -> list[str]:
        return list(dict.fromkeys(r.format for r in self.rows))

    def best(self, fmt: str) -> Row:
        return max((r for r in self.rows if r.format == fmt), key=lambda r: r.mean)

    def ceiling(self, workers: int) -> float | None:
        """Decode ceiling: one process's decode rate times min(max(workers, 1), cores)."""
        if self.ceiling_single is None:
            return None
        return self.ceiling_single * min(max(workers, 1), self.cores)


# --- sources ---------------------------------------------------------------------------------


def _say(cfg: BenchConfig, msg: str) -> None:
    if cfg.progress is not None:
        cfg.progress(msg)


def _is_pattern(text: str) -> bool:
    return any(c in text for c in "*?[{")


def _complete(path: str) -> bool:
    """A packed dataset we can use as is: URL, glob, manifest, or a directory holding shards."""
    if is_url(path) or (_is_pattern(path) and "{format}" not in path):
        return True
    if os.path.basename(path) == MANIFEST_NAME:
        return os.path.isfile(path)
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return True
    if os.path.isdir(path):  # shards without a manifest (another tool), not a half-made pack
        return any(not n.startswith(".") for n in os.listdir(path))
    return False


def _existing_format(path: str) -> str | None:
    if not _complete(path):
        return None
    if not is_url(path) and os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return read_manifest(path).shard_format
    from ..sources import resolve_source

    return resolve_source(path).format


def _plan_sources(cfg: BenchConfig) -> tuple[dict[str, str], str | None]:
    """format -> path to read, making and packing what is missing; and the source folder."""
    data = cfg.data
    if data is None and cfg.shards is None:
        from ..synth import make_lfw

        data = cfg.default_data
        if not os.path.isfile(os.path.join(data, ".synth.json")):
            _say(cfg, f"making the default LFW-shaped set in {data} (once; ~30 s on 2 cores)")
        report = make_lfw(data)
        _say(cfg, report.summary())
    if data is not None:
        data = os.fspath(data)
        if not os.path.isdir(data):
            raise InputError(
                f"{data}: no such directory; pass --data an image folder (class-per-folder tree)"
            )
    formats = cfg.formats
    if formats is None:
        if cfg.shards is not None and "{format}" not in cfg.shards:
            shard_fmts: tuple[str, ...] = (_existing_format(cfg.shards) or "tar",)
        else:
            shard_fmts = SHARD_FORMATS
        formats = (("folder",) if data is not None else ()) + shard_fmts
    shard_fmts = tuple(f for f in formats if f in SHARD_FORMATS)
    sources: dict[str, str] = {}
    for fmt in formats:
        if fmt == "memory":
            continue  # loaded from whichever source comes first, once the others are ready
        if fmt == "folder":
            if data is None:
                raise InputError(
                    "the folder baseline needs the image folder: pass --data SRC, or drop "
                    "folder from --formats"
                )
            sources[fmt] = data
            continue
        if cfg.shards is None:
            target = f"{data.rstrip('/')}-shards-{fmt}"
        elif "{format}" in cfg.shards:
            target = cfg.shards.replace("{format}", fmt)
        elif len(shard_fmts) > 1:
            raise InputError(
                f"--shards {cfg.shards!r} names one dataset but --formats asks for "
                f"{', '.join(shard_fmts)}: put {{format}} in it, e.g. --shards out/lfw-{{format}}"
            )
        else:
            target = cfg.shards
        found = _existing_format(target)
        if found is None:
            if data is None:
                raise InputError(
                    f"{target}: no packed dataset there; pass --data SRC to pack it on the fly, "
                    "or point --shards at packed shards"
                )
            from ..packer import pack

            _say(cfg, f"packing {data} into {target} ({fmt}, {cfg.shard_size} shards)")
            report = pack(data, target, format=fmt, shard_size=cfg.shard_size, progress=False)
            _say(cfg, report.summary())
        elif found != fmt:
            raise InputError(
                f"{target} holds {found} shards, not {fmt}: point --shards at {fmt} shards or "
                "change --formats"
            )
        elif data is not None:
            _check_packed_from(cfg, target, data)
        sources[fmt] = target
    if "memory" in formats:
        if not sources:
            raise InputError("the memory reference needs a source: add folder, tar or lmdb")
        first = "folder" if "folder" in sources else next(iter(sources))
        sources["memory"] = sources[first]
    return sources, data


def _check_packed_from(cfg: BenchConfig, target: str, data: str) -> None:
    """Say so when reused shards were packed from another folder than the one benchmarked."""
    if is_url(target) or not _complete_shards(target):
        return
    source = read_manifest(target).pack.get("source")
    if source and os.path.realpath(source) != os.path.realpath(data):
        _say(
            cfg,
            f"note: {target} was packed from {source}, not {data}; the comparison is only fair "
            "if they hold the same images (delete it to re-pack)",
        )


def _make_dataset(fmt: str, path: str, cfg: BenchConfig, storage):
    from ..dataset import FolderDataset, ShardDataset

    decode = DATASET_DECODE[cfg.mode]
    transform = Augment() if cfg.mode == "augment" else None
    if fmt == "memory":
        blobs, labels = _load_all(path)
        return MemoryDataset(blobs, labels, decode=decode, transform=transform, seed=cfg.seed)
    if fmt == "folder":
        return FolderDataset(path, decode=decode, transform=transform, storage=storage)
    if is_url(path):
        storage = None  # remote storage: LocalStorage cannot open URLs
    return ShardDataset(
        path, decode=decode, transform=transform, shuffle=True, seed=cfg.seed, storage=storage
    )


def _load_all(path: str) -> tuple[list[bytes], list[int]]:
    """Every sample's stored bytes and label, from an image folder or from shards."""
    from ..dataset import FolderDataset, ShardDataset

    if os.path.isdir(path) and not _complete_shards(path):
        folder = FolderDataset(path, decode="raw")
        blobs = []
        for i in range(len(folder)):
            with open(os.path.join(folder.root, folder.relpath(i)), "rb") as f:
                blobs.append(f.read())
        return blobs, folder.targets.tolist()
    pairs = list(ShardDataset(path, decode="raw", shuffle=False))
    return [d for d, _ in pairs], [lab for _, lab in pairs]


def _complete_shards(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def _read_paths(fmt: str, ds) -> list[str] | None:
    """The local files a run of this dataset reads (None: nothing on local storage)."""
    if fmt == "memory":
        return None
    if fmt == "folder":
        return [ds.root]
    if any(is_url(u) and not u.startswith("file://") for u in ds.urls):
        return None
    return [u[len("file://") :] if u.startswith("file://") else u for u in ds.urls]


def _bytes_per_sample(fmt: str, ds, paths: list[str] | None) -> float | None:
    """Stored bytes per sample: image file sizes for the folder, shard bytes for shards."""
    if fmt == "memory":
        return len(ds.blob) / len(ds)
    if fmt == "folder":
        total = sum(os.path.getsize(os.path.join(ds.root, ds.relpath(i))) for i in range(len(ds)))
        return total / len(ds)
    if ds.manifest_path and not is_url(ds.manifest_path):
        man = read_manifest(ds.manifest_path)
        if man.num_samples:
            return man.total_bytes / man.num_samples
    if paths:
        return sum(os.path.getsize(p) for p in paths) / ds.num_samples
    return None


def _residency(paths: list[str]) -> float:
    """Page-cache residency over several files or directories, weighted by their pages."""
    from ..pagecache import iter_files

    files = list(iter_files(paths))
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    if not total:
        return 0.0
    return sum(resident_fraction(f) * s for f, s in zip(files, sizes, strict=True)) / total


#: Eviction passes before a cold run gives up and runs with what is left (recorded per run).
EVICT_ATTEMPTS = 5


def _evict(paths: list[str]) -> float:
    """Evict until mincore reports nothing cached; return the residency left.

    Retried because DONTNEED skips pages it cannot drop at that moment: pages still under
    writeback right after a pack (measured: 62% stayed cached after a first pass over a
    freshly made folder) and read-ahead of the previous run still landing (up to 1% here).
    """
    left = 1.0
    for _ in range(EVICT_ATTEMPTS):
        evict(paths)
        left = _residency(paths)
        if left == 0.0:
            break
    return left


def _prime(paths: list[str]) -> float:
    """Read every file once so that warm runs find them in the page cache."""
    from ..pagecache import iter_files

    buf = bytearray(1 << 20)
    for f in iter_files(paths):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return _residency(paths)


# --- the decode ceiling ----------------------------------------------------------------------


def _sample_bytes(fmt: str, ds, count: int, seed: int) -> list[bytes]:
    if fmt == "folder":
        rng = np.random.default_rng(seed)
        idx = rng.choice(len(ds), size=min(count, len(ds)), replace=False)
        out = []
        for i in idx.tolist():
            with open(os.path.join(ds.root, ds.relpath(i)), "rb") as f:
                out.append(f.read())
        return out
    from ..dataset import ShardDataset

    raw = ShardDataset(ds.urls, decode="raw", shuffle=False, storage=ds.storage)
    out = []
    for data, _label in raw:
        out.append(data)
        if len(out) >= count:
            break
    return out


def measure_ceiling(samples: Sequence[bytes], mode: str, seconds: float = 1.0) -> float:
    """Samples/s of one process doing the mode's per-sample work on in-memory JPEG bytes.

    ``decode``: ``decode_image(data, "tensor")``, the datasets' own decode; ``augment``: PIL
    decode then ``Augment``. No reading, no DataLoader: the best a single core can do.
    """
    from ..images import decode_image

    decode = DATASET_DECODE[mode]
    aug = Augment() if mode == "augment" else None
    n, t0 = 0, clock()
    while True:
        for data in samples:
            img = decode_image(data, decode)
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
    shuffle_in_loader = fmt == "folder"
    if shuffle_in_loader:
        wrapped = TimedMap(ds)
        generator = torch.Generator()
        generator.manual_seed(cfg.seed * 1_000_003 + epoch)
    else:
        ds.set_epoch(epoch)
        wrapped, generator = TimedIterable(ds), None
    with _quiet_worker_count():
        loader = DataLoader(
            wrapped,
            batch_size=cfg.batch_size,
            shuffle=shuffle_in_loader,
            generator=generator,
            num_workers=workers,
            collate_fn=Collate(cfg.mode),
        )
    warmup = max(1, workers)
    opens0 = storage.opens() if storage is not None else 0
    batches: list[tuple[int, float, float, float]] = []
    waits: list[tuple[float, float]] = []
    steps: list[tuple[float, float]] = []
    samples = timed_batches = 0
    wait_total = stall_total = 0.0
    first = t_start = t_end = 0.0
    t0 = clock()
    with _quiet_worker_count():
        it = iter(loader)
    started = clock() - t0
    try:
        for k in range(warmup + cfg.batches):
            tw = clock()
            try:
                _images, labels, (wid, b0, b1) = next(it)
            except StopIteration:
                break
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
                if (
                    cfg.max_seconds
                    and te - t_start >= cfg.max_seconds
                    and timed_batches >= MIN_TIMED_BATCHES
                ):
                    break
    finally:
        del it  # shuts the workers down before the next run
    if timed_batches == 0:
        raise InputError(
            f"{fmt} with {workers} workers delivered only {len(batches)} batches of "
            f"{cfg.batch_size}: the dataset is too small for {warmup} warm-up + {cfg.batches} "
            "timed batches; lower --batch-size or --batches"
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
                f"--timeline-config {fmt}:{w}: {fmt} is not among the benchmarked formats "
                f"{', '.join(formats)}"
            )
        return fmt, int(w)
    shard = [f for f in formats if f in SHARD_FORMATS]
    return (shard[0] if shard else formats[0]), max(cfg.workers)


def run_bench(config: BenchConfig) -> BenchResult:
    """Run every (format, workers) configuration ``repeats`` times; write what was asked for.

    Raises InputError (a ShardkitError) for unusable arguments or data, before any run starts.
    """
    cfg = config
    cfg.check()
    _check_outputs(cfg)
    started = clock()
    sources, _data = _plan_sources(cfg)
    formats = list(sources)
    n_cores = cores()
    notes: list[str] = []

    if cfg.cold:
        notes.append(
            "cold: file data pages are evicted before each run (posix_fadvise DONTNEED, checked "
            "with mincore); directory entries and inodes stay cached (dropping them needs root), "
            "so a folder's cold cost here is a lower bound of a truly cold one"
        )
    storages: dict[str, CountingStorage | None] = {}
    datasets: dict[str, object] = {}
    paths: dict[str, list[str] | None] = {}
    per_sample: dict[str, float | None] = {}
    for fmt in formats:
        storage = CountingStorage(latency_ms=cfg.latency_ms)
        ds = _make_dataset(fmt, sources[fmt], cfg, storage)
        storages[fmt] = storage if getattr(ds, "storage", None) is storage else None
        datasets[fmt] = ds
        paths[fmt] = _read_paths(fmt, ds)
        per_sample[fmt] = _bytes_per_sample(fmt, ds, paths[fmt])
        if fmt == "memory":
            notes.append(
                "memory: a reference, not a format: the same bytes held in RAM, decoded and "
                "batched through the same DataLoader; no storage, so no eviction or latency"
            )
        elif paths[fmt] is None:
            notes.append(f"{fmt}: remote shards; not evicted (--cold has no effect on them)")
        if storages[fmt] is None and cfg.latency_ms and fmt != "memory":
            notes.append(f"{fmt}: remote shards; --latency-ms not injected (real latency)")
        need = (max(1, max(cfg.workers)) + cfg.batches) * cfg.batch_size
        if len(ds) < need:
            raise InputError(
                f"{sources[fmt]}: {len(ds)} samples, but a run with {max(cfg.workers)} workers "
                f"reads {need} ((warm-up {max(1, max(cfg.workers))} + --batches {cfg.batches}) x "
                f"--batch-size {cfg.batch_size}); lower --batches or --batch-size"
            )

    ceiling_single = None
    samples_for_ceiling: list[bytes] = []
    if cfg.mode in ("decode", "augment"):
        ref = next(f for f in formats if f != "memory")
        samples_for_ceiling = _sample_bytes(ref, datasets[ref], 256, cfg.seed)
        _say(cfg, f"measuring the {cfg.mode} ceiling (1 process, {len(samples_for_ceiling)} JPEGs)")
        ceiling_single = measure_ceiling(samples_for_ceiling, cfg.mode, cfg.ceiling_seconds)

    if not cfg.cold:
        for fmt in formats:
            if paths[fmt]:
                left = _prime(paths[fmt])
                _say(cfg, f"warm: read {sources[fmt]} once ({left:.0%} now cached)")

    rows = {(f, w): Row(f, w) for f in formats for w in cfg.workers}
    chosen = _timeline_choice(cfg, formats)
    timeline: Timeline | None = None
    epochs = dict.fromkeys(formats, 0)
    # One untimed burn-in run: the first run in a process pays one-time costs (allocator growth,
    # decoder set-up); measured 429 samples/s for a first folder run vs ~2,000 for its repeats.
    burn = replace(cfg, batches=MIN_TIMED_BATCHES, max_seconds=0.2)
    first = formats[0]
    run_once(
        datasets[first],
        first,
        0,
        burn,
        epoch=epochs[first],
        repeat=-1,
        bytes_per_sample=per_sample[first],
        storage=storages[first],
        resident_before=None,
    )
    epochs[first] += 1
    total = len(rows) * cfg.repeats
    done = 0
    for repeat in range(cfg.repeats):
        for fmt in formats:
            for w in cfg.workers:
                ds, fpaths = datasets[fmt], paths[fmt]
                resident = None
                if fpaths:
                    resident = _evict(fpaths) if cfg.cold else _residency(fpaths)
                if cfg.before_run is not None:
                    cfg.before_run(RunContext(fmt, w, repeat, cfg.cold, list(fpaths or []), ds))
                result, tl = run_once(
                    ds,
                    fmt,
                    w,
                    cfg,
                    epoch=epochs[fmt],
                    repeat=repeat,
                    bytes_per_sample=per_sample[fmt],
                    storage=storages[fmt],
                    resident_before=resident,
                )
                epochs[fmt] += 1
                rows[(fmt, w)].runs.append(result)
                if (fmt, w) == chosen and timeline is None:
                    timeline = tl
                done += 1
                _say(
                    cfg,
                    f"[{done}/{total}] repeat {repeat + 1}/{cfg.repeats} {fmt:>6} "
                    f"workers={w}: {result.samples_per_s:,.0f} samples/s, first batch "
                    f"{result.first_batch_s:.2f} s, wait {result.wait_fraction:.0%}",
                )

    if ceiling_single is not None:  # again at the end: keep the better (the stricter ceiling)
        ceiling_single = max(
            ceiling_single, measure_ceiling(samples_for_ceiling, cfg.mode, cfg.ceiling_seconds)
        )
    result = BenchResult(
        config=cfg,
        rows=list(rows.values()),
        sources=dict(sources),
        bytes_per_sample=per_sample,
        cores=n_cores,
        ceiling_single=ceiling_single,
        timeline=timeline,
        machine=machine_facts(),
        seconds=clock() - started,
        notes=notes,
    )
    for row in result.rows:
        row.ceiling = result.ceiling(row.workers)
    _write_outputs(result)
    return result


def _check_outputs(cfg: BenchConfig) -> None:
    """Make the output folders now: a bad path should fail before minutes of runs, not after."""
    for opt, path in (
        ("--json", cfg.json_path),
        ("--plot", cfg.plot_path),
        ("--timeline", cfg.timeline_path),
    ):
        if not path:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"{opt} {path}: cannot create {parent} ({exc.strerror})") from None
        if os.path.isdir(path) or not os.access(parent, os.W_OK):
            raise OutputError(f"{opt} {path}: not a writable file path; choose another")


def _write_outputs(result: BenchResult) -> None:
    cfg = result.config
    if cfg.json_path:
        from .report import write_json

        write_json(result, cfg.json_path)
        _say(cfg, f"wrote {cfg.json_path}")
    if cfg.plot_path:
        from .plot import plot_throughput

        plot_throughput(result, cfg.plot_path)
        _say(cfg, f"wrote {cfg.plot_path}")
    if cfg.timeline_path and result.timeline is not None:
        from .plot import plot_timeline

        plot_timeline(result.timeline, cfg.timeline_path, result)
        _say(cfg, f"wrote {cfg.timeline_path}")
