#!/usr/bin/env python3
"""What each operation costs at N samples: subsets, splits, lookups, growth, open, ls, show.

Makes N samples (one tiny 64x64 JPEG's bytes under N keys in 1,000 classes, written with
``ShardWriter``: fast), then measures each figure in a fresh child process, with the sample
indexes (``*.tar.idx``) and on the same shards without them (hard links, the indexes left out:
an older pack), interleaved. ``--format lmdb``: LMDB shards with their index record, and a copy
whose shards have it deleted (through the ``lmdb`` package: an older pack's reads). Every figure
is given with N, in CPU seconds (this process, or the CLI child's own) and bytes, which a busy
machine moves least:

- ``subset``: a ``subset=0.01`` epoch: bytes read (``rchar``) against the drawn samples' own
  bytes, CPU per drawn sample;
- ``split``, ``split-train``: ``split="val"`` and ``split="train"`` construction
  (``val_fraction=0.1``): CPU and peak resident memory above the imports, per sample of the
  whole data set, then a second construction under ``tracemalloc``: the bytes it allocates at
  its peak and holds after (numpy's arrays included; not the ~10 MB of pages the first one
  touches whatever N; the manifest's size cap set to its file's size, as an older checkout
  allocated the cap, 512 MiB, to read it), and the bytes the first one read (``rchar``: the
  manifest and the indexes) per sample, and the bytes of the key file a construction reads
  at ``val_fraction`` 0.1 and 0.01 (``keys_read_b``: every ``os.pread`` of it counted: one
  count vector and a segment's blocks where its runs have count tables, the val prefix where
  not); with ``--against DIR`` also on another checkout;
- ``split-plan``, ``split-train-plan``: an epoch's draw of that split (``MixLayout``, built in
  every worker) and one worker's plan of it (one rank, one worker: its part is the epoch;
  a plan made in pieces as it is read is made piece by piece, each let go), under
  ``tracemalloc``: the draw's bytes held, the plan's peak and what both hold after, per
  sample of the whole data set (``--against DIR`` too);
- ``split-epoch``: a ``split="val"`` epoch: CPU per sample, against a full epoch's;
- ``keys-subset`` (a subset of every 100th sample's key) and ``mix`` (a mixture of the
  ``split="train"`` and ``split="val"`` sides, shares by size), as rank 0 of
  ``--world-size``: the CPU seconds and the index heads (``.idx`` files) opened by the
  construction, by rank 0's plan (one worker) and by a ``state_dict`` saved and loaded back;
- ``view``: ``ShardView`` open: CPU and peak memory;
- ``get``: ``ShardView.get(key)``: CPU per lookup, 200 random keys;
- ``random``: a long-lived view's memory and its first lookups: the CPU of a first
  ``get(key)`` in a new view and of its second (a key table built in memory there is counted
  there; one on disk is built by an earlier view: that view's first lookup is given too), then
  the resident memory after 1,000 random ``get(key)`` and 1,000 random ``view[i]``, and
  after 4,000 more, against before them; and the first lookup of the child's first view, which
  builds the key table where one is kept on disk (in a directory of its own); ``--against``
  too;
- ``ls`` first line, ``show KEY``, ``show-missing`` (a key that is not there): CPU and memory;
- ``epoch``: a full epoch (``decode="raw"``): samples/s and CPU per sample;
- ``append`` (``shardkit pack MORE OUT --append`` of ``--new`` samples onto a hard-linked copy)
  and ``merge`` (``shardkit merge OUT MORE NEW``): the CLI's CPU, peak memory and bytes read
  (``rchar``, the imports included), run in one child process, indexed side only (growth is
  this code's, not an older pack's); ``--shard-size 128kB`` makes shards of ~32 samples (a
  1.28M set in 40,000 shards: growth's per-shard cost).

``--against DIR`` (another checkout) also runs ``append`` and ``merge`` with DIR's shardkit,
interleaved with this one's.

``--many-shards S`` also makes the same N samples in about S shards and measures open, get,
``ls``, ``show`` and ``show-missing`` on it (the per-shard costs: 40,000 shards at LAION size).

    python benchmarks/bench_scale.py --n 128000 --out /tmp/scale
    python benchmarks/bench_scale.py --n 128000 1280000 --json bench-out/scale.json
    python benchmarks/bench_scale.py --n 200000 --format lmdb --what split view ls show
    python benchmarks/bench_scale.py --n 128000 --many-shards 4000 --what view get show-missing
    python benchmarks/bench_scale.py --n 128000 1280000 --what append merge --against /tmp/base
    python benchmarks/bench_scale.py --n 128000 1280000 --what append merge --shard-size 128kB \
        --index-only --out /tmp/scale-keys --against /tmp/base
    python benchmarks/bench_scale.py --n 1280000 --what split split-train --against /tmp/main-wt
    python benchmarks/bench_scale.py --n 128000 1280000 --what keys-subset mix --index-only \
        --world-size 8 --against /tmp/main-wt
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

import data
import harness

CHILD = r"""
import json, os, resource, sys, time, warnings
warnings.simplefilter("ignore")
import numpy as np
from shardkit import Order, ShardDataset, ShardView, Source
from shardkit.stream.show import list_lines, show_lines
what, where, key = sys.argv[1], sys.argv[2], sys.argv[3]
try:  # the peak from here on, not the imports' transient one (Linux: clear_refs 5 resets VmHWM)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
def syscr():  # read calls so far
    with open("/proc/self/io") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("syscr"))
