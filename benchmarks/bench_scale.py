#!/usr/bin/env python3
"""What subsets, splits, random access, ``ls`` and ``show`` cost at ImageNet's sample count.

Makes N samples (one tiny 64x64 JPEG's bytes under N keys in 1,000 classes, written with
``ShardWriter``: fast), then measures each figure in a fresh child process, with the sample
indexes (``*.tar.idx``) and on the same shards without them (hard links, the indexes left out:
an older pack), interleaved. ``--format lmdb``: LMDB shards with their index record, and a copy
whose shards have it deleted (through the ``lmdb`` package: an older pack's reads):

- ``subset=0.01`` epoch: bytes read (``rchar``) against the drawn samples' own bytes;
- ``split="val"`` construction: seconds and peak memory;
- ``ShardView`` open: seconds and peak memory;
- ``shardkit ls`` first line and ``shardkit show KEY``: seconds after imports, peak memory;
- a full epoch (``decode="raw"``): samples/s, both sides (nothing else slower).

    python benchmarks/bench_scale.py --n 128000 --out /tmp/scale
    python benchmarks/bench_scale.py --n 1280000 --out /tmp/scale --json bench-out/scale.json
    python benchmarks/bench_scale.py --n 200000 --format lmdb --what split view ls show
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import data
import harness

CHILD = r"""
import json, os, resource, sys, time, warnings
warnings.simplefilter("ignore")
import numpy as np
from shardkit import ShardDataset, ShardView
from shardkit.stream.show import list_lines, show_lines
what, where, key = sys.argv[1], sys.argv[2], sys.argv[3]
def rchar():
    with open("/proc/self/io") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("rchar"))
r0, t0 = rchar(), time.perf_counter()
out = {"base_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # after imports
if what == "subset":
    ds = ShardDataset(where, decode="raw", subset=0.01, with_keys=True)
    out["construct_s"] = time.perf_counter() - t0
    n = sum(len(s[0]) for s in ds)
    out["drawn"], out["image_bytes"] = len(ds), n
elif what == "split":
    ds = ShardDataset(where, decode="raw", split="val", val_fraction=0.1)
    out["len"] = len(ds)
elif what == "view":
    view = ShardView(where, decode="raw")
    out["len"] = len(view)
elif what == "ls":
    view = ShardView(where, decode="raw")
    out["line"] = next(iter(list_lines(view, 1)))
elif what == "show":
    view = ShardView(where, decode="raw")
    out["lines"] = len(list(show_lines(view, key)))
elif what == "epoch":
    ds = ShardDataset(where, decode="raw")
    out["samples"] = sum(1 for _ in ds)
out["seconds"] = time.perf_counter() - t0
out["rchar"] = rchar() - r0
out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def make(out: Path, n: int, fmt: str = "tar") -> tuple[str, str]:
    """N samples packed with indexes, and the same shards without them (``data.scale_set``)."""
    packed, bare = data.scale_set(n, out, fmt)
    return str(packed), str(bare)


def child(what: str, where: str, key: str = "") -> dict:
    return harness.in_child(harness.ROOT, CHILD, what, where, key)


def main() -> None:
    ap = harness.parser(__doc__, rounds=1, against=False)
    ap.add_argument("--n", type=int, nargs="+", default=[128_000])
    ap.add_argument("--out", type=Path, default=None, help="data (default: the data root)")
    ap.add_argument("--skip-epoch", action="store_true", help="Leave out the full epoch.")
    ap.add_argument("--format", choices=["tar", "lmdb"], default="tar")
    ap.add_argument("--what", nargs="+", default=None, help="Only these figures (split, view...).")
    args = harness.parse(ap, smoke={"n": [500]})
    args.out = args.out or data.root() / "scale"
    results = []
    for n in args.n:
        t0 = time.perf_counter()
        packed, bare = make(args.out, n, args.format)
        made = time.perf_counter() - t0
        tars = [f for f in os.listdir(packed) if f.endswith(f".{args.format}")]
        total = sum(os.path.getsize(os.path.join(packed, f)) for f in tars)
        from shardkit import ShardView

        key = ShardView(packed, decode="raw").key(n // 2)  # a sample halfway
        row = {"n": n, "dataset_bytes": total, "make_s": made}
        row["load_before"] = harness.load_now().as_dict()
        row["format"] = args.format
        whats = ["subset", "split", "view", "ls", "show"] + ([] if args.skip_epoch else ["epoch"])
        whats = [w for w in whats if args.what is None or w in args.what]
        sides = {
            f"{what}/{side}": (lambda r, what=what, where=where, key=key: child(what, where, key))
            for what in whats
            for side, where in (("index", packed), ("no_index", bare))
        }
        rounds = harness.interleave(sides, args.rounds, order="reverse", quiet=True)
        for k, runs in rounds.results.items():  # the median run by seconds; all in "runs"
            row[k] = sorted(runs, key=lambda x: x["seconds"])[len(runs) // 2]
        row["runs"] = rounds.results
        row["loads"] = [x.as_dict() for x in rounds.loads]
        row["load_after"] = harness.load_now().as_dict()
        results.append(row)
        _print(row)
    harness.write_result(args.json, "bench_scale", args, {"rows": results})


def _print(row: dict) -> None:
    n = row["n"]
    print(
        f"\nN = {n:,} samples, {row['dataset_bytes'] / 1e9:.2f} GB of {row.get('format', 'tar')} "
        f"(made in {row['make_s']:.0f} s); load {row['load_before']['load_1m']} -> "
        f"{row['load_after']['load_1m']}"
    )
    base = next(r["base_mb"] for k, r in row.items() if k.endswith("/index"))
    print(f"memory: peak above the {base:.0f} MB a process holds after importing shardkit+torch")
    print(f"{'figure':34s} {'with index':>30s} {'without':>30s}")
    for what, label in (
        ("subset", "subset=0.01 epoch: read / drawn"),
        ("split", 'split="val" construction'),
        ("view", "ShardView open"),
        ("ls", "ls first line"),
        ("show", "show KEY"),
        ("epoch", "full epoch (raw)"),
    ):
        if f"{what}/index" not in row:
            continue
        cells = []
        for side in ("index", "no_index"):
            r = row[f"{what}/{side}"]
            more = r["peak_mb"] - r["base_mb"]
            if what == "subset":
                drawn = r["drawn"] * _sample_bytes(row)
                cells.append(f"{r['rchar'] / 1e6:.1f} MB ({r['rchar'] / drawn:.2f}x)")
            elif what == "epoch":
                cells.append(f"{r['samples'] / r['seconds']:,.0f}/s +{more:.0f} MB")
            else:
                cells.append(f"{r['seconds']:.2f} s +{more:.0f} MB, {r['rchar'] / 1e6:.1f} MB read")
        print(f"{label:34s} {cells[0]:>30s} {cells[1]:>30s}")


def _sample_bytes(row: dict) -> float:
    """Bytes of one sample in its shard (all samples are alike here: one JPEG, one label)."""
    return row["dataset_bytes"] / row["n"]


if __name__ == "__main__":
    main()
