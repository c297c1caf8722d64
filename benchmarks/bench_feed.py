#!/usr/bin/env python3
"""Where the feed goes under training, on the CPUs at hand: ShardLoader (LFW-shaped, full
decode) alone, beside a GPU-like step (a sleep of one batch at the loader's own rate L) and
beside a CPU step (float32 matmuls for about that long, torch's pool at 1 thread and at the
cores' count), interleaved; per contender images/s, the ratio to what the step alone allows
(L, or ``1 / (1/L + 1/S)`` for the busy step: above 1 they overlapped), the training thread's
CPU per image (``feed_counts``). Figures: docs/loader.md ("Where the feed goes under
training"); ``bench_device.py`` measures the same under a real model on a GPU.

    python benchmarks/bench_feed.py --lfw /tmp/bl/lfw --rounds 3
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import data
import harness
import torch

from shardkit import ShardDataset, ShardLoader

ROOT = harness.ROOT


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


@harness.case(
    data="the --lfw tree (made at --lfw-scale when missing), packed",
    measures="the feed under a training step: alone, a GPU-like wait, a CPU step sharing cores",
    small={"lfw": data.root() / "lfw-smoke", "lfw_scale": 0.01, "batch": 8, "batches": 6},
)
class Feed(harness.Bench):
    rounds: int = 3
    json: Path | None = ROOT / "bench-out" / "bench_feed.json"
    lfw: Path = ROOT / "data" / "lfw"
    lfw_scale: float = 1.0
    batch: int = 64
    workers: int = 2
    batches: int = 60


def main(args: Feed) -> None:
    shards = data.packed(data.lfw(args.lfw, args.lfw_scale), shard_size="16MB")
    threads = os.cpu_count() or 1
    state: dict = {"step_ms": None}

    def alone(r: int) -> dict:
        torch.set_num_threads(threads)
        res = _run(shards, args, None, args.batches)
        if state["step_ms"] is None:  # one batch at the loader's own rate
            state["step_ms"] = args.batch / res["images_per_s"] * 1e3
        return res

    def gpu_like(r: int) -> dict:
        pause = state["step_ms"] / 1e3
        res = _run(shards, args, lambda: time.sleep(pause), args.batches)
        busy = state["busy"] = _step_matmul(state["step_ms"])
        t = time.perf_counter()
        for _ in range(10):
            busy()
        state["step_rate"] = args.batch / ((time.perf_counter() - t) / 10)
        return res

    def cpu_step(n: int):
        def run(r: int) -> dict:
            torch.set_num_threads(n)
            row = _run(shards, args, state["busy"], args.batches // 2)
            row["step_alone_images_per_s"] = state["step_rate"]
            return row

        return run

    sides = {"alone": alone, "gpu-like step": gpu_like}
    sides.update({f"cpu step, {n} threads": cpu_step(n) for n in sorted({1, threads})})
    rounds = harness.interleave(sides, args.rounds, order="fixed")  # each needs the one before
    rows = rounds.results
    out: dict = {"batch": args.batch, "workers": args.workers, "step_ms": state["step_ms"]}
    alone_rate = rounds.median("alone", "images_per_s")
    for name, runs in rows.items():
        rate = statistics.median(x["images_per_s"] for x in runs)
        cpu = statistics.median(x["trainer_cpu_us_per_image"] for x in runs)
        if name.startswith("cpu step"):
            bound = statistics.median(x["step_alone_images_per_s"] for x in runs)
            # the step and the workers share the cores: both at once give 1 / (1/L + 1/S)
            bound = 1 / (1 / alone_rate + 1 / bound)
        else:
            bound = alone_rate
        what = "of step and loader in turn" if name.startswith("cpu") else "of the loader alone"
        out[name] = {"images_per_s": rate, "ratio": rate / bound, "ratio_of": what}
        out[name]["trainer_cpu_us_per_image"] = cpu
    rows = {k: v for k, v in out.items() if isinstance(v, dict)}
    harness.table(
        rows, ["images_per_s:.0f", "ratio:.3f", "ratio_of", "trainer_cpu_us_per_image:.1f"]
    )
    harness.write_result(args.json, "bench_feed", args, out, rounds)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    harness.script(__file__)
