#!/usr/bin/env python3
"""What the loader's stats counters cost, as CPU time per image against another checkout.

Wall-clock rates on a loaded machine swing 0.4x-2x from round to round (bench_against at load
14 on 2 cores); CPU time per image does not wait for a core. ``ShardLoader(num_workers=0)`` runs
the fill loop in the caller, so the child's CPU time (``time.process_time``, after the first
batch) is the whole loader's: read, decode, the counters. Each round runs every job on both
checkouts in fresh child processes (``harness.in_child``, ``OMP_NUM_THREADS=1``), flipping
which goes first every round; reported per job, the median over rounds of this checkout's
images per CPU-second over the other's (above 1: this one is cheaper), with each round's load
average. Jobs: ``tiny`` (whole 8x8 JPEGs, batches of 256, one epoch: the least work per image,
where per-image costs show most) and ``rrc`` (ImageNet-shaped photos, random-resized crops to
224, batches of 64, two epochs). The data are bench_against.py's (``data.table`` and
``data.imagenet`` under ``--work``, packed by this checkout), made on the first run:

    git worktree add /tmp/base <rev>   # or: git archive <rev> | tar -x -C /tmp/base
    python benchmarks/bench_stats_overhead.py --against /tmp/base --rounds 9
"""

from __future__ import annotations

import os
from pathlib import Path

import data
import harness

_CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
from shardkit import ShardDataset, ShardLoader
kw = {"decode": "tensor"}
if sys.argv[2] == "rrc":
    kw.update(size=224, crop="random", flip=True)
ds = ShardDataset(sys.argv[1], **kw)
loader = ShardLoader(ds, int(sys.argv[3]), num_workers=0)
n, cpu = 0, 0.0
for epoch in range(int(sys.argv[4])):
    loader.set_epoch(epoch)
    it = iter(loader)
    next(it)
    t0 = time.process_time()
    n += sum(len(x) for x, _ in it)
    cpu += time.process_time() - t0
if n == 0:
    sys.exit(f"{sys.argv[1]}: one batch or less per epoch: smaller batches or more data")
print(json.dumps({"rate": n / max(cpu, 1e-9), "images": n}))
"""

JOBS = ("tiny", "rrc")


@harness.case(
    data="bench_against's 8x8 JPEG table and LFW-shaped folder photos, packed",
    measures="what loader.stats()'s counters cost: CPU per image of whole and RRC epochs",
    small={"rows": 300, "per_class": 4, "tiny_batch": 16, "rrc_batch": 4},
)
class StatsOverhead(harness.Bench):
    rounds: int = 9
    against: Path | None = harness.arg(None, "another checkout, side by side")
    work: Path | None = harness.arg(None, "data (default: bench_against's)")
    rows: int = harness.arg(8000, "the table's rows (tiny)")
    per_class: int = harness.arg(100, "photos per class, x4 (rrc)")
    tiny_batch: int = 256
    rrc_batch: int = 64
    jobs: str = ",".join(JOBS)


def main(a: StatsOverhead) -> None:
    checkouts = harness.checkouts(a)
    os.environ["OMP_NUM_THREADS"] = "1"  # the children's torch: one thread, as the fill loop
    work = a.work or data.root() / "against"  # bench_against.py's data, shared with it
    table = data.packed(
        data.table(work / "table", a.rows, classes=100), work / f"table-{a.rows}-pack"
    )
    inet = data.packed(data.imagenet(work / "inet", 4, a.per_class), work / "inet-pack")
    jobs = {
        "tiny": (table, "tiny", a.tiny_batch, 1),
        "rrc": (inet, "rrc", a.rrc_batch, 2),
    }
    names = a.jobs.split(",")
    sides = {
        f"{j}/{c}": (lambda r, j=j, c=c: harness.in_child(checkouts[c], _CHILD, *jobs[j]))
        for j in names
        for c in checkouts
    }
    rounds = harness.interleave(sides, a.rounds, order="reverse")
    summary = {
        j: {
            "measure": "images per CPU-second",
            **harness.side_by_side(rounds, f"{j}/this", f"{j}/against"),
        }
        for j in names
    }
    print(f"load average per round: {rounds.load_text()}")
    print(f"{'job':5s} {'this':>10s} {'against':>10s} {'ratio':>7s}  per round (>1: this cheaper)")
    for j, s in summary.items():
        print(f"{j:5s} {s['this']:10.0f} {s['against']:10.0f} {s['ratio']:7.3f}  {s['ratios']}")
    result = {"against": str(checkouts["against"]), "rows": a.rows, "jobs": summary}
    out = a.json or harness.ROOT / "bench-out" / "bench_stats_overhead.json"
    harness.write_result(out, "bench_stats_overhead", a, result, rounds)


if __name__ == "__main__":
    harness.script(__file__)
