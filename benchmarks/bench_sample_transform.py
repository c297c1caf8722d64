#!/usr/bin/env python3
"""What a ``sample_transform`` batch costs in CPU per image: this checkout against another.

Small noisy JPEGs (``data.noisy``: ``--count`` of 160x120, made once) packed into tar shards;
one epoch of ``ShardLoader(ShardDataset(decode=Decode(crop=RandomResizedCrop(112)),
sample_transform=...), --batch, num_workers=--workers)`` per checkout and round, each in a fresh
child process (``harness.in_child``), so its CPU is the child's own and its reaped workers'
(``os.times``: user + system, from the loader's construction to its close), per image delivered.
The transform passes the image and label on: what is measured is how the batch reaches the
caller (this checkout: stacked columns through the ring's slots; an older one: pickled through
the pipe). Rounds interleave the checkouts (which goes first flips every round), with each
round's load average; the ratio is the median of per-round ratios this / against (below 1: this
one is cheaper), for the whole CPU and for the training process's own.

    git worktree add /tmp/base 16caec4 && cp shardkit/images/_native*.so /tmp/base/shardkit/images/
    python benchmarks/bench_sample_transform.py --against /tmp/base --rounds 5
"""

from __future__ import annotations

from pathlib import Path

import data
import harness

_EPOCH = """
import json, os, sys, warnings
warnings.simplefilter("ignore")
from shardkit import Decode, RandomResizedCrop, ShardDataset, ShardLoader

def passed_on(s):
    return {"image": s["image"], "label": s["label"]}

crop = Decode(crop=RandomResizedCrop(112))
ds = ShardDataset(sys.argv[1], decode=crop, sample_transform=passed_on)
loader = ShardLoader(ds, int(sys.argv[3]), num_workers=int(sys.argv[2]))
t0 = os.times()
n = sum(len(b["label"]) for b in loader)
loader.close()
t1 = os.times()
own = (t1.user - t0.user) + (t1.system - t0.system)
children = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
print(json.dumps({"n": n, "own_us": 1e6 * own / n, "cpu_us": 1e6 * (own + children) / n}))
"""


def epoch(checkout: Path, source: str, workers: int, batch: int) -> dict:
    """One epoch through ``checkout``'s ShardLoader in a child: CPU us per image, the whole
    (``cpu_us``: the child and its workers) and the training process's own (``own_us``)."""
    return harness.in_child(checkout, _EPOCH, source, workers, batch)


@harness.case(
    data="--count noisy 160x120 photos, packed",
    measures="CPU per image of a sample_transform= epoch through ShardLoader, against DIR",
    small={"count": 32, "batch": 8},
)
class SampleTransform(harness.Bench):
    rounds: int = 5
    against: Path | None = harness.arg(None, "another checkout, side by side")
    data: Path | None = harness.arg(None, "the photos (default: data root)")
    count: int = harness.arg(2048, "photos, 160x120")
    workers: int = 2
    batch: int = 64


def main(args: SampleTransform) -> None:
    checkouts = harness.checkouts(args)
    source = str(data.packed(data.noisy(args.data, args.count)))
    sides = {
        name: (lambda r, c=c: epoch(c, source, args.workers, args.batch))
        for name, c in checkouts.items()
    }
    rounds = harness.interleave(sides, args.rounds, order="reverse")
    for r, load in enumerate(rounds.loads):
        this, other = rounds.results["this"][r], rounds.results["against"][r]
        print(
            f"round {r + 1}: CPU us/image this {this['cpu_us']:.0f} (trainer {this['own_us']:.0f})"
            f", against {other['cpu_us']:.0f} (trainer {other['own_us']:.0f}), load {load.text()}"
        )
    result = {
        "against": str(checkouts["against"]),
        "images": rounds.results["this"][0]["n"],
        "cpu_us": {k: rounds.median(k, "cpu_us") for k in checkouts},
        "own_us": {k: rounds.median(k, "own_us") for k in checkouts},
        "ratio": rounds.ratio("this", "against", "cpu_us"),
        "own_ratio": rounds.ratio("this", "against", "own_us"),
        "ratios": [round(x, 3) for x in rounds.ratios("this", "against", "cpu_us")],
    }
    print(
        f"CPU per image, this / against: {result['ratio']:.2f} "
        f"(the training process's own: {result['own_ratio']:.2f}), per round {result['ratios']}"
    )
    out = args.json or harness.ROOT / "bench-out" / "bench_sample_transform.json"
    harness.write_result(out, "bench_sample_transform", args, result, rounds)


if __name__ == "__main__":
    harness.script(__file__)
