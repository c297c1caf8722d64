#!/usr/bin/env python3
"""ShardLoader against DataLoader(ShardDataset), DataLoader(FolderDataset), webdataset and
the libjpeg-turbo decode ceiling, on the cores of this machine (bench_train.py: across core
counts); (a) LFW-shaped full decode, (b) ImageNet-shaped random-resized crop 224 + flip, batch
64, 2 workers, interleaved with the ceiling first in every round; per-worker efficiency (a
worker's fill loop against a bare decoder loop on the same bytes) and memory over ``--epochs``.
Method, goals, the FFCV venv (``--ffcv``, ``--ffcv-bytes``) and figures: docs/loader.md
("Measured on 2 cores, FFCV beside").

    python benchmarks/bench_loader.py --lfw data/lfw --imagenet data/imagenet --repeats 3
"""

from __future__ import annotations

import gc
import glob
import itertools
import statistics
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Literal

import data
import harness

ROOT = harness.ROOT

import simplejpeg  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from shardkit import (  # noqa: E402
    CenterCrop,
    Decode,
    FolderDataset,
    RandomResizedCrop,
    ShardDataset,
    ShardLoader,
)
from shardkit.loader.fill import Filler, FillSpec  # noqa: E402
from shardkit.loader.messages import Start  # noqa: E402
from shardkit.loader.ring import MappedSlots, Ring  # noqa: E402
from shardkit.stream.world import World  # noqa: E402

BATCH = 64
WORKERS = 2


# --- data -------------------------------------------------------------------------------------


def ensure(src: Path, kind: str, scale: float, per_class: int = 250) -> Path:
    """The image tree (synthesised if missing) packed to 16 MB tar shards beside it."""
    tree = data.lfw(src, scale) if kind == "lfw" else data.imagenet(src, 20, per_class)
    return data.packed(tree, shard_size="16MB")


def rss_mb(pid: int | None = None) -> float:
    return harness.proc_kb(pid or "self") / 1024


# --- contenders --------------------------------------------------------------------------------


_cpu_s = harness.cpu_seconds  # this process and its exited children (DataLoader workers)
live_cpu_s = harness.live_cpu_seconds  # ShardLoader's persistent workers: not yet reaped


def timed_epoch(batches) -> dict:
    """One epoch (``harness.epoch``): first-batch time, images/s after the first batch and
    overall, CPU microseconds per image over the whole epoch, workers included; for ShardLoader
    also the training process's own CPU per image (what its workers leave it to do)."""
    e = harness.epoch(batches)
    n = e["images"]
    return {
        "cpu_us_per_image": e["cpu_s"] / n * 1e6,
        "main_cpu_us_per_image": e["main_cpu_s"] / n * 1e6,
        "first_batch_s": e["first_s"],
        "images_per_s": e["steady_rate"],
        "epoch_images_per_s": e["rate"],
        "images": n,
    }


def webdataset_loader(shards: Path, epoch: int):
    import webdataset as wds

    urls = sorted(glob.glob(str(shards / "*.tar")))
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=epoch, empty_check=False)
        .shuffle(1000)
        .decode("torchrgb8")
        .to_tuple("jpg", "cls")
    )
    return DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)


def _once(build):
    """A contender built on first use and kept, as a training script keeps its loader; each
    call sets the next epoch. (DataLoader workers still start afresh every epoch, their
    default; ShardLoader keeps its batch buffers.)"""
    state: dict = {}

    def run(epoch):
        if not state:
            state["ds"], state["loader"] = build()
        state["ds"].set_epoch(epoch)
        return state["loader"]

    return run


# --- FFCV (optional) ---------------------------------------------------------------------------


