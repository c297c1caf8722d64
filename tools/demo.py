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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def step(title: str, *argv: str) -> None:
    print(f"\n=== {title}\n$ {shlex.join(argv)}", flush=True)
    cmd = [os.path.join(BIN, argv[0]), *argv[1:]] if argv[0] == "shardkit" else list(argv)
    subprocess.run(cmd, cwd=ROOT, check=True)


def stream(shards: str) -> None:
    """Two epochs through a real DataLoader with worker processes, as training code would."""
    import torch
    from torch.utils.data import DataLoader

    from shardkit import ShardDataset

    print(f"\n=== stream: ShardDataset({shards!r}, decode='tensor') -> DataLoader(2 workers)")
    ds = ShardDataset(shards, decode="tensor", seed=0)
    loader = DataLoader(ds, batch_size=64, num_workers=2, persistent_workers=True)
    print(f"len(ds) = {len(ds)} samples per epoch on this rank")
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
        print(f"epoch {epoch}: {n} samples in {dt:.1f} s = {n / dt:,.0f} samples/s; "
              f"first batch {first[0]} {first[1]}, labels {first[2]}")
    assert isinstance(images, torch.Tensor)


def main() -> None:
    os.chdir(ROOT)
    step("make the embedded LFW-shaped dataset (skipped if already made)",
         "shardkit", "synth", "lfw", "data/lfw")
    step("pack it into tar shards", "shardkit", "pack", "data/lfw", "out/lfw-tar",
         "--shard-size", "32MB", "--threads", "2", "--overwrite")
    step("pack it into LMDB shards", "shardkit", "pack", "data/lfw", "out/lfw-lmdb",
         "--format", "lmdb", "--shard-size", "32MB", "--threads", "2", "--overwrite")
    step("what was packed", "shardkit", "info", "out/lfw-tar")
    step("check every shard against the manifest", "shardkit", "verify", "out/lfw-tar")
    stream("out/lfw-tar")
    step("benchmark: folder of files vs shards, cold cache, raw reads",
         "shardkit", "bench", "--data", "data/lfw", "--workers", "0,2,4", "--repeats", "2",
         "--mode", "raw", "--cold", "--plot", "bench-out/demo-bench.png",
         "--json", "bench-out/demo-bench.json")
    print("\nplot written to bench-out/demo-bench.png")


if __name__ == "__main__":
    main()
