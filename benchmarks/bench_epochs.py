#!/usr/bin/env python3
"""Short epochs against long ones: what epoch boundaries cost ShardLoader (LFW-shaped full
decode), with its workers filling the next epoch ahead (the default) and without, many epochs
back to back, a fresh loader per side and round, interleaved: images/s boundaries included, the
mean wait for an epoch's first batch, and short / long per mode (goal >= 0.95 with filling
ahead on 2 cores). Figures: docs/loader.md.

    python benchmarks/bench_epochs.py --lfw /tmp/bl/lfw --rounds 5
"""

from __future__ import annotations

import glob
import os
import statistics
from pathlib import Path

import data
import harness

from shardkit import ShardDataset, ShardLoader

ROOT = harness.ROOT


def subset_tree(src: Path, images: int) -> Path:
    """The first ``images`` files of ``src`` (sorted) hard-linked into a tree beside it."""
    out = src.with_name(f"{src.name}-first{images}")
    if not out.exists():
        files = sorted(glob.glob(str(src / "*" / "*")))
        if len(files) < images:
            raise SystemExit(f"{src} holds {len(files)} images, fewer than {images}")
        tmp = out.with_name(out.name + ".tmp")
        for f in files[:images]:
            dest = tmp / Path(f).parent.name / Path(f).name
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.link(f, dest)
        tmp.rename(out)
    return out


def run_side(shards: Path, batch: int, workers: int, epochs: int, overlap: bool) -> dict:
    """``epochs`` epochs back to back after an untimed first one: images/s and first waits."""
    ds = ShardDataset(str(shards), decode="tensor")
    loader = ShardLoader(ds, batch, num_workers=workers)
    loader.overlap_epochs = overlap
    loader.set_epoch(0)
    for _ in loader:  # starts the workers
        pass
    runs = []
    for epoch in range(1, epochs + 1):
        loader.set_epoch(epoch)
        runs.append(harness.epoch(loader))
    loader.close()
    n, seconds = sum(e["images"] for e in runs), sum(e["wall_s"] for e in runs)
    waits = [e["first_s"] for e in runs]
    return {
        "images_per_s": n / seconds,
        "first_batch_wait_ms": 1000 * statistics.mean(waits),
        "epochs": epochs,
        "images": n,
    }


@harness.case(
    data="the first short x batch and long x batch images of the --lfw tree, packed",
    measures="short epochs against long ones, with and without the workers' epoch overlap",
    small={
        "lfw": data.root() / "lfw-smoke",
        "lfw_scale": 0.01,
        "batch": 8,
        "long": 4,
        "short": 2,
        "long_epochs": 1,
    },  # fmt: skip
)
class Epochs(harness.Bench):
    rounds: int = 5
    json: Path | None = ROOT / "bench-out" / "bench_epochs.json"
    lfw: Path = ROOT / "data" / "lfw"
    lfw_scale: float = 1.0
    batch: int = 256
    workers: int = 2
    short: int = harness.arg(6, "batches per short epoch")
    long: int = harness.arg(48, "batches per long epoch")
    long_epochs: int = harness.arg(2, "timed long epochs per round")


def main(args: Epochs) -> None:
    lfw = data.lfw(args.lfw, args.lfw_scale)
    lengths = {"short": args.short, "long": args.long}
    shards = {
        name: data.packed(subset_tree(lfw, batches * args.batch), shard_size="16MB")
        for name, batches in lengths.items()
    }
    total = args.long * args.long_epochs  # batches per side and round
    epochs = {name: max(1, round(total / batches)) for name, batches in lengths.items()}
    label = {True: "overlap", False: "no overlap"}
    sides = {
        f"{name} {label[overlap]}": (
            lambda r, name=name, overlap=overlap: run_side(
                shards[name], args.batch, args.workers, epochs[name], overlap
            )
        )
        for overlap in (True, False)
        for name in lengths
    }
    print(
        f"{args.workers} workers, batch {args.batch}: short epochs of {args.short} batches "
        f"(x{epochs['short']}), long of {args.long} (x{epochs['long']}), {args.rounds} rounds; "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    rounds = harness.interleave(sides, args.rounds, order="reverse")
    summary = {}
    for key in sides:
        summary[key] = {
            "images_per_s": rounds.median(key, "images_per_s"),
            "first_batch_wait_ms": rounds.median(key, "first_batch_wait_ms"),
        }
        print(
            f"{key:>18}: {summary[key]['images_per_s']:7.0f} img/s, first batch of an epoch "
            f"after {summary[key]['first_batch_wait_ms']:.0f} ms"
        )
    for mode in ("overlap", "no overlap"):
        ratio = rounds.ratio(f"short {mode}", f"long {mode}", "images_per_s")
        summary[f"short/long {mode}"] = ratio
        print(f"short / long, {mode}: {ratio:.3f} (median of per-round ratios)")
    harness.write_result(args.json, "bench_epochs", args, summary, rounds)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    harness.script(__file__)