def ffcv_beton(src: Path, quality: int) -> Path:
    """The tree written once as an FFCV .beton beside it (FFCV's own writer)."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    path = src.with_name(f"{src.name}-ffcv-q{quality}.beton")
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        ds = FolderDataset(str(src), decode="pil")
        tmp = path.with_suffix(".tmp")
        fields = {
            "image": RGBImageField(write_mode="jpg", jpeg_quality=quality),
            "label": IntField(),
        }
        DatasetWriter(str(tmp), fields, num_workers=WORKERS).from_indexed_dataset(ds)
        tmp.rename(path)
    return path


def ffcv_encoded(src: Path, quality: int) -> Path:
    """``src`` re-encoded the way FFCV's writer encodes (OpenCV at ``quality``), beside it: the
    tar shards packed from it and the .beton written from it then hold the same pictures at
    nearly the same bytes (re-encoding a quality-q JPEG at q barely changes it), so the run
    compares loaders, not files (``--ffcv-bytes``)."""
    import numpy as np
    from ffcv.fields.rgb_image import encode_jpeg
    from PIL import Image

    out = src.with_name(f"{src.name}-cv2-q{quality}")
    if not out.exists():
        print(f"re-encoding {src} -> {out} ...", flush=True)
        tmp = out.with_name(out.name + ".tmp")
        for f in sorted(glob.glob(str(src / "*" / "*"))):
            dest = tmp / Path(f).relative_to(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with Image.open(f) as img:
                dest.write_bytes(encode_jpeg(np.asarray(img.convert("RGB")), quality).tobytes())
        tmp.rename(out)
    return out


def ffcv_contender(beton: Path, crop: bool):
    """FFCV's Loader, built and warmed up once (numba compiles its pipeline on first use)."""
    from ffcv.fields.decoders import (
        IntDecoder,
        RandomResizedCropRGBImageDecoder,
        SimpleRGBImageDecoder,
    )
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage

    state: dict = {}

    def run(epoch):
        if not state:
            if crop:
                image = [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip()]
            else:
                image = [SimpleRGBImageDecoder()]
            pipelines = {
                "image": [*image, ToTensor(), ToTorchImage()],
                "label": [IntDecoder(), ToTensor()],
            }
            loader = Loader(
                str(beton),
                batch_size=BATCH,
                num_workers=WORKERS,
                order=OrderOption.RANDOM,
                os_cache=True,
                pipelines=pipelines,
            )
            for _ in loader:  # the numba compile, not timed
                pass
            state["loader"] = loader
        return state["loader"]

    return run


def add_ffcv(contenders: dict, src: Path, shards: Path, ffcv, crop: bool) -> str:
    """With ``ffcv`` = (jpeg quality, contender name): FFCV joins ``contenders``. Returns and
    prints the mean bytes per image of the tar shards (and of the .beton)."""
    from shardkit.manifest import read_manifest

    m = read_manifest(str(shards))
    text = f"tar shards {m.total_bytes / m.num_samples / 1e3:.1f} KB/image"
    if ffcv is not None:
        quality, name = ffcv
        beton = ffcv_beton(src, quality)
        contenders[name] = ffcv_contender(beton, crop=crop)
        text += f", FFCV .beton {beton.stat().st_size / m.num_samples / 1e3:.1f} KB/image"
    print(f"  {text}", flush=True)
    return text


def _shard_loader(shards: Path, decode, channels_last: bool, loader=ShardLoader):
    def build():
        ds = ShardDataset(str(shards), decode=decode)
        return ds, loader(ds, BATCH, num_workers=WORKERS, channels_last=channels_last)

    return _once(build)


def _dl_shard(shards: Path, decode):
    def build():
        ds = ShardDataset(str(shards), decode=decode)
        return ds, DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)

    return _once(build)


