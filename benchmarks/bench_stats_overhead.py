#!/usr/bin/env python3
"""What the loader's stats counters cost, as CPU time per image against another checkout.

Wall-clock rates on a loaded machine swing 0.4x-2x from round to round (bench_against at load
14 on 2 cores); CPU time per image does not wait for a core. ``ShardLoader(num_workers=0)`` runs
the fill loop in the caller, so the child's CPU time is the whole loader's: read, decode, the
counters. Each round runs both checkouts in fresh child processes, alternating which goes first;
reported per job, the median over rounds of this checkout's images per CPU-second over the
other's (above 1: this one is cheaper). Jobs: ``tiny`` (whole 8x8 JPEGs, batches of 256: the
least work per image, where per-image costs show most) and ``rrc`` (ImageNet-shaped photos,
random-resized crops to 224, two epochs). The data are bench_against.py's (run it once first):

    git worktree add /tmp/base <rev>   # or: git archive <rev> | tar -x -C /tmp/base
    python benchmarks/bench_against.py --against /tmp/base --jobs epoch-tiny --rounds 1 \
        --rows 8000 --per-class 100 --work /tmp/bench-against
    python benchmarks/bench_stats_overhead.py /tmp/base --rounds 9 --work /tmp/bench-against
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
from shardkit import ShardDataset, ShardLoader
kw = {"decode": "tensor"}
if sys.argv[2] == "rrc":
    kw.update(size=224, crop="random", flip=True)
ds = ShardDataset(sys.argv[1], **kw)
loader = ShardLoader(ds, int(sys.argv[3]), num_workers=0)
n = 0
for epoch in range(int(sys.argv[4])):
    loader.set_epoch(epoch)
    it = iter(loader)
    next(it)
    t0 = time.process_time()
    n += sum(len(x) for x, _ in it)
    cpu = time.process_time() - t0 if epoch == 0 else cpu + time.process_time() - t0
print(json.dumps({"rate": n / cpu}))
"""


def run(checkout, *args):
    env = {**os.environ, "PYTHONPATH": checkout, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        env=env,
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])["rate"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("against", type=Path, help="the other checkout")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-against"))
    ap.add_argument("--rows", type=int, default=8000, help="the table's rows (bench_against)")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    this, against, rounds = str(ROOT), str(a.against.resolve()), a.rounds
    jobs = {
        "tiny": (str(a.work / f"table-{a.rows}-pack"), "tiny", "256", "1"),
        "rrc": (str(a.work / "inet-pack"), "rrc", "64", "2"),
    }
    out, loads = {}, []
    for name, args in jobs.items():
        ratios = []
        for r in range(rounds):
            loads.append(round(os.getloadavg()[0], 1))
            order = [this, against] if r % 2 == 0 else [against, this]
            got = {c: run(c, *args) for c in order}
            ratios.append(got[this] / got[against])
        out[name] = {"ratio": statistics.median(ratios), "ratios": [round(x, 3) for x in ratios]}
        print(name, out[name], flush=True)
    print("load averages:", loads)


if __name__ == "__main__":
    main()