r0, s0, c0, t0 = rchar(), syscr(), cpu(), time.perf_counter()
out = {"base_mb": status_mb("VmRSS")}  # after imports
if what == "subset":
    ds = ShardDataset(Source(where, subset=0.01), decode="raw", with_keys=True)
    out["construct_s"] = time.perf_counter() - t0
    c1 = cpu()
    n = sum(len(s[0]) for s in ds)
    out["drawn"], out["image_bytes"], out["epoch_cpu_s"] = len(ds), n, cpu() - c1
elif what in ("split", "split-train"):
    side = "val" if what == "split" else "train"
    ws = int(os.environ.get("SHARDKIT_BENCH_WORLD", "1"))  # rank 0 of ws
    ds = ShardDataset(Source(where, split=side, val_fraction=0.1), decode="raw", rank=0,
                      world_size=ws)
    out["len"] = len(ds)
    out["construct_rchar"] = rchar() - r0  # the manifest and the indexes, as read to build it
    out["construct_reads"] = syscr() - s0
    out["construct_cpu_s"] = cpu() - c0
    from shardkit.stream.planner import worker_plan
    from shardkit.stream.world import World
    r1, s1, c1 = rchar(), syscr(), cpu()  # rank 0's plan (one worker): the pieces it reads
    plan = worker_plan(ds._layout(0), World(0, ws), {})
    for p in plan.sources:
        for piece in p.pieces():
            del piece
    out["plan_rchar"], out["plan_reads"] = rchar() - r1, syscr() - s1
    out["plan_cpu_s"] = cpu() - c1
    c1, t1 = cpu(), time.perf_counter()
    out["peak_mb"] = status_mb("VmHWM")
    del ds, plan
    import tracemalloc  # again, traced: the bytes it allocates (numpy's too), not the page floor
    import shardkit.manifest  # the cap at the file's size: an older checkout read the cap whole
    shardkit.manifest.MAX_MANIFEST_BYTES = os.path.getsize(os.path.join(where, "manifest.json"))
    tracemalloc.start()
    ds = ShardDataset(Source(where, split=side, val_fraction=0.1), decode="raw")
    out["held_b"], out["traced_peak_b"] = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    def keys_read(fraction):  # bytes of the key file a construction reads: its every pread
        got, real = [0], os.pread
        def pread(fd, n, at):
            raw = real(fd, n, at)
            if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("manifest.keys"):
                got[0] += len(raw)
            return raw
        os.pread = pread
        try:
            ShardDataset(Source(where, split=side, val_fraction=fraction), decode="raw")
        finally:
            os.pread = real
        return got[0]
    out["keys_read_b"] = {str(f): keys_read(f) for f in (0.1, 0.01)}
    c0, t0 = c0 + cpu() - c1, t0 + time.perf_counter() - t1  # the first construction's CPU
