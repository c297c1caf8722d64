"""``shardkit bench``: is training input-bound, why, and which knob fixes it.

Measures folder-of-files against tar and LMDB shards through real DataLoaders across worker
counts, and reports a table, a verdict in words, JSON, an error-bar plot and a measured worker
timeline. One concern per module: ``config`` (what to measure), ``sources`` (where each format
reads from), ``workloads`` (what a run asks of the pipeline, the probes), ``runner`` (exactly
what is timed), ``results``, ``report`` (table, verdict, JSON), ``plot`` (the ``bench``
extra), ``stats`` (Welch's t-test: is a difference real), ``estimate`` (how long a run will
take, said before it starts) and ``pagecache`` (the page cache dropped for cold runs, without
root).
"""

from __future__ import annotations

from .config import (
    ALL_FORMATS,
    DEFAULT_DATA,
    SHARD_FORMATS,
    BenchConfig,
    parse_formats,
    parse_workers,
)
from .report import format_table, to_json, verdict, write_json
from .results import BenchResult, Row, RunContext, RunResult, Timeline
from .runner import measure_ceiling, run_bench
from .workloads import MODES, Augment, CountingStorage

__all__ = [
    "ALL_FORMATS",
    "DEFAULT_DATA",
    "MODES",
    "SHARD_FORMATS",
    "Augment",
    "BenchConfig",
    "BenchResult",
    "CountingStorage",
    "Row",
    "RunContext",
    "RunResult",
    "Timeline",
    "format_table",
    "measure_ceiling",
    "parse_formats",
    "parse_workers",
    "run_bench",
    "to_json",
    "verdict",
    "write_json",
]
