#!/usr/bin/env python3
"""A CLIP recipe through ShardLoader against WebDataset (open_clip's pipeline, torchvision's
RandomResizedCrop written out), on the very same img2dataset-style tar shards (a caption and
JSON metadata per photo), one epoch per contender and round, interleaved: images/s after the
first batch, CPU per image, the median of per-round ratios. Goal: >= 2.5x on 2 cores.

    python benchmarks/bench_clip.py --imagenet /tmp/bench-crops/inet --rounds 3
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
from pathlib import Path

import data
import harness


def _shardkit_epoch(source: str, workers: int, batch: int, epoch: int) -> float:
    from shardkit import Decode, RandomResizedCrop, ShardDataset, ShardLoader

    crop = RandomResizedCrop(224, scale=(0.9, 1.0), interpolation="bicubic")
    ds = ShardDataset(source, decode=Decode("tensor", crop=crop, flip=True), fields=("txt",))
    loader = ShardLoader(ds, batch, num_workers=workers)
    try:
        loader.set_epoch(epoch)
        return harness.epoch(loader)["steady_rate"]  # after the first batch: the steady epoch
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
    return harness.epoch(loader)["steady_rate"]


@harness.case(
    data="img2dataset-style CLIP shards of an ImageNet-shaped tree",
    measures="a CLIP recipe through ShardLoader against WebDataset on the same tars",
    small={"classes": 2, "per_class": 8, "per_shard": 4, "batch": 4},
)
class Clip(harness.Bench):
    rounds: int = 3
    imagenet: Path | None = harness.arg(None, "the photos (default: data root)")
    classes: int = 4
    per_class: int = 150
    per_shard: int = 100
    workers: int = 2
    batch: int = 64


def main(args: Clip) -> None:
    tree = data.imagenet(args.imagenet, args.classes, args.per_class)
    source = str(data.clip_shards(tree, tree.parent / "clip-shards", args.per_shard))
    count = sum(1 for _ in tree.rglob("*.JPEG"))
    sides = {"shardkit": _shardkit_epoch, "webdataset": _webdataset_epoch}
    try:
        import webdataset  # noqa: F401
    except ImportError:
        if not args.smoke:
            raise
        del sides["webdataset"]  # smoke: the contender's package is not installed
    rounds = harness.interleave(
        {n: (lambda r, f=f: f(source, args.workers, args.batch, r)) for n, f in sides.items()},
        args.rounds,
        order="reverse",
    )
    rates = {n: rounds.values(n) for n in sides}
    cpu = {n: [c / count * 1e6 for c in rounds.values(n, "cpu_s")] for n in sides}
    result = dict(
        images_per_s={n: rounds.median(n) for n in sides},
        rates=rates,
        cpu_us_per_image={n: statistics.median(v) for n, v in cpu.items()},
    )
    if "webdataset" in sides:
        result["ratio"] = rounds.ratio("shardkit", "webdataset")
        result["ratios"] = rounds.ratios("shardkit", "webdataset")
    out = args.json or harness.ROOT / "bench-out" / "bench_clip.json"
    harness.write_result(out, "bench_clip", args, result, rounds)
    print(json.dumps({**result, "load_per_round": rounds.load_text()}, indent=2))


if __name__ == "__main__":
    harness.script(__file__)
