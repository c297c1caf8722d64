"""Rendering one image: the shipped photographs, per-layout looks, crops, colour and grain.

Every draw comes from a generator seeded by (seed, kind, class, index) alone, so an image's bytes
do not depend on which thread renders it or when.
"""

from __future__ import annotations

import importlib.util
import io
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import MissingExtraError
from ..extras import require

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
    require("synth", "synth (the embedded datasets)")
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
        raise MissingExtraError(
            "no source photographs found (looked in scikit-image's data/ and matplotlib's "
            "mpl-data/sample_data/): pip install 'shardkit[synth]'"
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
