#!/usr/bin/env python3
"""Where users train: loaders across core counts (``--scaling``: for N = 1, 2, 4... workers,
ShardLoader and DataLoader(ShardDataset) against N processes decoding at once, (a) LFW full
decode and (b) ImageNet RRC-224 + flip, with per-worker efficiency against a bare decoder loop)
and feeding a real model (``--train resnet50,resnet18``: the batch resident on the GPU vs
ShardLoader(device=) vs DataLoader(pin_memory=True), bf16, channels_last; images/s, the GPU's
wait share from CUDA events, ``loader.stats()``). ``--train tiny --device cpu`` runs the loop
on any machine.

    python benchmarks/bench_train.py --scaling --lfw /tmp/bl/lfw --imagenet /tmp/bl/imagenet
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

import data
import harness

ROOT = harness.ROOT

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_loader import RRC, WorkerLoop, ensure, timed_epoch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from shardkit import ShardDataset, ShardLoader  # noqa: E402
from shardkit.stream.world import World  # noqa: E402

MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
WORKLOADS = {
    "a": ("LFW full decode", {"decode": "tensor"}),
    "b": ("ImageNet RRC-224+flip", {"decode": RRC}),
}


def worker_counts(limit: int) -> list[int]:
    counts, n = [], 1
    while n < limit:
        counts.append(n)
        n *= 2
    return [*counts, limit]


# --- the ceiling and the bare loop --------------------------------------------------------------


def bare_cpu_us(shards: Path, kw: dict) -> float:
    """CPU us per image of the workers' own decoder calls on the same bytes into batch
    buffers, in this process (``bench_loader.WorkerLoop.bare``: the per-worker bare loop)."""
    ds = ShardDataset(str(shards), **kw)
    loop = WorkerLoop(
        ds, [(r.data, r.key) for r in ds.records_from(World(0, 1, 0, 1), 0, None)], False
    )
    try:
        return loop.bare(0)
    finally:
        loop.close()


# --- --scaling --------------------------------------------------------------------------------


def scaling(args) -> dict:
    out: dict = {"cpus": harness.cores(), "batch_size": args.batch, "workloads": {}}
    counts = args.workers or worker_counts(harness.cores())
    for part in args.only or ["a", "b"]:
        out["workloads"][part] = _scaling_part(args, part, counts)
    return out


def _scaling_part(args, part: str, counts: list[int]) -> dict:
    title, kw = WORKLOADS[part]
    src = args.lfw if part == "a" else args.imagenet
    shards = ensure(src, "lfw" if part == "a" else "imagenet", args.lfw_scale)
    datas = data.jpeg_bytes(src)
    plain, own = harness.ceiling(datas, processes=1).cpu_us, bare_cpu_us(shards, kw)
    print(f"({part}) {title}: {len(datas)} images; a decode {plain:.0f} CPU us/image "
          f"(simplejpeg), the workers' decoder calls into batch buffers {own:.0f}")  # fmt: skip
    names = ["ShardLoader", "DataLoader"]
    loaders: dict = {}

    def ceiling(n: int):
        return lambda r: harness.ceiling_at_once(datas, n)

    def contender(name: str, n: int):
        def run(r: int) -> dict:
            key = (name, n)
            if key not in loaders:  # built once and warmed up, as a trainer keeps it
                loaders[key] = _build(name, shards, kw, n, args.batch)
                timed_epoch(_epoch(*loaders[key], 0))
            res = timed_epoch(_epoch(*loaders[key], r + 1))
            if getattr(loaders[key][1], "worker_pids", []):
                workers = res["cpu_us_per_image"] - res["main_cpu_us_per_image"]
                res["worker_efficiency"] = own / workers
            res["main_cpu_share"] = res["main_cpu_us_per_image"] / plain
            return res

        return run

    sides = {}
    for n in counts:  # per worker count: its ceiling first, then the loaders
        sides[f"ceiling {n}"] = ceiling(n)
        sides.update({f"{name} {n}": contender(name, n) for name in names})
    rounds = harness.interleave(sides, args.rounds, order="fixed")
    rows = {}
    for n in counts:
        rows[n] = {"ceiling": rounds.values(f"ceiling {n}")}
        for name in names:
            runs = rounds.results[f"{name} {n}"]
            for x, load in zip(runs, rounds.loads, strict=True):
                x.pop("cpu_s", None), x.pop("wall_s", None)
                x["load_1min"] = load.load_1m
            rows[n][name] = runs
    _print_rounds(args, part, counts, rows)
    for _, loader in loaders.values():
        if hasattr(loader, "close"):
            loader.close()
    return {
        "title": title,
        "bare_cpu_us_simplejpeg": plain,
        "bare_cpu_us_decoder_batches": own,
        "by_workers": {str(n): _summary(rows[n]) for n in counts},
    }


def _print_rounds(args, part: str, counts: list[int], rows: dict) -> None:
    table = {}
    for r in range(args.rounds):
        for n in counts:
            c = rows[n]["ceiling"][r]
            for name in ("ShardLoader", "DataLoader"):
                x = rows[n][name][r]
                table[f"[{part} {r + 1}/{args.rounds}] N={n} {name}"] = {
                    **x, "ceiling": c, "of ceiling": x["images_per_s"] / c}  # fmt: skip
    cols = ["ceiling:.0f", "images_per_s:.0f", "of ceiling:.2f", "worker_efficiency:.2f",
            "main_cpu_share:.3f", "load_1min:.1f"]  # fmt: skip
    harness.table(table, cols)


def _build(name: str, shards: Path, kw: dict, n: int, batch: int):
    if name == "ShardLoader":
        ds = ShardDataset(str(shards), **kw)
        return ds, ShardLoader(ds, batch, num_workers=n)
    ds = ShardDataset(str(shards), batch_size=batch, **kw)
    return ds, DataLoader(ds, batch_size=batch, num_workers=n, persistent_workers=True)


def _epoch(ds, loader, epoch: int):
    ds.set_epoch(epoch)
    return loader


#: A loader's figures in ``--scaling``'s summary: medians over the rounds.
SUMMED = ("images_per_s", "main_cpu_share", "worker_efficiency")


def _summary(row: dict) -> dict:
    ceil = statistics.median(row["ceiling"])
    out = {"ceiling_images_per_s": ceil, "ceiling_runs": row["ceiling"]}
    for name in [k for k in row if k != "ceiling"]:  # ShardLoader, DataLoader
        runs = row[name]
        ratios = [x["images_per_s"] / c for x, c in zip(runs, row["ceiling"], strict=True)]
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0] if k in SUMMED}
        out[name] = {**med, "ratio_to_ceiling": statistics.median(ratios), "runs": runs}
    return out


# --- --train ---------------------------------------------------------------------------------


def _model(name: str, device: torch.device):
    if name == "tiny":  # a smoke test of the loop on any machine
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 7, stride=4),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 1000),
        ).to(device, memory_format=torch.channels_last)
    import torchvision

    return getattr(torchvision.models, name)(num_classes=1000).to(
        device, memory_format=torch.channels_last
    )


def train(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--train needs CUDA: skipped (use --device cpu --train tiny for the loop alone)")
        return {"skipped": "no CUDA"}
    models = args.train.split(",")
    if any(m != "tiny" for m in models):
        try:
            import torchvision  # noqa: F401
        except ImportError:
            print("--train needs torchvision for its models: skipped")
            return {"skipped": "no torchvision"}
    shards = ensure(args.imagenet, "imagenet", 1.0)
    dest = args.imagenet.with_name(args.imagenet.name + "-replicated")
    urls, per_epoch = data.replicated(shards, args.samples, dest)
    geo = {"decode": RRC}
    n = args.train_workers or max(1, harness.cores() - 1)
    torch.backends.cudnn.benchmark = True
    out: dict = {"device": str(device), "workers": n, "samples_per_epoch": per_epoch}
    for name in models:
        model = _model(name, device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        rows = {}
        feeders = ["resident"]
        for where in args.decode_on:  # ShardLoader once per decode_on ("workers": its default)
            feeders.append("ShardLoader" if where == "workers" else f"ShardLoader {where}")
        for feeder in [*feeders, "DataLoader"]:
            sink: dict = {}
            batches = _feeder(feeder, urls, geo, n, args.batch, device, sink)
            rows[feeder] = _steps(model, opt, batches, device, args.batch, args.steps)
            if "loader" in sink:  # ShardLoader: where images were decoded, the trainer's CPU
                rows[feeder]["feed"] = sink["loader"].feed_counts.as_dict()
                # and what the loader itself says of the epoch (``loader.stats()``): the run
                # time verdict next to the bench's own measure of the GPU's wait
                rows[feeder]["loader_stats"] = sink["loader"].stats()
                if hasattr(sink["loader"], "balance") and " auto" in feeder:
                    rows[feeder]["share_to_workers"] = sink["loader"].balance.sent
            said = rows[feeder].get("loader_stats")
            said = (
                f"  loader.stats(): {said['verdict']} ({said['wait_share'] or 0:.3f})"
                if said
                else ""
            )
            print(
                f"  {name:9s} {feeder:12s} {rows[feeder]['images_per_s']:8.0f} img/s  "
                f"waiting {rows[feeder]['wait_share']:.3f} of step time{said}  "
                f"{rows[feeder].get('feed', '')}",
                flush=True,
            )
        gpu = rows["resident"]["images_per_s"]
        for r in rows.values():
            r["of_gpu_speed"] = r["images_per_s"] / gpu
        out[name] = rows
    return out


def trainer_loader(
    urls, decode_on="workers", workers=1, batch=256, device="cuda", decode=RRC, **kw
):
    """ShardLoader as a trainer builds it: normalised, channels_last, on ``device``, full
    batches (RRC-224 + flip unless ``decode``); (the dataset, the loader)."""
    ds = ShardDataset(urls, decode=decode)
    how = dict(device=device, drop_last=True, normalize=MEAN_STD, channels_last=True, **kw)
    return ds, ShardLoader(ds, batch, num_workers=workers, decode_on=decode_on, **how)


def _feeder(kind: str, urls, geo: dict, n: int, batch: int, device: torch.device, sink=None):
    """An endless iterator of (images float NCHW channels_last normalised, labels) on device;
    the ShardLoader built goes into ``sink["loader"]`` (its ``feed_counts``)."""
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in MEAN_STD)
    if kind == "resident":
        x = torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8, device=device)
        x = ((x.float() / 255 - mean) / std).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=device)
        while True:
            yield x, y
    if kind.startswith("ShardLoader"):
        where = kind.split()[1] if " " in kind else "workers"
        ds, loader = trainer_loader(urls, where, n, batch, device, **geo)
        if sink is not None:
            sink["loader"] = loader
    else:
        ds = ShardDataset(urls, batch_size=batch, **geo)
        loader = DataLoader(
            ds,
            batch_size=batch,
            num_workers=n,
            drop_last=True,
            pin_memory=device.type == "cuda",
            persistent_workers=True,
        )
    epoch = 0
    try:
        while True:
            ds.set_epoch(epoch)
            for x, y in loader:
                if kind == "DataLoader":
                    x = x.to(device, non_blocking=True).float().div_(255)
                    x = ((x - mean) / std).contiguous(memory_format=torch.channels_last)
                    y = y.to(device, non_blocking=True)
                yield x, y
            epoch += 1
    finally:
        if hasattr(loader, "close"):
            loader.close()


def _steps(model, opt, batches, device, batch: int, steps: int) -> dict:
    """``steps`` timed training steps after 20 warm-up ones; the GPU's wait for data is the
    gap between one step's last kernel and the next step's first (CUDA events)."""
    cuda = device.type == "cuda"
    loss_fn = torch.nn.CrossEntropyLoss()
    marks = []
    t0 = None
    host_wait = 0.0
    for i in range(20 + steps):
        if i == 20:
            if cuda:
                torch.cuda.synchronize()
            t0, host_wait = time.perf_counter(), 0.0
        tw = time.perf_counter()
        x, y = next(batches)
        host_wait += time.perf_counter() - tw
        begin = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            begin.record()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            end.record()
            if i >= 20:
                marks.append((begin, end))
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    batches.close()
    if cuda and len(marks) > 1:
        busy = sum(b.elapsed_time(e) for b, e in marks) / 1e3
        span = marks[0][0].elapsed_time(marks[-1][1]) / 1e3
        wait_share = max(0.0, 1 - busy / span)
    else:
        wait_share = host_wait / wall
    return {
        "images_per_s": steps * batch / wall,
        "wait_share": wait_share,
        "host_wait_share": host_wait / wall,
        "steps": steps,
    }


@harness.case(
    data="the --lfw tree and an ImageNet-shaped one, packed",
    measures="loaders across core counts against the ceiling of as many processes (--scaling); "
    "feeding a real model on a GPU (--train)",
    small={
        "lfw": data.root() / "lfw-smoke",
        "lfw_scale": 0.01,
        "imagenet": data.root() / "inet-smoke",
        "scaling": True,
        "workers": (1,),
        "only": ("a",),
        "batch": 8,
        "device": "cpu",
    },  # fmt: skip
    aliases={"rounds": ["repeats"]},
)
class Train(harness.Bench):
    rounds: int = 3
    json: Path | None = ROOT / "bench-out" / "bench_train.json"
    scaling: bool = False
    train: str | None = harness.arg(None, "comma-separated torchvision models (or tiny)")
    lfw: Path = ROOT / "data" / "lfw"
    lfw_scale: float = 1.0
    imagenet: Path = ROOT / "data" / "imagenet"
    workers: tuple[int, ...] = ()
    only: tuple[Literal["a", "b"], ...] = ()
    batch: int = harness.arg(64, "batch size of --scaling")
    device: str = "cuda"
    samples: int = harness.arg(40_000, "--train: samples per epoch")
    steps: int = harness.arg(200, "--train: timed steps per feeder")
    train_workers: int | None = harness.arg(None, "--train: workers (usable CPUs - 1)")
    decode_on: tuple[str, ...] = harness.arg(
        ("workers",),
        "--train: ShardLoader decode_on values to run, e.g. workers,device,auto "
        "(device and auto need shardkit[gpu])",
    )


def main(args: Train) -> None:
    if args.smoke:
        args = replace(args, train=args.train and "tiny")
    if not args.scaling and not args.train:
        raise SystemExit("give --scaling and/or --train MODELS")
    torch.set_num_threads(1)  # the bare loop and the trainer's own work: one core, as a worker
    result: dict = {"load_start": harness.loadavg(), "cpus": harness.cores()}
    if args.scaling:
        result["scaling"] = scaling(args)
    if args.train:
        result["train"] = train(argparse.Namespace(**{**vars(args), "batch": 256}))
    harness.write_result(args.json, "bench_train", args, result)
    print(f"json: {args.json}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    harness.script(__file__)
