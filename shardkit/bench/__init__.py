"""``shardkit bench``: is training input-bound, why, and which knob fixes it.

Measures folder-of-files against tar and LMDB shards through real DataLoaders across worker
counts (see ``runner`` for exactly what is timed), and reports a table, a verdict in words, JSON,
an error-bar plot and a measured worker timeline.
"""

from __future__ import annotations

from .report import format_table, to_json, verdict, write_json
from .runner import (
    ALL_FORMATS,
    DEFAULT_DATA,
    SHARD_FORMATS,
    BenchConfig,
    BenchResult,
    Row,
    RunContext,
    RunResult,
    Timeline,
    measure_ceiling,
    parse_formats,
    parse_workers,
    run_bench,
)
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
