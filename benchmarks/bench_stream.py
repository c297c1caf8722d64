#!/usr/bin/env python3
"""ShardDataset against WebDataset, in one run: raw reads (``decode="raw"``, one process, page
cache; goal >= 10x ``WebDataset(shards)``), DataLoader worker memory over epochs and by shuffle
buffer (flat within 5%; bounded by the buffer), and shuffle quality per buffer size. End to end
against the decode ceiling (and FolderDataset, and DataLoader transport alone) is
``bench_loader.py --only a``. Figures: docs/benchmarks.md ("Streaming") and docs/stream.md.

    python benchmarks/bench_stream.py --repeats 7 --json bench-out/bench_stream.json
    python benchmarks/bench_stream.py --only raw --only shuffle     # some parts only
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

import data
import harness

ROOT = harness.ROOT

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from shardkit.bench.pagecache import prime  # noqa: E402
from shardkit.formats import get_format  # noqa: E402
from shardkit.manifest import read_manifest  # noqa: E402
from shardkit.stream.dataset import ShardDataset  # noqa: E402
from shardkit.stream.shuffle import Order  # noqa: E402

# --- data -------------------------------------------------------------------------------------


# --- measurements -----------------------------------------------------------------------------


def rate(iterable) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for _ in iterable:
        n += 1
    return n / (time.perf_counter() - t0), n


def bench_raw(urls: list[str], repeats: int) -> dict:
    import webdataset as wds

    def ours(**kw):
        return ShardDataset(urls, decode="raw", **kw)

    def theirs():
        return wds.WebDataset(urls, shardshuffle=False, empty_check=False)

    def theirs_shuffled():
        return wds.WebDataset(urls, shardshuffle=False, empty_check=False).shuffle(1000)

    sides = {
        "shardkit (default: shard shuffle + 1000-sample buffer)": lambda e: ours(seed=e),
        "shardkit (shuffle=False)": lambda e: ours(order=Order(shuffle=False)),
        "webdataset WebDataset(shards)": lambda e: theirs(),
        "webdataset .shuffle(1000)": lambda e: theirs_shuffled(),
    }
    counts = {}

    def side(name):
        def run(rep: int) -> float:
            ds = sides[name](rep)
            if isinstance(ds, ShardDataset):
                ds.set_epoch(rep)
            r, counts[name] = rate(ds)
            return r

        return run

    rounds = harness.interleave({name: side(name) for name in sides}, repeats, quiet=True)
    default, no_shuffle, plain, shuffled = sides
    return {
        "samples_per_s": {k: rounds.median(k) for k in sides},
        "samples": counts,
        "ratio_default_vs_webdataset": rounds.ratio(default, plain),
        "ratio_noshuffle_vs_webdataset": rounds.ratio(no_shuffle, plain),
        "ratio_default_vs_webdataset_shuffled": rounds.ratio(default, shuffled),
        "repeats": repeats,
    }


class _Epochs:
    """Hands out fresh epoch numbers, so no measured pass repeats an earlier order."""

    def __init__(self, ds: ShardDataset | None = None):
        self.ds, self.next = ds, 0

    def __call__(self) -> None:
        if self.ds is not None:
            self.ds.set_epoch(self.next)
        self.next += 1


def _worker_pids(loader: DataLoader) -> list[int]:
    """Pids of a persistent-worker loader's processes (they live as long as the loader)."""
    return [w.pid for w in loader._iterator._workers]


def _uss_kb(pid: int) -> int:
    """Memory only this process holds (Private_Clean + Private_Dirty): what a worker adds.

    VmRSS of a forked worker also counts every page it shares with the parent, so it says more
    about when the worker was forked than about the worker.
    """
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    return total


def _epoch_memory(loader: DataLoader, epochs: _Epochs, every: int = 2) -> tuple[list, list, list]:
    """One epoch, sampling each worker's USS every ``every`` batches.

    Returns per worker: peak USS during the epoch, USS at its end (what stays: a leak shows here)
    and VmRSS at its end.
    """
    epochs()
    peak: dict[int, int] = {}
    for i, _ in enumerate(loader):
        if i % every == 0:
            for p in _worker_pids(loader):
                peak[p] = max(peak.get(p, 0), _uss_kb(p))
    pids = _worker_pids(loader)
    end = [_uss_kb(p) for p in pids]
    return (
        [max(peak.get(p, 0), u) for p, u in zip(pids, end, strict=True)],
        end,
        [harness.proc_kb(p) for p in pids],
    )


