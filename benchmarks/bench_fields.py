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

from pathlib import Path

import data
import harness


def _rate(src: str, fields: tuple[str, ...], workers: int, batch: int, shard_loader=False):
    """(images/s, the training process's CPU us per image) of one epoch."""
    from torch.utils.data import DataLoader

    from shardkit import CenterCrop, Decode, ShardDataset, ShardLoader

    ds = ShardDataset(src, decode=Decode("tensor", crop=CenterCrop(64, 64)), fields=fields)
    if shard_loader:
        loader = ShardLoader(ds, batch, num_workers=max(1, workers))
        next(iter(loader))  # workers started, as a trainer keeps them
    else:
        loader = DataLoader(ds, batch_size=batch, num_workers=workers)
    e = harness.epoch(loader)
    if shard_loader:
        loader.close()
    return e["rate"], e["main_cpu_s"] / e["images"] * 1e6


@harness.case(
    data="the LFW-shaped set with a .txt caption and a .json beside every image, packed",
    measures="images/s and training-process CPU without and with fields=('txt', 'json')",
    small={"scale": 0.01, "batch_size": 8},
    aliases={"rounds": ["repeats"]},
)
class Fields(harness.Bench):
    rounds: int = 5
    data: Path | None = harness.arg(None, "default: the data root")
    scale: float = 0.15
    workers: int = 1
    batch_size: int = 64


def main(args: Fields) -> None:
    import warnings

    warnings.simplefilter("ignore")  # each contender re-reads epoch 0 on purpose
    src = str(data.lfw_with_captions(args.data, args.scale))

    def side(loader: bool, fields: tuple):
        def run(r: int) -> dict:
            rate, main_us = _rate(src, fields, args.workers, args.batch_size, loader)
            return {"rate": rate, "main_us": main_us}

        return run

    sides = {
        f"{name} {what}": side(loader, fields)
        for name, loader in (("DataLoader", False), ("ShardLoader", True))
        for what, fields in (("plain", ()), ("fields", ("txt", "json")))
    }
    rounds = harness.interleave(sides, args.rounds, order="fixed")
    result = {}
    for name in ("DataLoader", "ShardLoader"):
        plain, fields = f"{name} plain", f"{name} fields"
        ratio = rounds.ratio(fields, plain)
        result[name] = {"ratio": ratio, "plain": rounds.median(plain),
                        "fields": rounds.median(fields)}  # fmt: skip
        print(f"{name}: images/s, median of {args.rounds}: image only "
              f"{rounds.median(plain):.0f}, with txt+json "
              f"{rounds.median(fields):.0f}; ratio {ratio:.3f}; training "
              f"process CPU {rounds.median(plain, 'main_us'):.0f} -> "
              f"{rounds.median(fields, 'main_us'):.0f} us/image")  # fmt: skip
    print(f"load average per round {rounds.load_text()}")
    harness.write_result(args.json, "bench_fields", args, result, rounds)


if __name__ == "__main__":
    harness.script(__file__)
