"""Building a tree: plan the files, render them on threads into a temporary sibling, rename.

The marker (``MARKER``, plain JSON) is written last; a later call with the same parameters finds
it and reuses the tree instead of rendering again.
"""

from __future__ import annotations

import json
import operator
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError, OutputError
from ..fsutil import remove_stale_staging, staging_name
from ..progress import Progress
from .names import _check_scale, imagenet_wnids, lfw_counts, lfw_names
from .render import _IMAGENET_LOOK, _LFW_LOOK, _Look, _photos, _render, photo_sources

__all__ = ["GENERATOR_VERSION", "MARKER", "SCALE_ENV", "SynthReport", "make_imagenet", "make_lfw"]

MARKER = ".synth.json"
# Default for make_lfw's scale (and `shardkit synth lfw`, the bench's default set): lets the README
# doc test and a quick try run everything on a small set without editing a single command.
SCALE_ENV = "SHARDKIT_LFW_SCALE"
# Bump whenever a given seed would produce different bytes, so old trees are rebuilt, not reused.
GENERATOR_VERSION = 1


@dataclass(frozen=True)
class SynthReport:
    """What a make_* call produced (or found already complete, when ``reused``)."""

    path: Path
    images: int
    folders: int
    total_bytes: int
    mean_bytes: float
    seconds: float
    reused: bool

    def summary(self) -> str:
        """One line for the CLI and the tools: counts, total, the average file size and time."""
        how = "reused (already complete)" if self.reused else f"built in {self.seconds:.1f} s"
        return (
            f"{self.path}: {self.images} images in {self.folders} folders, "
            f"{self.total_bytes / 1e6:.1f} MB, average {self.mean_bytes / 1e3:.1f} KB/file, {how}"
        )


@dataclass(frozen=True)
class _Job:
    """Everything the workers need: flat per-image arrays rather than per-image objects."""

    root: Path
    folders: list[str]
    classes: np.ndarray  # class of image i
    indices: np.ndarray  # index of image i within its class (seeds its RNG)
    files: list[str]  # relative path of image i
    sizes: tuple[int, int] | None
    look: _Look
    seed: int
    sources: list[Path]
    weights: np.ndarray


def _render_range(job: _Job, start: int, stop: int) -> int:
    photos = _photos(job.sources)
    total = 0
    for i in range(start, stop):
        data = _render(
            photos,
            job.weights,
            job.look,
            job.seed,
            int(job.classes[i]),
            int(job.indices[i]),
            job.sizes,
        )
        with open(job.root / job.files[i], "wb") as f:
            f.write(data)
        total += len(data)
    return total


def _default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _read_marker(out: Path) -> dict | None:
    try:
        with open(out / MARKER) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _complete(out: Path, marker: dict | None, params: dict) -> bool:
    """The marker says these parameters, and the folders hold as many files as it counts."""
    if not marker or marker.get("params") != params:
        return False
    try:
        found = sum(
            1 for d in os.scandir(out) if d.is_dir() for f in os.scandir(d.path) if f.is_file()
        )
    except OSError:
        return False
    return found == marker.get("images")


def _report_from(out: Path, marker: dict, started: float, reused: bool = True) -> SynthReport:
    return SynthReport(
        path=out,
        images=marker["images"],
        folders=marker["folders"],
        total_bytes=marker["total_bytes"],
        mean_bytes=marker["total_bytes"] / max(1, marker["images"]),
        seconds=time.perf_counter() - started,
        reused=reused,
    )