elif what in ("split-plan", "split-train-plan"):  # an epoch's draw and one worker's plan
    import tracemalloc
    from shardkit.stream.world import World
    try:  # one planner for every epoch
        from shardkit.stream.planner import worker_plan
        def plan_of(layout):
            return worker_plan(layout, World(), {})
    except ImportError:  # a checkout from before it (--against)
        from shardkit.stream.partition import mix_worker_plan
        def plan_of(layout):
            return mix_worker_plan(layout, ds.sources, World(), {})
    side = "val" if what == "split-plan" else "train"
    ds = ShardDataset(Source(where, split=side, val_fraction=0.1), decode="raw", seed=3)
    def made(plan):  # a plan made in pieces as it is read: every piece made, each let go
        for p in plan.sources:
            for piece in p.pieces() if callable(getattr(p, "pieces", None)) else ():
                del piece
        for chunk in plan.schedule() if callable(plan.schedule) else ():
            del chunk
        return plan
    made(plan_of(ds._layout(0)))  # the first one's imports
    tracemalloc.start()
    layout = ds._layout(1)  # the dataset holds one epoch's: the warm one is let go
    out["layout_b"] = tracemalloc.get_traced_memory()[0]
    c1 = cpu()
    plan = made(plan_of(layout))
    out["plan_cpu_s"] = cpu() - c1
    out["held_b"], out["traced_peak_b"] = tracemalloc.get_traced_memory()
    tracemalloc.stop()
elif what in ("keys-subset", "mix"):  # rank 0 of ws: index heads opened and CPU
    from shardkit.stream.planner import worker_plan
    from shardkit.stream.world import World
    ws = int(os.environ.get("SHARDKIT_BENCH_WORLD", "1"))
    if what == "keys-subset":  # every 100th sample's key (``data.scale_set``'s keys)
        n = json.load(open(os.path.join(where, "manifest.json")))["num_samples"]
        labels = np.random.default_rng(0).integers(0, 1000, n)
        src = Source(where, subset=[f"n{c:08d}/n{c:08d}_{i}" for i, c in
                                    enumerate(labels.tolist()) if i % 100 == 0])
    else:  # the two sides of a split, shares by size
        src = [Source(where, split="train"), Source(where, split="val")]
    heads = []
    sys.addaudithook(lambda e, a: heads.append(1) if e == "open" and str(a[0]).endswith(
        ".idx") else None)
    c1, h = cpu(), len(heads)
    ds = ShardDataset(src, decode="raw", rank=0, world_size=ws, seed=3)
    out["construct_cpu_s"], out["construct_heads"] = cpu() - c1, len(heads) - h
    c1, h = cpu(), len(heads)
    plan = worker_plan(ds._layout(0), World(0, ws), {})  # rank 0, one worker
    for p in plan.sources:
        for piece in p.pieces():
            del piece
    out["plan_cpu_s"], out["plan_heads"] = cpu() - c1, len(heads) - h
    c1, h = cpu(), len(heads)
    ds.load_state_dict(ds.state_dict())
    out["state_cpu_s"], out["state_heads"] = cpu() - c1, len(heads) - h
    out["shards"], out["len"] = len(ds.shards), len(ds)
elif what == "split-epoch":
    ds = ShardDataset(Source(where, split="val", val_fraction=0.1), decode="raw")
    c1 = cpu()
    out["samples"] = sum(1 for _ in ds)
    out["epoch_cpu_s"] = cpu() - c1
