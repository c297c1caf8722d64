#!/usr/bin/env python3
"""What the crop objects cost: each crop variant against ``crop="random"`` (today's
RandomResizedCrop) through ``ShardLoader`` on ImageNet-shaped photos, one epoch per contender
and round, interleaved: images/s, the median of per-round ratios (goal >= 1), and each variant's
mean pixel difference from torch's antialiased resize of the same box (goal < 1 level).
``--against DIR`` adds another checkout's ``crop="random"``; ``--breakdown`` times the box, the
region decode and the resize per variant on one thread. Figures: docs/loader.md ("Crops").

    python benchmarks/bench_crops.py --imagenet /tmp/inet --rounds 3
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import data
import harness


class TopHalfHook:
    """A user's crop hook: a random square from the image's upper half."""

    size = 224
    interpolation = "bilinear"

    def box(self, height, width, uniforms):
        side = min(height, width) // 2 + int(next(uniforms) * (min(height, width) // 2))
        top = int(next(uniforms) * max(1, height // 2 - side // 2))
        left = int(next(uniforms) * (width - side + 1))
        return min(top, height - side), left, side, side


def contenders() -> dict[str, dict]:
    from shardkit import CenterCrop, RandomCrop, RandomResizedCrop

    return {
        'crop="random" (today)': dict(crop=RandomResizedCrop(224)),
        "RRC(0.08-1, bilinear)": dict(crop=RandomResizedCrop(224)),
        "RRC(0.9-1, bilinear)": dict(crop=RandomResizedCrop(224, (0.9, 1.0))),
        "RRC(0.9-1, bicubic)": dict(
            crop=RandomResizedCrop(224, (0.9, 1.0), interpolation="bicubic")
        ),
        "CenterCrop(224, short 256)": dict(crop=CenterCrop(224, resize_short=256)),
        "RandomCrop(224, short 256-320)": dict(crop=RandomCrop(224, resize_short=(256, 320))),
        "hook (TopHalfHook)": dict(crop=TopHalfHook()),
    }


def epoch(source: str, kw: dict, workers: int, batch: int, epoch: int) -> tuple[float, int]:
    from shardkit import Decode, ShardDataset, ShardLoader

    ds = ShardDataset(source, decode=Decode(crop=kw["crop"], flip=True))
    loader = ShardLoader(ds, batch, num_workers=workers)
    try:
        loader.set_epoch(epoch)
        e = harness.epoch(loader)  # the steady rate: after workers started, shards opened
    finally:
        loader.close()
    return e["steady_rate"], e["images"]


_AGAINST = """
import json, sys
import bench_crops
from shardkit import RandomResizedCrop
crop = dict(crop=RandomResizedCrop(224))
rate, n = bench_crops.epoch(sys.argv[1], crop, *map(int, sys.argv[2:]))
print(json.dumps({"rate": rate, "n": n}))
"""


def _epoch_against(checkout: Path, source: str, workers: int, batch: int, epoch: int) -> float:
    """``crop="random"`` through another checkout's ShardLoader, in a child process."""
    return harness.in_child(checkout, _AGAINST, source, workers, batch, epoch)["rate"]


