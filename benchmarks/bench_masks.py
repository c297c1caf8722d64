#!/usr/bin/env python3
"""What a segmentation mask costs beside each image through DataLoader(ShardDataset), against
the mask's own decode.

The LFW-shaped set with a ``.seg.png`` beside every image (its greyscale quantized to 4 classes:
an 8-bit PNG of the image's size), packed once. One interleaved run (every contender once per
repeat), medians over repeats: ``DataLoader(ShardDataset(decode=Decode(
crop=RandomResizedCrop(64), flip=True)))`` without fields and with ``fields=("seg.png",)`` (the
mask cut, nearest-resized and flipped with its image); the mask's cost per sample (1/rate with
minus 1/rate without, one worker) is set against the mask's own decode (PNG -> uint8 tensor,
timed in this process over the same masks), and the geometry's share (``crop_mask``) is printed
too. The
load average is printed beside it.

    python benchmarks/bench_masks.py --data /tmp/lfw-masks --scale 0.15 --repeats 5
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import data
import harness

SIZE = 64


def _rate(src: str, fields: tuple[str, ...], workers: int, batch: int) -> float:
    from torch.utils.data import DataLoader

    from shardkit import Decode, RandomResizedCrop, ShardDataset

    ds = ShardDataset(
        src, decode=Decode("tensor", crop=RandomResizedCrop(SIZE), flip=True), fields=fields
    )
    return harness.epoch(DataLoader(ds, batch_size=batch, num_workers=workers))["rate"]


def _mask_costs(src: str) -> tuple[float, float]:
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
    return decode, (time.perf_counter() - start) / len(samples)


@harness.case(
    data="the LFW-shaped set with a seg.png mask beside every image, packed",
    measures="images/s without and with a mask field; a mask's decode and geometry cost",
    small={"scale": 0.01, "batch_size": 8},
    aliases={"rounds": ["repeats"]},
)
class Masks(harness.Bench):
    rounds: int = 5
    data: Path | None = harness.arg(None, "default: the data root")
    scale: float = 0.15
    workers: int = 1
    batch_size: int = 64


def main(args: Masks) -> None:
    src = str(data.lfw_with_masks(args.data, args.scale))

    def costs(r: int) -> dict:
        decode, geom = _mask_costs(src)
        return {"decode": decode, "geom": geom}

    sides = {
        "plain": lambda r: _rate(src, (), args.workers, args.batch_size),
        "masked": lambda r: _rate(src, ("seg.png",), args.workers, args.batch_size),
        "mask costs": costs,
    }
    rounds = harness.interleave(sides, args.rounds, order="fixed")
    plain, masked = rounds.values("plain"), rounds.values("masked")
    decodes, geoms = rounds.values("mask costs", "decode"), rounds.values("mask costs", "geom")
    extra = statistics.median(
        (1 / m - 1 / p) / d for m, p, d in zip(masked, plain, decodes, strict=True)
    )
    p, m = statistics.median(plain), statistics.median(masked)
    d, g = statistics.median(decodes), statistics.median(geoms)
    per_mask = 1e6 * (1 / m - 1 / p)
    load = f"load average per round {rounds.load_text()}"
    print(f"images/s, median of {args.rounds}, {args.workers} worker(s): image only {p:.0f}, "
          f"with seg.png {m:.0f} (ratio {m / p:.3f}); mask per sample {per_mask:.0f} us "
          f"against its own decode {1e6 * d:.0f} us (ratio {extra:.2f}; crop/resize/flip "
          f"{1e6 * g:.0f} us) ({load})")  # fmt: skip
    result = {"images_per_s": p, "masked_images_per_s": m, "mask_us": per_mask}
    result.update(mask_decode_us=1e6 * d, mask_geometry_us=1e6 * g, extra_to_decode=extra)
    harness.write_result(args.json, "bench_masks", args, result, rounds)


if __name__ == "__main__":
    harness.script(__file__)
