#!/usr/bin/env python3
"""Table pack at scale: each child's peak resident memory (``ru_maxrss``) and time for
planning (``plan_pack`` alone) and packing an N-row CSV whose images are hard links to a few
tiny JPEGs, in fresh child processes, interleaved with ``--against DIR``'s; the memory law as
bytes per row above ``--base-rows``'s peak. ``--engine local|ray`` plans (and packs) on a pool
or a Ray cluster, with the driver's CPU and its workers' peak. Figures: docs/benchmarks.md.

    python benchmarks/bench_table.py --rows 1280000 --against /tmp/main-wt
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import data
import harness

_PLAN = """
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
from shardkit.write.engines import LocalRunner
from shardkit.write.plan import plan_pack
engine = LocalRunner(2) if sys.argv[3] == "local" else None
if sys.argv[3] == "ray":
    from shardkit.integrations.ray import RayRunner
    engine = RayRunner(num_cpus=2)
kw = dict(shard_size="64MB", format="tar", shuffle=True, seed=0, validate="header",
          resize_short=None, on_error="skip")
try:  # the planner takes the pack's options whole
    from shardkit.write.options import PackOptions
    how = (PackOptions(**kw, progress=False),), {}
except ImportError:  # an older checkout (--against): its planner took them loose
    how = (), kw
t0 = time.perf_counter()
plan = plan_pack(sys.argv[1], sys.argv[2], *how[0], **how[1], engine=engine)
dt = time.perf_counter() - t0
if hasattr(engine, "close"):
    engine.close()
# VmHWM: this process's own peak (ru_maxrss keeps the launching parent's across the exec)
with open("/proc/self/status") as f:
    peak = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps({"seconds": dt, "peak_mb": peak, "workers_mb": workers,
                  "driver_cpu_s": time.process_time(), "shards": plan.num_shards,
                  "samples": len(plan.order), "fp": plan.fingerprint}))
"""

# The CLI pack in a child whose own peak is read from this wrapper (RUSAGE_CHILDREN).
_PACK = """
import resource, subprocess, sys, json, time
t0 = time.perf_counter()
subprocess.run([sys.executable, "-m", "shardkit.cli", "pack", *sys.argv[1:]], check=True,
               stdout=subprocess.DEVNULL)
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt,
                  "peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def plan_once(checkout: Path, table: Path, out: Path, engine: str = "") -> dict:
    return harness.in_child(checkout, _PLAN, table, out, engine or "-")


def pack_once(checkout: Path, table: Path, out: Path, engine: str = "") -> dict:
    args = (table, out, "-q", "--overwrite", "--shard-size", "64MB")
    args += ("--engine", engine) if engine else ()
    return harness.in_child(checkout, _PACK, *args)


@harness.case(
    data="an N-row table of hard-linked JPEGs (and a --base-rows one)",
    measures="planning's and packing's peak memory and time, bytes per row, at N rows",
    small={"rows": 300, "base_rows": 100},
    aliases={"rounds": ["repeats"]},
)
class Table(harness.Bench):
    rounds: int = 1
    against: Path | None = harness.arg(None, "another checkout, side by side")
    rows: int = 1_280_000
    base_rows: int = 10_000
    work: Path | None = harness.arg(None, "data (default: the data root)")
    no_pack: bool = harness.arg(False, "time the plan only")
    engine: Literal["local", "ray"] | None = harness.arg(
        None,
        "plan (and pack) on --engine local, 2 processes: the driver's peak and its "
        "workers'; or on a local Ray cluster of 2 CPUs (--engine ray: the driver's peak)",
    )


def main(a: Table) -> None:
    work = a.work or data.root() / "table"
    tables = {n: data.table(work, n) for n in (a.base_rows, a.rows)}
    contenders = {"this": harness.ROOT}
    if a.against:
        contenders["against"] = a.against.resolve()
    sides = {}
    for n, table in tables.items():
        for name, checkout in contenders.items():
            out = work / f"out-{name}"

            def one(r, checkout=checkout, table=table, out=out) -> dict:
                res = {"plan": plan_once(checkout, table, out, a.engine)}
                if not a.no_pack:
                    res["pack"] = pack_once(checkout, table, out, a.engine)
                return res

            sides[f"{name} {n}"] = one
    rounds = harness.interleave(sides, a.rounds, order="reverse")
    results = {
        k: {w: [r[w] for r in runs if w in r] for w in ("plan", "pack")}
        for k, runs in rounds.results.items()
    }
    report(results, contenders, tables, a.rows, a.base_rows)
    harness.write_result(a.json, "bench_table", a, results, rounds)


def report(results: dict, contenders: dict, tables: dict, rows: int, base_rows: int) -> None:
    """The best of the rounds (seconds and peak each), bytes per row above the small table's
    peak, and whether every contender planned the same table alike."""
    print(f"load average {harness.load_now().text()}")
    best = {}
    for key, res in results.items():
        best[key] = {f"{what} {k}": min(r.get(k, 0) for r in res[what])
                     for what in ("plan", "pack") if res[what]
                     for k in ("seconds", "peak_mb", "driver_cpu_s", "workers_mb")}  # fmt: skip
        n = key.rsplit(" ", 1)[1]
        fps = {r["plan"][0]["fp"] for k, r in results.items() if k.endswith(f" {n}")}
        best[key]["fingerprints"] = "agree" if len(fps) == 1 else "DIFFER"
    for name in contenders:
        small, big = best[f"{name} {base_rows}"], best[f"{name} {rows}"]
        for what in ("plan", "pack"):
            if f"{what} peak_mb" in big:
                d = big[f"{what} peak_mb"] - small[f"{what} peak_mb"]
                big[f"{what} B/row"] = d * 2**20 / (rows - base_rows)
    cols = ["plan seconds:.1f", "plan peak_mb:.0f", "plan driver_cpu_s:.1f",
            "plan workers_mb:.0f", "pack seconds:.1f", "pack peak_mb:.0f", "plan B/row:.0f",
            "pack B/row:.0f", "fingerprints"]  # fmt: skip
    harness.table(best, cols)


if __name__ == "__main__":
    harness.script(__file__)
