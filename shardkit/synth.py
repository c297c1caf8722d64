"""Embedded default datasets: LFW- and ImageNet-shaped folder trees made from real photographs.

Nothing can be downloaded where shardkit is built and tested, yet packing and streaming only mean
something on files that look like the real ones: JPEGs whose sizes and decode costs are those of
photographs, in the folder layouts and class-size distributions people actually pack. So the pixels
come from the colour photographs that ship inside the scikit-image and matplotlib wheels, cropped,
rotated, zoomed, flipped, colour-jittered, blurred or grained per image and re-encoded at a JPEG
quality drawn from a realistic range.

Every image's random state is seeded from ``(seed, kind, class, index)`` alone, so a seed gives
byte-identical files whatever the worker count or scheduling. Output is written into a temporary
sibling directory and renamed into place when complete, with ``.synth.json`` (plain JSON) written
last; a later call with the same parameters finds the marker and reuses the tree.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import io
import json
import math
import operator
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .errors import InputError, OutputError

__all__ = [
    "SynthReport",
    "make_lfw",
    "make_imagenet",
    "lfw_counts",
    "lfw_names",
    "imagenet_wnids",
    "photo_sources",
    "MARKER",
    "LFW_PEOPLE",
    "LFW_IMAGES",
]

MARKER = ".synth.json"
# Bump whenever a given seed would produce different bytes, so old trees are rebuilt, not reused.
GENERATOR_VERSION = 1

LFW_PEOPLE = 5749
LFW_IMAGES = 13233
# The head of real LFW (people with 40+ images), which every LFW user meets first.
_LFW_HEAD = [
    ("George_W_Bush", 530),
    ("Colin_Powell", 236),
    ("Tony_Blair", 144),
    ("Donald_Rumsfeld", 121),
    ("Gerhard_Schroeder", 109),
    ("Ariel_Sharon", 77),
    ("Hugo_Chavez", 71),
    ("Junichiro_Koizumi", 60),
    ("Jean_Chretien", 55),
    ("John_Ashcroft", 53),
    ("Jacques_Chirac", 52),
    ("Serena_Williams", 52),
    ("Vladimir_Putin", 49),
    ("Luiz_Inacio_Lula_da_Silva", 48),
    ("Gloria_Macapagal_Arroyo", 44),
    ("Arnold_Schwarzenegger", 42),
    ("Jennifer_Capriati", 42),
    ("Laura_Bush", 41),
    ("Lleyton_Hewitt", 41),
]
# The rest of real LFW by bracket: (fewest, most, people, images). 62 people have 20+ images
# (3,023 in all), 158 have 10+ (4,324), 1,680 have 2+; 4,069 have exactly one.
_LFW_BRACKETS = [(20, 39, 43, 1156), (10, 19, 96, 1301), (2, 9, 1522, 4840)]
_LFW_SINGLES = 4069

_FIRST = (
    "Aaron Abdullah Adam Adriana Ahmed Aicha Akira Alan Alberto Alejandro Alexandra Ali Alicia "
    "Amanda Amelie Ana Andre Andrea Angela Anna Anthony Antonio Ari Arturo Ayumi Barbara Beatriz "
    "Ben Bernard Bill Bob Boris Brian Bruce Carla Carlos Carmen Catherine Cesar Charles Chen Chris "
    "Christine Claudia Colin Daniel David Deborah Dennis Diana Dmitri Dolores Elena Elizabeth "
    "Emily Emma Enrique Eric Erik Eva Fatima Felipe Fernando Frank Gabriel George Gerard Gina "
    "Gordon "
    "Grace Gustavo Hamid Hans Harry Helen Hiroshi Hugo Ian Igor Ingrid Irene Isabel Ivan Jack "
    "Jacques Jake James Jan Jane Javier Jean Jennifer Jeremy Jessica Jim Joan Joe John Jorge Jose "
    "Joseph Juan Julia Julie Karen Kate Kenji Kevin Kim Kofi Laura Leonid Li Linda Lisa Lucia "
    "Luis Lynn Manuel Marco Maria Mark Martin Mary Masao Matt Megan Michael Michelle Miguel Mike "
    "Mohammed Monica Nancy Naomi Natalie Nicole Nina Olga Omar Oscar Pablo Patricia Paul Pedro "
    "Peter Pierre Rachel Rafael Ralph Raul Ricardo Richard Rita Robert Roberto Rosa Ruth Sally "
    "Sam Sandra Sarah Sergei Sharon Silvio Simon Sofia Stefan Stephen Steve Susan Tariq Tatiana "
    "Thomas Tim Tom Valentina Vicente Victor Walter Wang Wendy William Yasser Yoko Yuri Zhang Zoran"
).split()
_LAST = (
    "Abbas Adams Aguilar Ahmadi Albright Alvarez Anderson Andrade Arafat Armstrong Aziz Baker "
    "Banda Barnes Bauer Becker Bell Bennett Berlusconi Bianchi Blanco Bondarenko Borges Brown "
    "Bruno Cabrera Campbell Carter Castillo Castro Chang Chavez Cho Clark Collins Cooper Costa "
    "Cruz Davis Diaz Dubois Duarte Edwards Evans Fernandez Ferrari Fischer Fisher Flores Fontaine "
    "Garcia Gomez Gonzalez Green Guerrero Gupta Hall Hansen Harris Hernandez Herrera Hill Hoffmann "
    "Hughes Ivanov Jackson Jensen Jimenez Johnson Jones Kaur Keller Khan Kim King Klein Koch "
    "Kowalski Kumar Lambert Lee Lewis Lopez Mahmoud Martin Martinez Mendoza Meyer Miller Mitchell "
    "Molina Moore Morales Moreau Morris Muller Murphy Nakamura Nelson Nguyen Novak Ortiz Park "
    "Patel Perez Peterson Petrov Phillips Pham Popescu Ramirez Reyes Richter Rivera Roberts "
    "Robinson Rodriguez Romero Rossi Ruiz Russo Sanchez Santos Sato Schmidt Schneider Schulz "
    "Scott Silva Singh Smith Sokolov Sousa Stewart Suzuki Tanaka Taylor Thomas Thompson Torres "
    "Turner Vargas Vasquez Vega Volkov Wagner Walker Wang Watanabe Weber White Williams Wilson "
    "Wong Wright Yamamoto Yilmaz Young Zhang Zimmermann"
).split()


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


# --- class-size distributions and names --------------------------------------------------------


def _bracket_counts(lo: int, hi: int, people: int, images: int) -> list[int]:
    """``people`` counts in [lo, hi] summing to ``images``, falling off like a power law.

    Count at rank r is ``lo + (hi - lo) * (1 - r / people) ** p``; ``p`` is found by bisection so
    the rounded counts land near ``images``, and the last few units are settled one at a time.
    """

    def counts(p: float) -> list[int]:
        return [int(lo + (hi - lo) * (1 - r / people) ** p + 0.5) for r in range(people)]

    a, b = 0.01, 100.0
    for _ in range(80):
        mid = (a + b) / 2
        if sum(counts(mid)) > images:
            a = mid
        else:
            b = mid
    out = counts(b)
    diff = images - sum(out)
    i = 0
    while diff:  # a few units at most; keep within bounds and non-increasing
        step = 1 if diff > 0 else -1
        j = i % people if step > 0 else people - 1 - (i % people)
        if lo <= out[j] + step <= hi:
            out[j] += step
            diff -= step
        i += 1
    return sorted(out, reverse=True)


@functools.cache
def _full_lfw_counts() -> tuple[int, ...]:
    counts = [c for _, c in _LFW_HEAD]
    for bracket in _LFW_BRACKETS:
        counts += _bracket_counts(*bracket)
    counts += [1] * _LFW_SINGLES
    assert len(counts) == LFW_PEOPLE and sum(counts) == LFW_IMAGES
    return tuple(counts)


def _lfw_ranks(scale: float) -> list[int]:
    """Ranks (into the full table) of the people kept at ``scale``: evenly spaced quantiles.

    Sampling the sorted table at evenly spaced quantiles keeps its shape (about 71% singletons, a
    head of people with many images) and its mean, so the image count follows the scale too.
    """
    people = max(2, int(LFW_PEOPLE * scale + 0.5))
    return [int((i + 0.5) * LFW_PEOPLE / people) for i in range(people)]


def lfw_counts(scale: float = 1.0) -> list[int]:
    """Images per person of the LFW-shaped set at ``scale``, largest first.

    At 1.0 this is LFW's own shape: 5,749 people, 13,233 images, 4,069 with one image, George W
    Bush 530. Smaller scales keep about ``5749 * scale`` people (at least 2) and
    ``13233 * scale`` images (at least one per person), with the long tail kept.
    """
    _check_scale(scale)
    full = _full_lfw_counts()
    counts = [full[r] for r in _lfw_ranks(scale)]
    target = max(len(counts), int(LFW_IMAGES * scale + 0.5))
    diff = target - sum(counts)
    # Settle the difference on the people who have several images, round-robin from the largest,
    # so singletons stay singletons and the head keeps its weight.
    many = [i for i, c in enumerate(counts) if c > 1] or [0]
    i = 0
    while diff > 0:
        counts[many[i % len(many)]] += 1
        diff -= 1
        i += 1
    while diff < 0:
        donors = [k for k in many if counts[k] > 2] or [k for k, c in enumerate(counts) if c > 1]
        counts[donors[i % len(donors)]] -= 1
        diff += 1
        i += 1
    return sorted(counts, reverse=True)


def lfw_names(scale: float = 1.0) -> list[str]:
    """Folder names matching :func:`lfw_counts`, LFW style (``First_Last``, unique).

    The head carries real LFW's names; the rest are drawn, seed-independently, from common first
    names and surnames, with a middle name added where a pair is already taken.
    """
    _check_scale(scale)
    full = _full_lfw_names()
    return [full[r] for r in _lfw_ranks(scale)]


@functools.cache
def _full_lfw_names() -> tuple[str, ...]:
    rng = np.random.default_rng(2007)
    names = [n for n, _ in _LFW_HEAD]
    taken = set(names)
    while len(names) < LFW_PEOPLE:
        first, last = _FIRST[rng.integers(len(_FIRST))], _LAST[rng.integers(len(_LAST))]
        name = f"{first}_{last}"
        if name in taken:
            name = f"{first}_{_FIRST[rng.integers(len(_FIRST))]}_{last}"
        if name in taken:
            continue
        taken.add(name)
        names.append(name)
    return tuple(names)


def imagenet_wnids(classes: int, seed: int = 0) -> list[str]:
    """``classes`` distinct, sorted WordNet-style ids (``n`` + 8 digits) drawn from ``seed``.

    Drawn from the range the real ILSVRC ids span (n01440764 .. n15075141).
    """
    rng = np.random.default_rng([seed, 1, 0])
    ids = rng.choice(15075141 - 1440764, size=classes, replace=False) + 1440764
    return [f"n{i:08d}" for i in sorted(int(x) for x in ids)]


def _check_scale(scale: float) -> None:
    if not (0 < scale <= 1) or math.isnan(scale):
        raise InputError(f"--scale must be in (0, 1], got {scale}; 1.0 is LFW's full size")


# --- source photographs --------------------------------------------------------------------------

# (package, path inside the package, weight). Colour photographs only: the grey ones and the
# synthetic test patterns would make JPEGs unlike camera output.
_SOURCES = [
    ("skimage", "data/astronaut.png", 2.0),
    ("skimage", "data/chelsea.png", 1.5),
    ("skimage", "data/coffee.png", 1.5),
    ("skimage", "data/rocket.jpg", 1.5),
    ("skimage", "data/motorcycle_left.png", 1.0),
    ("skimage", "data/motorcycle_right.png", 0.5),
    ("skimage", "data/hubble_deep_field.jpg", 0.7),
    ("skimage", "data/retina.jpg", 0.5),
    ("skimage", "data/ihc.png", 0.8),
    ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg", 2.0),
]


def photo_sources() -> list[tuple[Path, float]]:
    """The shipped photographs this machine has, with their sampling weights.

    Located through import specs, without importing the packages (importing skimage takes
    seconds).
    """
    found = []
    for package, rel, weight in _SOURCES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            path = Path(root) / rel
            if path.is_file():
                found.append((path, weight))
                break
    if not found:
        raise InputError(
            "no source photographs found (looked in scikit-image's data/ and matplotlib's "
            "mpl-data/sample_data/); install scikit-image and matplotlib"
        )
    return found


class _Photo:
    """One source photograph as RGB, with a box-filtered pyramid so big crops are cheap."""

    def __init__(self, path: Path):
        with Image.open(path) as im:
            self.levels = [im.convert("RGB")]
        while min(self.levels[-1].size) >= 256 and len(self.levels) < 4:
            self.levels.append(self.levels[-1].reduce(2))

    @property
    def size(self) -> tuple[int, int]:
        return self.levels[0].size


_PHOTOS: dict[Path, _Photo] = {}
_PHOTOS_LOCK = threading.Lock()


def _photos(paths: Sequence[Path]) -> list[_Photo]:
    with _PHOTOS_LOCK:
        for p in paths:
            if p not in _PHOTOS:
                _PHOTOS[p] = _Photo(p)
        return [_PHOTOS[p] for p in paths]


# --- rendering one image --------------------------------------------------------------------------

_RGB_TO_YIQ = np.array(
    [[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]], dtype=np.float64
)
_YIQ_TO_RGB = np.linalg.inv(_RGB_TO_YIQ)


@dataclass(frozen=True)
class _Look:
    """Tunable per-layout style: how strongly images vary and how they are encoded."""

    kind: int  # 0 lfw, 1 imagenet: part of every seed, so the two layouts never share pixels
    zoom: tuple[float, float]  # crop width as a fraction of the widest crop that fits
    rotate_p: float
    angle_sd: float  # degrees
    soft_p: float  # share of images rendered smaller and upscaled: out of focus, resized uploads
    gray_p: float
    noise: tuple[float, float]  # grain std dev in 8-bit levels
    quality: tuple[int, int]  # JPEG quality, inclusive
    subsampling: tuple[float, float, float]  # shares of 4:4:4, 4:2:2, 4:2:0 (PIL's 0, 1, 2)


_LFW_LOOK = _Look(
    kind=0,
    zoom=(0.2, 0.8),
    rotate_p=0.4,
    angle_sd=6.0,
    soft_p=0.3,
    gray_p=0.02,
    noise=(0.0, 6.0),
    quality=(74, 93),
    subsampling=(0.0, 0.0, 1.0),
)
_IMAGENET_LOOK = _Look(
    kind=1,
    zoom=(0.5, 1.0),
    rotate_p=0.3,
    angle_sd=4.0,
    soft_p=0.15,
    gray_p=0.01,
    noise=(1.5, 10.5),
    quality=(88, 98),
    subsampling=(0.1, 0.2, 0.7),
)


def _colour_matrix(
    hue: float, saturation: float, contrast: float, brightness: float, mean: float
) -> tuple[float, ...]:
    """One affine RGB->RGB map (PIL's 12-tuple) for hue rotation, saturation, contrast, brightness.

    All four are linear, so one C pass over the pixels does them together.
    """
    c, s = math.cos(hue) * saturation, math.sin(hue) * saturation
    chroma = np.array([[1, 0, 0], [0, c, -s], [0, s, c]])
    m = brightness * contrast * (_YIQ_TO_RGB @ chroma @ _RGB_TO_YIQ)
    bias = brightness * (1 - contrast) * mean
    return tuple(float(v) for row in m for v in (*row, bias))


_GRAINS: dict[int, np.ndarray] = {}
_GRAIN_LOCK = threading.Lock()


def _grain(side: int) -> np.ndarray:
    """A fixed ``side`` x ``side`` field of Gaussian grain, N(0, 32) as int8.

    Images add a window of it at a random offset: drawing fresh normals per image cost more than
    everything else put together.
    """
    with _GRAIN_LOCK:
        if side not in _GRAINS:
            g = np.random.default_rng([20070101, side]).standard_normal((side, side, 3))
            _GRAINS[side] = np.clip(np.rint(g * 32), -127, 127).astype(np.int8)
        return _GRAINS[side]


def _add_grain(img: Image.Image, sd: float, oy: int, ox: int) -> Image.Image:
    w, h = img.size
    k = int(round(sd * 8))  # (grain * k) >> 8 has std dev 32 * k / 256 = sd
    side = 512 if max(w, h) <= 384 else max(2048, 1 << (max(w, h) + 128 - 1).bit_length())
    g = _grain(side)
    oy, ox = oy % (side - h + 1), ox % (side - w + 1)
    delta = g[oy : oy + h, ox : ox + w].astype(np.int16)
    delta *= k
    delta >>= 8
    delta += np.asarray(img, dtype=np.int16)
    np.clip(delta, 0, 255, out=delta)
    return Image.fromarray(delta.astype(np.uint8))


def _render(
    photos: Sequence[_Photo],
    weights: np.ndarray,
    look: _Look,
    seed: int,
    cls: int,
    index: int,
    size: tuple[int, int] | None,
) -> bytes:
    """JPEG bytes of image ``index`` of class ``cls``; ``size`` None draws an ImageNet-like size.

    Each class has its own look (source, framing, tint), so classes are learnable; each image
    varies around it. Every draw is made unconditionally, in a fixed order, so one parameter's
    branch never shifts another's value.
    """
    rc = np.random.default_rng([seed, look.kind, 1, cls])
    c_src = int(rc.choice(len(photos), p=weights))
    c_x, c_y = rc.uniform(0.2, 0.8, size=2)
    c_zoom = rc.uniform(*look.zoom)
    c_hue = rc.normal(0, 0.15)

    r = np.random.default_rng([seed, look.kind, 2, cls, index])
    other = int(r.choice(len(photos), p=weights))
    src = c_src if r.random() < 0.8 else other
    width, height = size if size is not None else _imagenet_size(r)
    zoom = float(np.clip(c_zoom * math.exp(r.normal(0, 0.2)), 0.12, 1.0))
    fx = float(np.clip(c_x + r.normal(0, 0.08), 0, 1))
    fy = float(np.clip(c_y + r.normal(0, 0.08), 0, 1))
    angle = math.radians(float(np.clip(r.normal(0, look.angle_sd), -20, 20)))
    angle = angle if r.random() < look.rotate_p else 0.0
    flip = r.random() < 0.5
    soft = r.uniform(0.45, 0.85)
    soft = soft if r.random() < look.soft_p else 1.0
    hue = c_hue + r.normal(0, 0.05)
    saturation = math.exp(r.normal(0, 0.25))
    saturation = saturation if r.random() >= look.gray_p else 0.0
    contrast = math.exp(r.normal(0, 0.15))
    brightness = math.exp(r.normal(0, 0.15))
    noise = r.uniform(*look.noise)
    oy, ox = (int(v) for v in r.integers(0, 1 << 30, size=2))
    quality = int(r.integers(look.quality[0], look.quality[1] + 1))
    subsampling = int(r.choice(3, p=look.subsampling))

    photo = photos[src]
    sw, sh = photo.size
    cos, sin = abs(math.cos(angle)), abs(math.sin(angle))
    aspect = height / width
    # Widest crop of the output's aspect that, rotated, still fits inside the photo.
    widest = min(sw / (cos + aspect * sin), sh / (sin + aspect * cos))
    cw = widest * zoom
    ch = cw * aspect
    ex, ey = (cw * cos + ch * sin) / 2, (cw * sin + ch * cos) / 2
    cx = ex + fx * (sw - 2 * ex)
    cy = ey + fy * (sh - 2 * ey)
    rw, rh = max(8, int(width * soft + 0.5)), max(8, int(height * soft + 0.5))
    k = cw / rw  # source pixels per rendered pixel
    if angle:
        # Affine sampling does not antialias: take the pyramid level that leaves k below ~1.4.
        level = min(len(photo.levels) - 1, max(0, int(math.floor(math.log2(k * 1.4)))))
        img = photo.levels[level]
        f = 2.0**level
        k, cx, cy = k / f, cx / f, cy / f
        # Rendered (x, y) -> source (u, v): centre, flip, scale by k, rotate, move to (cx, cy).
        ca, sa = math.cos(angle) * k, math.sin(angle) * k
        fl = -1.0 if flip else 1.0
        a, b, d, e = ca * fl, -sa, sa * fl, ca
        c0 = cx - a * rw / 2 - b * rh / 2
        f0 = cy - d * rw / 2 - e * rh / 2
        img = img.transform((rw, rh), Image.AFFINE, (a, b, c0, d, e, f0), Image.BILINEAR)
    else:
        # resize() antialiases itself, so any level at least as large as the output will do.
        level = min(len(photo.levels) - 1, max(0, int(math.floor(math.log2(max(k, 1.0))))))
        f = 2.0**level
        img = photo.levels[level]
        lw, lh = img.size  # clamp: rounding may put a full-width crop a hair outside
        box = (
            max(0.0, (cx - cw / 2) / f),
            max(0.0, (cy - ch / 2) / f),
            min(float(lw), (cx + cw / 2) / f),
            min(float(lh), (cy + ch / 2) / f),
        )
        img = img.resize((rw, rh), Image.BILINEAR, box=box)
        if flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if (rw, rh) != (width, height):
        img = img.resize((width, height), Image.BICUBIC)

    mean = float(np.asarray(img.reduce(4)).mean())
    img = img.convert("RGB", _colour_matrix(hue, saturation, contrast, brightness, mean))
    if noise >= 0.5:
        img = _add_grain(img, noise, oy, ox)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality, subsampling=subsampling)
    return buf.getvalue()


def _imagenet_size(r: np.random.Generator) -> tuple[int, int]:
    """An ImageNet-like (width, height): mostly 500 on the long side, some larger and smaller."""
    u = r.random()
    long_small = int(r.integers(150, 451))
    long_big = int(r.integers(600, 1601))
    short_500 = int(r.integers(250, 481))
    aspect = float(r.choice([4 / 3, 3 / 2, 16 / 9, 1.0, 5 / 4]))
    portrait = r.random() < 0.25
    if u < 0.40:
        return 500, 375
    if u < 0.52:
        return 375, 500
    if u < 0.64:
        return 500, 333
    if u < 0.68:
        return 333, 500
    if u < 0.73:
        return 500, 500
    if u < 0.83:
        return 500, short_500
    if u < 0.87:
        return short_500, 500
    long_side = long_big if u < 0.95 else long_small
    w, h = long_side, max(32, int(long_side / aspect + 0.5))
    return (h, w) if portrait else (w, h)


# --- building a tree ---------------------------------------------------------------------------


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


def _report_from(out: Path, marker: dict, started: float) -> SynthReport:
    return SynthReport(
        path=out,
        images=marker["images"],
        folders=marker["folders"],
        total_bytes=marker["total_bytes"],
        mean_bytes=marker["total_bytes"] / max(1, marker["images"]),
        seconds=time.perf_counter() - started,
        reused=True,
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
) -> SynthReport:
    started = time.perf_counter()
    out = Path(out_dir)
    if out.name in ("", ".", ".."):
        out = out.resolve()
    if workers is not None and workers < 1:
        raise InputError(f"--workers must be at least 1, got {workers}")
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
    tmp = out.parent / f".{out.name}.synth-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
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
        total = _run(job, n, workers or _default_workers())
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
    return SynthReport(
        path=out,
        images=marker["images"],
        folders=marker["folders"],
        total_bytes=marker["total_bytes"],
        mean_bytes=marker["total_bytes"] / max(1, marker["images"]),
        seconds=time.perf_counter() - started,
        reused=False,
    )


def _run(job: _Job, n: int, workers: int) -> int:
    """Render all images; threads suffice because PIL and numpy release the GIL in the heavy parts.

    Chunks are small and handed out in order, so the pool stays busy to the end.
    """
    chunk = 64
    ranges = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]
    if workers == 1 or len(ranges) == 1:
        return sum(_render_range(job, s, e) for s, e in ranges)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="synth")
    try:
        total = sum(pool.map(lambda se: _render_range(job, *se), ranges))
    except BaseException:
        # Ctrl-C or a failed chunk: drop the queued chunks rather than render them all first.
        pool.shutdown(wait=True, cancel_futures=True)
        raise
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
    old = out.parent / f".{out.name}.synth-old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return True


def _clear_stale_temps(out: Path) -> None:
    """Remove temporaries left by runs that were killed (their pid no longer exists)."""
    for sibling in out.parent.glob(f".{glob.escape(out.name)}.synth-*-*-*"):
        try:
            pid = int(sibling.name.rsplit("-", 2)[-2])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(sibling, ignore_errors=True)
        except OSError:
            pass


# --- public entry points -------------------------------------------------------------------------


def make_lfw(
    out_dir: str | os.PathLike,
    *,
    scale: float = 1.0,
    seed: int = 0,
    size: int = 250,
    workers: int | None = None,
) -> SynthReport:
    """Make an LFW-shaped tree, ``Person_Name/Person_Name_0001.jpg``, at ``out_dir``.

    Scale 1.0 is LFW's size and long tail (5,749 people, 13,233 JPEGs of 250x250, most people with
    one image, George_W_Bush with 530). ``workers`` changes speed only, never bytes.
    """
    scale = float(scale)
    _check_scale(scale)
    if size < 16 or size > 4096:
        raise InputError(f"--size must be between 16 and 4096 pixels, got {size}")
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
    )


def make_imagenet(
    out_dir: str | os.PathLike,
    *,
    classes: int = 10,
    images_per_class: int = 100,
    seed: int = 0,
    workers: int | None = None,
) -> SynthReport:
    """Make an ImageNet-shaped tree, ``n01440764/n01440764_10026.JPEG``, at ``out_dir``.

    Sizes vary like ILSVRC training images (mostly 500x375, 375x500, 500x333, some larger and
    smaller) and the average file is near ImageNet's ~110 KB. ``workers`` never changes bytes.
    """
    if classes < 1 or images_per_class < 1:
        raise InputError(
            f"--classes and --images-per-class must be at least 1, got {classes} and "
            f"{images_per_class}"
        )
    if classes > 100_000 or images_per_class > 50_000:
        raise InputError("at most 100000 classes and 50000 images per class")
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
    )


def _check_seed(seed: int) -> int:
    try:
        value = operator.index(seed)
    except TypeError:
        value = -1
    if value < 0:
        raise InputError(f"--seed must be a non-negative integer, got {seed!r}")
    return value
