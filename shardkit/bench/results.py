"""What a bench run found: per-run results, per-configuration rows, one run's timeline.

Plain dataclasses with no behaviour beyond summary statistics, so the report and the plots read
them without importing the runner that fills them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .config import BenchConfig

__all__ = ["BenchResult", "Load", "Row", "RunContext", "RunResult", "Timeline"]


@dataclass(frozen=True)
class Load:
    """The machine's load average (1, 5, 15 min) and CPU counts at one moment.

    Recorded before and after the whole bench: on a shared machine the load decides whether the
    figures mean anything (a load above the cores means other processes took CPU time from the
    runs). ``cores``: CPUs this process may use; ``cpu_count``: the machine's.
    """

    load_1m: float
    load_5m: float
    load_15m: float
    cores: int
    cpu_count: int | None

    @classmethod
    def now(cls, cores: int) -> Load:
        one, five, fifteen = os.getloadavg()
        return cls(round(one, 2), round(five, 2), round(fifteen, 2), cores, os.cpu_count())

    def text(self) -> str:
        return f"{self.load_1m:.2f}/{self.load_5m:.2f}/{self.load_15m:.2f}"

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RunResult:
    """One DataLoader run.

    ``wait_fraction``: share of the timed wall time spent in ``next(loader)``. ``stall_fraction``:
    the part of it before the batch was even ready in its worker (collated), i.e. waiting on
    loading; the rest of the wait is receiving a ready batch (the DataLoader's transfer).
    ``opens``: latency charges paid during the run (workers' prefetch included);
    ``resident_before``: page-cache residency of the read files as the run started.
    ``stopped``: why timing ended: "target" (min samples and seconds reached, or ``batches``),
    "max_seconds" (the cap, before the target) or "data" (the epoch ended first).
    ``wall_s``: the whole run, DataLoader start to shutdown (what the estimate bounds).
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
    stopped: str = "target"
    wall_s: float = 0.0


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
    def rates(self) -> list[float]:
        """samples/s of each repeat: what the verdict's significance test compares."""
        return [r.samples_per_s for r in self.runs]

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
    num_samples: dict[str, int] = field(default_factory=dict)
    load_before: Load | None = None
    load_after: Load | None = None
    estimate_s: float | None = None

    def load_warning(self) -> str | None:
        """One line when the load average exceeded the cores before or after the bench."""
        loads = [(w, x) for w, x in (("before", self.load_before), ("after", self.load_after)) if x]
        over = [(w, x) for w, x in loads if x.load_1m > x.cores]
        if not over:
            return None
        when = " and ".join(f"{x.load_1m:.2f} {w}" for w, x in over)
        return (
            f"warning: load average {when} the bench exceeded its {over[0][1].cores} cores: "
            "other processes took CPU time from the runs, so rates are lower and noisier than "
            "on an idle machine"
        )

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
