"""Time to the first batch after resuming mid-epoch vs at the start of a fresh epoch.

Resuming recomputes the position from sample indices and seeks (shardkit.stream.resume), so it
should cost about what starting an epoch costs, wherever in the epoch it resumes. Both are measured
side by side, interleaved, through a real DataLoader with worker processes (their start-up counted
in both), on shards in page cache. For scale, one run also times what a loader without resume
support does: iterate and discard the consumed batches (torchdata's "naive fast-forward").

    shardkit synth lfw /tmp/lfw && shardkit pack /tmp/lfw /tmp/lfw-tar --shard-size 16MB
    python benchmarks/bench_resume.py /tmp/lfw-tar --at 0.9
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import data
import harness
from torch.utils.data import DataLoader

from shardkit import ShardDataset
from shardkit.bench.pagecache import prime


def first_batch(ds: ShardDataset, args) -> float:
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    return harness.epoch(loader, limit=1)["first_s"]


def make(args) -> ShardDataset:
    return ShardDataset(args.shards, decode="tensor", seed=0, batch_size=args.batch_size)


@harness.case(
    data="a shard directory (default under --small: a packed tiny LFW-shaped set)",
    measures="the first batch after resuming mid-epoch against a fresh epoch's",
    small={"batch_size": 8},
    aliases={"rounds": ["repeats"]},
)
class Resume(harness.Bench):
    rounds: int = 7
    shards: str | None = harness.arg(None, "shard directory (e.g. packed LFW)", positional=True)
    at: float = harness.arg(0.9, "resume point, fraction of the epoch")
    batch_size: int = 64
    workers: int = 2
    epoch: int = 3
    no_naive: bool = harness.arg(False, "skip the fast-forward reference")


def main(args: Resume) -> None:
    if args.smoke and args.shards is None:
        lfw = data.lfw(data.root() / "lfw-smoke", 0.01)
        args = replace(args, shards=str(data.packed(lfw, shard_size="16MB")))
    if args.shards is None:
        raise SystemExit("the shard directory is required (e.g. packed LFW)")
    prime([args.shards])  # page cache: measure the loader, not the disk
    probe = make(args)
    batches = -(-len(probe) // args.batch_size)
    k = int(batches * args.at)
    probe.set_epoch(args.epoch)
    state = probe.state_dict(batches=k, num_workers=args.workers)
    load_before = harness.loadavg()

    def fresh_epoch(r: int) -> float:
        ds = make(args)
        ds.set_epoch(args.epoch)
        return first_batch(ds, args)

    def resumed_epoch(r: int) -> float:
        ds = make(args)
        ds.load_state_dict(state)
        return first_batch(ds, args)

    sides = {"fresh": fresh_epoch, "resumed": resumed_epoch}
    rounds = harness.interleave(sides, args.rounds, order="fixed", quiet=True)
    fresh, resumed = rounds.values("fresh"), rounds.values("resumed")
    naive = None
    if not args.no_naive:
        ds = make(args)
        ds.set_epoch(args.epoch)
        loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
        t0 = time.perf_counter()
        it = iter(loader)
        for _ in range(k + 1):
            next(it)
        naive = time.perf_counter() - t0
        del it
    load_after = harness.loadavg()
    f_med, r_med = statistics.median(fresh), statistics.median(resumed)
    print(f"{probe!r}")
    print(
        f"resume after {k} of {batches} batches ({args.at:.0%}), batch {args.batch_size}, "
        f"{args.workers} workers, {args.rounds} interleaved repeats"
    )
    rows = {name: {"median ms": 1000 * statistics.median(v), "x fresh": statistics.median(v)
                   / f_med, "rounds ms": [round(1000 * x) for x in v]}
            for name, v in (("fresh", fresh), ("resumed", resumed), ("fast-forward", [naive]))
            if v != [None]}  # fmt: skip
    harness.table(rows, ["median ms:,.1f", "x fresh:.2f", "rounds ms"], "first batch")
    text = f"{harness.load_text(load_before)}, after {harness.load_text(load_after)}"
    print(f"load average before {text}")
    result = {"fresh_s": f_med, "resumed_s": r_med, "ratio": r_med / f_med, "naive_s": naive}
    harness.write_result(args.json, "bench_resume", args, result, rounds)


if __name__ == "__main__":
    harness.script(__file__)