def bench_memory(urls, workers: int, batch: int, epochs: int, buffer_sizes, mean_bytes) -> dict:
    """Per-worker memory over ``epochs`` epochs, and peak worker memory per buffer size."""
    out: dict = {"epochs": epochs}
    ds = ShardDataset(urls, decode="tensor")
    loader = DataLoader(ds, batch_size=batch, num_workers=workers, persistent_workers=True)
    counter = _Epochs(ds)
    peak, end, rss = [], [], []
    for _ in range(epochs):
        p, e, r = _epoch_memory(loader, counter)
        peak.append(p)
        end.append(e)
        rss.append(r)
    del loader
    out["peak_uss_kb_per_epoch"] = peak
    out["end_uss_kb_per_epoch"] = end
    out["rss_kb_per_epoch"] = rss

    def spread(rows):  # each worker's max-min across epochs over its mean; worst worker
        a = np.array(rows, dtype=np.float64)
        return float(((a.max(0) - a.min(0)) / a.mean(0)).max())

    out["rss_spread"] = spread(rss)
    out["end_uss_spread"] = spread(end)
    out["peak_uss_spread"] = spread(peak)
    peaks = {}
    for size in buffer_sizes:
        ds = ShardDataset(
            urls, decode="raw", order=Order(buffer_size=size) if size > 0 else Order(shuffle=False)
        )
        loader = DataLoader(ds, batch_size=batch, num_workers=workers, persistent_workers=True)
        counter = _Epochs(ds)
        peaks[size] = max(max(_epoch_memory(loader, counter)[0]) for _ in range(2))
        del loader
    out["peak_uss_kb_by_buffer"] = peaks
    base = peaks[min(buffer_sizes)]
    out["uss_growth_mb_vs_buffer_mb"] = {
        s: ((peaks[s] - base) / 1024, s * mean_bytes / 2**20) for s in buffer_sizes
    }
    return out


def bench_shuffle(urls: list[str], buffer_sizes, batch: int) -> dict:
    """Displacement of samples by the buffer, and the mix of shards/classes per batch."""
    fmt = get_format("tar")
    shard_of, label_of = {}, {}
    for i, u in enumerate(urls):
        for r in fmt.iter_records(u):
            shard_of[r.key] = i
            label_of[r.key] = r.label
    # The order samples come off the shards in epoch 1 (shard permutation, no buffer).
    ref = ShardDataset(urls, decode="raw", with_keys=True, order=Order(buffer_size=0), seed=0)
    ref.set_epoch(1)
    read_pos = {k: i for i, (_, _, k) in enumerate(ref)}
    out = {}
    for size in buffer_sizes:
        ds = ShardDataset(
            urls, decode="raw", with_keys=True, order=Order(shuffle=True, buffer_size=size), seed=0
        )
        ds.set_epoch(1)
        keys = [k for _, _, k in ds]
        disp = np.abs(np.arange(len(keys)) - np.array([read_pos[k] for k in keys]))
        n_batches = len(keys) // batch
        shards_per_batch = [
            len({shard_of[k] for k in keys[b * batch : (b + 1) * batch]}) for b in range(n_batches)
        ]
        classes_per_batch = [
            len({label_of[k] for k in keys[b * batch : (b + 1) * batch]}) for b in range(n_batches)
        ]
        out[size] = {
            "mean_displacement": float(disp.mean()),
            "p50_displacement": float(np.percentile(disp, 50)),
            "p90_displacement": float(np.percentile(disp, 90)),
            "p99_displacement": float(np.percentile(disp, 99)),
            "distinct_shards_per_batch": float(np.mean(shards_per_batch)),
            "distinct_classes_per_batch": float(np.mean(classes_per_batch)),
        }
    return out


# --- main -------------------------------------------------------------------------------------


