#!/usr/bin/env python3
"""Table pack at scale: planning (``plan_pack`` alone) and packing an N-row CSV whose images are
hard links to a few tiny JPEGs (``--sources folder``: its class folders), each in a fresh child
process, interleaved with ``--against DIR``'s: time, peak memory (the memory law as bytes per
row above ``--base-rows``'s peak), the driver's CPU for the plan; ``--engine none local ray``
plans (and packs) on each (a pool of 2 processes, a local Ray cluster of 2 CPUs, started before
the clock), with the workers' peak; ``--stats`` also times the scan and the plan's ``stat``
calls apart. Figures: docs/benchmarks.md and docs/pack.md.

    python benchmarks/bench_table.py --rows 1280000 --against /tmp/main-wt
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import data
import harness

_PLAN = """
import json, warnings
warnings.simplefilter("ignore")
from shardkit.write.plan import plan_pack
src, out, engine = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
runner = None
if engine == "local":
    from shardkit.write.engines import LocalRunner
    runner = LocalRunner(2)
elif engine == "ray":
    from shardkit.integrations.ray import RayRunner
    runner = RayRunner(num_cpus=2)
    runner.map_chunks(len, [("warm-up",)] * 2)  # workers started before the clock
row = {"engine_start": time.perf_counter() - t0}
kw = dict(shard_size="64MB", format="tar", shuffle=True, seed=0, validate="header",
          resize_short=None, on_error="skip")
try:  # the planner takes the pack's options whole
    from shardkit.write.options import PackOptions
    how = (PackOptions(**kw, progress=False),), {}
except ImportError:  # an older checkout (--against): its planner took them loose
    how = (), kw
c, t0 = cpu(), time.perf_counter()
plan = plan_pack(src, out, *how[0], **how[1], engine=runner)
row.update(seconds=time.perf_counter() - t0, plan_cpu=cpu() - c, fp=plan.fingerprint)
if sys.argv[4] == "stats":  # the scan and the stat calls apart, measured again after the plan
    from shardkit.scan import scan_source
    from shardkit.write.read import source_stats
    c0 = cpu()
    scan = scan_source(src, engine=runner)
    c1, w1 = cpu(), time.perf_counter()
    stats = source_stats(scan, runner)
    row.update(scan_cpu=c1 - c0, stats_cpu=cpu() - c1, stats_wall=time.perf_counter() - w1,
               fp=f"{plan.fingerprint} {int(stats.files[:, 0].sum())}")
if hasattr(runner, "close"):
    runner.close()
# VmHWM: this process's own peak (ru_maxrss keeps the launching parent's across the exec)
row.update(peak_mb=status_mb("VmHWM"), files=len(plan.order),
           workers_mb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
print(json.dumps(row))
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


@harness.case(
    data="an N-row table of hard-linked JPEGs (and a --base-rows one)",
    measures="planning's and packing's peak memory and time, bytes per row, at N rows",
    small={
        "rows": 300,
        "base_rows": 100,
        "sources": ("table", "folder"),
        "engines": ("local",),
        "stats": True,
    },  # fmt: skip
    aliases={"rounds": ["repeats"], "engines": ["engine"]},
)
class Table(harness.Bench):
    rounds: int = 1
    against: Path | None = harness.arg(None, "another checkout, side by side")
    rows: int = 1_280_000
    base_rows: int = 10_000
    work: Path | None = harness.arg(None, "data (default: the data root)")
    no_pack: bool = harness.arg(False, "time the plan only")
    engines: tuple[Literal["none", "local", "ray"], ...] = harness.arg(
        ("none",), "plan (and pack) on each: none, a pool of 2 processes, a Ray cluster of 2 CPUs"
    )
    sources: tuple[Literal["table", "folder"], ...] = ("table",)
    stats: bool = harness.arg(False, "also time the scan and the stat calls apart")


def main(a: Table) -> None:
    work = a.work or data.root() / "table"
    tables = {n: data.table(work, n) for n in (a.base_rows, a.rows)}
    contenders = {"this": harness.ROOT}
    if a.against:
        contenders["against"] = a.against.resolve()
    sides = {}
    for n, table in tables.items():
        for name, checkout in contenders.items():
            for src in a.sources:  # one folder (work/img) holds every table's images
                for engine in a.engines if src == "table" or n == a.rows else ():
                    what = (checkout, table if src == "table" else work / "img", work / "out")
                    sides[f"{name} {src} {engine} {n}"] = lambda r, w=what, e=engine: one(
                        a, *w, "" if e == "none" else e
                    )
    rounds = harness.interleave(sides, a.rounds, order="reverse")
    results = {
        k: {w: [r[w] for r in runs if w in r] for w in ("plan", "pack")}
        for k, runs in rounds.results.items()
    }
    report(results, a.rows, a.base_rows)
    harness.write_result(a.json, "bench_table", a, results, rounds)


def one(a: Table, checkout: Path, src: Path, out: Path, engine: str) -> dict:
    res = {
        "plan": harness.in_child(
            checkout, _PLAN, src, out, engine or "-", "stats" if a.stats else "-"
        )
    }
    if not a.no_pack:
        args = (src, out, "-q", "--overwrite", "--shard-size", "64MB")
        res["pack"] = harness.in_child(
            checkout, _PACK, *args, *(("--engine", engine) if engine else ())
        )
    return res


def report(results: dict, rows: int, base_rows: int) -> None:
    """The best of the rounds per figure, bytes per row above the small table's peak, each
    engine's driver CPU over none's, and whether every contender planned each source alike."""
    print(f"load average {harness.load_now().text()}")
    best = {}
    for key, res in results.items():
        best[key] = {f"{what} {k}": min(r[k] for r in res[what])
                     for what in ("plan", "pack") if res[what] for k in res[what][0]
                     if isinstance(res[what][0][k], (int, float))}  # fmt: skip
        src, n = key.split()[1], key.split()[-1]
        fps = {
            r["plan"][0]["fp"]
            for k, r in results.items()
            if f" {src} " in k and k.endswith(f" {n}")
        }
        best[key]["fingerprints"] = "agree" if len(fps) == 1 else "DIFFER"
    for key, b in best.items():
        name, src, engine, n = key.split()
        small, none = (
            best.get(f"{name} {src} {engine} {base_rows}"),
            best.get(f"{name} {src} none {n}"),
        )
        for what in ("plan", "pack"):
            if f"{what} peak_mb" in b and n == str(rows) and small:
                b[f"{what} B/row"] = (
                    (b[f"{what} peak_mb"] - small[f"{what} peak_mb"]) * 2**20 / (rows - base_rows)
                )
        for k in ("plan plan_cpu", "plan stats_cpu"):
            if none and k in b and engine != "none" and none[k]:
                b[f"{k} x none"] = b[k] / none[k]
    cols = ["plan seconds:.1f", "plan peak_mb:.0f", "plan plan_cpu:.1f", "plan workers_mb:.0f",
            "plan engine_start:.1f", "plan scan_cpu:.2f", "plan stats_cpu:.2f",
            "plan stats_wall:.2f", "plan plan_cpu x none:.3f", "plan stats_cpu x none:.3f",
            "pack seconds:.1f", "pack peak_mb:.0f", "plan B/row:.0f", "pack B/row:.0f",
            "fingerprints"]  # fmt: skip
    harness.table(best, cols)


if __name__ == "__main__":
    harness.script(__file__)
