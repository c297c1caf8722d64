#!/usr/bin/env python3
"""Where the feed goes under training, on the CPUs at hand: ShardLoader beside a stand-in for the
training step, in the training process.

Contenders, interleaved round by round on the same LFW-shaped shards (full decode to uint8
batches of ``--batch``, ``--workers`` workers, long epochs):

- ``alone``: the loader with nothing else in the loop (its own rate, L);
- ``gpu-like step``: each step sleeps ``T`` (the training thread idle while a GPU works, as in
  a CUDA step after its kernels are queued), T = one batch at L: the rate to expect is L, and
  what is lost is the overlap the loader fails to give;
- ``cpu step, N threads``: each step multiplies float32 matrices on the CPU for about T of one
  core (a model on the CPU, or a trainer's own CPU work), with torch's intra-op pool at 1 thread
  and at the cores' count: the step then competes with the workers for the cores, and a pool of
  spinning threads competes with itself.

Reported per contender: images/s (median over rounds), the ratio to what the step alone allows
(L for the sleep; for the busy step, the rate of the step and the loader taking turns,
``1 / (1/L + 1/S)`` with S the step's own rate: above 1, they overlapped), the
training thread's CPU per image inside the loader (``ShardLoader.feed_counts``), and the load
average. On a GPU node ``bench_device.py`` measures the same under a real model.

    python benchmarks/bench_feed.py --lfw /tmp/bl/lfw --rounds 3
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from bench_loader import ensure  # noqa: E402

from shardkit import ShardDataset, ShardLoader  # noqa: E402


def _step_matmul(ms: float):
    """A CPU step of about ``ms`` on one thread: (n x n) @ (n x n) repeated."""
    a = torch.rand(256, 256)
    torch.set_num_threads(1)
    t, reps = time.perf_counter(), 0
    while time.perf_counter() - t < 0.2:
        a @ a
        reps += 1
    per = (time.perf_counter() - t) / reps
    count = max(1, round(ms / 1e3 / per))

    def step():
        for _ in range(count):
            a @ a

    return step


def _run(shards: Path, args, step, batches: int) -> dict:
    ds = ShardDataset(str(shards), decode="tensor")
    loader = ShardLoader(ds, args.batch, num_workers=args.workers)
    it = iter(loader)
    for _ in range(3):  # workers started, first batches out of the way
        next(it)
    c0 = loader.feed_counts.trainer_cpu_s
    d0 = loader.feed_counts.delivered
    t = time.perf_counter()
    images = 0
    epoch = 0
    while images < batches * args.batch:
        try:
            x, _ = next(it)
        except StopIteration:
            epoch += 1
            loader.set_epoch(epoch)
            it = iter(loader)
            continue
        images += x.shape[0]
        if step is not None:
            step()
    wall = time.perf_counter() - t
    cpu = loader.feed_counts.trainer_cpu_s - c0
    delivered = loader.feed_counts.delivered - d0
    loader.close()
    return {
        "images_per_s": images / wall,
        "trainer_cpu_us_per_image": cpu / max(1, delivered) * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lfw", type=Path, default=ROOT / "data" / "lfw")
    ap.add_argument("--lfw-scale", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=ROOT / "bench-out" / "bench_feed.json")
    args = ap.parse_args()
    shards = ensure(args.lfw, "lfw", args.lfw_scale)
    threads = os.cpu_count() or 1
    rows: dict[str, list] = {}
    loads = []
    step_ms = None
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        torch.set_num_threads(threads)
        alone = _run(shards, args, None, args.batches)
        rows.setdefault("alone", []).append(alone)
        if step_ms is None:  # one batch at the loader's own rate
            step_ms = args.batch / alone["images_per_s"] * 1e3
        pause = step_ms / 1e3
        rows.setdefault("gpu-like step", []).append(
            _run(shards, args, lambda pause=pause: time.sleep(pause), args.batches)
        )
        busy = _step_matmul(step_ms)
        t = time.perf_counter()
        for _ in range(10):
            busy()
        step_rate = args.batch / ((time.perf_counter() - t) / 10)
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            row = _run(shards, args, busy, args.batches // 2)
            row["step_alone_images_per_s"] = step_rate
            rows.setdefault(f"cpu step, {n} threads", []).append(row)
        print(
            f"round {r + 1}: "
            + ", ".join(f"{k} {v[-1]['images_per_s']:.0f}" for k, v in rows.items())
            + f" img/s; load {loads[-1]:.1f}",
            flush=True,
        )
    out: dict = {"batch": args.batch, "workers": args.workers, "step_ms": step_ms, "loads": loads}
    alone = statistics.median(x["images_per_s"] for x in rows["alone"])
    for name, runs in rows.items():
        rate = statistics.median(x["images_per_s"] for x in runs)
        cpu = statistics.median(x["trainer_cpu_us_per_image"] for x in runs)
        if name.startswith("cpu step"):
            bound = statistics.median(x["step_alone_images_per_s"] for x in runs)
            # the step and the workers share the cores: both at once give 1 / (1/L + 1/S)
            bound = 1 / (1 / alone + 1 / bound)
        else:
            bound = alone
        what = "of step and loader in turn" if name.startswith("cpu") else "of the loader alone"
        out[name] = {"images_per_s": rate, "ratio": rate / bound, "ratio_of": what}
        out[name]["trainer_cpu_us_per_image"] = cpu
        print(
            f"{name:22s} {rate:7.0f} img/s  {rate / bound:.3f} {what}, "
            f"trainer CPU {cpu:.1f} us/image"
        )
    out["load_end"] = os.getloadavg()[0]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
