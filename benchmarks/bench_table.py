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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PLAN = """
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
from shardkit.write.plan import plan_pack
t0 = time.perf_counter()
plan = plan_pack(sys.argv[1], sys.argv[2], shard_size="64MB", format="tar", shuffle=True,
                 seed=0, validate="header", resize_short=None, on_error="skip")
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": dt, "peak_mb": peak, "shards": plan.num_shards,
                  "samples": len(plan.order), "fp": plan.fingerprint}))
"""


def make_table(work: Path, rows: int, classes: int = 1000) -> Path:
    """``work/table-<rows>.csv`` and its images (hard links to 64 tiny JPEGs), made once."""
    from PIL import Image

    table = work / f"table-{rows}.csv"
    if table.exists():
        return table
    img = work / "img"
    img.mkdir(parents=True, exist_ok=True)
    seeds = []
    for s in range(64):  # ext4 allows 65,000 links per inode
        p = work / f"seed{s}.jpg"
        if not p.exists():
            Image.new("RGB", (8, 8), (4 * s, 100, 255 - 3 * s)).save(p, quality=90)
        seeds.append(p)
    per = max(1, rows // classes)
    tmp = table.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("image,caption,label\n")
        for i in range(rows):
            c = min(i // per, classes - 1)
            folder = img / f"c{c:04d}"
            if i % per == 0 or not folder.exists():
                folder.mkdir(exist_ok=True)
            name = folder / f"img{i:09d}.jpg"
            if not name.exists():
                os.link(seeds[i % len(seeds)], name)
            f.write(f"img/c{c:04d}/img{i:09d}.jpg,a photo of thing {i} in class {c},n{c:08d}\n")
    tmp.rename(table)
    return table


def run_child(checkout: Path, argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, cwd=checkout, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(argv)}\n{r.stderr[-3000:]}")
    return {"wall": dt, "stdout": r.stdout}


def plan_once(checkout: Path, table: Path, out: Path) -> dict:
    r = run_child(checkout, [sys.executable, "-c", _PLAN, str(table), str(out)])
    return json.loads(r["stdout"].strip().splitlines()[-1])


def pack_once(checkout: Path, table: Path, out: Path) -> dict:
    """The CLI pack in a child whose own peak is read from a wrapper (RUSAGE_CHILDREN)."""
    wrapper = (
        "import resource, subprocess, sys, json, time\n"
        "t0 = time.perf_counter()\n"
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
        "dt = time.perf_counter() - t0\n"
        "print(json.dumps({'seconds': dt, "
        "'peak_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))\n"
    )
    cmd = [sys.executable, "-m", "shardkit.cli", "pack", str(table), str(out), "-q"]
    cmd += ["--overwrite", "--shard-size", "64MB"]
    r = run_child(checkout, [sys.executable, "-c", wrapper, *cmd])
    return json.loads(r["stdout"].strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_280_000)
    ap.add_argument("--base-rows", type=int, default=10_000)
    ap.add_argument("--work", default="/tmp/bench-table")
    ap.add_argument("--against", default=None, help="another checkout to run side by side")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-pack", action="store_true", help="time the plan only")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    tables = {n: make_table(work, n) for n in (a.base_rows, a.rows)}
    contenders = {"this": ROOT}
    if a.against:
        contenders["against"] = Path(a.against).resolve()
    results: dict = {}
    for rep in range(a.repeats):
        names = list(contenders) if rep % 2 == 0 else list(reversed(contenders))
        for n, table in tables.items():
            for name in names:
                out = work / f"out-{name}"
                res = results.setdefault(f"{name} {n}", {"plan": [], "pack": []})
                res["plan"].append(plan_once(contenders[name], table, out))
                if not a.no_pack:
                    res["pack"].append(pack_once(contenders[name], table, out))
    report(results, contenders, tables, a.rows, a.base_rows)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


def report(results: dict, contenders: dict, tables: dict, rows: int, base_rows: int) -> None:
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs")
    print(f"{'contender':<22}{'plan s':>9}{'plan MB':>9}{'pack s':>9}{'pack MB':>9}")
    for key, res in results.items():
        line = f"{key:<22}"
        for what in ("plan", "pack"):  # the best of the repeats: seconds and peak each
            if res[what]:
                line += f"{min(r['seconds'] for r in res[what]):>9.1f}"
                line += f"{min(r['peak_mb'] for r in res[what]):>9.0f}"
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
    main()