elif what == "view":
    view = ShardView(where, decode="raw")
    out["len"] = len(view)
elif what == "get":
    view = ShardView(where, decode="raw")
    keys = [view.key(int(i)) for i in np.random.default_rng(0).integers(0, len(view), 200)]
    view.index(keys[0]), view.index(keys[1])  # the first two build the sorted hash table
    c1 = cpu()
    for k in keys:
        view.index(k)
    out["lookups"], out["lookup_cpu_s"] = len(keys), cpu() - c1
    c1 = cpu()
    for k in keys:  # a key no shard holds: answered without loading an index
        try:
            view.index(k + "-missing")
        except Exception:
            pass
    out["miss_cpu_s"] = cpu() - c1
elif what == "random":  # a long-lived view: its first lookups, its memory after many
    import tempfile  # where an older shardkit kept its key tables: this child's own
    os.environ["SHARDKIT_CACHE"] = tempfile.mkdtemp(prefix="bench-keys-")
    view = ShardView(where, decode="raw")
    n = len(view)
    labels = np.random.default_rng(0).integers(0, 1000, n)  # data.scale_set's keys
    def name(i):
        return f"n{int(labels[i]):08d}/n{int(labels[i]):08d}_{i}"
    picks = np.random.default_rng(1).integers(0, n, 6003).tolist()
    c1 = time.process_time()
    view.index(name(picks[0]))  # where a key table is built on disk, it is built here
    out["earlier_view_first_s"] = time.process_time() - c1
    view.close()
    del view
    view = ShardView(where, decode="raw")
    c1 = time.process_time()
    assert view.get(name(picks[1])) is not None
    out["first_get_s"] = time.process_time() - c1
    c1 = time.process_time()
    view.get(name(picks[2]))
    out["second_get_s"] = time.process_time() - c1
    out["rss_before_mb"] = status_mb("VmRSS")
    c1 = time.process_time()
    for i in picks[3:1003]:
        view.get(name(i))
    for i in picks[1003:2003]:
        view[i]
    out["loop_cpu_s"] = time.process_time() - c1
    out["rss_after_mb"] = status_mb("VmRSS")
    for i in picks[2003:]:  # as many again, twice: flat, or still growing
        view.get(name(i)) if i % 2 else view[i]
    out["rss_later_mb"] = status_mb("VmRSS")
    view.close()
    import shutil
    shutil.rmtree(os.environ["SHARDKIT_CACHE"], ignore_errors=True)
elif what == "ls":
    view = ShardView(where, decode="raw")
    out["line"] = next(iter(list_lines(view, 1)))
elif what == "show":
    view = ShardView(where, decode="raw")
    out["lines"] = len(list(show_lines(view, key)))
elif what == "show-missing":
    view = ShardView(where, decode="raw")
    try:
        out["lines"] = len(list(show_lines(view, "no-such-class/no-such-key")))
    except Exception as exc:  # the answer is an error naming the key
        out["error"] = type(exc).__name__
elif what == "epoch":
    ds = ShardDataset(where, decode="raw")
    c1 = cpu()
    out["samples"] = sum(1 for _ in ds)
    out["epoch_cpu_s"] = cpu() - c1
out["seconds"] = time.perf_counter() - t0
out["cpu_s"] = cpu() - c0
out["rchar"] = rchar() - r0
out.setdefault("peak_mb", status_mb("VmHWM"))
print(json.dumps(out))
"""

# The CLI in a child: its own CPU seconds and peak memory (RUSAGE_CHILDREN of this wrapper).
CLI = r"""
import contextlib, io, json, resource, sys, time
t0, r0 = time.perf_counter(), rchar()
from shardkit.cli import main
sys.argv = ["shardkit", *sys.argv[1:]]
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main()
    except SystemExit as exc:
        if exc.code:
            raise
# VmHWM: this process's (ru_maxrss keeps the parent's)
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu(),
                  "peak_mb": status_mb("VmHWM"), "rchar": rchar() - r0}))