def _build(
    out_dir: str | os.PathLike,
    params: dict,
    folders: list[str],
    counts: Sequence[int],
    file_name: Callable[[int, int], str],
    sizes: tuple[int, int] | None,
    look: _Look,
    seed: int,
    workers: int | None,
    progress: bool = False,
) -> SynthReport:
    started = time.perf_counter()
    out = Path(out_dir)
    if out.name in ("", ".", ".."):
        out = out.resolve()
    if workers is not None and workers < 1:
        raise InputError(f"workers={workers} must be at least 1")
    sources = photo_sources()
    params = {**params, "generator": GENERATOR_VERSION, "sources": [p.name for p, _ in sources]}

    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a directory; choose another output path")
    marker = _read_marker(out) if out.is_dir() else None
    if _complete(out, marker, params):
        return _report_from(out, marker, started)
    if out.is_dir() and marker is None and any(out.iterdir()):
        raise OutputError(
            f"{out} is not empty and holds no readable {MARKER} (not made by shardkit synth); "
            "choose an empty or new directory, or delete it"
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale_temps(out)
    tmp = out.parent / staging_name(_temp_prefix(out, "tmp"))
    try:
        tmp.mkdir()
        for name in folders:
            (tmp / name).mkdir()
        n = int(sum(counts))
        classes = np.repeat(np.arange(len(folders), dtype=np.int64), counts)
        starts = np.cumsum([0, *counts[:-1]])
        indices = np.arange(n, dtype=np.int64) - np.repeat(starts, counts)
        files = [file_name(int(c), int(j)) for c, j in zip(classes, indices, strict=True)]
        weights = np.array([w for _, w in sources], dtype=np.float64)
        job = _Job(
            tmp,
            folders,
            classes,
            indices,
            files,
            sizes,
            look,
            seed,
            [p for p, _ in sources],
            weights / weights.sum(),
        )
        total = _run(job, n, workers or _default_workers(), progress, out)
        marker = {
            "params": params,
            "images": n,
            "folders": len(folders),
            "total_bytes": total,
            "mean_bytes": round(total / max(1, n), 1),
        }
        with open(tmp / MARKER, "w") as f:
            json.dump(marker, f, indent=1, sort_keys=True)
            f.write("\n")
        placed = _move_into_place(tmp, out, params)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not placed:  # a concurrent run with the same parameters finished first: same bytes
        return _report_from(out, marker, started)
    return _report_from(out, marker, started, reused=False)


def _run(job: _Job, n: int, workers: int, progress: bool = False, out: Path | None = None) -> int:
    """Render all images; threads suffice because PIL and numpy release the GIL in the heavy parts.

    Chunks are small and handed out in order, so the pool stays busy to the end.
    """
    chunk = 64
    ranges = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]
    bar = Progress(n, f"synth {out}", "img", enabled=progress)

    if workers == 1 or len(ranges) == 1:
        sizes = map(lambda se: _render_range(job, *se), ranges)
        pool = None
    else:
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="synth")
        sizes = pool.map(lambda se: _render_range(job, *se), ranges)
    total = 0
    try:
        with bar:  # updated here in the calling thread, as results come back in order
            for (s, e), size in zip(ranges, sizes, strict=True):
                bar.update(e - s)
                total += size
    except BaseException:
        # Ctrl-C or a failed chunk: drop the queued chunks rather than render them all first.
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        raise
    if pool is not None:
        pool.shutdown()
    return total


def _move_into_place(tmp: Path, out: Path, params: dict) -> bool:
    """Rename the finished tree to ``out``; False if an identical tree got there first.

    An older synth tree (other parameters) is replaced whole, never merged into.
    """
    try:
        os.replace(tmp, out)  # works when out is missing or an empty directory
        return True
    except OSError:
        marker = _read_marker(out)
        if marker is None:
            raise OutputError(
                f"{out} appeared while it was being built and holds no {MARKER}; "
                "choose another output path"
            ) from None
    if _complete(out, marker, params):
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    old = out.parent / staging_name(_temp_prefix(out, "old"))
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return True


def _temp_prefix(out: Path, kind: str) -> str:
    """Siblings of ``out``: ``.<name>.synth-tmp-<pid>-<hex>`` (being built) and ``...-old-...``
    (the tree being replaced), named by ``fsutil.staging_name`` so they carry their owner's pid."""
    return f".{out.name}.synth-{kind}-"


