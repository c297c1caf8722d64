#!/usr/bin/env python3
"""Everything a lent GPU machine should measure, in one call: one JSON, a table printed last.

Sections (``--sections``; each timed, its errors recorded, never fatal): ``tests`` (the CUDA
tests), ``cpu`` (the CPUs and one process's RRC-224 decode on one thread: the unit of worker
efficiency), ``probe`` (nvImageCodec alone per option set and backend list), ``pipeline``
(``DeviceDecoder`` and ``resize_batch`` without a loader, against the CPU path), ``loader``
(ShardLoader per ``decode_on``, no model), ``cpu_backend``, ``stub`` (alone: ``--stub``, no GPU:
the decode thread's own Python with the decode and resize stubbed) and ``train``
(``bench_train.train``). torchvision is imported first (``--no-torchvision`` to skip), as
training scripts do: its older nvJPEG decides nvImageCodec's answers. Figures: docs/loader.md.

    python benchmarks/bench_device.py --json $OUT/device.json
    python benchmarks/bench_device.py --stub --samples 5000 --workers 1   # any machine
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import data as makers
import harness

ROOT = harness.ROOT

SECTIONS = ("tests", "cpu", "probe", "pipeline", "loader", "cpu_backend", "stub", "train")


def _early_torchvision(argv: list[str]) -> bool:
    if "--no-torchvision" in argv:
        return False
    try:
        import torchvision  # noqa: F401  (first, as in training scripts)
    except ImportError:
        return False
    return True


TORCHVISION = _early_torchvision(sys.argv)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_loader import RRC  # noqa: E402
from bench_train import trainer_loader  # noqa: E402

from shardkit import Decode, Order, RandomResizedCrop, ShardDataset  # noqa: E402
from shardkit.images import device as dev  # noqa: E402
from shardkit.images.geometry import CropBox  # noqa: E402

GEO = {"decode": RRC}


def _records(shards: Path, n: int) -> tuple[list[np.ndarray], list[CropBox], list[tuple]]:
    """``n`` samples' bytes, their RRC boxes, and (bytes, key) for the CPU path."""
    ds = ShardDataset(str(shards), **GEO, with_keys=True)
    dec = ds.tensor_decoder(0)
    raw = ShardDataset(str(shards), decode="raw", order=Order(shuffle=False), with_keys=True)
    bufs, boxes, datas = [], [], []
    for data, _, key in raw:
        bufs.append(np.frombuffer(data, np.uint8))
        boxes.append(dec.crop_box(data, key))
        datas.append((data, key))
        if len(bufs) == n:
            break
    return bufs, boxes, datas


