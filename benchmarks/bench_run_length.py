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

import time
from dataclasses import replace
from pathlib import Path

import data
import harness
import numpy as np

from shardkit.bench.config import BenchConfig
from shardkit.bench.pagecache import evict_until_cold
from shardkit.bench.runner import prepare, run_prepared
from shardkit.bench.sources import packed_skips, plan_sources

CONFIGS = [("tar", 2), ("folder", 2), ("tar", 8), ("tar", 0)]


@harness.case(
    data="the LFW-shaped tree (--data), packed to tar; cold page cache every run",
    measures="samples/s and its spread (CV) against how long a shardkit bench run is timed",
    small={"data": str(data.root() / "lfw-smoke"), "lengths": "0.1"},
    aliases={"rounds": ["repeats"]},
)
class RunLength(harness.Bench):
    rounds: int = 5
    data: str = "data/lfw"
    lengths: str = "0.25,0.5,1,1.5,2,3"


def main(args: RunLength) -> None:
    if args.smoke:
        data.lfw(Path(args.data), 0.01)
    lengths = [float(x) for x in args.lengths.split(",")]
    base = BenchConfig(
        data=args.data,
        formats=("folder", "tar"),
        workers=(0, 2, 8),
        mode="decode",
        batch_size=4 if args.smoke else 64,
    ).resolved()
    sources, folder = plan_sources(base)
    prep = prepare(base, sources, packed_skips(sources, folder))
    t0 = time.time()
    run_prepared(replace(base, batches=5, max_seconds=0.2, min_seconds=0.0), prep, "tar", 0, -1)

    def side(length: float, fmt: str, w: int):
        cfg = replace(base, min_samples=0, min_seconds=length, max_seconds=length)

        def run(r: int) -> dict:
            evict_until_cold(prep.paths[fmt])
            res, _ = run_prepared(cfg, prep, fmt, w, r)
            return {"rate": res.samples_per_s, "samples": res.timed_samples, "wall": res.wall_s}

        return run

    sides = {
        f"{fmt}:{w}:{length:g}": side(length, fmt, w) for length in lengths for fmt, w in CONFIGS
    }
    rounds = harness.interleave(sides, args.rounds, order="fixed")
    print(f"load per round {rounds.load_text()}, {time.time() - t0:.0f} s")
    rows = {}
    for key in sides:  # format:workers:L
        rates = np.array(rounds.values(key))
        cv = rates.std(ddof=1) / rates.mean() if len(rates) > 1 else float("nan")
        rows[key] = {"samples/s": rates.mean(), "CV": cv, "timed samples": np.mean(rounds.values(
            key, "samples")), "wall s": np.mean(rounds.values(key, "wall"))}  # fmt: skip
    harness.table(rows, ["samples/s:.0f", "CV:.2f", "timed samples:.0f", "wall s:.2f"])
    harness.write_result(args.json, "bench_run_length", args, {}, rounds)


if __name__ == "__main__":
    harness.script(__file__)
