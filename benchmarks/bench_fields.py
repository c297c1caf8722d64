#!/usr/bin/env python3
"""What reading a caption and a JSON field costs beside each image, through ShardDataset.

The LFW-shaped set with a ``.txt`` caption and a ``.json`` beside every image, packed once; the
same shards read by ``DataLoader(ShardDataset(decode="tensor"))`` without fields and with
``fields=("txt", "json")`` (decoded: str and object, default collate). One interleaved run
(every contender once per repeat), medians over repeats, the ratio the median of per-repeat
ratios; the load average is printed beside it. ShardLoader takes no fields yet.

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


def _rate(src: str, fields: tuple[str, ...], workers: int, batch: int) -> float:
    from torch.utils.data import DataLoader

    from shardkit import ShardDataset

    ds = ShardDataset(src, decode="tensor", size=64, fields=fields)
    loader = DataLoader(ds, batch_size=batch, num_workers=workers)
    start, n = time.perf_counter(), 0
    for batch_ in loader:
        n += len(batch_[0])
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("/tmp/shardkit-bench-fields"))
    ap.add_argument("--scale", type=float, default=0.15)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    src = _data(args.data, args.scale)
    load_before = os.getloadavg()[0]
    plain, fields = [], []
    for _ in range(args.repeats):
        plain.append(_rate(src, (), args.workers, args.batch_size))
        fields.append(_rate(src, ("txt", "json"), args.workers, args.batch_size))
    ratio = statistics.median(f / p for f, p in zip(fields, plain, strict=True))
    print(f"images/s, median of {args.repeats}: image only {statistics.median(plain):.0f}, "
          f"with txt+json {statistics.median(fields):.0f}; ratio {ratio:.3f} "
          f"(load average {load_before:.1f} -> {os.getloadavg()[0]:.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