def _timed(fn, reps: int) -> tuple[float, float]:
    """(seconds to the device's end, this thread's CPU seconds in the call itself: not the
    final synchronize, which spins) per call, medians of ``reps`` after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    walls, cpus = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        cpus.append(time.thread_time() - c)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls), statistics.median(cpus)


# --- sections ------------------------------------------------------------------------------------


def tests(args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-k",
        "cuda",
        "tests/loader",
        "-p",
        "no:cacheprovider",
    ]
    t = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    tail = (run.stdout + run.stderr).strip().splitlines()[-15:]
    print("\n".join(tail), flush=True)
    return {"rc": run.returncode, "tail": tail, "seconds": time.perf_counter() - t}


def probe(args) -> dict:
    nv = dev.nvimgcodec()
    bufs, boxes, _ = _records(args.shards, args.batch)
    kinds = nv.BackendKind
    lists = {
        "hw": [kinds.HW_GPU_ONLY],
        "hybrid": [kinds.HYBRID_CPU_GPU],
        "hw,cuda,hybrid": [kinds.HW_GPU_ONLY, kinds.GPU_ONLY, kinds.HYBRID_CPU_GPU],
    }
    stream = torch.cuda.Stream()
    out: dict = {}
    for opt_name, options in (
        ("fancy", ""),
        *[(n + "-" + o[:12], o) for n, o in dev.UPSAMPLING[1:]],
    ):
        for list_name, backends in lists.items():
            name = f"{opt_name} [{list_name}]"
            try:
                decoder = nv.Decoder(
                    device_id=0, backends=[nv.Backend(k) for k in backends], options=options
                )
            except Exception as exc:
                out[name] = {"error": str(exc)[:200]}
                continue
            for what, regions in (("region", True), ("whole", False)):

                def call(regions=regions, decoder=decoder):
                    streams = []
                    for b, box in zip(bufs, boxes, strict=True):
                        cs = nv.CodeStream(b)
                        if regions:
                            cs = cs.get_sub_code_stream(
                                region=nv.Region(
                                    box.top, box.left, box.top + box.h, box.left + box.w
                                )
                            )
                        streams.append(cs)
                    return decoder.decode(streams, cuda_stream=stream.cuda_stream)

                try:
                    decoded = sum(1 for i in call() if i is not None)
                    wall, cpu = _timed(call, args.rounds)
                    out[f"{name} {what}"] = {
                        "decoded": decoded,
                        "of": len(bufs),
                        "images_per_s": len(bufs) / wall,
                        "thread_cpu_us_per_image": cpu / len(bufs) * 1e6,
                    }
                except Exception as exc:
                    out[f"{name} {what}"] = {"error": str(exc)[:200]}
                print(f"  probe {name} {what}: {out[f'{name} {what}']}", flush=True)
    out["nvjpeg"] = dev.nvjpeg_versions()
    return out


def _resized(decoder, kept: list, flips: list, dtype) -> torch.Tensor:
    """The loader's way: groups of similar sizes, each padded and resized in one go."""
    cuda = torch.device("cuda")
    images = torch.empty((len(kept), 3, 224, 224), dtype=torch.uint8, device=cuda)
    for group in dev.groups(kept):
        part = [kept[g] for g in group]
        tmp = torch.empty((len(part), 3, 224, 224), dtype=torch.uint8, device=cuda)
        dev.resize_batch(
            decoder.padded(part, cuda),
            [c.h for c in part],
            [c.w for c in part],
            224,
            [flips[g] for g in group],
            tmp,
            dtype=dtype,
        )
        # pinned, as the loader does: a pageable index would make the host wait for the stream
        where = torch.tensor(group, dtype=torch.int64).pin_memory().to(cuda, non_blocking=True)
        images.index_copy_(0, where, tmp)
    return images


