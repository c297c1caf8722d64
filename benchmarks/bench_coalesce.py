"""Remote sparse epochs with nearby samples coalesced into one ranged GET, against one GET a
run of adjacent samples (``RemoteStorage(ranged_gap=0)``, the rule before): subset and split
epochs of a few thousand small samples over the tests' loopback HTTP server, counted, not
timed (ranged GETs per drawn sample, bytes asked over the samples' own), each epoch's samples
checked against the local epoch's. Figures: docs/benchmarks.md ("Nearby samples in one GET").

    python benchmarks/bench_coalesce.py --samples 3000
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path

import harness
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from remote_servers import HttpServer

from shardkit.formats.sample_index import decode_index, index_path
from shardkit.manifest import read_manifest
from shardkit.remote import RemoteStorage
from shardkit.stream.dataset import ShardDataset
from shardkit.stream.mix import Source
from shardkit.stream.shuffle import Order
from shardkit.write.packer import pack

CASES = {
    "subset=0.01": {"subset": 0.01},
    "subset=0.1": {"subset": 0.1},
    "subset=0.3": {"subset": 0.3},
    "split=val (0.1)": {"split": "val", "val_fraction": 0.1},
}


def build(root: Path, n: int) -> Path:
    rng = np.random.default_rng(0)
    for i in range(n):
        os.makedirs(root / "src" / f"c{i % 3}", exist_ok=True)
        arr = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)
        Image.fromarray(arr).save(root / "src" / f"c{i % 3}" / f"im{i:05d}.jpg")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pack(str(root / "src"), str(root / "tar"), shard_size="200kB", progress=False)
    return root / "tar"


def sizes(out: Path) -> dict[str, int]:
    got = {}
    for e in read_manifest(str(out)).shards:
        shard = str(out / e.path)
        ix = decode_index(open(index_path(shard), "rb").read(), shard)
        for j, key in enumerate(ix.keys()):
            got[key] = int(ix.offsets[j + 1] - ix.offsets[j])
    return got


@harness.case(
    data="N samples of ~2.6 kB packed, served by the loopback HTTP Range server",
    measures="ranged GETs and bytes of a sparse epoch with and without coalescing",
    small={"samples": 300},
)
class Coalesce(harness.Bench):
    rounds: int = 1
    samples: int = harness.arg(3000, "samples packed")


def main(args: Coalesce) -> None:
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-coalesce-") as tmp:
        out = build(Path(tmp), args.samples)
        size = sizes(out)
        shards = len(read_manifest(str(out)).shards)
        print(
            f"{args.samples} samples in {shards} shards, ~{np.mean(list(size.values())):.0f} B each"
        )
        with HttpServer(Path(tmp)) as http:
            url = f"{http.url}/tar/manifest.json"
            for name, kw in CASES.items():
                local = [
                    s[2]
                    for s in ShardDataset(
                        Source(str(out), **kw),
                        decode="raw",
                        with_keys=True,
                        order=Order(shuffle=False),
                    )
                ]
                drawn = sum(size[k] for k in local)
                row = [f"{name:16} {len(local):5} drawn"]
                result[name] = {"drawn": len(local)}
                for label, gap in (("gap 0 (before)", 0), ("ranged_gap 1 MiB", 1 << 20)):
                    http.log.clear()
                    ds = ShardDataset(
                        Source(url, **kw),
                        decode="raw",
                        with_keys=True,
                        order=Order(shuffle=False),
                        storage=RemoteStorage(prefetch=0, ranged_gap=gap),
                    )
                    keys = [s[2] for s in ds]
                    if keys != local:
                        raise SystemExit(f"{name}, {label}: not the local epoch's samples")
                    gets = [
                        g[2] for g in http.log.gets(".tar") if g[2] and not g[1].endswith(".idx")
                    ]
                    read = sum(
                        int(r.split("-")[1]) - int(r.split("=")[1].split("-")[0]) + 1 for r in gets
                    )
                    result[name][f"gap_{gap}"] = {
                        "gets_per_sample": len(gets) / max(1, len(keys)),
                        "read_per_drawn": read / max(1, drawn),
                    }
                    row.append(
                        f"{label}: {len(gets) / max(1, len(keys)):.3f} GETs/sample, "
                        f"read/drawn {read / max(1, drawn):.2f}"
                    )
                print(" | ".join(row), flush=True)
    harness.write_result(args.json, "bench_coalesce", args, result)
    return 0


if __name__ == "__main__":
    harness.script(__file__)
