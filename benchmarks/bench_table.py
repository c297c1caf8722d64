#!/usr/bin/env python3
"""Table pack at scale: peak memory and time of planning and packing an N-row CSV.

Makes (once, under ``--work``) a CSV of N rows ``image,caption,label`` whose images are hard
links to a handful of real tiny JPEGs (one inode each: an N-file tree costs directory entries,
not disk), then runs each contender in a fresh child process:

- ``plan``: ``plan_pack`` alone (the scan and the plan, nothing read or written);
- ``pack``: ``shardkit pack table.csv OUT`` (scan, plan, read, write, commit).

and reports each child's peak resident memory (``ru_maxrss``) and wall time. ``--against DIR``
runs the same children on another checkout (``git worktree add /tmp/main-wt main``) in the same
run, interleaved, so old and new code are compared on the same data and load:

    python benchmarks/bench_table.py --rows 1280000 --against /tmp/main-wt

The memory law is printed as bytes per row above a small table's peak (``--base-rows``).
``--engine local`` plans (and packs) on a pool of 2 processes: the table is scanned there in
spans, and the plan reports the driver's own CPU and its workers' peak beside the driver's.
``--engine ray`` plans on a local Ray cluster of 2 CPUs (its workers are the raylet's children,
so the workers' column reads what the driver waited for, not them).
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
    load = harness.load_now()
    print(f"load average {load.text()}; {load.cpu_count} CPUs")
    head = f"{'contender':<22}{'plan s':>9}{'plan MB':>9}{'CPU s':>8}{'wkr MB':>8}"
    print(head + f"{'pack s':>9}{'pack MB':>9}")
    for key, res in results.items():
        line = f"{key:<22}"
        for what in ("plan", "pack"):  # the best of the repeats: seconds and peak each
            if res[what]:
                line += f"{min(r['seconds'] for r in res[what]):>9.1f}"
                line += f"{min(r['peak_mb'] for r in res[what]):>9.0f}"
            if what == "plan" and res[what]:  # the driver's own CPU; its workers' peak
                line += f"{min(r.get('driver_cpu_s', 0) for r in res[what]):>8.1f}"
                line += f"{min(r.get('workers_mb', 0) for r in res[what]):>8.0f}"
        print(line)
    for name in contenders:
        small, big = results[f"{name} {base_rows}"], results[f"{name} {rows}"]
        for what in ("plan", "pack"):
            if not big[what]:
                continue
            d = min(r["peak_mb"] for r in big[what]) - min(r["peak_mb"] for r in small[what])
            per = d * 2**20 / (rows - base_rows)
            print(f"{name} {what}: {per:.0f} B/row above a {base_rows}-row table's peak")
    fps = {k: r["plan"][0]["fp"] for k, r in results.items()}
    for n in tables:
        same = {v for k, v in fps.items() if k.endswith(f" {n}")}
        print(f"{n} rows: fingerprints {'agree' if len(same) == 1 else 'DIFFER'}")


if __name__ == "__main__":
    harness.script(__file__)
