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

from ..errors import InputError
from .workloads import MODES

if TYPE_CHECKING:
    from .results import RunContext

__all__ = [
    "format_list",
    "int_list",
    "ALL_FORMATS",
    "BENCH_SHARD_SIZE",
    "DEFAULT_BATCHES",
    "DEFAULT_DATA",
    "MIN_TIMED_BATCHES",
    "SHARD_FORMATS",
    "BenchConfig",
    "parse_formats",
    "parse_workers",
    "say",
]


SHARD_FORMATS = ("tar", "lmdb")
#: "memory" is a reference, not a storage format: the same JPEG bytes held in RAM, decoded and
#: batched through the same DataLoader (``workloads.MemoryDataset``). Opt-in via --formats.
#: "loader" reads the tar shards through ``ShardLoader`` (decode threads into reused batch
#: buffers) instead of a DataLoader; ``--workers`` is its thread count. Opt-in, decode mode only.
ALL_FORMATS = ("folder", *SHARD_FORMATS, "memory", "loader")
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

    def resolved(self) -> BenchConfig:
        """A copy with lists parsed and mode-dependent defaults filled in; InputError if unusable.

        Raises before any run starts, naming the parameter (``batch_size``, ``timeline_config``).
        """
        cfg = replace(self, workers=parse_workers(self.workers))
        if cfg.formats is not None:
            cfg.formats = parse_formats(cfg.formats)
        if cfg.mode not in MODES:
            raise InputError(f"mode={cfg.mode!r} is unknown; choose from {', '.join(MODES)}")
        if cfg.batches is None:
            cfg.batches = DEFAULT_BATCHES[cfg.mode]
        for name, value in (
            ("batch_size", cfg.batch_size),
            ("batches", cfg.batches),
            ("repeats", cfg.repeats),
        ):
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a whole number >= 1, got {value!r}")
        if cfg.max_seconds is not None and cfg.max_seconds < 0:
            raise InputError(f"max_seconds must be >= 0 (0: no limit), got {cfg.max_seconds}")
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

    def as_dict(self) -> dict:
        skip = {"progress", "before_run"}
        out = {k: v for k, v in self.__dict__.items() if k not in skip}
        out["workers"] = list(self.workers)
        out["formats"] = list(self.formats) if self.formats else None
        out["timeline_config"] = list(self.timeline_config) if self.timeline_config else None
        return out
