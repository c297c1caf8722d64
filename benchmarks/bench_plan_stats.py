#!/usr/bin/env python3
"""The driver's own CPU time for planning a pack, with the plan's ``stat`` calls on the driver
or on an engine (``map_chunks``: ``LocalRunner``'s pool, a local Ray cluster).

Uses ``data.table``'s N-row CSV (images: hard links under ``img/<class>/``) as the
table source, and its ``img`` folder as the class-per-folder source. Each measurement runs in
a fresh child process; the engine is started before the clock (a Ray cluster's start-up and
a pool's fork are reported apart, not counted). Per source and engine it reports the driver's
CPU seconds (``RUSAGE_SELF``: user + system, this process only, so work done by pool workers
or Ray workers is not in it; Ray's own driver threads are) for the whole ``plan_pack``, and
apart (measured again after it) for the scan and for the stats, with the stats' wall time
and the driver's peak resident memory (with Ray: its libraries' too).
Rounds are interleaved:

    python benchmarks/bench_plan_stats.py --rows 200000 --repeats 3
"""

from __future__ import annotations

from pathlib import Path

import data
import harness

_CHILD = """
import json, os, resource, sys, time, warnings
warnings.simplefilter("ignore")
from shardkit.scan import scan_source
from shardkit.write.read import source_stats

src, engine = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
runner = None
if engine == "local":
    from shardkit.write.engines import LocalRunner
    runner = LocalRunner(2)
elif engine == "ray":
    import ray
    from shardkit.integrations.ray import RayRunner
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    runner = RayRunner()
    runner.map_chunks(len, [("warm-up",)] * 2)  # workers started before the clock
start = time.perf_counter() - t0
from shardkit.write.plan import plan_pack
kw = dict(shard_size="64MB", format="tar", shuffle=True, seed=0, validate="header",
          resize_short=None, on_error="skip")
try:  # the planner takes the pack's options whole
    from shardkit.write.options import PackOptions
    how = (PackOptions(**kw, progress=False),), {}
except ImportError:  # an older checkout (--against): its planner took them loose
    how = (), kw
c = cpu()
plan = plan_pack(src, "/nonexistent-out", *how[0], **how[1], engine=runner)
plan_cpu = cpu() - c
c0 = cpu()
scan = scan_source(src, engine=runner)  # a table's rows on the engine too, where it scans
c1, w1 = cpu(), time.perf_counter()
stats = source_stats(scan, runner)
c2, w2 = cpu(), time.perf_counter()
if engine == "ray":
    ray.shutdown()
print(json.dumps({"files": len(scan.files), "scan_cpu": c1 - c0, "stats_cpu": c2 - c1,
                  "plan_cpu": plan_cpu, "fp": plan.fingerprint,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "stats_wall": w2 - w1, "engine_start": start,
                  "sum": int(stats.files[:, 0].sum())}))
"""


@harness.case(
    data="an N-row table of hard-linked JPEGs",
    measures="the driver's CPU for planning a pack, its stat calls on the driver or an engine",
    small={"rows": 300, "engines": "none,local"},
    aliases={"rounds": ["repeats"]},
)
class PlanStats(harness.Bench):
    rounds: int = 3
    rows: int = 200_000
    work: Path | None = harness.arg(None, "data (default: the data root)")
    engines: str = "none,local,ray"


def main(a: PlanStats) -> None:
    work = a.work or data.root() / "table"
    table = data.table(work, a.rows)
    sources = {"table": table, "folder": work / "img"}
    engines = a.engines.split(",")
    sides = {
        f"{name} {engine}": (lambda r, src=src, engine=engine: harness.in_child(
            harness.ROOT, _CHILD, src, engine))
        for name, src in sources.items()
        for engine in engines
    }  # fmt: skip
    rounds = harness.interleave(sides, a.rounds, order="reverse")
    report(rounds.results, engines, sources)
    harness.write_result(a.json, "bench_plan_stats", a, {}, rounds)


def report(results: dict, engines: list[str], sources: dict) -> None:
    load = harness.load_now()
    print(f"load average {load.text()}; {load.cpu_count} CPUs")
    print(
        f"{'source engine':<16}{'files':>9}{'scan cpu':>10}{'stat cpu':>10}{'plan cpu':>10}"
        f"{'stat wall':>11}{'start s':>9}{'peak MB':>9}"
    )
    best = {}
    for key, runs in results.items():
        keys = ("scan_cpu", "stats_cpu", "stats_wall", "plan_cpu")
        b = {k: min(r[k] for r in runs) for k in keys}
        b["engine_start"] = min(r["engine_start"] for r in runs)
        b["peak_mb"] = min(r["peak_mb"] for r in runs)
        best[key] = b
        print(
            f"{key:<16}{runs[0]['files']:>9}{b['scan_cpu']:>10.2f}{b['stats_cpu']:>10.2f}"
            f"{b['plan_cpu']:>10.2f}{b['stats_wall']:>11.2f}"
            f"{b['engine_start']:>9.1f}{b['peak_mb']:>9.0f}"
        )
        if len({r["sum"] for r in runs}) != 1:
            print(f"  {key}: the stats DIFFER between rounds")
    for name in sources:
        base = best.get(f"{name} none")
        for engine in engines:
            b = best.get(f"{name} {engine}")
            if engine == "none" or base is None or b is None:
                continue
            plan = b["plan_cpu"] / base["plan_cpu"]
            stat = b["stats_cpu"] / base["stats_cpu"]
            print(f"{name} {engine}/none: driver CPU stats x{stat:.3f}, whole plan x{plan:.3f}")
    sums = {k.split()[0]: set() for k in results}
    for k, runs in results.items():
        sums[k.split()[0]].update((r["sum"], r["fp"]) for r in runs)
    for name, s in sums.items():
        print(f"{name}: stats and fingerprints {'agree' if len(s) == 1 else 'DIFFER'}")


if __name__ == "__main__":
    harness.script(__file__)
