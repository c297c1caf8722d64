#!/usr/bin/env python3
"""What choosing what to read costs: (a) a 2-source mixture through ShardLoader against one
source of the same bytes (goal: <= 5% images/s); (b) ``DataLoader(ShardView(tar))`` against
``DataLoader(FolderDataset)`` on the same seeded random order, warm and cold page cache (goal:
the view >= the folder warm). Interleaved rounds, medians, per-round ratios.

    python benchmarks/bench_mix.py --lfw data/lfw --repeats 5
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Literal

import data as makers
import harness

ROOT = harness.ROOT


def _data(lfw: Path, scale: float) -> dict[str, str]:
    """The tree (made with shardkit synth when missing), its two halves by class, and packs."""
    lfw = makers.lfw(lfw, scale)
    base = lfw.parent / f"{lfw.name}-mix"
    classes = sorted(p.name for p in lfw.iterdir() if p.is_dir())
    half = len(classes) // 2
    out = {"tree": str(lfw)}
    for part, names in (("a", classes[:half]), ("b", classes[half:])):
        tree = base / f"tree-{part}"
        if not tree.exists():
            for name in names:  # hard links: the very same files, no copy
                (tree / name).mkdir(parents=True)
                for f in (lfw / name).iterdir():
                    os.link(f, tree / name / f.name)
        out[f"tree-{part}"] = str(tree)
    for name, tree in (("one", out["tree"]), ("a", out["tree-a"]), ("b", out["tree-b"])):
        out[name] = str(makers.packed(Path(tree), base / f"pack-{name}", shard_size="64MB"))
    return out


def _epoch_rate(make, epoch: int | None = None) -> tuple[float, float, int]:
    """images/s and CPU microseconds per image (workers included) of one epoch."""
    loader = make()
    if epoch is not None:
        loader.set_epoch(epoch)
    e = harness.epoch(loader)
    getattr(loader, "close", lambda: None)()  # a ShardLoader's workers end here
    return e["rate"], e["cpu_s"] * 1e6 / e["images"], e["images"]


def bench_mixture(data: dict, repeats: int, workers: int, batch: int) -> dict:
    from shardkit import ShardDataset, ShardLoader, Source

    def one():
        ds = ShardDataset(data["one"], decode="tensor", seed=1)
        return ShardLoader(ds, batch_size=batch, num_workers=workers)

    def mixed():
        ds = ShardDataset(
            [Source(data["a"]), Source(data["b"])], decode="tensor", seed=1, labels="union"
        )
        return ShardLoader(ds, batch_size=batch, num_workers=workers)

    counts = {}
    _epoch_rate(one, 0), _epoch_rate(mixed, 0)  # warm-up: page cache, worker start-up paths

    def side(name, make):
        def run(r: int) -> dict:
            rate, us, counts[name] = _epoch_rate(make, r + 1)
            return {"rate": rate, "cpu_us": us}

        return run

    sides = {
        "one source": side("one source", one),
        "2-source mixture": side("2-source mixture", mixed),
    }
    rounds = harness.interleave(sides, repeats, order="fixed")
    return {**_figures(rounds, "2-source mixture", "one source"), "samples": counts}


def _figures(rounds: harness.Rounds, a: str, b: str) -> dict:
    """Both sides' images/s and CPU per image per round, and the medians of a's over b's."""
    return {
        "rates": {name: rounds.values(name) for name in (b, a)},
        "cpu_us": {name: rounds.values(name, "cpu_us") for name in (b, a)},
        "ratio": rounds.ratio(a, b),
        "cpu_ratio": rounds.ratio(a, b, "cpu_us"),
    }


def bench_random_access(data: dict, repeats: int, workers: int, batch: int) -> dict:
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from shardkit import FolderDataset, ShardView
    from shardkit.bench.pagecache import evict_until_cold, iter_files, prime

    folder = FolderDataset(data["tree"], decode="tensor")
    view = ShardView(data["one"], decode="tensor")
    assert len(folder) == len(view)
    files = {"folder": list(iter_files(data["tree"])), "view": list(iter_files(data["one"]))}

    def run(ds, seed: int) -> tuple[float, float]:
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(seed))
        loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers)
        return _epoch_rate(lambda: loader)[:2]  # the workers end with the epoch's iterator

    out = {}
    for cache in ("warm", "cold"):

        def side(name, ds, cache=cache):
            def once(r: int) -> dict:
                if cache == "warm":
                    prime(files[name])
                else:
                    evict_until_cold(files[name])
                rate, us = run(ds, r)
                return {"rate": rate, "cpu_us": us}

            return once

        sides = {"folder": side("folder", folder), "view": side("view", view)}
        rounds = harness.interleave(sides, repeats, order="fixed")
        out[cache] = _figures(rounds, "view", "folder")
    return out


@harness.case(
    data="the --lfw tree at --lfw-scale, split in two sources and packed",
    measures="a mixture against one source; ShardView random access against files",
    small={"lfw": makers.root() / "lfw-smoke", "lfw_scale": 0.01, "batch_size": 8},
    aliases={"rounds": ["repeats"]},
)
class Mix(harness.Bench):
    rounds: int = 5
    lfw: Path = ROOT / "data" / "lfw"
    lfw_scale: float = 0.15
    workers: int = 2
    batch_size: int = 64
    only: tuple[Literal["a", "b"], ...] = harness.arg((), "parts to run (default: both)")


def main(args: Mix) -> None:
    load_before = harness.loadavg()
    data = _data(args.lfw, args.lfw_scale)
    result: dict = {"cpus": os.cpu_count(), "workers": args.workers, "batch": args.batch_size}
    only = set(args.only or ["a", "b"])
    if "a" in only:
        result["mixture"] = bench_mixture(data, args.rounds, args.workers, args.batch_size)
    if "b" in only:
        result["random_access"] = bench_random_access(
            data, args.rounds, args.workers, args.batch_size
        )
    result["loadavg"] = {"before": load_before, "after": harness.loadavg()}
    _print(result)
    harness.write_result(args.json, "bench_mix", args, result)
    return 0


def _print(result: dict) -> None:
    """Images/s and CPU us per image (medians of the rounds), the ratios (medians of per-round
    ratios): (a) the mixture over one source, (b) the view over the folder, warm and cold."""
    parts = {"(a) ShardLoader": result.get("mixture")}
    parts.update({f"(b) {k}": v for k, v in result.get("random_access", {}).items()})
    rows = {}
    for part, f in parts.items():
        for name, rates in (f or {}).get("rates", {}).items():
            cpu = statistics.median(f["cpu_us"][name])
            rows[f"{part} {name}"] = {"images/s": statistics.median(rates), "CPU us/img": cpu}
        if f:
            rows[f"{part} ratio"] = {"images/s": f["ratio"], "CPU us/img": f["cpu_ratio"]}
    harness.table(rows, ["images/s:,.3f", "CPU us/img:,.3f"])
    la = {k: harness.load_text(v) for k, v in result["loadavg"].items()}
    print(f"{result['workers']} workers, batch {result['batch']}", end="; ")
    print(f"load average before {la['before']}, after {la['after']}")


if __name__ == "__main__":
    harness.script(__file__)
