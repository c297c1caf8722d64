"""Where each benchmarked format reads from: planning (make and pack what is missing) and datasets.

``plan_sources`` turns a ``BenchConfig`` into one path per format. What counts as a packed
dataset is decided by ``shardkit.stream.sources.resolve_source``, the same resolution
``ShardDataset`` uses, so the bench never reuses something the dataset would read differently.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from ..errors import InputError
from ..manifest import MANIFEST_NAME
from ..stream.sources import resolve_source
from ..stream.storage import is_url
from .config import DEFAULT_SIZE, MIN_TIMED_BATCHES, SHARD_FORMATS, BenchConfig, say
from .workloads import DATASET_DECODE, Augment, MemoryDataset

__all__ = [
    "bytes_per_sample",
    "check_enough",
    "check_one_size",
    "load_all",
    "image_size",
    "make_dataset",
    "packed_skips",
    "packed_format",
    "pending",
    "plan_sources",
    "read_paths",
    "sample_bytes",
]


def packed_format(path: str) -> str | None:
    """The shard format packed at ``path``; None when nothing is packed there yet.

    "Nothing yet" is a missing local path or a directory holding only hidden entries (a pack's
    staging); anything else must resolve, and its InputError says what is wrong with it.
    """
    if not is_url(path) and not _has_pattern(path):
        if not os.path.exists(path):
            return None
        if os.path.isdir(path) and all(n.startswith(".") for n in os.listdir(path)):
            return None
    return resolve_source(path).format


def _has_pattern(path: str) -> bool:
    return glob.escape(path) != path or ("{" in path and "}" in path)


def _default_data(cfg: BenchConfig) -> str:
    """Make (once) the embedded LFW-shaped set at ``cfg.default_data``."""
    from ..synth import MARKER, make_lfw

    data = cfg.default_data
    if not os.path.isfile(os.path.join(data, MARKER)):
        say(cfg, f"making the default LFW-shaped set in {data} (once; ~30 s on 2 cores)")
    report = make_lfw(data)
    say(cfg, report.summary())
    return data


def _formats(cfg: BenchConfig, data: str | None) -> tuple[str, ...]:
    if cfg.formats is not None:
        return cfg.formats
    if cfg.shards is not None and "{format}" not in cfg.shards:
        shard_fmts: tuple[str, ...] = (packed_format(cfg.shards) or "tar",)
    else:
        shard_fmts = SHARD_FORMATS
    return (("folder",) if data is not None else ()) + shard_fmts


def _target(cfg: BenchConfig, data: str | None, fmt: str, shard_fmts: tuple[str, ...]) -> str:
    """Where the ``fmt`` shards are (or will be packed)."""
    if cfg.shards is None:
        return f"{data.rstrip('/')}-shards-{fmt}"
    if "{format}" in cfg.shards:
        return cfg.shards.replace("{format}", fmt)
    if len(shard_fmts) > 1:
        raise InputError(
            f"shards={cfg.shards!r} names one dataset but formats asks for "
            f"{', '.join(shard_fmts)}: put {{format}} in it, e.g. out/lfw-{{format}}"
        )
    return cfg.shards


def _shards_for(cfg: BenchConfig, data: str | None, fmt: str, target: str) -> str:
    """Reuse the shards at ``target``, or pack ``data`` there; returns ``target``."""
    found = packed_format(target)
    if found is None:
        if data is None:
            raise _nothing_packed(target)
        from ..write.packer import pack

        say(cfg, f"packing {data} into {target} ({fmt}, {_size_text(cfg.shard_size)} shards)")
        report = pack(data, target, format=fmt, shard_size=cfg.shard_size, progress=False)
        say(cfg, report.summary())
    elif found != fmt:
        raise InputError(
            f"{target} holds {found} shards, not {fmt}: point shards at {fmt} shards or "
            "change formats"
        )
    elif data is not None:
        _check_packed_from(cfg, target, data)
    return target


def _check_formats(formats: tuple[str, ...], data: str | None) -> None:
    if "folder" in formats and data is None:
        raise InputError(
            "the folder baseline needs the image folder: pass data (--data SRC), or "
            "drop folder from formats"
        )
    if formats == ("memory",):
        raise InputError("the memory reference needs a source: add folder, tar or lmdb")


def _check_folder(data: str) -> None:
    if not os.path.isdir(data):
        raise InputError(
            f"{data}: no such directory; pass an image folder (class-per-folder tree) as data"
        )


def pending(cfg: BenchConfig) -> tuple[list[tuple[str, str | None]], tuple[str, ...]]:
    """What ``plan_sources`` would make before the runs, without doing it, and the formats.

    For the estimate: (what, None) for the default set, (what, source folder) for each shard
    format to pack.
    Raises the same InputErrors as ``plan_sources`` for a missing folder or a bad shards path,
    and refuses data too small for the runs, all before anything is made or packed.
    """
    from ..synth import MARKER

    data, steps = cfg.data, []
    if data is None and cfg.shards is None:
        data = cfg.default_data
        if not os.path.isfile(os.path.join(data, MARKER)):
            steps.append(("making the default LFW-shaped set", None))
    elif data is not None:
        _check_folder(os.fspath(data))
    formats = _formats(cfg, data)
    _check_formats(formats, data)
    shard_fmts = tuple(f for f in formats if f in SHARD_FORMATS)
    if "loader" in formats and "tar" not in shard_fmts:
        shard_fmts += ("tar",)
    for fmt in shard_fmts:
        target = _target(cfg, data, fmt, shard_fmts)
        if packed_format(target) is None:
            if data is None:
                raise _nothing_packed(target)
            steps.append((f"packing {data} into {target}", os.fspath(data)))
        elif not is_url(target):
            manifest = resolve_source(target).manifest
            if manifest is not None:
                check_enough(cfg, manifest.num_samples, target)
    if data is not None and not steps[:1] == [("making the default LFW-shaped set", None)]:
        check_enough(cfg, _folder_count(cfg, os.fspath(data)), os.fspath(data))
    return steps, formats


def check_enough(cfg: BenchConfig, samples: int, where: str) -> None:
    """InputError unless ``samples`` cover the biggest run's warm-up and a few timed batches.

    ``batches`` asks for exactly that many timed batches; otherwise a run shorter than
    ``min_samples`` ends with the data (the verdict says so), and only ``MIN_TIMED_BATCHES``
    are required: a small folder still benches, with short runs.
    """
    warm = max(1, max(cfg.workers)) * cfg.batch_size
    timed = (cfg.batches if cfg.batches else MIN_TIMED_BATCHES) * cfg.batch_size
    if samples < warm + timed:
        knobs = ["batches="] if cfg.batches else []
        knobs += ["batch_size="] + (["workers="] if max(cfg.workers) else [])
        what = " or ".join(filter(None, [", ".join(knobs[:-1]), knobs[-1]]))
        raise InputError(
            f"{where}: {samples} samples, but a run with {max(cfg.workers)} workers needs "
            f"{warm + timed} (warm-up {warm} + {timed} timed); lower {what}"
        )


def check_one_size(blobs: list[bytes], where: str) -> None:
    """With ``size=0`` decode mode stacks images as stored: refuse mixed sizes up front."""
    from ..images.decode import image_size as header_size

    seen: dict[tuple[int, int], int] = {}
    for data in blobs:
        try:
            seen.setdefault(header_size(data), 0)
        except Exception:  # a bad image is the datasets' to report
            continue
        if len(seen) > 1:
            (h0, w0), (h1, w1) = list(seen)[:2]
            raise InputError(
                f"{where}: images differ in size ({w0}x{h0} and {w1}x{h1}) and size 0 keeps "
                "them as stored, which cannot be batched; pass size= N (the default is "
                f"{DEFAULT_SIZE}, a centre crop)"
            )


def _folder_count(cfg: BenchConfig, data: str) -> int:
    """Samples the folder holds by the scanner's rule; with ``size=0`` checks their sizes."""
    from ..scan import scan_source

    scan = scan_source(data)
    if cfg.mode == "decode" and not cfg.size and len(scan.files):
        rng = np.random.default_rng(cfg.seed)
        pick = rng.choice(len(scan.files), size=min(256, len(scan.files)), replace=False)
        blobs = []
        for i in pick.tolist():
            with open(os.path.join(data, scan.files[i]), "rb") as f:
                blobs.append(f.read())
        check_one_size(blobs, data)
    return len(scan.files)


