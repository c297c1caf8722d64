#!/usr/bin/env python3
"""What opening a many-shard dataset costs each process: CPU seconds and memory.

Every DataLoader worker (and every rank) parses the manifest and builds the shard list, so this
is paid per process. ``data.many_shards`` makes one real tar shard of ``--samples`` tiny samples
(with its ``.idx``) and hard-links it ``--shards`` times under a manifest listing every link (no
disk beyond one shard); each contender then opens it in a fresh child process
(``harness.in_child``) and measures ``ShardDataset(DIR, decode="raw")`` and ``len()``: CPU
seconds (user + system, so load does not move them) and peak memory over the imports.
Contenders, interleaved round by round (each goes first in turn, each round's load recorded):

- ``current``: the pack as this checkout writes it;
- ``json-offsets``: the same shards under a manifest that also lists each shard's sparse byte
  offsets as JSON ints (``index_every``/``index``): how packs were written before the offsets
  were read from each shard's ``.idx``; this checkout still reads it;
- with ``--against DIR`` (another checkout, e.g. ``git worktree add /tmp/old 16caec4``): that
  checkout opening ``current`` (where it reads that pack) and ``json-offsets``, its own format.

Reported per contender: the median CPU seconds and MB over rounds, and the median of per-round
ratios contender / ``current`` (above 1: ``current`` opens cheaper).

    python benchmarks/bench_open.py --shards 40000 --samples 10000 --against /tmp/old
    python benchmarks/bench_open.py --shards 40000 --samples 128 --against /tmp/old

10,000 samples a shard at 40,000 shards is LAION-400M's shape (157 offsets a shard, 6.3M in all);
128 a shard (2 offsets, a 12 MB manifest) is the shape of the scale trial's 40,000-shard set.

Measured 2026-11-29 on the shared 2-core VM (load 7-9, so CPU seconds run high; the ratios are
the figures), against the tree before the offsets left the manifest (best of 3 per case, before
this script ran on the harness):

| shape | before (JSON offsets) | now | older pack, read now |
|---|---|---|---|
| 40,000 x 10,000 (96 MB -> 10 MB) | 1.62 s CPU, +453 MB | 0.54 s, +54 MB | 1.58 s, +453 MB |
| 40,000 x 128 (12.2 MB -> 9.8 MB) | 0.54 s, +53 MB | 0.49 s, +52 MB | 0.57 s, +53 MB |

On the harness, the same VM and day (load 8.3-8.6, 3 rounds, 40,000 x 10,000; ratios are
medians of per-round ratios to ``current``): ``current`` 0.50-0.54 s, +54 MB; ``json-offsets``
read now 2.97-3.19x the CPU, 8.4x the memory; ``--against`` 16caec4 opening ``json-offsets``
6.45x (3.43 s), ``--against`` 378a9b7 (where the offsets change began) 7.09x (3.56 s), 8.4x the
memory both. Those two trees pay more than the table's "before" column: they also predate the
manifest check column by column that came with the offsets change, so their ratio is not the
JSON offsets' alone.

What was left was O(shards) objects: one ``ShardEntry`` and one ``ShardInfo`` per shard, one
``stat`` per local shard, the URLs split again for the resume fingerprint. The shard list is now
a ``ShardTable`` of columns (docs/benchmarks.md, "Scale": 0.55 -> 0.24 s CPU, 53 -> 41 MB at
40,000 x 10,000, and the same at 40,000 x 128); what is left is the JSON parse and the columns'
checks, in C loops.
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
