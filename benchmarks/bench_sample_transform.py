#!/usr/bin/env python3
"""What a ``sample_transform`` batch costs in CPU per image: this checkout against another.

Small noisy JPEGs (made once, ``--count`` of 160x120) packed into tar shards; one epoch of
``ShardLoader(ShardDataset(size=112, crop="random", sample_transform=...), 64,
num_workers=--workers)`` per contender and round, each in its own child process, so its CPU
is the child's own and its reaped workers' (``os.times``: user + system), per image delivered.
The transform passes the image and label on: what is measured is how the batch reaches the
caller (this checkout: stacked columns through the ring's slots; an older one: pickled through
the pipe). Rounds interleave the contenders; the ratio is the median of per-round ratios, with
the load average beside it.

    git worktree add /tmp/base 16caec4 && cp shardkit/images/_native*.so /tmp/base/shardkit/images/
    python benchmarks/bench_sample_transform.py --against /tmp/base --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_EPOCH = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import shardkit
from shardkit import ShardDataset, ShardLoader

def passed_on(s):
    return {"image": s["image"], "label": s["label"]}

ds = ShardDataset(sys.argv[2], decode="tensor", size=112, crop="random", sample_transform=passed_on)
loader = ShardLoader(ds, 64, num_workers=int(sys.argv[3]))
t0 = os.times()
n = sum(len(b["label"]) for b in loader)
loader.close()
t1 = os.times()
own = (t1.user - t0.user) + (t1.system - t0.system)
children = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
print(json.dumps({"n": n, "own": own, "all": own + children, "shardkit": shardkit.__file__}))
"""


def _data(root: Path, count: int) -> str:
    import numpy as np
    from PIL import Image

    from shardkit.write.packer import pack

    src, out = root / "src", root / "tar"
    if not (out / "manifest.json").exists():
        rng = np.random.default_rng(0)
        for i in range(count):
            d = src / f"c{i % 4}"
            d.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(d / f"{i:05d}.jpg", quality=90)
        pack(str(src), str(out), progress=False)
    return str(out)


def _epoch(checkout: Path, data: str, workers: int) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", _EPOCH, str(checkout), data, str(workers)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise SystemExit(f"{checkout} failed:\n{r.stderr[-2000:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    if not doc["shardkit"].startswith(str(checkout)):
        raise SystemExit(f"ran {doc['shardkit']}, not {checkout}'s shardkit")
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, required=True, help="another checkout")
    ap.add_argument("--data", type=Path, default=Path("/tmp/bench-sample-transform"))
    ap.add_argument("--count", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    data = _data(args.data, args.count)
    sides = {"this": ROOT, "against": args.against.resolve()}
    per: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            per[name].append(_epoch(sides[name], data, args.workers))
        this, other = per["this"][-1], per["against"][-1]
        print(
            f"round {r}: CPU us/image this {1e6 * this['all'] / this['n']:.0f} "
            f"(trainer {1e6 * this['own'] / this['n']:.0f}), against "
            f"{1e6 * other['all'] / other['n']:.0f} (trainer {1e6 * other['own'] / other['n']:.0f})"
            f", load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    pairs = list(zip(per["this"], per["against"], strict=True))
    ratio = statistics.median((a["all"] / a["n"]) / (b["all"] / b["n"]) for a, b in pairs)
    own = statistics.median((a["own"] / a["n"]) / (b["own"] / b["n"]) for a, b in pairs)
    print(f"CPU per image, this / against: {ratio:.2f} (the training process's own: {own:.2f})")


if __name__ == "__main__":
    main()