def _nothing_packed(target: str) -> InputError:
    return InputError(
        f"{target}: no packed dataset there; pass the image folder (data, --data) to "
        "pack it on the fly, or point shards (--shards) at packed shards"
    )


def _size_text(size: int | str) -> str:
    """``32000000`` -> ``"32 MB"`` (the CLI passes bytes); strings are shown as given."""
    return f"{size / 1e6:g} MB" if isinstance(size, int) else str(size)


def plan_sources(cfg: BenchConfig) -> tuple[dict[str, str], str | None]:
    """format -> path to read, making and packing what is missing; and the source folder."""
    data = cfg.data
    if data is None and cfg.shards is None:
        data = _default_data(cfg)
    if data is not None:
        data = os.fspath(data)
        _check_folder(data)
    formats = _formats(cfg, data)
    _check_formats(formats, data)
    shard_fmts = tuple(f for f in formats if f in SHARD_FORMATS)
    sources: dict[str, str] = {}
    for fmt in formats:
        if fmt == "memory":
            continue  # loaded from whichever source comes first, once the others are ready
        if fmt == "loader":  # ShardLoader over the tar shards, packed as the tar format's
            sources[fmt] = _shards_for(cfg, data, "tar", _target(cfg, data, "tar", ("tar",)))
            continue
        if fmt == "folder":
            sources[fmt] = data
        else:
            target = _target(cfg, data, fmt, shard_fmts)
            sources[fmt] = _shards_for(cfg, data, fmt, target)
    if "memory" in formats:
        first = "folder" if "folder" in sources else next(iter(sources))
        sources["memory"] = sources[first]
    return sources, data