def _breakdown(source: str, cons: dict, count: int, rounds: int) -> dict:
    """Per variant: us per image for box, decode and resize (median over ``rounds`` passes
    over the first ``count`` photos, one thread), the crop's share of the photo's pixels and
    the decoded share of its rows."""
    import torch

    from shardkit import Decode, Order, ShardDataset
    from shardkit.images.decode import decode_jpeg_region, jpeg_scale
    from shardkit.images.geometry import resized, scaled_box

    torch.set_num_threads(1)
    raw = ShardDataset(source, decode="raw", order=Order(shuffle=False), with_keys=True)
    photos = [(b, k) for (b, _, k), _ in zip(raw, range(count), strict=False)]
    out = {}
    for name, kw in cons.items():
        if not kw:
            continue  # another checkout's contender
        ds = ShardDataset(source, decode=Decode(crop=kw["crop"], flip=True))
        dec, size, how = ds.tensor_decoder(0), ds.geometry.size, ds.geometry.interpolation
        passes = []
        for _ in range(rounds):
            t = {"box": 0.0, "decode": 0.0, "resize": 0.0}
            area = rows = 0.0
            for blob, key in photos:
                t0 = time.perf_counter()
                height, width, top, left, h, w, flip = dec.crop_box(blob, key)
                need = (min(height, -(-height * size // h)), min(width, -(-width * size // w)))
                d = jpeg_scale(height, width, need)
                dh, dw = -(-height // d), -(-width // d)
                y0, x0, y1, x1 = scaled_box(top, left, h, w, height, width, dh, dw)
                t1 = time.perf_counter()
                px = decode_jpeg_region(blob, d, y0, x0, y1 - y0, x1 - x0)
                t2 = time.perf_counter()
                resized(torch.from_numpy(px).permute(2, 0, 1)[None], size, flip, how)
                t3 = time.perf_counter()
                t["box"] += t1 - t0
                t["decode"] += t2 - t1
                t["resize"] += t3 - t2
                area += h * w / (height * width)
                rows += (top + h) / height
            passes.append({k: v / len(photos) * 1e6 for k, v in t.items()})
        row = {k: statistics.median(p[k] for p in passes) for k in ("box", "decode", "resize")}
        row["crop_area"] = area / len(photos)
        row["rows_decoded"] = rows / len(photos)
        out[name] = row
    return out


def _difference(source: str, kw: dict, count: int) -> float:
    """Mean |pixel - reference| over the first ``count`` images (the same box and flip)."""
    import torch
    import torch.nn.functional as F

    from shardkit import Decode, Order, ShardDataset
    from shardkit.images.decode import decode_rgb

    decode = Decode(crop=kw["crop"], flip=True)
    ds = ShardDataset(source, decode=decode, order=Order(shuffle=False), with_keys=True)
    dec = ds.tensor_decoder(0)
    how = ds.geometry.interpolation
    raw = ShardDataset(source, decode="raw", order=Order(shuffle=False), with_keys=True)
    diffs = []
    for (img, _, key), (blob, _, _) in zip(ds, raw, strict=False):
        box = dec.crop_box(blob, key)
        full = torch.from_numpy(decode_rgb(blob)).permute(2, 0, 1)[None]
        x = full[:, :, box.top : box.top + box.h, box.left : box.left + box.w].contiguous()
        ref = F.interpolate(x, size=(224, 224), mode=how, antialias=True)[0]
        ref = ref.flip(-1) if box.flip else ref
        diffs.append(float((img.float() - ref.float()).abs().mean()))
        if len(diffs) >= count:
            break
    return statistics.mean(diffs)


@harness.case(
    data="an ImageNet-shaped tree (--classes x --per-class photos), packed",
    measures="every crop variant against crop='random'; their pixel difference from a reference",
    small={"classes": 2, "per_class": 8, "batch": 4, "check": 2},
)
class Crops(harness.Bench):
    rounds: int = 3
    against: Path | None = harness.arg(None, "another checkout, side by side")
    imagenet: Path | None = harness.arg(None, "the photos (default: data root)")
    classes: int = 4
    per_class: int = 150
    workers: int = 2
    batch: int = 64
    check: int = 64
    breakdown: bool = harness.arg(False, "where each variant's time goes")


def main(args: Crops) -> None:
    tree = data.imagenet(args.imagenet, args.classes, args.per_class)
    source = str(data.packed(tree))
    cons = contenders()
    against = f'crop="random" ({args.against})' if args.against else None
    if against:
        cons[against] = {}

    def run(name):
        if name == against:
            return lambda r: _epoch_against(args.against, source, args.workers, args.batch, r)
        return lambda r: epoch(source, cons[name], args.workers, args.batch, r)[0]

    rounds = harness.interleave({name: run(name) for name in cons}, args.rounds)
    base = 'crop="random" (today)'
    rows = []
    for name, kw in cons.items():
        row = dict(
            name=name,
            images_per_s=rounds.median(name),
            ratio_to_today=rounds.ratio(name, base),
            mean_difference=None if name == against else _difference(source, kw, args.check),
        )
        if against:  # the same per-round ratio against the other checkout's crop="random"
            row["ratio_to_against"] = rounds.ratio(name, against)
        rows.append(row)
    result = dict(rows=rows)
    out = args.json or harness.ROOT / "bench-out" / "bench_crops.json"
    cols = ["images_per_s:.0f", "ratio_to_today:.2f", "ratio_to_against:.2f", "mean_difference:.2f"]
    harness.table({row["name"]: row for row in rows}, cols)
    print(f"load average per round {rounds.load_text()}")
    if args.breakdown:
        result["breakdown"] = parts = _breakdown(source, cons, 200, 3)
        cols = ["box:.0f", "decode:.0f", "resize:.0f", "crop_area:.2f", "rows_decoded:.2f"]
        harness.table(parts, cols, "one thread, us per image")
    harness.write_result(out, "bench_crops", args, result, rounds)


if __name__ == "__main__":
    harness.script(__file__)