def _gpu_ms(fn, reps: int) -> float:
    """The device's own time for ``fn``'s work on the current stream (CUDA events), median
    over ``reps``: with the host's CPU per call it tells launch-bound from GPU-bound."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def pipeline(args) -> dict:
    bufs, boxes, datas = _records(args.shards, args.batch)
    ds = ShardDataset(str(args.shards), **GEO)
    cpu_dec = ds.tensor_decoder(0)
    cuda = torch.device("cuda")
    out: dict = {"nvjpeg": None}
    for upsampling in ("fancy", "fast"):
        decoder = dev.DeviceDecoder(cuda, upsampling=upsampling)
        stream = torch.cuda.Stream()
        row: dict = {
            "backend": decoder.backend,
            "options": decoder.options,
            "memcpy2d": decoder.memcpy2d,
        }
        for dtype in (torch.float16, torch.float32):

            def call(dtype=dtype, decoder=decoder, stream=stream):
                with torch.cuda.stream(stream):
                    crops = decoder.decode(bufs, boxes, stream)
                    kept = [c for c in crops if c is not None]
                    flips = [b.flip for b, c in zip(boxes, crops, strict=True) if c is not None]
                    images = _resized(decoder, kept, flips, dtype)
                return crops, images

            crops, images = call()
            wall, cpu = _timed(call, args.rounds)
            key = str(dtype).split(".")[-1]
            row[key] = {
                "images_per_s": len(bufs) / wall,
                "thread_cpu_us_per_image": cpu / len(bufs) * 1e6,
                "region": sum(1 for c in crops if c is not None and not c.whole),
                "whole": sum(1 for c in crops if c is not None and c.whole),
                "declined": sum(1 for c in crops if c is None),
            }
            # the padded copies and the resize alone, on decoded crops
            kept = [c for c in crops if c is not None]
            flips = [b.flip for b, c in zip(boxes, crops, strict=True) if c is not None]

            def resize(dtype=dtype, kept=kept, flips=flips, decoder=decoder):
                _resized(decoder, kept, flips, dtype)

            rw, rc = _timed(resize, args.rounds)
            row[key]["pad_and_resize_ms_per_batch"] = rw * 1e3
            row[key]["pad_and_resize_gpu_ms_per_batch"] = _gpu_ms(resize, args.rounds)
            row[key]["groups"] = len(dev.groups(kept))
            row[key]["resize_thread_cpu_us_per_image"] = rc / len(kept) * 1e6
            if dtype == torch.float16:
                diffs = []
                for i, ((d, key), c) in enumerate(zip(datas, crops, strict=True)):
                    if c is None:
                        continue
                    ref = cpu_dec(d, key)
                    j = sum(1 for cc in crops[:i] if cc is not None)
                    diffs.append(float((images[j].cpu().float() - ref.float()).abs().mean()))
                row["mean_diff_from_cpu_path"] = {
                    "median": statistics.median(diffs),
                    "worst": max(diffs),
                    "mean": statistics.fmean(diffs),
                }
        out[upsampling] = row
        print(f"  pipeline {upsampling}: {json.dumps(row)}", flush=True)
    out["nvjpeg"] = dev.nvjpeg_versions()
    out["auto"] = dev.DeviceDecoder(cuda).backend
    return out


def _urls(args) -> list[str]:
    dest = args.imagenet.with_name(args.imagenet.name + "-replicated")
    return makers.replicated(args.shards, args.samples, dest)[0]


def _drain(ld, warmup: int, steps: int, batch: int) -> dict:
    """``steps`` batches after ``warmup``: images/s, the calling thread's and the process's CPU
    per image (the process: the decode thread and nvImageCodec's threads too)."""
    it = iter(ld)
    for _ in range(warmup):
        next(it)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    counts0 = ld.feed_counts.as_dict()
    t = time.perf_counter()
    row = _drain_more(it, steps, batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    del it
    return {
        "images_per_s": steps * batch / (time.perf_counter() - t),
        **row,
        "feed_counts": ld.feed_counts.as_dict(),
        "feed_counts_at_start": counts0,
        "share_to_workers": ld.balance.sent if ld.decode_on == "auto" else None,
        "repr": repr(ld),
    }


def cpu_facts() -> dict:
    """Model, logical CPUs usable, and physical cores (distinct (package, core) pairs)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.*)", text)
    cores = set(re.findall(r"physical id\s*:\s*(\d+)[\s\S]*?core id\s*:\s*(\d+)", text))
    return {"usable": harness.cores(), "model": model and model.group(1),
            "physical_cores": len(cores) or None}  # fmt: skip


def cpu(args) -> dict:
    """The CPUs, and one process's RRC-224 decode on one thread (images/s), median of 3."""
    torch.set_num_threads(1)
    _, _, datas = _records(args.shards, 256)
    dec = ShardDataset(str(args.shards), **GEO).tensor_decoder(0)
    out = torch.empty((3, 224, 224), dtype=torch.uint8)
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        for data, key in datas:
            dec(data, key, out)
        rates.append(len(datas) / (time.perf_counter() - t))
    torch.set_num_threads(harness.cores())
    return {**cpu_facts(), "one_process_rrc_images_per_s": statistics.median(rates)}


def loader(args) -> dict:
    from shardkit.loader import epoch as epoch_mod

    urls = _urls(args)
    n = args.workers or max(1, harness.cores() - 1)
    out: dict = {"num_workers": n}  # not "workers": that is decode_on="workers"'s row
    for mode in [*args.decode_on, "device-nothread"]:
        epoch_mod.DECODE_THREADS = 1 if mode != "device-nothread" else 0
        ds, ld = trainer_loader(urls, mode.split("-")[0], n, args.batch)
        try:
            out[mode] = row = _drain(ld, args.warmup, args.steps, args.batch)
        finally:
            ld.close()
            epoch_mod.DECODE_THREADS = 1
        print(
            f"  loader {mode}: {row['images_per_s']:.0f} img/s, trainer thread CPU "
            f"{row['trainer_thread_cpu_us_per_image']:.1f} us/img, process "
            f"{row['process_cpu_us_per_image']:.0f}, {row['feed_counts']}",
            flush=True,
        )
    return out


def cpu_backend(args) -> dict:
    """decode_on="device" on nvImageCodec's CPU backend (no GPU): the training thread's CPU."""
    n = args.workers or max(1, harness.cores() - 1)
    ds, ld = trainer_loader(_urls(args), "device", n, args.batch, None)
    try:
        row = _drain(ld, 2, 6, args.batch)
    finally:
        ld.close()
    print(f"  cpu backend: {row}", flush=True)
    return row


def stub(args) -> dict:
    """The decode thread's CPU per image with the decode (``StandInDecoder(stub=True)``) and the
    batch resize (``resize_batch``) stubbed: what the device path's own Python costs per image
    in the training process, measured by ``time.thread_time`` in the decode thread around each
    batch, less the time inside the two stubs."""
    import threading

    from shardkit.loader import device_feed

    spent = {"batch": 0.0, "decode": 0.0, "resize": 0.0, "images": 0, "batches": 0}
    lock = threading.Lock()

    class Timed(dev.StandInDecoder):
        def decode(self, buffers, boxes, stream=None):
            c = time.thread_time()
            out = super().decode(buffers, boxes, stream)
            with lock:
                spent["decode"] += time.thread_time() - c
            return out

    def resize(*a, **k):
        c = time.thread_time()
        with lock:
            spent["resize"] += time.thread_time() - c

    stage = device_feed.DeviceFeed._stage_encoded

    def staged(self, msg):
        c = time.thread_time()
        try:
            return stage(self, msg)
        finally:
            with lock:
                spent["batch"] += time.thread_time() - c
                spent["images"] += msg.count
                spent["batches"] += 1

    def factory(device=None, upsampling=None):
        return Timed(device, stub=True)

    n = args.workers or max(1, harness.cores() - 1)
    urls = _urls(args)
    out: dict = {"num_workers": n}
    # 16: the Python alone (the batch's tensors tiny); 224: with the host's copies into the
    # batch (index_copy_ of the size groups), which on a GPU are kernels, not host time
    for size in (16, 224):
        for k in spent:
            spent[k] = 0
        device_feed.DeviceFeed._stage_encoded, real_resize = staged, device_feed.resize_batch
        device_feed.resize_batch = resize
        try:
            decode = Decode(crop=RandomResizedCrop(size), flip=True)
            _, ld = trainer_loader(
                urls, "device", n, args.batch, None, decode, _decoder_factory=factory
            )
            try:
                it = iter(ld)
                for _ in range(args.warmup):
                    next(it)
                for k in spent:
                    spent[k] = 0
                row = _drain_more(it, args.steps, args.batch)
            finally:
                ld.close()
        finally:
            device_feed.DeviceFeed._stage_encoded, device_feed.resize_batch = stage, real_resize
        images = spent["images"] or 1
        rest = spent["batch"] - spent["decode"] - spent["resize"]
        row.update(
            {
                "batches": spent["batches"],
                "decode_thread_cpu_us_per_image": spent["batch"] / images * 1e6,
                "in_decode_stub_us_per_image": spent["decode"] / images * 1e6,
                "in_resize_stub_us_per_image": spent["resize"] / images * 1e6,
                "device_path_python_us_per_image": rest / images * 1e6,
            }
        )
        out[f"size_{size}"] = row
        print(f"  stub size {size}: {row}", flush=True)
    return out


def _drain_more(it, steps: int, batch: int) -> dict:
    """``steps`` more batches of ``it``: the calling thread's and the process's CPU per image."""
    c, p = time.thread_time(), time.process_time()
    for _ in range(steps):
        next(it)
    images = steps * batch  # the calling thread's CPU: not the final synchronize, which spins
    return {
        "trainer_thread_cpu_us_per_image": (time.thread_time() - c) / images * 1e6,
        "process_cpu_us_per_image": (time.process_time() - p) / images * 1e6,
    }


def train(args) -> dict:
    import bench_train

    ns = argparse.Namespace(
        device="cuda",
        train=args.models,
        imagenet=args.imagenet,
        samples=args.samples,
        train_workers=args.workers,
        decode_on=args.decode_on,
        batch=args.batch,
        steps=args.train_steps,
    )
    return bench_train.train(ns)


#: The summary's columns: every section's rows that carry one of them.
COLUMNS = ("images_per_s:.0f", "thread_cpu_us_per_image:.1f", "trainer_thread_cpu_us_per_image:.1f",
           "process_cpu_us_per_image:.0f", "pad_and_resize_ms_per_batch:.2f",
           "decode_thread_cpu_us_per_image:.1f", "device_path_python_us_per_image:.1f",
           "median:.2f", "of_gpu_speed:.3f", "wait_share:.3f")  # fmt: skip


def _rows(x, name: str):
    """(name, row) of every dict within ``x`` that has one of the summary's columns."""
    if not isinstance(x, dict):
        return
    if any(c.split(":")[0] in x for c in COLUMNS):
        yield name, x
    for k, v in x.items():
        yield from _rows(v, f"{name} {k}")


def summary(r: dict) -> None:
    """The figures that matter, last in the output (a lent machine's reply carries its end)."""
    print("\n== summary", r.get("gpu"), r.get("cpus"), "cpus,", r.get("versions"))
    print("tests:", (r.get("tests") or {}).get("tail", ["-"])[-1:])
    c = r.get("cpu") or {}
    if "model" in c:
        print(f"cpu {c['model']}: {c['usable']} usable, {c['physical_cores']} cores; one process "
              f"RRC-224 {c['one_process_rrc_images_per_s']:.0f} images/s (worker efficiency: "
              "the loader workers' images/s over workers x this)")  # fmt: skip
    rows = {n: v for s in SECTIONS[2:] for n, v in _rows(r.get(s), s)}
    harness.table(rows, COLUMNS)
    for name in SECTIONS:
        if isinstance(r.get(name), dict) and "error" in r[name]:
            print(f"{name} ERROR: {r[name]['error'][-400:]}")


@harness.case(
    data="an ImageNet-shaped tree (20 classes x --per-class), packed",
    measures="everything a lent GPU machine measures (device decode, pipeline, loader, "
    "training), one JSON",
    small={
        "per_class": 4,
        "samples": 400,
        "batch": 16,
        "warmup": 1,
        "steps": 3,
        "train_steps": 3,
        "models": "resnet18",
        "sections": "cpu,probe,pipeline,loader",
    },  # fmt: skip
    aliases={"rounds": ["reps"]},
)
class Device(harness.Bench):
    rounds: int = 5
    json: Path | None = ROOT / "bench-out" / "bench_device.json"
    sections: str = ",".join(SECTIONS)
    no_torchvision: bool = False
    stub: bool = harness.arg(False, "the stub section alone (no GPU needed)")
    imagenet: Path | None = harness.arg(None, "default: the data root")
    shards: Path | None = harness.arg(None, "packed shards (default: made from --imagenet)")
    per_class: int = harness.arg(100, "synthetic ImageNet, 20 classes")
    samples: int = harness.arg(100_000, "samples per long epoch")
    batch: int = 256
    warmup: int = 10
    steps: int = harness.arg(60, "loader: timed batches")
    workers: int | None = None
    models: str = "resnet18,resnet50"
    train_steps: int = 100
    decode_on: tuple[str, ...] = ("workers", "device", "auto")


def main(args: Device) -> None:
    args = replace(args, imagenet=args.imagenet or makers.root() / "imagenet")
    result: dict = {
        "torchvision_first": TORCHVISION,
        "cpus": harness.cores(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "load_start": harness.loadavg(),
    }
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    try:
        result["versions"] = dev.versions_text()
    except Exception as exc:
        result["versions"] = repr(exc)
    wanted = ["stub"] if args.stub else args.sections.split(",")
    if any(s != "tests" for s in wanted):
        t = time.perf_counter()
        tree = makers.imagenet(args.imagenet, classes=20, per_class=args.per_class)
        args = replace(args, shards=args.shards or makers.packed(tree, shard_size="16MB"))
        result["data_s"] = time.perf_counter() - t
    for name in SECTIONS:
        if name not in wanted:
            continue
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            result[name] = globals()[name](args)
        except Exception:
            result[name] = {"error": traceback.format_exc()[-2000:]}
            print(result[name]["error"], flush=True)
        result[name + "_s"] = time.perf_counter() - t
        harness.write_result(args.json, "bench_device", args, result)  # each section: kept
    result["versions_end"] = dev.versions_text()
    harness.write_result(args.json, "bench_device", args, result)
    summary(result)
    print(f"json: {args.json}")


if __name__ == "__main__":
    harness.script(__file__)
