#!/usr/bin/env python3
"""Make the default LFW-shaped dataset (data/lfw) that the demo and benchmarks pack and stream.

The script form of ``shardkit.synth.make_lfw``: nothing can be downloaded here, so the set is made
from the photographs shipped in scikit-image and matplotlib. A complete set with the same options
is reused, so running it twice costs nothing the second time.

    python tools/make_default_data.py                  # data/lfw, full LFW size
    python tools/make_default_data.py out/tiny --scale 0.01
    python tools/make_default_data.py --imagenet data/imagenet --classes 10 --images-per-class 100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from shardkit.errors import ShardkitError
from shardkit.synth import make_imagenet, make_lfw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="data/lfw", help="LFW output (default data/lfw)")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of LFW (default 1.0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=250, help="LFW image side (default 250)")
    parser.add_argument("--workers", type=int, default=None, help="threads (default: CPUs)")
    parser.add_argument("--imagenet", metavar="DIR", help="also make an ImageNet-shaped set here")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--images-per-class", type=int, default=100)
    args = parser.parse_args(argv)
    try:
        report = make_lfw(
            args.out, scale=args.scale, seed=args.seed, size=args.size, workers=args.workers
        )
        print(report.summary())
        if args.imagenet:
            report = make_imagenet(
                args.imagenet,
                classes=args.classes,
                images_per_class=args.images_per_class,
                seed=args.seed,
                workers=args.workers,
            )
            print(report.summary())
    except ShardkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
