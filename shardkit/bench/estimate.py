"""How long a bench will take, said before it starts, and how far along it is while it runs.

The bound is simple on purpose, so a user can check it: per run ``max_seconds`` plus a start-up
allowance that grows with the workers (``config.RUN_OVERHEAD_S``, ``WORKER_OVERHEAD_S``), plus
the fixed steps (the decode ceiling, the burn-in run) and, when the data or its shards are
missing, making and packing them. The per-run progress line then replaces the bound
with the mean of the runs so far.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from .config import BenchConfig

__all__ = ["Estimate", "clock_text", "estimate"]

#: Seconds to make the default LFW-shaped set (``synth.make_lfw``): measured 136 s on the
#: 2-core VM at load 10, about 30 s when it is idle.
SYNTH_LFW_S = 60.0
#: Bytes of the default set, for the packing estimate before it exists.
LFW_BYTES = 176e6
#: Packing rate for the estimate: ``pack`` of the LFW set on the 2-core VM measured 82 MB/s from
#: page cache at load 4.6; a cold read is several times slower.
PACK_MB_PER_S = 20.0
#: Evicting the folder's files before each cold run (``pagecache.evict_until_cold`` on 13k files:
#: fadvise, then mincore to check): measured 1.3 s at load 5 on the 2-core VM.
EVICT_FOLDER_S = 1.5
#: The one write-back (fdatasync) of the folder's files before the cold runs: 2.7 s at load 5.
WRITE_BACK_FOLDER_S = 5.0
#: Fixed steps besides the runs: loading datasets, the burn-in run (the ceiling is added apart).
FIXED_S = 3.0


@dataclass
class Estimate:
    """``runs`` runs of ``per_run_s`` each on average (bound), plus ``prep`` steps (what, s)."""

    runs: int
    per_run_s: float | None
    fixed_s: float
    prep: list[tuple[str, float]] = field(default_factory=list)

    @property
    def total_s(self) -> float | None:
        if self.per_run_s is None:
            return None
        return self.runs * self.per_run_s + self.fixed_s + sum(s for _, s in self.prep)

    def line(self, cfg: BenchConfig, formats: list[str]) -> str:
        """``estimate: 60 runs (...) x up to 5.4 s each (...) = up to 5:28 min, plus ...``."""
        what = (
            f"{self.runs} runs ({','.join(formats)} x workers "
            f"{','.join(map(str, cfg.workers))} x {cfg.repeats} repeats)"
        )
        if self.per_run_s is None:
            return f"estimate: {what}; no bound (max_seconds 0: runs are not capped)"
        runs_s = self.runs * self.per_run_s + self.fixed_s
        text = (
            f"estimate: {what} x up to {self.per_run_s:.1f} s each (timed up to "
            f"{cfg.max_seconds:g} s, plus start-up) = up to {clock_text(runs_s)}"
        )
        for step, seconds in self.prep:
            text += f", plus ~{clock_text(seconds)} {step}"
        if self.prep:
            text += f" (total up to ~{clock_text(self.total_s or 0)})"
        return text


def clock_text(seconds: float) -> str:
    """``75`` -> ``"1:15 min"``; under a minute ``"42 s"``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    return f"{seconds // 60}:{seconds % 60:02d} min"


def _tree_bytes(root: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def estimate(
    cfg: BenchConfig, pending: list[tuple[str, str | None]], formats: Sequence[str]
) -> Estimate:
    """The bound for ``cfg`` over ``formats`` with ``pending`` preparation steps.

    ``pending``: (what, None) for making the default set, (what, source folder) per shard format
    to pack (``sources.pending``).
    """
    runs = len(formats) * len(cfg.workers) * cfg.repeats
    fixed = FIXED_S + (2 * cfg.ceiling_seconds if cfg.mode != "raw" else 0.0)
    bounds = [cfg.run_bound_s(w) for w in cfg.workers]
    per_run = None if None in bounds else sum(bounds) / len(bounds)
    if per_run is not None and cfg.cold and "folder" in formats:
        per_run += EVICT_FOLDER_S / len(formats)  # spread over all runs: one line, one bound
        fixed += WRITE_BACK_FOLDER_S
    prep: list[tuple[str, float]] = []
    sizes: dict[str, float] = {}
    for step, source in pending:
        if source is None:
            prep.append((step, SYNTH_LFW_S))
            continue
        if source not in sizes:
            sizes[source] = LFW_BYTES if not os.path.isdir(source) else _tree_bytes(source)
        prep.append((step, sizes[source] / 1e6 / PACK_MB_PER_S))
    return Estimate(runs, per_run, fixed, prep)
