#!/usr/bin/env python3
"""Is anything slower, or costlier in CPU, than another checkout? Jobs timed side by side.

Every job runs on this checkout and on ``--against DIR`` (``git worktree add /tmp/base <rev>``)
in a fresh child process per checkout and round (``harness.in_child``: only the job is timed,
after its imports), the checkouts alternating which goes first; per job and measure, the median
over rounds of the per-round ratio this / against, with each round's load average. The jobs
(``--jobs``; docs/benchmarks.md says what each measures): the everyday ones by default
(``pack-folder``, ``pack-table``, ``writer``, ``epoch-raw``, ``epoch-rrc``, ``epoch-tiny``),
``cpu-tiny`` and ``cpu-rrc`` (images per CPU-second with ``num_workers=0``: what the loader's
stats counters cost) and ``transform`` (CPU per image of a ``sample_transform=`` epoch).

    python benchmarks/bench_against.py --against /tmp/base --rounds 5
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import data
import harness

# --- the jobs, as the child runs them (this module imported there, after that checkout's
# shardkit: its API as of the older checkouts compared) --------------------------------------


def cli(*argv: str) -> dict:
    """``shardkit ARGV`` in a process of its own: its seconds."""
    gc.collect()  # the imports' garbage collected here, not in the timed job
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "shardkit.cli", *argv]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return {"seconds": time.perf_counter() - t0}


def writer(out: str, n: str, jpeg: str) -> dict:
    """``ShardWriter`` with ``n`` tiny samples, a label and a caption each: its seconds."""
    from shardkit import ShardWriter

    blob = Path(jpeg).read_bytes()
    gc.collect()
    t0 = time.perf_counter()
    with ShardWriter(out, shard_size="16MB") as w:
        for i in range(int(n)):
            w.write(f"s{i:09d}", blob, i % 100, txt=f"a caption for sample {i}")
    return {"seconds": time.perf_counter() - t0}


def epoch_raw(src: str) -> dict:
    """One ``ShardDataset(decode="raw")`` epoch: samples/s."""
    from shardkit import ShardDataset

    ds = ShardDataset(src, decode="raw", seed=1)
    gc.collect()
    t0 = time.perf_counter()
    n = sum(1 for _ in ds)
    return {"rate": n / (time.perf_counter() - t0), "samples": n}


def _loader(src: str, kind: str, batch: str, workers: int, **kw):
    from shardkit import Decode, RandomResizedCrop, ShardDataset, ShardLoader

    size = {"rrc": 224, "rrc112": 112}.get(kind)
    decode = Decode(crop=RandomResizedCrop(size), flip=kind == "rrc") if size else "tensor"
    return ShardLoader(ShardDataset(src, decode=decode, **kw), int(batch), num_workers=workers)


def epoch(src: str, kind: str, batch: str) -> dict:
    """One ``ShardLoader`` epoch (2 workers) after its first batch: images/s."""
    loader = _loader(src, kind, batch, 2)
    it = iter(loader)
    n0 = len(next(it)[0])  # workers up: time the steady epoch
    gc.collect()
    t0 = time.perf_counter()
    n = sum(len(x) for x, _ in it)
    loader.close()
    return {"rate": n / (time.perf_counter() - t0), "samples": n + n0}


def cpu(src: str, kind: str, batch: str, epochs: str) -> dict:
    """``epochs`` epochs with ``num_workers=0`` (the fill loop in this process, one torch
    thread), after each one's first batch: images per CPU-second of the whole loader."""
    import torch

    torch.set_num_threads(1)
    loader = _loader(src, kind, batch, 0)
    n, spent = 0, 0.0
    for e in range(int(epochs)):
        loader.set_epoch(e)
        it = iter(loader)
        next(it)
        t0 = time.process_time()
        n += sum(len(x) for x, _ in it)
        spent += time.process_time() - t0
    if n == 0:
        sys.exit(f"{src}: one batch or less per epoch: smaller batches or more data")
    return {"rate": n / max(spent, 1e-9), "images": n}


def _passed_on(s):
    return {"image": s["image"], "label": s["label"]}


def transform(src: str, batch: str) -> dict:
    """One epoch of a ``sample_transform=`` passing image and label on (112-pixel crops, 2
    workers), from the loader's construction to its close: CPU us per image of the whole
    (``cpu_us``: this process and its workers) and of the training process (``own_us``)."""
    loader = _loader(src, "rrc112", batch, 2, sample_transform=_passed_on)
    t0 = os.times()
    n = sum(len(b["label"]) for b in loader)
    loader.close()
    t1 = os.times()
    own = (t1.user - t0.user) + (t1.system - t0.system)
    kids = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
    return {"n": n, "own_us": 1e6 * own / n, "cpu_us": 1e6 * (own + kids) / n}


