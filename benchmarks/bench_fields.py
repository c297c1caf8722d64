#!/usr/bin/env python3
"""What reading a caption and a JSON field costs beside each image, through ShardDataset.

The LFW-shaped set with a ``.txt`` caption and a ``.json`` beside every image, packed once; the
same shards read by ``DataLoader(ShardDataset(decode="tensor"))`` without fields and with
``fields=("txt", "json")`` (decoded: str and object, default collate). One interleaved run
(every contender once per repeat), medians over repeats, the ratio the median of per-repeat
ratios; the load average is printed beside it. The same pair through ``ShardLoader`` (a dict
per batch, fields decoded in its workers), with the training process's own CPU per image.

    python benchmarks/bench_fields.py --data /tmp/lfw-fields --scale 0.15 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install


def _data(root: Path, scale: float) -> str:
    """The tree with captions (made when missing) and its pack; returns the pack's folder."""
    from shardkit.synth import make_lfw
    from shardkit.write.packer import pack

    tree, out = root / "tree", root / "packed"
    if not tree.exists():
        make_lfw(tree, scale=scale)
        for i, image in enumerate(sorted(tree.rglob("*.jpg"))):
            stem = image.with_suffix("")
            Path(f"{stem}.txt").write_text(f"a photo of {image.parent.name}, number {i}")
            Path(f"{stem}.json").write_text(json.dumps({"i": i, "person": image.parent.name}))
    if not (out / "manifest.json").exists():
        pack(str(tree), str(out), progress=False)
    return str(out)


def _rate(src: str, fields: tuple[str, ...], workers: int, batch: int, shard_loader=False):
    """(images/s, the training process's CPU us per image) of one epoch."""
    from torch.utils.data import DataLoader

    from shardkit import ShardDataset, ShardLoader

    ds = ShardDataset(src, decode="tensor", size=64, fields=fields)
    if shard_loader:
        loader = ShardLoader(ds, batch, num_workers=max(1, workers))
        next(iter(loader))  # workers started, as a trainer keeps them
    else:
        loader = DataLoader(ds, batch_size=batch, num_workers=workers)
    start, cpu, n = time.perf_counter(), time.process_time(), 0
    for batch_ in loader:
        n += len(batch_["image"] if isinstance(batch_, dict) else batch_[0])
    rate = n / (time.perf_counter() - start)
    main_us = (time.process_time() - cpu) / n * 1e6
    if shard_loader:
        loader.close()
    return rate, main_us


def main() -> None:
    import warnings

    warnings.simplefilter("ignore")  # each contender re-reads epoch 0 on purpose
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("/tmp/shardkit-bench-fields"))
    ap.add_argument("--scale", type=float, default=0.15)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    src = _data(args.data, args.scale)
    load_before = os.getloadavg()[0]
    runs: dict = {}
    for _ in range(args.repeats):
        for name, loader in (("DataLoader", False), ("ShardLoader", True)):
            for what, fields in (("plain", ()), ("fields", ("txt", "json"))):
                res = _rate(src, fields, args.workers, args.batch_size, loader)
                runs.setdefault((name, what), []).append(res)
    for name in ("DataLoader", "ShardLoader"):
        plain, fields = runs[(name, "plain")], runs[(name, "fields")]
        ratio = statistics.median(f[0] / p[0] for f, p in zip(fields, plain, strict=True))
        print(f"{name}: images/s, median of {args.repeats}: image only "
              f"{statistics.median(r[0] for r in plain):.0f}, with txt+json "
              f"{statistics.median(r[0] for r in fields):.0f}; ratio {ratio:.3f}; training "
              f"process CPU {statistics.median(r[1] for r in plain):.0f} -> "
              f"{statistics.median(r[1] for r in fields):.0f} us/image")  # fmt: skip
    print(f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
