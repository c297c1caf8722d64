#!/usr/bin/env python3
"""What a field costs beside each image: a caption and a JSON record, or a segmentation mask.

The LFW-shaped set with a ``.txt`` and a ``.json`` (``--sets captions``) or a 4-class
``.seg.png`` (``--sets masks``) beside every image, packed once; one epoch each of the same
shards without the fields and with them, through ``DataLoader(ShardDataset)`` and through
``ShardLoader`` (its training process's own CPU per image beside it), interleaved, medians over
rounds, the ratio the median of per-round ratios. For masks also the mask's own costs in this
process (its PNG decode, its crop, resize and flip), set against what it adds per sample.

    python benchmarks/bench_fields.py --data /tmp/lfw-fields --scale 0.15 --repeats 5
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Literal

import data
import harness

SIZE = 64
#: set -> (its data maker, its fields).
SETS = {"captions": (data.lfw_with_captions, ("txt", "json")),
        "masks": (data.lfw_with_masks, ("seg.png",))}  # fmt: skip


def _decode(name: str):
    from shardkit import CenterCrop, Decode, RandomResizedCrop

    if name == "masks":  # the mask is cut, nearest-resized and flipped with its image
        return Decode("tensor", crop=RandomResizedCrop(SIZE), flip=True)
    return Decode("tensor", crop=CenterCrop(SIZE, SIZE))


def _rate(src: str, name: str, fields: tuple, workers: int, batch: int, shard_loader: bool):
    """One epoch: images/s and the training process's CPU us per image."""
    from torch.utils.data import DataLoader

    from shardkit import ShardDataset, ShardLoader

    ds = ShardDataset(src, decode=_decode(name), fields=fields)
    if shard_loader:
        loader = ShardLoader(ds, batch, num_workers=max(1, workers))
        next(iter(loader))  # workers started, as a trainer keeps them
    else:
        loader = DataLoader(ds, batch_size=batch, num_workers=workers)
    e = harness.epoch(loader)
    if shard_loader:
        loader.close()
    return {"rate": e["rate"], "main_us": e["main_cpu_s"] / e["images"] * 1e6}


def _mask_costs(src: str) -> dict:
    """Seconds per mask: its PNG decode, and the crop/resize/flip after it (this process)."""
    from shardkit import Order, ShardDataset
    from shardkit.images.geometry import Geometry, TensorDecoder, crop_mask
    from shardkit.stream.fields import decode_field_image

    raw = ShardDataset(
        src, decode="raw", fields=("seg.png",), order=Order(shuffle=False), with_keys=True
    )
    samples = [(img, key, seg) for img, _, key, seg in raw]
    decoder = TensorDecoder(Geometry(SIZE, "random", True))
    boxes = [decoder.crop_box(img, key) for img, key, _ in samples]
    start = time.perf_counter()
    masks = [decode_field_image(seg) for _, _, seg in samples]
    decode = (time.perf_counter() - start) / len(samples)
    start = time.perf_counter()
    for mask, box in zip(masks, boxes, strict=True):
        crop_mask(mask, box, SIZE)
    return {"decode": decode, "geom": (time.perf_counter() - start) / len(samples)}


@harness.case(
    data="the LFW-shaped set with a .txt caption and a .json, or a seg.png mask, beside every "
    "image, packed",
    measures="images/s and training-process CPU without and with the fields; a mask's decode "
    "and geometry cost",
    small={"scale": 0.01, "batch_size": 8, "sets": ("captions", "masks")},
    aliases={"rounds": ["repeats"]},
)
class Fields(harness.Bench):
    rounds: int = 5
    data: Path | None = harness.arg(None, "default: the data root (one folder per set)")
    scale: float = 0.15
    workers: int = 1
    batch_size: int = 64
    sets: tuple[Literal["captions", "masks"], ...] = ("captions",)


def main(args: Fields) -> None:
    import warnings

    warnings.simplefilter("ignore")  # each contender re-reads epoch 0 on purpose
    sides, srcs = {}, {}
    for name in args.sets:
        make, fields = SETS[name]
        where = args.data if len(args.sets) == 1 or not args.data else args.data / name
        src = srcs[name] = str(make(where, args.scale))
        for loader, shard_loader in (("DataLoader", False), ("ShardLoader", True)):
            for what, got in (("plain", ()), ("fields", fields)):
                run = (src, name, got, args.workers, args.batch_size, shard_loader)
                sides[f"{name} {loader} {what}"] = lambda r, run=run: _rate(*run)
        if name == "masks":
            sides["mask costs"] = lambda r, s=src: _mask_costs(s)
    rounds = harness.interleave(sides, args.rounds, order="fixed")
    result = {}
    for key in [k.removesuffix(" plain") for k in sides if k.endswith(" plain")]:
        plain, fields = f"{key} plain", f"{key} fields"
        result[key] = {"plain": rounds.median(plain), "fields": rounds.median(fields),
                       "ratio": rounds.ratio(fields, plain),
                       "main_us_plain": rounds.median(plain, "main_us"),
                       "main_us_fields": rounds.median(fields, "main_us")}  # fmt: skip
    if "masks" in args.sets:  # what a mask adds per sample, against its own decode
        p, m = rounds.values("masks DataLoader plain"), rounds.values("masks DataLoader fields")
        decodes = rounds.values("mask costs", "decode")
        per = [(1 / x - 1 / y) for x, y in zip(m, p, strict=True)]
        result["masks DataLoader"].update(
            mask_us=1e6 * statistics.median(per),
            mask_decode_us=1e6 * statistics.median(decodes),
            mask_geometry_us=1e6 * rounds.median("mask costs", "geom"),
            extra_to_decode=statistics.median(x / d for x, d in zip(per, decodes, strict=True)),
        )
    cols = ["plain:.0f", "fields:.0f", "ratio:.3f", "main_us_plain:.0f", "main_us_fields:.0f"]
    harness.table(result, [*cols, "mask_us:.0f", "mask_decode_us:.0f", "mask_geometry_us:.0f"])
    print(f"images/s, median of {args.rounds}; load average per round {rounds.load_text()}")
    harness.write_result(args.json, "bench_fields", args, result, rounds)


if __name__ == "__main__":
    harness.script(__file__)