def _check_packed_from(cfg: BenchConfig, target: str, data: str) -> None:
    """Say so when reused shards were packed from another folder than the one benchmarked."""
    if is_url(target):
        return
    manifest = resolve_source(target).manifest
    source = manifest.pack.get("source") if manifest is not None else None
    if source and os.path.realpath(source) != os.path.realpath(data):
        say(
            cfg,
            f"note: {target} was packed from {source}, not {data}; the comparison is only fair "
            "if they hold the same images (delete it to re-pack)",
        )


def image_size(cfg: BenchConfig) -> int | None:
    """The fixed side decoded images get in this run (``cfg.size`` in decode mode), else None."""
    return cfg.size if cfg.mode == "decode" and cfg.size else None


def make_dataset(fmt: str, path: str, cfg: BenchConfig, storage, skip=()):
    """The dataset a run of ``fmt`` iterates, decoding as ``cfg.mode`` asks.

    ``skip``: the folder's files to leave out (what pack skipped), so it reads the shards' samples.
    """
    from ..stream.dataset import FolderDataset, ShardDataset

    decode = bench_decode(cfg)  # one Decode for every reader compared
    transform = Augment() if cfg.mode == "augment" else None
    if fmt == "memory":
        blobs, labels = load_all(path, skip)
        return MemoryDataset(
            blobs, labels, decode=decode.mode, transform=transform, seed=cfg.seed,
            size=decode.size,
        )  # fmt: skip
    if fmt == "folder":
        return FolderDataset(path, decode=decode, transform=transform, storage=storage, skip=skip)
    if is_url(path):
        storage = None  # remote storage: LocalStorage cannot open URLs
    return ShardDataset(path, decode=decode, transform=transform, seed=cfg.seed, storage=storage)


