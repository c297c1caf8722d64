#!/usr/bin/env python3
"""A CLIP recipe through ShardLoader against WebDataset, the same tar shards.

ImageNet-shaped photos (``shardkit synth``: mostly 500x375) with a caption and img2dataset-style
JSON metadata each, written once as img2dataset writes them (``000000000.jpg/.txt/.json`` per
sample, no class) and indexed with ``shardkit index``: both sides read the very same tar files.

- shardkit: ``ShardDataset(decode="tensor", crop=RandomResizedCrop(224, scale=(0.9, 1.0),
  interpolation="bicubic"), flip=True, fields=("txt",))`` through ``ShardLoader``.
- WebDataset (open_clip's pipeline, torchvision's transforms written out: torchvision cannot
  install here): ``WebDataset(urls, shardshuffle=True).shuffle(1000).decode("pil")
  .to_tuple("jpg", "txt")``, then RandomResizedCrop's box by ``get_params`` and PIL's bicubic
  resize of that box (what ``torchvision.transforms.RandomResizedCrop`` does to a PIL image),
  a flip, ``to_tensor``-like uint8 CHW, through ``DataLoader(batch_size, num_workers)``.

One epoch per contender and round, interleaved (the order alternates every round), images/s
over the epoch after its first batch, the load average of every round; the ratio is the median
of per-round ratios. CPU per image (this process and its joined workers over the whole epoch,
start-up included) is the figure a busy machine moves least. Goal: shardkit >= 2.5x
WebDataset on 2 cores.

    python benchmarks/bench_clip.py --imagenet /tmp/bench-crops/inet --rounds 3
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import resource
import statistics
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install


def _shards(tree: Path, out: Path, per_shard: int) -> str:
    """img2dataset's layout for every photo of ``tree``, then ``shardkit index``."""
    if (out / "manifest.json").exists():
        return str(out)
    from shardkit.write.index import index_shards

    photos = sorted(tree.rglob("*.JPEG")) + sorted(tree.rglob("*.jpg"))
    out.mkdir(parents=True, exist_ok=True)
    for s in range(0, len(photos), per_shard):
        with tarfile.open(out / f"{s // per_shard:05d}.tar", "w") as tar:
            for j, path in enumerate(photos[s : s + per_shard]):
                key = f"{s // per_shard:05d}{j:04d}"
                meta = {"url": f"https://example.com/{path.name}", "key": key, "caption": None,
                        "status": "success", "exif": None, "error_message": None}  # fmt: skip
                members = (
                    ("jpg", path.read_bytes()),
                    ("txt", f"a photo of a {path.parent.name}".encode()),
                    ("json", json.dumps(meta).encode()),
                )
                for ext, data in members:
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    index_shards([str(out)])
    return str(out)


def _shardkit_epoch(source: str, workers: int, batch: int, epoch: int) -> float:
    from shardkit import RandomResizedCrop, ShardDataset, ShardLoader

    crop = RandomResizedCrop(224, scale=(0.9, 1.0), interpolation="bicubic")
    ds = ShardDataset(source, decode="tensor", crop=crop, flip=True, fields=("txt",))
    loader = ShardLoader(ds, batch, num_workers=workers)
    try:
        loader.set_epoch(epoch)
        return _rate(iter(loader), lambda b: len(b["image"]))
    finally:
        loader.close()


def _rrc_params(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``, scale (0.9, 1.0), ratio (3/4, 4/3)."""
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * rng.uniform(0.9, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    side = min(width, height)
    return (height - side) // 2, (width - side) // 2, side, side


class _ClipTransform:
    """What ``RandomResizedCrop(224, (0.9, 1), BICUBIC)``, ``RandomHorizontalFlip`` and
    ``PILToTensor`` do to a PIL image."""

    def __init__(self) -> None:
        self.rng = random.Random(os.getpid())

    def __call__(self, img):
        import numpy as np
        import torch
        from PIL import Image

        top, left, h, w = _rrc_params(img.width, img.height, self.rng)
        out = img.resize((224, 224), Image.BICUBIC, box=(left, top, left + w, top + h))
        if self.rng.random() < 0.5:
            out = out.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(out)).permute(2, 0, 1).contiguous()


def _webdataset_epoch(source: str, workers: int, batch: int, epoch: int) -> float:
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = sorted(str(p) for p in Path(source).glob("*.tar"))
    ds = (
        wds.WebDataset(urls, shardshuffle=100, seed=epoch, empty_check=False)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "txt")
        .map_tuple(_ClipTransform(), lambda t: t)
    )
    loader = DataLoader(ds, batch_size=batch, num_workers=workers)
    return _rate(iter(loader), lambda b: len(b[0]))


def _cpu() -> float:
    """CPU seconds of this process and of its ended children (the workers, once joined)."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _rate(it, count) -> float:
    next(it)  # workers started, shards open: time the steady epoch after the first batch
    n, t0 = 0, time.perf_counter()
    for b in it:
        n += count(b)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--imagenet", type=Path, default=Path("/tmp/bench-crops/inet"))
    ap.add_argument("--classes", type=int, default=4)
    ap.add_argument("--per-class", type=int, default=150)
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=ROOT / "bench-out" / "bench_clip.json")
    args = ap.parse_args()
    if not args.imagenet.exists():
        from shardkit.synth import make_imagenet

        make_imagenet(str(args.imagenet), classes=args.classes, images_per_class=args.per_class)
    source = _shards(args.imagenet, args.imagenet.parent / "clip-shards", args.per_shard)
    sides = {"shardkit": _shardkit_epoch, "webdataset": _webdataset_epoch}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    count = sum(1 for _ in args.imagenet.rglob("*.JPEG"))
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            cpu0 = _cpu()
            rates[name].append(sides[name](source, args.workers, args.batch, r))
            cpu[name].append((_cpu() - cpu0) / count * 1e6)
        print(f"round {r}: load {loads[-1]:.2f} " + ", ".join(
            f"{n} {rates[n][-1]:.0f} img/s" for n in sides), file=sys.stderr)  # fmt: skip
    ratios = [a / b for a, b in zip(rates["shardkit"], rates["webdataset"], strict=True)]
    result = dict(
        workers=args.workers, batch=args.batch, rounds=args.rounds, cpus=os.cpu_count(),
        images_per_s={n: statistics.median(v) for n, v in rates.items()}, rates=rates,
        cpu_us_per_image={n: statistics.median(v) for n, v in cpu.items()},
        ratio=statistics.median(ratios), ratios=ratios, load_per_round=loads,
        load_end=os.getloadavg()[0],
    )  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