@harness.case(
    data="a class-per-folder tree (--src, default LFW-shaped), packed to tar at --shards",
    measures="raw reads against WebDataset, worker memory, shuffle quality",
    small={
        "src": str(data.root() / "lfw-smoke"),
        "shards": str(data.root() / "lfw-smoke-stream"),
        "epochs": 2,
    },  # fmt: skip
    aliases={"rounds": ["repeats"]},
)
class Stream(harness.Bench):
    rounds: int = 5
    src: str = harness.arg(str(ROOT / "data" / "lfw"), "class-per-folder tree")
    shards: str = harness.arg("/tmp/bench-shards", "where to pack the tar shards")
    shard_size: str = harness.arg("16MB", "13 shards for LFW at the default")
    workers: int = 2
    batch: int = 64
    epochs: int = harness.arg(5, "epochs for the memory check")
    only: tuple[Literal["raw", "memory", "shuffle"], ...] = harness.arg((), "run only these parts")


def main(args: Stream) -> None:
    if args.smoke:
        data.lfw(Path(args.src), 0.01)
    src, shards = Path(args.src), Path(args.shards)
    data.packed(data.lfw(src), shards, shard_size=args.shard_size, workers=2)
    manifest = read_manifest(str(shards))
    urls = [str(shards / e.path) for e in manifest.shards]
    prime(urls)  # every measurement sees the shards in the page cache
    mean_bytes = manifest.total_bytes / manifest.num_samples
    results: dict = {
        "dataset": {
            "src": str(src),
            "shards": len(urls),
            "samples": manifest.num_samples,
            "mean_sample_bytes_in_shard": mean_bytes,
        },
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
    }
    print(f"{manifest.num_samples} samples in {len(urls)} shards, {mean_bytes / 1e3:.1f} KB each")
    parts = set(args.only or ["raw", "memory", "shuffle"])
    if args.smoke and not harness.available("webdataset"):
        parts.discard("raw")
    if "raw" in parts:
        print("raw iteration ...", flush=True)
        results["raw"] = bench_raw(urls, args.rounds)
    if "memory" in parts:
        print("worker memory ...", flush=True)
        results["memory"] = bench_memory(
            urls, args.workers, args.batch, args.epochs, [0, 1000, 4000], mean_bytes
        )
    if "shuffle" in parts:
        print("shuffle quality ...", flush=True)
        results["shuffle"] = bench_shuffle(urls, [0, 10, 100, 1000, 5000], args.batch)
    report(results)
    harness.write_result(args.json, "bench_stream", args, results)


def report(r: dict) -> None:
    """The parts' figures (medians of the rounds; goals: raw >= 10x WebDataset, end to end
    >= 80% of the ceiling, worker memory flat within 5% over the epochs)."""
    if "raw" in r:
        rows = {k: {"samples/s": v} for k, v in r["raw"]["samples_per_s"].items()}
        harness.table(rows, ["samples/s:,.0f"], "raw iteration, one process, page cache")
        harness.table({k: {"ratio": v} for k, v in r["raw"].items() if k.startswith("ratio")},
                      ["ratio:.1f"])  # fmt: skip
    if "memory" in r:
        m = r["memory"]
        cols = ("rss_kb", "end_uss_kb", "peak_uss_kb")
        per = zip(*(m[f"{c}_per_epoch"] for c in cols), strict=True)
        rows = {f"epoch {i}": dict(zip(cols, x, strict=True)) for i, x in enumerate(per)}
        rows.update(
            {f"buffer {k}": {"peak_uss_kb": v} for k, v in m["peak_uss_kb_by_buffer"].items()}
        )
        harness.table(rows, cols, "worker memory (kB per worker; spread: max-min over the mean)")
        spreads = {k: {"spread": v} for k, v in m.items() if k.endswith("spread")}
        harness.table(spreads, ["spread:.2%"])
    if "shuffle" in r:
        cols = ["mean_displacement:.0f", "p50_displacement:.0f", "p90_displacement:.0f",
                "p99_displacement:.0f", "distinct_shards_per_batch:.1f",
                "distinct_classes_per_batch:.1f"]  # fmt: skip
        harness.table({f"buffer {k}": q for k, q in r["shuffle"].items()}, cols, "shuffle, epoch 1")


if __name__ == "__main__":
    harness.script(__file__)