"""

WHATS = (
    "subset",
    "split",
    "split-train",
    "split-plan",
    "split-train-plan",
    "split-epoch",
    "keys-subset",
    "mix",
    "view",
    "get",
    "random",
    "ls",
    "show",
    "show-missing",
    "epoch",
)
GROWTH = ("append", "merge")
MANY = ("view", "get", "ls", "show", "show-missing")
# The figures ``--against`` measures on the other checkout too.
AGAINST = ("split", "split-train", "split-plan", "split-train-plan", "random", "keys-subset", "mix")
# Figures of rank 0 of ``--world-size``: its index heads opened and CPU, built, planned, resumed.
RANKED = ("keys-subset", "mix")


def make(out: Path, n: int, fmt: str = "tar") -> tuple[str, str]:
    """N samples packed with indexes, and the same shards without them (``data.scale_set``)."""
    packed, bare = data.scale_set(n, out, fmt)
    return str(packed), str(bare)


def child(what: str, where: str, key: str = "", checkout: Path = harness.ROOT) -> dict:
    return harness.in_child(checkout, CHILD, what, where, key)


def growth(
    what: str,
    packed: Path,
    n: int,
    new: int,
    work: Path,
    fmt: str,
    checkout: Path = harness.ROOT,
    shard_size: str = "5MB",
) -> dict:
    """``append`` or ``merge`` of ``new`` samples onto the N-sample pack, in a CLI child of
    ``checkout`` (this one, or ``--against``'s)."""
    scratch = work / f"grow-{what}"
    if what == "append":
        more = data.scale_tree(new, n, work)
        dest = data.linked_copy(packed, scratch)
        argv = ["pack", more, dest, "--append", "-q", "--format", fmt]
    else:
        more, _ = data.scale_set(new, work, fmt, shard_size, start=n)
        shutil.rmtree(scratch, ignore_errors=True)
        argv = ["merge", packed, more, scratch]
    try:
        return harness.in_child(checkout, CLI, *argv)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(args, n: int, fmt: str, shard_size: str, whats, growth_whats) -> dict:
    """Every asked figure on the N-sample set of ``shard_size`` shards, interleaved."""
    from shardkit import ShardView

    t0 = time.perf_counter()
    packed, bare = data.scale_set(n, args.out, fmt, shard_size)
    made = time.perf_counter() - t0
    shards = [f for f in os.listdir(packed) if f.endswith(f".{fmt}")]
    total = sum(os.path.getsize(packed / f) for f in shards)
    key = ShardView(str(packed), decode="raw").key(n // 2)  # a sample halfway
    row = {"n": n, "shards": len(shards), "dataset_bytes": total, "make_s": made, "format": fmt}
    row["load_before"] = harness.load_now().as_dict()
    sides = {
        f"{what}/{side}": (lambda r, what=what, where=where: child(what, str(where), key))
        for what in whats
        for side, where in (("index", packed), ("no_index", bare))
        if side == "index" or not args.index_only
    }
    sides.update(
        {
            f"{what}/index": (
                lambda r, what=what: growth(
                    what, packed, n, args.new, args.out, fmt, shard_size=shard_size
                )
            )
            for what in growth_whats
        }
    )
    if args.against is not None:  # the same children of another checkout, interleaved
        there = args.against.resolve()
        sides.update(
            {
                f"{what}/against": (lambda r, what=what: child(what, str(packed), key, there))
                for what in whats
                if what in AGAINST
            }
        )
        sides.update(
            {
                f"{what}/against": (
                    lambda r, what=what: growth(
                        what, packed, n, args.new, args.out, fmt, there, shard_size
                    )
                )
                for what in growth_whats
            }
        )
    rounds = harness.interleave(sides, args.rounds, order="reverse", quiet=True)
    for k, runs in rounds.results.items():  # the median run by CPU; all in "runs"
        row[k] = sorted(runs, key=lambda x: x["cpu_s"])[len(runs) // 2]
        if k.startswith("random/"):  # the one round that found no key table on disk built it
            row[k] = {**row[k], "build_s": max(x["earlier_view_first_s"] for x in runs)}
    row["runs"] = rounds.results
    row["loads"] = [x.as_dict() for x in rounds.loads]
    row["load_after"] = harness.load_now().as_dict()
    return row


@harness.case(
    data="N-sample sets with and without indexes (and about S shards), under <data root>/scale",
    measures="at N samples: CPU seconds, bytes of epochs, open, get, ls, show, growth",
    small={"n": (500,), "new": 50, "many_shards": 20},
)
class Scale(harness.Bench):
    rounds: int = 1
    against: Path | None = harness.arg(None, "another checkout, side by side")
    n: tuple[int, ...] = (128_000,)
    out: Path | None = harness.arg(None, "data (default: the data root)")
    skip_epoch: bool = harness.arg(False, "Leave out the full epoch.")
    index_only: bool = harness.arg(False, "Leave out the shards without indexes.")
    format: Literal["tar", "lmdb"] = "tar"
    what: tuple[str, ...] | None = harness.arg(None, "Only these figures (split, view...).")
    new: int = harness.arg(10_000, "samples that append/merge add")
    many_shards: int = harness.arg(0, "also a set of about S shards")
    shard_size: str = harness.arg("5MB", "the main set's shard size (e.g. 128kB: ~32 samples)")
    world_size: int = harness.arg(
        1, "split, split-train, keys-subset, mix: built and planned as rank 0 of this"
    )


def main(args: Scale) -> None:
    args = replace(args, out=args.out or data.root() / "scale")
    os.environ["SHARDKIT_BENCH_WORLD"] = str(args.world_size)  # the split children's world
    skip = {"epoch"} if args.skip_epoch else set()
    whats = [w for w in WHATS if w not in skip and (args.what is None or w in args.what)]
    grows = [w for w in GROWTH if args.what is None or w in args.what]
    many = [w for w in MANY if args.what is None or w in args.what]
    results = []
    for n in args.n:
        row = measure(args, n, args.format, args.shard_size, whats, grows)
        results.append(row)
        _print(row)
        if args.many_shards and many:
            per = max(4096, row["dataset_bytes"] // args.many_shards)
            row = measure(args, n, args.format, f"{per}B", many, [])
            results.append(row)
            _print(row)
    harness.write_result(args.json, "bench_scale", args, {"rows": results})


LABELS = {
    "subset": "subset=0.01 epoch",
    "split": 'split="val" construction',
    "split-train": 'split="train" construction',
    "split-plan": 'split="val" epoch plan',
    "split-train-plan": 'split="train" epoch plan',
    "split-epoch": 'split="val" epoch',
    "keys-subset": "subset=[keys] (1%), rank 0",
    "mix": "train+val mixture, rank 0",
    "view": "ShardView open",
    "get": "get(key), per lookup",
    "random": "long-lived view",
    "ls": "ls first line",
    "show": "show KEY",
    "show-missing": "show a missing key",
    "epoch": "full epoch (raw)",
    "append": "pack --append",
    "merge": "merge",
}


def _cell(what: str, r: dict, row: dict) -> str:
    """One figure: CPU seconds (per sample or lookup where that is the question) and bytes."""
    more = r["peak_mb"] - r.get("base_mb", 0.0)
    if what == "subset":
        drawn = r["drawn"] * row["dataset_bytes"] / row["n"]
        us = r["epoch_cpu_s"] / max(1, r["drawn"]) * 1e6
        return f"read {r['rchar'] / drawn:.2f}x drawn, {us:.0f} us CPU/sample"
    if what in ("epoch", "split-epoch"):
        us = r["epoch_cpu_s"] / max(1, r["samples"]) * 1e6
        return f"{us:.1f} us CPU/sample +{more:.0f} MB"
    if what in RANKED:  # CPU seconds and index heads opened: build, plan, state round trip
        return (
            f"build {r['construct_cpu_s']:.2f} s/{r['construct_heads']} heads, plan "
            f"{r['plan_cpu_s']:.2f} s/{r['plan_heads']}, state {r['state_cpu_s']:.2f} s/"
            f"{r['state_heads']}"
        )
    if what.endswith("-plan"):
        n = row["n"]
        cpu = f", {r['plan_cpu_s']:.2f} s CPU" if "plan_cpu_s" in r else ""
        return (
            f"draw {r['layout_b'] / n:.2f} B, plan peak {r['traced_peak_b'] / n:.1f} B, "
            f"held {r['held_b'] / n:.2f} B{cpu}"
        )
    if what == "random":
        grew = r["rss_after_mb"] - r["rss_before_mb"]
        later = r["rss_later_mb"] - r["rss_before_mb"]
        return (
            f"get 1st {r['first_get_s'] * 1e3:.2f} ms, 2nd {r['second_get_s'] * 1e3:.2f} ms; "
            f"+{grew:.0f} MB after 2k, +{later:.0f} after 6k; table build {r['build_s']:.2f} s"
        )
    if what in AGAINST:
        per, n = more * 2**20 / row["n"], row["n"]
        traced = f"traced {r['traced_peak_b'] / n:.2f}/{r['held_b'] / n:.2f} B"
        read = f", read {r['construct_rchar'] / n:.1f} B" if "construct_rchar" in r else ""
        if "plan_rchar" in r:  # construction, then rank 0's plan: reads and bytes of each
            read += (
                f" in {r['construct_reads']} reads; rank 0 plan {r['plan_rchar'] / n:.2f} B "
                f"in {r['plan_reads']} reads, {r['plan_cpu_s']:.2f} s"
            )
        if "keys_read_b" in r:  # the key file's bytes a construction reads, at 0.1 and 0.01
            read += ", key file {} / {} B".format(*r["keys_read_b"].values())
        cpu = r.get("construct_cpu_s", r["cpu_s"])
        return f"{cpu:.2f} s CPU +{more:.0f} MB ({per:.1f} B), {traced}{read}"
    if what == "get":
        return f"{r['lookup_cpu_s'] / r['lookups'] * 1e3:.3f} ms CPU"
    if what in GROWTH:
        read = f", {r['rchar'] / 1e6:.1f} MB read" if "rchar" in r else ""
        return f"{r['cpu_s']:.2f} s CPU, peak {r['peak_mb']:.0f} MB{read}"
    return f"{r['cpu_s']:.2f} s CPU +{more:.0f} MB, {r['rchar'] / 1e6:.1f} MB read"


def _print(row: dict) -> None:
    n = row["n"]
    print(
        f"\nN = {n:,} samples in {row['shards']:,} shards, {row['dataset_bytes'] / 1e9:.2f} GB of "
        f"{row['format']} (made in {row['make_s']:.0f} s); load "
        f"{row['load_before']['load_1m']} -> {row['load_after']['load_1m']}"
    )
    print("memory: peak resident above what a process holds after importing shardkit+torch")
    heads = ["with index"]
    heads += ["without"] if any(k.endswith("/no_index") for k in row) else []
    heads += ["--against, with index"] if any(k.endswith("/against") for k in row) else []
    print(f"{'figure':28s} " + " ".join(f"{h:>44s}" for h in heads))
    for what, label in LABELS.items():
        if f"{what}/index" not in row:
            continue
        cells = [_cell(what, row[f"{what}/index"], row)]
        for side in ("no_index", "against"):
            if f"{what}/{side}" in row:
                cells.append(_cell(what, row[f"{what}/{side}"], row))
        print(f"{label:28s} " + " ".join(f"{c:>44s}" for c in cells))
        if f"{what}/against" in row:
            print(f"{'  against':28s} {_cell(what, row[f'{what}/against'], row):>44s}")


if __name__ == "__main__":
    harness.script(__file__)
