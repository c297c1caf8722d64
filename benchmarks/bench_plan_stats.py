#!/usr/bin/env python3
"""The driver's own CPU for planning a pack (``data.table``'s N-row CSV and its class
folders), with the plan's ``stat`` calls on the driver or on an engine (``LocalRunner``'s pool,
a local Ray cluster), each in a fresh child, the engine started before the clock: the whole
``plan_pack``, the scan and the stats apart, the stats' wall time and the driver's peak.

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
    """The best of the rounds per source and engine; each engine's driver CPU over none's."""
    print(f"load average {harness.load_now().text()}")
    best = {}
    for key, runs in results.items():
        best[key] = {k: min(r[k] for r in runs) for k in runs[0] if k not in ("fp", "sum")}
        name, engine = key.split()
        base = results.get(f"{name} none")
        if base and engine != "none":
            for k in ("stats_cpu", "plan_cpu"):
                best[key][f"{k} x none"] = best[key][k] / min(r[k] for r in base)
        agree = len({(r["sum"], r["fp"]) for r in runs + (base or [])}) == 1
        best[key]["stats and fingerprints"] = "agree" if agree else "DIFFER"
    cols = ["files", "scan_cpu:.2f", "stats_cpu:.2f", "plan_cpu:.2f", "stats_wall:.2f",
            "engine_start:.1f", "peak_mb:.0f", "stats_cpu x none:.3f", "plan_cpu x none:.3f",
            "stats and fingerprints"]  # fmt: skip
    harness.table(best, cols)


if __name__ == "__main__":
    harness.script(__file__)