def bench_decode(cfg: BenchConfig):
    """The ``shardkit.Decode`` every dataset of a run takes: ``cfg.mode``'s, with a centre
    crop to ``cfg.size`` in decode mode."""
    from ..images.crops import CenterCrop
    from ..images.geometry import Decode

    size = image_size(cfg)
    mode = DATASET_DECODE[cfg.mode]
    return Decode(mode, crop=CenterCrop(size, resize_short=size) if size else None)


def packed_skips(sources: dict[str, str], data: str | None) -> list[str]:
    """The files of ``data`` that pack left out of the shards benchmarked beside it (bad images
    it could not read), so the folder side leaves them out too: both sides read the same samples.
    """
    for fmt in SHARD_FORMATS:
        path = sources.get(fmt)
        if data is None or path is None or is_url(path):
            continue
        manifest = resolve_source(path).manifest
        source = manifest.pack.get("source") if manifest is not None else None
        if source and os.path.realpath(source) == os.path.realpath(data):
            return [s.path for s in manifest.skipped]
    return []


def load_all(path: str, skip=()) -> tuple[list[bytes], list[int]]:
    """Every sample's stored bytes and label, from an image folder or from packed shards."""
    from ..stream.dataset import FolderDataset, Order, ShardDataset

    packed = is_url(path) or os.path.isfile(os.path.join(path, MANIFEST_NAME))
    if os.path.isdir(path) and not packed:
        folder = FolderDataset(path, decode="raw", skip=skip)
        blobs = []
        for i in range(len(folder)):
            with open(os.path.join(folder.root, folder.relpath(i)), "rb") as f:
                blobs.append(f.read())
        return blobs, folder.targets.tolist()
    pairs = list(ShardDataset(path, decode="raw", order=Order.sequential()))
    return [d for d, _ in pairs], [lab for _, lab in pairs]


def read_paths(fmt: str, ds) -> list[str] | None:
    """The local files (or shard URLs' paths) a run of this dataset reads; None: none local."""
    if fmt == "memory":
        return None
    if fmt == "folder":
        # The files themselves, not the root: eviction before every run then skips walking
        # the tree (measured 1 s of 4 on the 13k-file LFW set).
        return [os.path.join(ds.root, ds.relpath(i)) for i in range(len(ds))]
    if any(is_url(u) and not u.startswith("file://") for u in ds.urls):
        return None
    return [u[len("file://") :] if u.startswith("file://") else u for u in ds.urls]


def bytes_per_sample(fmt: str, ds, paths: list[str] | None) -> float | None:
    """Stored bytes per sample: image file sizes for the folder, shard bytes for shards."""
    if fmt == "memory":
        return len(ds.blob) / len(ds)
    if fmt == "folder":
        total = sum(os.path.getsize(os.path.join(ds.root, ds.relpath(i))) for i in range(len(ds)))
        return total / len(ds)
    if ds.manifest_path and not is_url(ds.manifest_path):
        man = resolve_source(ds.manifest_path).manifest
        if man is not None and man.num_samples:
            return man.total_bytes / man.num_samples
    if paths:
        return sum(os.path.getsize(p) for p in paths) / ds.num_samples
    return None


def sample_bytes(fmt: str, ds, count: int, seed: int) -> list[bytes]:
    """Up to ``count`` stored samples (JPEG bytes), for measuring the decode ceiling."""
    if fmt == "folder":
        rng = np.random.default_rng(seed)
        idx = rng.choice(len(ds), size=min(count, len(ds)), replace=False)
        out = []
        for i in idx.tolist():
            with open(os.path.join(ds.root, ds.relpath(i)), "rb") as f:
                out.append(f.read())
        return out
    from ..stream.dataset import Order, ShardDataset

    raw = ShardDataset(ds.urls, decode="raw", order=Order.sequential(), storage=ds.storage)
    out = []
    for data, _label in raw:
        out.append(data)
        if len(out) >= count:
            break
    return out
