#!/usr/bin/env python3
"""Is anything slower than another checkout? The everyday jobs, timed side by side in one run.

New features must not tax what users already do. This runs the same jobs on this checkout and
on ``--against DIR`` (an older commit: ``git worktree add /tmp/base <rev>``), each job in a fresh
child process per checkout, interleaved round by round (the checkouts alternate which goes first),
and reports per job the median over rounds of the per-round ratio this / against (time: below 1
is faster; rate: above 1 is faster), with the load average of every round:

- ``pack-folder``: ``shardkit pack`` of a folder of ImageNet-shaped photos (``shardkit synth``);
- ``pack-table``: ``shardkit pack`` of an N-row CSV of tiny JPEGs (``data.table``);
- ``writer``: ``ShardWriter`` with N tiny samples (a label and a caption field each);
- ``epoch-raw``: one ``ShardDataset(decode="raw")`` epoch over the table's pack, samples/s;
- ``epoch-rrc``: one ``ShardLoader`` epoch (2 workers, random-resized crops to 224) over the
  folder's pack, images/s;
- ``epoch-tiny``: one ``ShardLoader`` epoch (2 workers, whole 8x8 JPEGs, batches of 256) over
  the table's pack, images/s: the least work per image, where per-image costs show most.

Every child times only its job (after imports); the data sets are made once, before round 1.

    python benchmarks/bench_against.py --against /tmp/base --rounds 5
"""

from __future__ import annotations

import shutil
from pathlib import Path

import data
import harness

_TIME_CLI = """
import gc, subprocess, sys, time, json
gc.collect()  # the imports' garbage collected here, not in the timed job
t0 = time.perf_counter()
subprocess.run([sys.executable, "-m", "shardkit.cli", *sys.argv[1:]], check=True,
               stdout=subprocess.DEVNULL)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

_WRITER = """
import gc, json, sys, time, warnings
warnings.simplefilter("ignore")
from shardkit import ShardWriter
out, n, jpeg = sys.argv[1], int(sys.argv[2]), open(sys.argv[3], "rb").read()
gc.collect()  # the imports' garbage collected here, not in the timed job
t0 = time.perf_counter()
with ShardWriter(out, shard_size="16MB") as w:
    for i in range(n):
        w.write(f"s{i:09d}", jpeg, i % 100, txt=f"a caption for sample {i}")
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

_EPOCH_RAW = """
import gc, json, sys, time, warnings
warnings.simplefilter("ignore")
from shardkit import ShardDataset
ds = ShardDataset(sys.argv[1], decode="raw", seed=1)
gc.collect()  # the imports' garbage collected here, not in the timed job
t0 = time.perf_counter()
n = sum(1 for _ in ds)
print(json.dumps({"rate": n / (time.perf_counter() - t0), "samples": n}))
"""

_EPOCH_RRC = """
import gc, json, sys, time, warnings
warnings.simplefilter("ignore")
from shardkit import Decode, RandomResizedCrop, ShardDataset, ShardLoader
ds = ShardDataset(sys.argv[1], decode=Decode(crop=RandomResizedCrop(224), flip=True))
loader = ShardLoader(ds, 64, num_workers=2)
it = iter(loader)
n0 = len(next(it)[0])  # workers up: time the steady epoch
gc.collect()  # the imports' garbage collected here, not in the timed job
t0 = time.perf_counter()
n = sum(len(x) for x, _ in it)
loader.close()
print(json.dumps({"rate": n / (time.perf_counter() - t0), "samples": n + n0}))
"""

_EPOCH_TINY = _EPOCH_RRC.replace(
    "decode=Decode(crop=RandomResizedCrop(224), flip=True)", 'decode="tensor"'
).replace("ShardLoader(ds, 64,", "ShardLoader(ds, 256,")

JOBS = ("pack-folder", "pack-table", "writer", "epoch-raw", "epoch-rrc", "epoch-tiny")


def make_data(work: Path, rows: int, per_class: int) -> dict[str, Path]:
    """The folder, the table and their packs (packed by this checkout), made once."""
    folder = data.imagenet(work / "inet", classes=4, per_class=per_class)
    table = data.table(work / "table", rows, classes=100)
    made = {"folder": folder, "table": table, "jpeg": next((work / "table").glob("seed*.jpg"))}
    made["folder-pack"] = data.packed(folder, work / "inet-pack")
    made["table-pack"] = data.packed(table, work / f"table-{rows}-pack")
    return made


def job(name: str, checkout: Path, made: dict[str, Path], out: Path, rows: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    if name == "pack-folder":
        return harness.in_child(checkout, _TIME_CLI, "pack", made["folder"], out, "-q")
    if name == "pack-table":
        cli = ["pack", made["table"], out, "-q", "--shard-size", "64MB"]
        return harness.in_child(checkout, _TIME_CLI, *cli)
    if name == "writer":
        return harness.in_child(checkout, _WRITER, out, rows, made["jpeg"])
    if name == "epoch-raw":
        return harness.in_child(checkout, _EPOCH_RAW, made["table-pack"])
    if name == "epoch-tiny":
        return harness.in_child(checkout, _EPOCH_TINY, made["table-pack"])
    return harness.in_child(checkout, _EPOCH_RRC, made["folder-pack"])


@harness.case(
    data="an N-row table of 8x8 JPEGs and LFW-shaped folder photos",
    measures="pack, table pack, ShardWriter, raw and RRC epochs against another checkout",
    small={"rows": 300, "per_class": 4},
)
class Against(harness.Bench):
    rounds: int = 3
    against: Path | None = harness.arg(None, "another checkout, side by side")
    work: Path | None = harness.arg(None, "data (default: the data root)")
    rows: int = harness.arg(100_000, "table rows and writer samples")
    per_class: int = harness.arg(250, "folder photos per class (x4)")
    jobs: str = ",".join(JOBS)


def main(a: Against) -> None:
    checkouts = harness.checkouts(a)
    work = a.work or data.root() / "against"
    made = make_data(work, a.rows, a.per_class)
    jobs = a.jobs.split(",")
    sides = {  # every job on both checkouts each round; the order flips every round
        f"{j}/{c}": (lambda r, c=c, j=j: job(j, checkouts[c], made, work / f"out-{c}", a.rows))
        for j in jobs
        for c in checkouts
    }
    rounds = harness.interleave(sides, a.rounds, order="reverse")
    summary = {}
    for j in jobs:
        key = "seconds" if "seconds" in rounds.results[f"{j}/this"][0] else "rate"
        summary[j] = {
            "measure": key,
            **harness.side_by_side(rounds, f"{j}/this", f"{j}/against", key),
        }
    result = {"against": str(checkouts["against"]), "rows": a.rows, "jobs": summary}
    harness.write_result(a.json or harness.ROOT / "bench-out" / "bench_against.json",
                         "bench_against", a, result, rounds)  # fmt: skip
    print(f"load average per round: {rounds.load_text()}")
    print(f"{'job':12s} {'measure':8s} {'this':>10s} {'against':>10s} {'ratio':>7s}  per round")
    for j, s in summary.items():
        better = "(<1 faster)" if s["measure"] == "seconds" else "(>1 faster)"
        print(
            f"{j:12s} {s['measure']:8s} {s['this']:10.2f} {s['against']:10.2f} "
            f"{s['ratio']:7.3f}  {s['ratios']} {better}"
        )


if __name__ == "__main__":
    harness.script(__file__)
