#!/usr/bin/env python3
"""How long must one ``shardkit bench`` run be timed? Spread of samples/s against run length.

For each timed length (``min_seconds = max_seconds = L``, no sample minimum) the same
configurations run ``--repeats`` times, interleaved (repeat-major, every length and
configuration once per repeat) on the default LFW-shaped set, decode mode, cold cache. Printed
per (format, workers, L): mean samples/s, the coefficient of variation between repeats, timed
samples and the run's whole wall time (its overhead is wall - L). The knee is the length past
which the CV stops falling; ``bench/config.py``'s MIN_SECONDS/MAX_SECONDS cite this script.
Run it on a quiet machine: at a load above the cores, load noise swamps the run length.

    python benchmarks/bench_run_length.py --data data/lfw --lengths 0.25,0.5,1,1.5,2,3 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from shardkit.bench.config import BenchConfig  # noqa: E402
from shardkit.bench.pagecache import evict_until_cold  # noqa: E402
from shardkit.bench.runner import prepare, run_prepared  # noqa: E402
from shardkit.bench.sources import plan_sources  # noqa: E402

CONFIGS = [("tar", 2), ("folder", 2), ("tar", 8), ("tar", 0)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="data/lfw")
    ap.add_argument("--lengths", default="0.25,0.5,1,1.5,2,3")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lengths = [float(x) for x in args.lengths.split(",")]
    base = BenchConfig(
        data=args.data, formats=("folder", "tar"), workers=(0, 2, 8), mode="decode"
    ).resolved()
    sources, _ = plan_sources(base)
    prep = prepare(base, sources)
    runs: dict[str, list[tuple[float, int, float]]] = {}
    load0, t0 = os.getloadavg(), time.time()
    run_prepared(replace(base, batches=5, max_seconds=0.2, min_seconds=0.0), prep, "tar", 0, -1)
    for r in range(args.repeats):
        for length in lengths:
            cfg = replace(base, min_samples=0, min_seconds=length, max_seconds=length)
            for fmt, w in CONFIGS:
                evict_until_cold(prep.paths[fmt])
                res, _ = run_prepared(cfg, prep, fmt, w, r)
                runs.setdefault(f"{fmt}:{w}:{length:g}", []).append(
                    (res.samples_per_s, res.timed_samples, res.wall_s)
                )
        print(f"repeat {r + 1}/{args.repeats} done, load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"load before {load0}, after {os.getloadavg()}, {time.time() - t0:.0f} s")
    print("format:workers:L   mean samples/s   CV   timed samples   wall s")
    for key, values in runs.items():
        rates = np.array([v[0] for v in values])
        cv = rates.std(ddof=1) / rates.mean()
        samples = np.mean([v[1] for v in values])
        wall = np.mean([v[2] for v in values])
        print(f"{key:18s} {rates.mean():14.0f} {cv:5.2f} {samples:15.0f} {wall:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_before": load0, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
