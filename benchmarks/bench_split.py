#!/usr/bin/env python3
"""What a split or subset epoch costs per sample against a full epoch, in CPU seconds and reads.

Makes N samples (``bench_scale.make``: one tiny JPEG's bytes under N keys, 5 MB shards, with
their sample indexes) and runs, each in a fresh child process, two epochs (``decode="raw"``,
seed 3) of: the whole dataset, ``split="val"`` and ``split="train"`` (``val_fraction=0.1``) and
``subset=0.01``; the second epoch is reported (the first also loads the indexes). Figures are
CPU seconds (user + system) per delivered sample, so load on the machine does not move them
much, and ``os.pread`` calls per delivered sample (how both formats read local shards).
``--against DIR``: the same runs on another checkout's ``shardkit`` (e.g. a worktree of main),
interleaved.

    python benchmarks/bench_split.py --n 128000 640000 --out /tmp/scale
    python benchmarks/bench_split.py --n 640000 --format lmdb --what subset val
    python benchmarks/bench_split.py --n 128000 --against /tmp/main-checkout
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

CHILD = r"""
import json, os, resource, sys, warnings
root, where, what = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, root)
warnings.simplefilter("ignore")
from shardkit import ShardDataset
calls = [0]
real = os.pread
def counting(fd, n, off):
    calls[0] += 1
    return real(fd, n, off)
os.pread = counting
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
kw = {"full": {}, "val": {"split": "val", "val_fraction": 0.1},
      "train": {"split": "train", "val_fraction": 0.1}, "subset": {"subset": 0.01}}[what]
ds = ShardDataset(where, decode="raw", seed=3, **kw)
for epoch in (1, 2):
    ds.set_epoch(epoch)
    calls[0] = 0
    c0 = cpu()
    n = sum(1 for _ in ds)
    c1 = cpu()
print(json.dumps({"n": n, "us": 1e6 * (c1 - c0) / n, "reads": calls[0] / n}))
"""


def run(root: str, where: str, what: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, root, where, what], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from bench_scale import make

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[128000])
    ap.add_argument("--out", default="/tmp/scale")
    ap.add_argument("--format", default="tar", choices=["tar", "lmdb"])
    ap.add_argument("--what", nargs="+", default=["full", "val", "train", "subset"])
    ap.add_argument("--against", help="another checkout whose shardkit to measure beside")
    args = ap.parse_args()
    roots = [("this", str(ROOT))] + ([("that", args.against)] if args.against else [])
    for n in args.n:
        where, _ = make(Path(args.out), n, args.format)
        full = {}
        for what in ["full"] + [w for w in args.what if w != "full"]:
            for name, root in roots:
                got = run(root, where, what)
                if what == "full":
                    full[name] = got["us"]
                ratio = got["us"] / full[name] if full.get(name) else float("nan")
                print(
                    f"N={n:>9,} {args.format} {what:6s} {name}: {got['n']:>9,} samples, "
                    f"{got['us']:6.2f} us CPU/sample ({ratio:4.2f}x full), "
                    f"{got['reads']:6.2f} preads/sample",
                    flush=True,
                )
        os.sync()


if __name__ == "__main__":
    main()
