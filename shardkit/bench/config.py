"""What a bench run is asked to measure: ``BenchConfig``, its defaults and the list parsers.

Kept apart from the runner so that the CLI, the reports and the tests can build and check a
configuration without importing what runs it. Messages name the Python parameters (``workers``,
``batch_size``); the CLI's click types catch malformed flags before they get here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..errors import InputError, check_int
from .workloads import MODES

if TYPE_CHECKING:
    from .results import RunContext

__all__ = [
    "format_list",
    "int_list",
    "ALL_FORMATS",
    "BENCH_SHARD_SIZE",
    "DEFAULT_SIZE",
    "DEFAULT_DATA",
    "MAX_SECONDS",
    "MIN_SAMPLES",
    "MIN_SECONDS",
    "MIN_TIMED_BATCHES",
    "SHARD_FORMATS",
    "BenchConfig",
    "parse_formats",
    "RUN_OVERHEAD_S",
    "WORKER_OVERHEAD_S",
    "parse_workers",
    "say",
]


SHARD_FORMATS = ("tar", "lmdb")
#: "memory" is a reference, not a storage format: the same JPEG bytes held in RAM, decoded and
#: batched through the same DataLoader (``workloads.MemoryDataset``). Opt-in via --formats.
#: "loader" reads the tar shards through ``ShardLoader`` (worker processes decoding into a reused
#: shared-memory ring) instead of a DataLoader; ``--workers`` is its worker count. Opt-in, decode
#: mode only.
ALL_FORMATS = ("folder", *SHARD_FORMATS, "memory", "loader")
#: Where the embedded LFW-shaped set is made when no data is given (relative to the cwd).
DEFAULT_DATA = os.path.join("data", "lfw")
#: How long a run is timed (``--batches`` not given): until it has at least ``min_samples``
#: timed samples AND ``min_seconds`` of timed wall time, or ``max_seconds`` at most, or the epoch
#: ends. Chosen from measured spread (``benchmarks/bench_run_length.py``, LFW set, decode, cold,
#: 5 repeats, load 8-12 on 2 cores): the median coefficient of variation of samples/s between
#: repeats over four configurations was 0.48, 0.57, 0.58, 0.50, 0.39, 0.39 for runs timed 0.25,
#: 0.5, 1, 1.5, 2 and 3 s: it stops falling at about 2 s, so 2 s is the minimum; load noise,
#: not run length, is what is left, and the verdict's t-test accounts for it. 1024 samples (16
#: batches of 64) keep two rounds of 8 workers' bursts in even a slow run. ``max_seconds`` bounds
#: a slow configuration (a folder paying latency per image, augment mode) so the whole bench's
#: time is known before it starts.
MIN_SAMPLES = 1024
MIN_SECONDS = 2.0
MAX_SECONDS = 3.0
#: Untimed seconds a run adds around its timed window (forking workers, their warm-up batches,
#: eviction, shutdown): ``RUN_OVERHEAD_S + WORKER_OVERHEAD_S * max(1, workers)``. Measured at
#: load ~10 on the 2-core VM (decode, LFW): 1.3-1.5 s at 0-2 workers, 3.9-5.6 s at 8. Used only
#: for the estimate printed before the bench starts.
RUN_OVERHEAD_S = 0.5
WORKER_OVERHEAD_S = 0.5
#: The untimed burn-in run and an absolute floor for a run: a few batches.
MIN_TIMED_BATCHES = 5
#: Shard size when the bench packs on the fly. Smaller than ``pack``'s 256 MB default because
#: LFW (176 MB) would fit one shard, and a worker whose slice starts mid-shard reads the tar from
#: the shard's start to reach it: 32 MB shards bound that start-up read.
BENCH_SHARD_SIZE = "32MB"
#: Side of the images that decode mode and the loader batch (``size`` / ``--size``): the 224
#: centre crop of most ImageNet recipes (shorter side to 224, then the central square), through
#: the same ``TensorDecoder`` for every format. Real folders hold images of many sizes, which
#: cannot be stacked into a batch as stored; 0 keeps them as stored (all must share one size).
DEFAULT_SIZE = 224


def int_list(text: str, low: int = 0, high: int = 256) -> tuple[int, ...]:
    """``"0,2,4,8"`` -> ``(0, 2, 4, 8)``; duplicates dropped, order kept.

    Raises ValueError with the reason only, so each caller prefixes what it parses (a Python
    parameter here, a flag in the CLI's click type).
    """
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"{text!r} is malformed: give comma-separated whole numbers, e.g. 0,2,4,8")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"{text!r} is malformed: {', '.join(parts)} are not all whole numbers; e.g. 0,2,4,8"
        ) from None
    return _in_range(values, low, high)


def _in_range(values: Sequence[int], low: int, high: int) -> tuple[int, ...]:
    if not values:
        raise ValueError("is empty: give at least one count, e.g. 0,2,4,8")
    bad = [v for v in values if v < low or v > high]
    if bad:
        raise ValueError(f"{bad[0]} is out of range; use counts from {low} to {high}")
    return tuple(dict.fromkeys(values))


def parse_workers(text: str | Sequence[int]) -> tuple[int, ...]:
    """DataLoader worker counts from ``"0,2,4,8"`` or a sequence; InputError naming ``workers``."""
    try:
        if isinstance(text, str):
            return int_list(text)
        return _in_range([int(v) for v in text], 0, 256)
    except ValueError as exc:
        raise InputError(f"workers {exc}") from None


def format_list(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"folder,tar"`` -> ``("folder", "tar")``; ValueError with the reason for unknown names."""
    parts = [p.strip().lower() for p in (text.split(",") if isinstance(text, str) else text)]
    if not parts or any(not p for p in parts):
        raise ValueError(
            f"{text!r} is malformed: give comma-separated names from {', '.join(ALL_FORMATS)}"
        )
    unknown = [p for p in parts if p not in ALL_FORMATS]
    if unknown:
        raise ValueError(f"unknown format {unknown[0]!r}; choose from {', '.join(ALL_FORMATS)}")
    return tuple(dict.fromkeys(parts))


def parse_formats(text: str | Sequence[str]) -> tuple[str, ...]:
    """Format names from ``"folder,tar"`` or a sequence; InputError naming ``formats``."""
    try:
        return format_list(text)
    except ValueError as exc:
        raise InputError(f"formats: {exc}") from None


def say(cfg: BenchConfig, msg: str) -> None:
    """A progress line, if the caller asked for them."""
    if cfg.progress is not None:
        cfg.progress(msg)


def _check_run_length(cfg: BenchConfig) -> None:
    if not isinstance(cfg.min_samples, int) or cfg.min_samples < 0:
        raise InputError(f"min_samples must be a whole number >= 0, got {cfg.min_samples!r}")
    if cfg.min_seconds < 0:
        raise InputError(f"min_seconds must be >= 0, got {cfg.min_seconds}")
    if cfg.max_seconds is not None and cfg.max_seconds < 0:
        raise InputError(f"max_seconds must be >= 0 (0: no limit), got {cfg.max_seconds}")
    if cfg.max_seconds and cfg.max_seconds < cfg.min_seconds:
        raise InputError(
            f"max_seconds {cfg.max_seconds:g} is below min_seconds {cfg.min_seconds:g}; "
            "raise max_seconds or lower min_seconds"
        )


@dataclass
class BenchConfig:
    """What to measure. Defaults give the few-minute default run on the LFW-shaped set.

    ``data``: image folder (class-per-folder); None with no ``shards`` means the embedded default
    set at ``default_data``, made (``synth.make_lfw``) and packed the first time. ``shards``: a
    packed dataset (directory, manifest, glob or URL) or a directory to pack into; ``{format}`` in
    it is replaced by each shard format (default: ``<data>-shards-{format}``). ``timeline_config``:
    ``(format, workers)`` whose first repeat is drawn by ``timeline_path`` (default: the first
    shard format at the largest worker count). A run is timed until it has ``min_samples``
    samples and ``min_seconds`` seconds, at most ``max_seconds`` (None or 0: no cap), or the epoch
    ends; ``batches``, if given, times exactly that many batches instead (the cap still holds).
    ``size``: decode and loader modes centre-crop and resize every image to ``size`` x ``size``
    (0: decode as stored). ``before_run``: called with a ``RunContext`` after
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
    size: int = DEFAULT_SIZE
    timeline_config: tuple[str, int] | None = None
    min_samples: int = MIN_SAMPLES
    min_seconds: float = MIN_SECONDS
    max_seconds: float | None = MAX_SECONDS
    ceiling_seconds: float = 1.0
    default_data: str = DEFAULT_DATA
    json_path: str | None = None
    plot_path: str | None = None
    timeline_path: str | None = None
    progress: Callable[[str], None] | None = None
    before_run: Callable[[RunContext], None] | None = None

    def resolved(self) -> BenchConfig:
        """A copy with lists parsed and mode-dependent defaults filled in; InputError if unusable.

        Raises before any run starts, naming the parameter (``batch_size``, ``timeline_config``).
        """
        cfg = replace(self, workers=parse_workers(self.workers))
        if cfg.formats is not None:
            cfg.formats = parse_formats(cfg.formats)
        if cfg.mode not in MODES:
            raise InputError(f"mode={cfg.mode!r} is unknown; choose from {', '.join(MODES)}")
        for name, value in (
            ("batch_size", cfg.batch_size),
            ("batches", 1 if cfg.batches is None else cfg.batches),
            ("repeats", cfg.repeats),
        ):
            check_int(name, value, 1)
        _check_run_length(cfg)
        if not isinstance(cfg.size, int) or cfg.size < 0:
            raise InputError(f"size= must be a whole number >= 0 (0: as stored), got {cfg.size!r}")
        if cfg.formats and "loader" in cfg.formats and cfg.mode != "decode":
            raise InputError(
                f"--formats loader measures ShardLoader's decoded batches; use --mode decode "
                f"(not {cfg.mode}), or drop loader from --formats"
            )
        if cfg.latency_ms < 0 or cfg.step_ms < 0:
            raise InputError("latency_ms and step_ms must be >= 0")
        if cfg.timeline_config is not None:
            fmt, w = cfg.timeline_config
            if fmt not in ALL_FORMATS:
                raise InputError(
                    f"timeline_config: unknown format {fmt!r}; give (format, workers), e.g. "
                    "('tar', 4)"
                )
            if int(w) not in cfg.workers:
                raise InputError(
                    f"timeline_config ({fmt!r}, {w}): {w} is not among workers "
                    f"{','.join(map(str, cfg.workers))}"
                )
        return cfg

    def run_bound_s(self, workers: int) -> float | None:
        """Bound of one run's wall time at ``workers``, for the estimate; None when uncapped."""
        if not self.max_seconds:
            return None
        return self.max_seconds + RUN_OVERHEAD_S + WORKER_OVERHEAD_S * max(1, workers)

    def as_dict(self) -> dict:
        skip = {"progress", "before_run"}
        out = {k: v for k, v in self.__dict__.items() if k not in skip}
        out["workers"] = list(self.workers)
        out["formats"] = list(self.formats) if self.formats else None
        out["timeline_config"] = list(self.timeline_config) if self.timeline_config else None
        return out