_CHILD = """
import json, warnings
warnings.simplefilter("ignore")
import bench_against
print(json.dumps(getattr(bench_against, sys.argv[1])(*sys.argv[2:])))
"""

#: job -> (the function above, its arguments from the data made and the case).
JOBS = {
    "pack-folder": lambda m, a, out: ("cli", "pack", m["folder"], out, "-q"),
    "pack-table": lambda m, a, out: ("cli", "pack", m["table"], out, "-q", "--shard-size", "64MB"),
    "writer": lambda m, a, out: ("writer", out, a.rows, m["jpeg"]),
    "epoch-raw": lambda m, a, out: ("epoch_raw", m["table-pack"]),
    "epoch-rrc": lambda m, a, out: ("epoch", m["folder-pack"], "rrc", a.rrc_batch),
    "epoch-tiny": lambda m, a, out: ("epoch", m["table-pack"], "tensor", a.tiny_batch),
    "cpu-tiny": lambda m, a, out: ("cpu", m["table-pack"], "tensor", a.tiny_batch, 1),
    "cpu-rrc": lambda m, a, out: ("cpu", m["folder-pack"], "rrc", a.rrc_batch, 2),
    "transform": lambda m, a, out: ("transform", m["noisy-pack"], a.rrc_batch),
}
EVERYDAY = ("pack-folder", "pack-table", "writer", "epoch-raw", "epoch-rrc", "epoch-tiny")
#: What a job's child reports, and which way is better.
MEASURES = {"seconds": "(<1 faster)", "rate": "(>1 faster)", "cpu_us": "(<1 cheaper)",
            "own_us": "(<1 cheaper)"}  # fmt: skip


def make_data(work: Path, a: Against) -> dict[str, Path]:
    """The folder, the table and their packs (packed by this checkout), made once; the noisy
    photos for ``transform``."""
    folder = data.imagenet(work / "inet", classes=4, per_class=a.per_class)
    table = data.table(work / "table", a.rows, classes=100)
    made = {"folder": folder, "table": table, "jpeg": next((work / "table").glob("seed*.jpg"))}
    made["folder-pack"] = data.packed(folder, work / "inet-pack")
    made["table-pack"] = data.packed(table, work / f"table-{a.rows}-pack")
    if "transform" in a.jobs:
        made["noisy-pack"] = data.packed(data.noisy(None, a.count))
    return made


@harness.case(
    data="an N-row table of 8x8 JPEGs, ImageNet-shaped folder photos, --count noisy photos",
    measures="pack, table pack, ShardWriter, raw and RRC epochs (time, rate), the loader's CPU "
    "per image and a sample_transform epoch's, against another checkout",
    small={
        "rows": 300,
        "per_class": 4,
        "count": 32,
        "tiny_batch": 16,
        "rrc_batch": 4,
        "jobs": tuple(JOBS),
    },  # fmt: skip
)
class Against(harness.Bench):
    rounds: int = 3
    against: Path | None = harness.arg(None, "another checkout, side by side")
    work: Path | None = harness.arg(None, "data (default: the data root)")
    rows: int = harness.arg(100_000, "table rows and writer samples")
    per_class: int = harness.arg(250, "folder photos per class (x4)")
    count: int = harness.arg(2048, "noisy 160x120 photos (transform)")
    tiny_batch: int = 256
    rrc_batch: int = 64
    jobs: tuple[Literal[tuple(JOBS)], ...] = EVERYDAY


def main(a: Against) -> None:
    checkouts = harness.checkouts(a)
    work = a.work or data.root() / "against"
    made = make_data(work, a)

    def run(job: str, c: str):
        out = work / f"out-{c}"
        shutil.rmtree(out, ignore_errors=True)
        return harness.in_child(checkouts[c], _CHILD, *JOBS[job](made, a, out))

    sides = {f"{j}/{c}": (lambda r, j=j, c=c: run(j, c)) for j in a.jobs for c in checkouts}
    rounds = harness.interleave(sides, a.rounds, order="reverse")
    summary = {}
    for j in a.jobs:
        for key, better in MEASURES.items():
            if key in rounds.results[f"{j}/this"][0]:
                got = harness.side_by_side(rounds, f"{j}/this", f"{j}/against", key)
                summary[f"{j} {key}"] = {**got, "measure": key, "better": better}
    result = {"against": str(checkouts["against"]), "rows": a.rows, "jobs": summary}
    harness.write_result(a.json or harness.ROOT / "bench-out" / "bench_against.json",
                         "bench_against", a, result, rounds)  # fmt: skip
    print(f"load average per round: {rounds.load_text()}")
    harness.table(summary, ["this:.2f", "against:.2f", "ratio:.3f", "better", "ratios"])


if __name__ == "__main__":
    harness.script(__file__)
