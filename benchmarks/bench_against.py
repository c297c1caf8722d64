#!/usr/bin/env python3
"""Is anything slower than another checkout? The everyday jobs, timed side by side in one run.

New features must not tax what users already do. This runs the same jobs on this checkout and
on ``--against DIR`` (an older commit: ``git worktree add /tmp/base <rev>``), each job in a fresh
child process per checkout, interleaved round by round (the checkouts alternate which goes first),
and reports per job the median over rounds of the per-round ratio this / against (time: below 1
is faster; rate: above 1 is faster), with the load average of every round:

- ``pack-folder``: ``shardkit pack`` of a folder of ImageNet-shaped photos (``shardkit synth``);
- ``pack-table``: ``shardkit pack`` of an N-row CSV of tiny JPEGs (``bench_table.make_table``);
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

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install
sys.path.insert(0, str(ROOT / "benchmarks"))

_TIME_CLI = """
import subprocess, sys, time, json
t0 = time.perf_counter()
subprocess.run([sys.executable, "-m", "shardkit.cli", *sys.argv[1:]], check=True,
               stdout=subprocess.DEVNULL)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

_WRITER = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
from shardkit import ShardWriter
out, n, jpeg = sys.argv[1], int(sys.argv[2]), open(sys.argv[3], "rb").read()
t0 = time.perf_counter()
with ShardWriter(out, shard_size="16MB") as w:
    for i in range(n):
        w.write(f"s{i:09d}", jpeg, i % 100, txt=f"a caption for sample {i}")
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

_EPOCH_RAW = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
from shardkit import ShardDataset
ds = ShardDataset(sys.argv[1], decode="raw", shuffle=True, seed=1)
t0 = time.perf_counter()
n = sum(1 for _ in ds)
print(json.dumps({"rate": n / (time.perf_counter() - t0), "samples": n}))
"""

_EPOCH_RRC = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
from shardkit import ShardDataset, ShardLoader
ds = ShardDataset(sys.argv[1], decode="tensor", size=224, crop="random", flip=True)
loader = ShardLoader(ds, 64, num_workers=2)
it = iter(loader)
n0 = len(next(it)[0])  # workers up: time the steady epoch
t0 = time.perf_counter()
n = sum(len(x) for x, _ in it)
loader.close()
print(json.dumps({"rate": n / (time.perf_counter() - t0), "samples": n + n0}))
"""

_EPOCH_TINY = _EPOCH_RRC.replace(
    'decode="tensor", size=224, crop="random", flip=True', 'decode="tensor"'
).replace("ShardLoader(ds, 64,", "ShardLoader(ds, 256,")


def child(checkout: Path, argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    r = subprocess.run(argv, env=env, cwd=checkout, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"failed in {checkout}: {' '.join(argv)}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def make_data(work: Path, rows: int, per_class: int) -> dict[str, Path]:
    """The folder, the table and their packs (packed by this checkout), made once."""
    from bench_table import make_table

    from shardkit import pack
    from shardkit.synth import make_imagenet

    folder = work / "inet"
    if not folder.exists():
        make_imagenet(str(folder), classes=4, images_per_class=per_class)
    table = make_table(work / "table", rows, classes=100)
    packs = {"folder": work / "inet-pack", "table": work / f"table-{rows}-pack"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, src in (("folder", folder), ("table", table)):
            if not (packs[name] / "manifest.json").exists():
                pack(str(src), str(packs[name]), progress=False, overwrite=True)
    jpeg = next((work / "table").glob("seed*.jpg"))
    made = {"folder": folder, "table": table, "jpeg": jpeg}
    return {**made, **{f"{k}-pack": v for k, v in packs.items()}}


def job(name: str, checkout: Path, data: dict[str, Path], out: Path, rows: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    py = sys.executable
    if name == "pack-folder":
        return child(checkout, [py, "-c", _TIME_CLI, "pack", str(data["folder"]), str(out), "-q"])
    if name == "pack-table":
        cli = ["pack", str(data["table"]), str(out), "-q", "--shard-size", "64MB"]
        return child(checkout, [py, "-c", _TIME_CLI, *cli])
    if name == "writer":
        return child(checkout, [py, "-c", _WRITER, str(out), str(rows), str(data["jpeg"])])
    if name == "epoch-raw":
        return child(checkout, [py, "-c", _EPOCH_RAW, str(data["table-pack"])])
    if name == "epoch-tiny":
        return child(checkout, [py, "-c", _EPOCH_TINY, str(data["table-pack"])])
    return child(checkout, [py, "-c", _EPOCH_RRC, str(data["folder-pack"])])


JOBS = ("pack-folder", "pack-table", "writer", "epoch-raw", "epoch-rrc", "epoch-tiny")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", type=Path, required=True, help="the other checkout")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-against"))
    ap.add_argument("--rows", type=int, default=100_000, help="table rows and writer samples")
    ap.add_argument("--per-class", type=int, default=250, help="folder photos per class (x4)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--json", type=Path, default=ROOT / "bench-out" / "bench_against.json")
    a = ap.parse_args()
    data = make_data(a.work, a.rows, a.per_class)
    checkouts = {"this": ROOT, "against": a.against.resolve()}
    jobs = a.jobs.split(",")
    results: dict[str, dict[str, list[dict]]] = {j: {c: [] for c in checkouts} for j in jobs}
    loads = []
    for r in range(a.rounds):
        loads.append(round(os.getloadavg()[0], 2))
        for j in jobs:
            order = list(checkouts) if r % 2 == 0 else list(checkouts)[::-1]
            for c in order:
                results[j][c].append(job(j, checkouts[c], data, a.work / f"out-{c}", a.rows))
        print(f"round {r + 1}/{a.rounds} done, load {loads[-1]}", file=sys.stderr)
    summary = {}
    for j in jobs:
        key = "seconds" if "seconds" in results[j]["this"][0] else "rate"
        pairs = zip(results[j]["this"], results[j]["against"], strict=True)
        ratios = [x[key] / y[key] for x, y in pairs]
        summary[j] = {
            "measure": key,
            "this": statistics.median(x[key] for x in results[j]["this"]),
            "against": statistics.median(x[key] for x in results[j]["against"]),
            "ratio": statistics.median(ratios),
            "ratios": [round(x, 3) for x in ratios],
        }
    doc = {"against": str(checkouts["against"]), "rows": a.rows, "loads": loads, "jobs": summary}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"load average per round: {loads}")
    print(f"{'job':12s} {'measure':8s} {'this':>10s} {'against':>10s} {'ratio':>7s}  per round")
    for j, s in summary.items():
        better = "(<1 faster)" if s["measure"] == "seconds" else "(>1 faster)"
        print(
            f"{j:12s} {s['measure']:8s} {s['this']:10.2f} {s['against']:10.2f} "
            f"{s['ratio']:7.3f}  {s['ratios']} {better}"
        )


if __name__ == "__main__":
    main()