class ConstantImages(torch.utils.data.IterableDataset):
    """``n`` copies of one uint8 CHW tensor, split across workers: DataLoader transport alone."""

    def __init__(self, n: int, shape: tuple[int, int, int]):
        self.n, self.shape = n, shape

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, k = (info.id, info.num_workers) if info else (0, 1)
        img = torch.zeros(self.shape, dtype=torch.uint8)
        for _ in range(w * self.n // k, (w + 1) * self.n // k):
            yield img, 0


def contenders_a(src: Path, shards: Path, datas: list[bytes]) -> dict:
    h, w = simplejpeg.decode_jpeg_header(datas[0])[:2]
    transport = ConstantImages(len(datas), (3, h, w))

    def dl_folder(epoch):
        g = torch.Generator().manual_seed(epoch)
        ds = FolderDataset(str(src), decode="tensor")
        return DataLoader(ds, batch_size=BATCH, num_workers=WORKERS, shuffle=True, generator=g)

    out = {
        "ShardLoader": _shard_loader(shards, "tensor", False),
        "ShardLoader channels_last": _shard_loader(shards, "tensor", True),
        # FFCV's accuracy (libjpeg-turbo's fast integer IDCT), opt-in
        "ShardLoader channels_last dct=fast": _shard_loader(
            shards, Decode("tensor", dct="fast"), True
        ),
        "DataLoader(ShardDataset)": _dl_shard(shards, "tensor"),
        "DataLoader(FolderDataset)": dl_folder,
        "webdataset + DataLoader": lambda e: webdataset_loader(shards, e),
        # the same loader over constant tensors: what moving batches through shared memory costs
        "DataLoader transport only": lambda e: DataLoader(
            transport, batch_size=BATCH, num_workers=WORKERS
        ),
    }
    return out


#: (b)'s decode: random-resized crops of 224 and flips.
RRC = Decode(crop=RandomResizedCrop(224), flip=True)


def contenders_b(shards: Path) -> dict:
    out = {
        "ShardLoader RRC224+flip": _shard_loader(shards, RRC, False),
        "ShardLoader RRC224+flip channels_last": _shard_loader(shards, RRC, True),
        "ShardLoader center224 channels_last": _shard_loader(
            shards, Decode(crop=CenterCrop(224, 224)), True
        ),
        "DataLoader(ShardDataset RRC224+flip)": _dl_shard(shards, RRC),
    }
    return out


# --- per-worker efficiency --------------------------------------------------------------------


class WorkerLoop:
    """One worker's fill loop against the bare decoder loop it wraps, in this process.

    "fill": ``Filler.run`` (what a ShardLoader worker runs) over a whole epoch, one worker, into
    4 ring slots taken in turn. "bare": the same decoder calls the fill loop makes (whole images:
    ``into_batch`` per batch; crops: per image) into one batch buffer, on the same records'
    bytes held in memory (no reading, no bookkeeping). "records": the epoch's records alone,
    undecoded. Process CPU microseconds per image: other processes' load barely moves them."""

    def __init__(self, ds, records: list[tuple[bytes, str]], nhwc: bool):
        self.ds, self.records, self.nhwc = ds, records, nhwc
        self.ring = Ring(1, 4, shared=True, pin=False)
        self.filler = Filler(ds, FillSpec(BATCH, 1, False, nhwc), 0, MappedSlots(ring=self.ring))
        c, h, w = ds.tensor_decoder(0)(*records[0]).shape
        shape = (BATCH, h, w, c) if nhwc else (BATCH, c, h, w)
        # the ring's slots mapped and sized before timing (a ShardLoader keeps them too)
        warm = self.filler.run(Start(0, 0, None), itertools.cycle(range(4)).__next__)
        for _ in zip(range(4), warm, strict=False):
            pass
        warm.close()
        # the bare loop writes into the same 4 slots, in turn: the same memory traffic
        self.arrs = [self.ring.array(0, slot, shape) for slot in range(4)]
        if ds.geometry is None:  # whole images: numpy slots, as the fill loop's
            self.targets = [img for arr in self.arrs for img in arr]
        else:  # crops: (3, H, W) tensor views, permuted for channels_last
            slots = [torch.from_numpy(arr) for arr in self.arrs]
            self.targets = [
                img for t in slots for img in (t.permute(0, 3, 1, 2) if nhwc else t).unbind(0)
            ]

    def bare(self, epoch: int) -> float:
        decoder = self.ds.tensor_decoder(epoch)
        planar = self.ds.geometry is None and not self.nhwc
        gc.collect()
        c = time.thread_time()
        if self.ds.geometry is None:  # whole images: the fill loop's one call per batch
            datas = [data for data, _ in self.records]
            for b, i in enumerate(range(0, len(datas), BATCH)):
                part = datas[i : i + BATCH]
                if decoder.into_batch(part, self.arrs[b % 4], 0, planar) < len(part):
                    raise SystemExit("bare loop: an image the batch decoder declines")
        else:
            for (data, key), out in zip(self.records, itertools.cycle(self.targets), strict=False):
                decoder(data, key, out)
        return (time.thread_time() - c) / len(self.records) * 1e6

    def records_only(self, epoch: int) -> float:
        gc.collect()
        c, n = time.thread_time(), 0
        for _ in self.ds.records_from(World(0, 1, 0, 1), epoch, None, BATCH):
            n += 1
        return (time.thread_time() - c) / n * 1e6

    def fill(self, epoch: int) -> float:
        acquire = itertools.cycle(range(4)).__next__  # every slot free again when it comes round
        gc.collect()
        c, n = time.thread_time(), 0
        for batch in self.filler.run(Start(0, epoch, None), acquire):
            n += batch.count
        return (time.thread_time() - c) / n * 1e6

    def once(self, epoch: int) -> dict:
        """Bare, records and fill with ``epoch``'s decoder (its crops) and order."""
        bare, records, fill = self.bare(epoch), self.records_only(epoch), self.fill(epoch)
        return {
            "bare_us_per_image": bare,
            "records_us_per_image": records,
            "fill_us_per_image": fill,
            "loop_us_per_image": fill - bare - records,
            "efficiency": bare / fill,
        }

    def close(self) -> None:
        self.ring.close()


def worker_loops(ds) -> dict[str, WorkerLoop]:
    """Both layouts' loops on ``ds`` (built as the ShardLoader contenders build theirs), with
    its records read once."""
    records = [(r.data, r.key) for r in ds.records_from(World(0, 1, 0, 1), 0, None, BATCH)]
    return {
        "contiguous": WorkerLoop(ds, records, False),
        "channels_last": WorkerLoop(ds, records, True),
    }


#: A contender's figures given as medians over the repeats.
MEDIANS = ("images_per_s", "ratio_to_ceiling", "ratio_to_two_processes", "first_batch_s",
           "cpu_us_per_image", "cpu_efficiency")  # fmt: skip


def measure(
    name: str,
    datas: list[bytes],
    contenders: dict,
    repeats: int,
    loops: dict[str, WorkerLoop] | None = None,
    ffcv: str | None = None,
) -> dict:
    """Every contender once per repeat, then each of ``loops`` (``WorkerLoop``); ``ffcv``: the
    contender whose images/s the others' are also given as a share of."""
    loops = loops or {}
    epoch = itertools.count(1)
    ceil: dict[str, float] = {}

    def ceiling(r: int) -> dict:  # first in every round: the contenders divide by it
        c = harness.ceiling(datas)  # the accurate IDCT, as Pillow and shardkit decode
        fast = harness.ceiling(datas, fastdct=True).scaled  # FFCV's faster, less accurate one
        ceil.update(one=c.scaled, cpu=c.cpu_us, fast=fast, two=harness.ceiling_at_once(datas, 2))
        return dict(ceil)

    def contender(cname, make):
        def run(r: int) -> dict:
            res = timed_epoch(make(next(epoch)))
            res["ratio_to_ceiling"] = res["images_per_s"] / ceil["one"]
            res["ratio_to_two_processes"] = res["images_per_s"] / ceil["two"]
            res["cpu_efficiency"] = ceil["cpu"] / res["cpu_us_per_image"]
            print(
                f"  [{name} {r + 1}/{repeats}] {cname:40s} {res['images_per_s']:7.0f} img/s  "
                f"{res['ratio_to_ceiling']:5.2f} of ceiling  first batch "
                f"{res['first_batch_s']:.2f} s  {res['cpu_us_per_image']:.0f} CPU us/image "
                f"({res['main_cpu_us_per_image']:.0f} in the training process)",
                flush=True,
            )
            return res

        return run

    def loop_run(layout, loop):
        def run(r: int) -> dict:
            res = loop.once(next(epoch))
            print(
                f"  [{name} {r + 1}/{repeats}] per-worker efficiency {layout}: bare "
                f"{res['bare_us_per_image']:.1f}, records {res['records_us_per_image']:.1f}, "
                f"fill {res['fill_us_per_image']:.1f} CPU us/image -> {res['efficiency']:.3f}",
                flush=True,
            )
            return res

        return run

    sides = {"(ceiling)": ceiling}
    sides.update({cname: contender(cname, make) for cname, make in contenders.items()})
    sides.update({f"(loop) {layout}": loop_run(layout, loop) for layout, loop in loops.items()})
    rounds = harness.interleave(sides, repeats, order="fixed")
    rows = {k: rounds.results[k] for k in contenders}
    eff = {k: rounds.results[f"(loop) {k}"] for k in loops}
    for runs in [*rows.values(), *eff.values()]:
        for x in runs:  # the harness's own figures: not the contender's
            x.pop("cpu_s", None), x.pop("wall_s", None)
    got = {k: rounds.values("(ceiling)", k) for k in ("one", "two", "fast", "cpu")}
    summary = {
        "ceiling_one_x2": got["one"],
        "ceiling_two_processes": got["two"],
        "ceiling_fastdct_one_x2": got["fast"],
        "ceiling_cpu_us_per_image": got["cpu"],
        "load_1min": [x.load_1m for x in rounds.loads],
        "contenders": {},
    }
    for cname, runs in rows.items():
        c = summary["contenders"][cname] = {"runs": runs}
        for k in MEDIANS:
            c[f"median_{k}"] = statistics.median(x[k] for x in runs)
        c["median_main_cpu_share"] = rounds.ratio(
            cname, "(ceiling)", "main_cpu_us_per_image", "cpu"
        )
        if ffcv in rows and cname != ffcv:
            c["median_ratio_to_ffcv"] = rounds.ratio(cname, ffcv, "images_per_s")
    if loops:
        summary["worker_efficiency"] = {
            layout: {
                "runs": runs,
                **{f"median_{k}": statistics.median(x[k] for x in runs) for k in runs[0]},
            }
            for layout, runs in eff.items()
        }
    return summary


def memory(shards: Path, epochs: int) -> dict:
    """RSS after each epoch of every process (MB): ShardLoader's main process and its persistent
    workers, and DataLoader's with persistent workers."""
    out: dict = {}
    for name in ("shardloader", "dataloader"):
        ds = ShardDataset(str(shards), decode="tensor")
        if name == "shardloader":
            loader = ShardLoader(ds, BATCH, num_workers=WORKERS)
        else:
            loader = DataLoader(ds, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True)
        main, workers = out[f"{name}_rss_mb"], out[f"{name}_workers_rss_mb"] = [], []
        for e in range(epochs):
            ds.set_epoch(e)
            it = iter(loader)
            for _ in it:
                pass
            main.append(rss_mb())
            pids = getattr(loader, "worker_pids", [w.pid for w in getattr(it, "_workers", [])])
            workers.append([rss_mb(p) for p in pids])
        if name == "shardloader":
            out["ring"] = repr(loader.ring)
            loader.close()
        del it, loader
    return out


def chosen(contenders: dict, names: str | None) -> dict:
    """``--contenders``: those whose name contains one of the comma-separated parts."""
    if not names:
        return contenders
    parts = [p.strip() for p in names.split(",") if p.strip()]
    return {k: v for k, v in contenders.items() if any(p in k for p in parts)}


def report(part: str, m: dict, text: str, repeats: int) -> None:
    """The summary of workload ``part`` (``measure``'s medians)."""
    print(f"\n({part}) medians over {repeats} repeats, load {m['load_1min']}; {text}")
    ceil = {k: {"median_images_per_s": statistics.median(m[k])} for k in m if k[:8] == "ceiling_"}
    cols = ["images_per_s:.0f", "ratio_to_ceiling:.2f", "ratio_to_two_processes:.2f",
            "first_batch_s:.2f", "cpu_us_per_image:.0f", "cpu_efficiency:.2f",
            "main_cpu_share:.2f", "ratio_to_ffcv:.2f"]  # fmt: skip
    harness.table({**ceil, **m["contenders"]}, [f"median_{c}" for c in cols])
    cols = ["bare_us_per_image:.1f", "records_us_per_image:.1f", "fill_us_per_image:.1f",
            "efficiency:.3f"]  # fmt: skip
    harness.table(m.get("worker_efficiency", {}), [f"median_{c}" for c in cols])


@harness.case(
    data="the --lfw tree and an ImageNet-shaped one (20 classes), packed",
    measures="ShardLoader against DataLoader, FolderDataset, WebDataset (FFCV with --ffcv) "
    "against the simplejpeg ceiling; per-worker efficiency; memory over epochs",
    small={
        "lfw": data.root() / "lfw-smoke",
        "lfw_scale": 0.01,
        "imagenet": data.root() / "inet-smoke",
        "imagenet_per_class": 4,
        "epochs": 2,
    },  # fmt: skip
    aliases={"rounds": ["repeats"]},
)
class Loader(harness.Bench):
    rounds: int = 3
    lfw: Path = ROOT / "data" / "lfw"
    lfw_scale: float = 1.0
    imagenet: Path = ROOT / "data" / "imagenet"
    imagenet_per_class: int = harness.arg(
        250, "images per class (20 classes) when the ImageNet tree is made"
    )
    epochs: int = harness.arg(10, "epochs of the memory check")
    only: tuple[Literal["a", "b", "memory"], ...] = harness.arg((), "run only these parts")
    ffcv: bool = harness.arg(False, "add FFCV's Loader (needs ffcv)")
    ffcv_bytes: bool = harness.arg(
        False, "(a) on LFW re-encoded as FFCV's writer does (needs ffcv): the same bytes for all"
    )
    contenders: str | None = harness.arg(
        None,
        "comma-separated parts of contender names to run (e.g. 'ShardLoader,FFCV'): fewer "
        "processes between the ones compared",
    )


def main(args: Loader) -> None:
    only = set(args.only or ["a", "b", "memory"])
    torch.set_num_threads(1)  # the caller's thread only consumes; decoding runs elsewhere
    warnings.filterwarnings("ignore", category=UserWarning, module="webdataset")
    out: dict = {"load_start": harness.load_now().as_dict(), "batch_size": BATCH}
    out["workers"] = WORKERS
    if "a" in only or "memory" in only:
        if args.ffcv_bytes:
            ensure(args.lfw, "lfw", args.lfw_scale)
            args = replace(args, lfw=ffcv_encoded(args.lfw, 85))
        lfw_shards = ensure(args.lfw, "lfw", args.lfw_scale)
    if "a" in only:
        print(f"(a) LFW-shaped full decode, {args.lfw}", flush=True)
        datas = data.jpeg_bytes(args.lfw)  # the folder contender's files cached too
        contenders = contenders_a(args.lfw, lfw_shards, datas)
        ffcv = (85, "FFCV Loader") if args.ffcv else None
        out["a_bytes"] = add_ffcv(contenders, args.lfw, lfw_shards, ffcv, crop=False)
        contenders = harness.smoke_drop(chosen(contenders, args.contenders), args, "webdataset")
        loops = worker_loops(ShardDataset(str(lfw_shards), decode="tensor"))
        out["a"] = measure("a", datas, contenders, args.rounds, loops, ffcv and ffcv[1])
        for loop in loops.values():
            loop.close()
    if "b" in only:
        inet_shards = ensure(args.imagenet, "imagenet", 1.0, args.imagenet_per_class)
        print(f"(b) ImageNet-shaped random-resized-crop 224 + flip, {args.imagenet}", flush=True)
        datas = data.jpeg_bytes(args.imagenet)
        contenders = contenders_b(inet_shards)
        ffcv = (93, "FFCV Loader RRC224+flip") if args.ffcv else None
        out["b_bytes"] = add_ffcv(contenders, args.imagenet, inet_shards, ffcv, crop=True)
        contenders = harness.smoke_drop(chosen(contenders, args.contenders), args, "webdataset")
        loops = worker_loops(ShardDataset(str(inet_shards), decode=RRC))
        out["b"] = measure("b", datas, contenders, args.rounds, loops, ffcv and ffcv[1])
        for loop in loops.values():
            loop.close()
    if "memory" in only:
        print(f"memory over {args.epochs} epochs ...", flush=True)
        out["memory"] = memory(lfw_shards, args.epochs)
        for k, v in out["memory"].items():  # MB per epoch: the main process, each worker
            print(f"  {k}:", v if k == "ring" else torch.tensor(v).round().int().tolist())
    for part in ("a", "b"):
        if part in out:
            report(part, out[part], out[part + "_bytes"], args.rounds)
    harness.write_result(args.json, "bench_loader", args, out)


if __name__ == "__main__":
    harness.script(__file__)
