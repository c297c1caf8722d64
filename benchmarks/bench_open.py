#!/usr/bin/env python3
"""What opening a many-shard dataset costs each process: CPU seconds and memory.

``data.many_shards`` hard-links one real tar shard ``--shards`` times under a manifest; each
contender opens it (``ShardDataset(DIR, decode="raw")`` and ``len()``) in a fresh child process:
``current`` (the pack as this checkout writes it), ``json-offsets`` (the same shards under a
manifest listing JSON offsets, as packs were once written) and, with ``--against DIR``, that
checkout opening both. Median CPU seconds and MB over interleaved rounds, and the median of
per-round ratios to ``current``; figures in docs/benchmarks.md ("Open at 40,000 shards").

    python benchmarks/bench_open.py --shards 40000 --samples 10000 --against /tmp/old
"""

from __future__ import annotations

import os
from pathlib import Path

import data
import harness

_CHILD = r"""
import json, resource, sys, warnings
warnings.simplefilter("ignore")
from shardkit import ShardDataset
base, c0 = status_mb("VmHWM"), cpu()
ds = ShardDataset(sys.argv[1], decode="raw")
n = len(ds)
print(json.dumps({"cpu_s": cpu() - c0, "mb": status_mb("VmHWM") - base, "len": n}))
"""


@harness.case(
    data="--shards shards of --samples each, packed and under a manifest with JSON offsets",
    measures="opening a many-shard dataset in a fresh process: CPU seconds and peak memory",
    small={"shards": 20, "samples": 200},
    aliases={"work": ["out"], "rounds": ["repeats"]},
)
class Open(harness.Bench):
    rounds: int = 3
    against: Path | None = harness.arg(None, "another checkout, side by side")
    shards: int = 40000
    samples: int = harness.arg(10000, "samples per shard")
    work: Path | None = harness.arg(None, "data (default: <data root>/open)")


def main(a: Open) -> None:
    packed, legacy = data.many_shards(a.shards, a.samples, a.work)
    cases = {"current": (packed, harness.ROOT), "json-offsets": (legacy, harness.ROOT)}
    if a.against is not None:
        cases["against: current"] = (packed, a.against.resolve())
        cases["against: json-offsets"] = (legacy, a.against.resolve())
    sizes = {name: os.path.getsize(where / "manifest.json") for name, (where, _) in cases.items()}
    for name, size in sizes.items():
        print(f"{name}: manifest.json {size / 1e6:.1f} MB")
    contenders = {
        name: (lambda r, w=where, c=checkout: harness.in_child(c, _CHILD, w))
        for name, (where, checkout) in cases.items()
    }
    rounds = harness.interleave(contenders, a.rounds)
    want = a.shards * a.samples
    for name in cases:
        got = {x["len"] for x in rounds.results[name]}
        if got != {want}:
            raise SystemExit(f"{name}: len() gave {sorted(got)}, not {want}")
    summary = {}
    for name in cases:
        summary[name] = {
            "manifest_bytes": sizes[name],
            "cpu_s": rounds.median(name, "cpu_s"),
            "mb": rounds.median(name, "mb"),
            "cpu_ratio": rounds.ratio(name, "current", "cpu_s"),
            "mb_ratio": rounds.ratio(name, "current", "mb"),
            "cpu_ratios": [round(x, 3) for x in rounds.ratios(name, "current", "cpu_s")],
        }
    print(f"load average per round: {rounds.load_text()}")
    print(f"open at {a.shards} shards x {a.samples} samples (median of {a.rounds} rounds)")
    print(f"  {'':24s} {'CPU':>8s}  {'memory':>9s}  {'/ current (CPU, memory)':s}")
    for name, s in summary.items():
        print(
            f"  {name:24s} {s['cpu_s']:6.3f} s  +{s['mb']:6.1f} MB"
            f"  {s['cpu_ratio']:5.2f}x {s['mb_ratio']:5.2f}x  per round {s['cpu_ratios']}"
        )
    result = {
        "shards": a.shards,
        "samples": a.samples,
        "against": str(a.against.resolve()) if a.against is not None else None,
        "cases": summary,
    }
    out = a.json or harness.ROOT / "bench-out" / "bench_open.json"
    harness.write_result(out, "bench_open", a, result, rounds)


if __name__ == "__main__":
    harness.script(__file__)
