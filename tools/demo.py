"""`make demo`: the main job end to end on the embedded default dataset.

Runs the same commands a user would type (printed before each step), so the demo doubles as a
check that the README's examples work on a fresh machine.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)

# What the demo leaves behind, where README and docs/ expect it (tests/docs/test_readme.py prepares
# the same layout with small data): the image tree, README's Quick start pack in out/ (the exact
# command, so running it again is up to date), and an LMDB copy in out-lmdb/ for docs/.
# (out, format, shard size): the shard size is part of the command each pack prints.
LAYOUT = SimpleNamespace(
    data="data/lfw",
    packs=[("out/", "tar", "256MB"), ("out-lmdb/", "lmdb", "16MB")],
)


def step(title: str, *argv: str) -> None:
    print(f"\n=== {title}\n$ {shlex.join(argv)}", flush=True)
    cmd = [os.path.join(BIN, argv[0]), *argv[1:]] if argv[0] == "shardkit" else list(argv)
    subprocess.run(cmd, cwd=ROOT, check=True)


def stream(shards: str) -> None:
    """Two epochs through a real DataLoader with worker processes, then through ShardLoader
    (worker processes decoding into a reused shared-memory ring), as training code would."""
    from torch.utils.data import DataLoader

    from shardkit import ShardDataset, ShardLoader

    ds = ShardDataset(shards, decode="tensor", seed=0)
    print(f"\n=== stream: ShardDataset({shards!r}, decode='tensor')")
    print(f"len(ds) = {len(ds)} samples per epoch on this rank")
    loaders = {
        "DataLoader(ds, batch_size=64, num_workers=2)": DataLoader(
            ds, batch_size=64, num_workers=2, persistent_workers=True
        ),
        "ShardLoader(ds, batch_size=64, num_workers=2)": ShardLoader(ds, 64, num_workers=2),
    }
    for name, loader in loaders.items():
        print(f"-> {name}")
        for epoch in range(2):
            ds.set_epoch(epoch)
            t0 = time.perf_counter()
            n = 0
            first = None
            for images, labels in loader:
                if first is None:
                    first = (tuple(images.shape), images.dtype, labels[:8].tolist())
                n += len(labels)
            dt = time.perf_counter() - t0
            print(
                f"epoch {epoch}: {n} samples in {dt:.1f} s = {n / dt:,.0f} samples/s; "
                f"first batch {first[0]} {first[1]}, labels {first[2]}"
            )
    loaders["ShardLoader(ds, batch_size=64, num_workers=2)"].close()


def main() -> None:
    os.chdir(ROOT)
    step(
        "make the embedded LFW-shaped dataset (skipped if already made)",
        "shardkit",
        "synth",
        "lfw",
        LAYOUT.data,
    )
    if os.path.isdir("out/lfw") and not os.path.exists("out/manifest.json"):
        sys.exit(
            "out/ holds an older demo's layout (out/lfw, out/lfw-lmdb); the demo now packs into "
            "out/ itself: remove out/ (make clean) and run it again"
        )
    for out, fmt, size in LAYOUT.packs:
        fmt_args = () if fmt == "tar" else ("--format", fmt)
        step(
            f"pack it into {fmt} shards (up to date if an earlier run packed it)",
            "shardkit",
            "pack",
            LAYOUT.data,
            out,
            *fmt_args,
            "--shard-size",
            size,
        )
    tar = LAYOUT.packs[0][0]
    step("what was packed", "shardkit", "info", tar)
    step("check every shard against the manifest", "shardkit", "verify", tar)
    stream(tar + "*.tar")  # README's ShardDataset("out/*.tar")
    # --shards: the bench reads the tar shards packed above instead of packing its own copy.
    step(
        "benchmark: folder of files vs shards, cold cache, raw reads",
        "shardkit",
        "bench",
        "--data",
        LAYOUT.data,
        "--shards",
        tar,
        "--workers",
        "0,2,4",
        "--repeats",
        "2",
        "--mode",
        "raw",
        "--cold",
        "--plot",
        "bench-out/demo-bench.png",
        "--json",
        "bench-out/demo-bench.json",
    )


if __name__ == "__main__":
    main()