def _clear_stale_temps(out: Path) -> None:
    """Remove temporaries left by runs that were killed, by the one stale-temp policy.

    No lock guards the parent directory (it is the user's), so only the pid decides: a
    temporary whose owner is alive (a concurrent synth) is kept, and so is a name without one.
    """
    for kind in ("tmp", "old"):
        remove_stale_staging(str(out.parent), _temp_prefix(out, kind), keep_unowned=True)


# --- public entry points -------------------------------------------------------------------------


def make_lfw(
    out_dir: str | os.PathLike,
    *,
    scale: float | None = None,
    seed: int = 0,
    size: int = 250,
    workers: int | None = None,
    progress: bool = False,
) -> SynthReport:
    """Make an LFW-shaped tree, ``Person_Name/Person_Name_0001.jpg``, at ``out_dir``.

    Scale 1.0 is LFW's size and long tail (5,749 people, 13,233 JPEGs of 250x250, most people with
    one image, George_W_Bush with 530). ``workers`` changes speed only, never bytes. ``scale``
    None: ``$SHARDKIT_LFW_SCALE`` or 1.0. ``progress``: a bar (a line every 10 s off a terminal).
    """
    scale = float(os.environ.get(SCALE_ENV) or 1.0) if scale is None else float(scale)
    _check_scale(scale)
    if size < 16 or size > 4096:
        raise InputError(f"size={size} must be between 16 and 4096 pixels")
    seed = _check_seed(seed)
    counts = lfw_counts(scale)
    names = lfw_names(scale)
    params = {"kind": "lfw", "scale": scale, "seed": seed, "size": size}
    return _build(
        out_dir,
        params,
        names,
        counts,
        lambda c, j: f"{names[c]}/{names[c]}_{j + 1:04d}.jpg",
        (size, size),
        _LFW_LOOK,
        seed,
        workers,
        progress,
    )


def make_imagenet(
    out_dir: str | os.PathLike,
    *,
    classes: int = 10,
    images_per_class: int = 100,
    seed: int = 0,
    workers: int | None = None,
    progress: bool = False,
) -> SynthReport:
    """Make an ImageNet-shaped tree, ``n01440764/n01440764_10026.JPEG``, at ``out_dir``.

    Sizes vary like ILSVRC training images (mostly 500x375, 375x500, 500x333, some larger and
    smaller) and the average file is near ImageNet's ~110 KB. ``workers`` never changes bytes.
    """
    if classes < 1 or images_per_class < 1:
        raise InputError(
            f"classes={classes} and images_per_class={images_per_class} must both be at least 1"
        )
    if classes > 100_000 or images_per_class > 50_000:
        raise InputError(
            f"classes={classes} and images_per_class={images_per_class}: at most 100000 and 50000"
        )
    seed = _check_seed(seed)
    wnids = imagenet_wnids(classes, seed)
    numbers = []
    for c in range(classes):
        rng = np.random.default_rng([seed, 1, 3, c])
        pool = max(2 * images_per_class, 15000)
        numbers.append(np.sort(rng.choice(pool, size=images_per_class, replace=False) + 1))
    params = {
        "kind": "imagenet",
        "classes": classes,
        "images_per_class": images_per_class,
        "seed": seed,
    }
    return _build(
        out_dir,
        params,
        wnids,
        [images_per_class] * classes,
        lambda c, j: f"{wnids[c]}/{wnids[c]}_{numbers[c][j]}.JPEG",
        None,
        _IMAGENET_LOOK,
        seed,
        workers,
        progress,
    )


def _check_seed(seed: int) -> int:
    try:
        value = operator.index(seed)
    except TypeError:
        value = -1
    if value < 0:
        raise InputError(f"seed={seed!r} must be a non-negative integer")
    return value
