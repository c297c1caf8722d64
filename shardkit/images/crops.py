"""Crop policies: where a sample's crop lies in its full-size image, chosen from the header.

A crop object answers one question before any pixel is decoded, ``box(height, width, uniforms)
-> (top, left, h, w)`` in full-size pixels, and says its output side (``size``) and resize
filter (``interpolation``: "bilinear" or "bicubic", both antialiased). The decoder
(``geometry.TensorDecoder``, the device path alike) then decodes that box only, at the smallest
DCT scale that still covers ``size`` x ``size``, and resizes it: any policy keeps the fused
decode. The classes are named as torchvision names the transforms whose boxes they draw:

- ``RandomResizedCrop(224, scale=(0.9, 1.0), interpolation="bicubic")``: torchvision's
  ``get_params`` rule (10 tries of area and log-uniform aspect, then the clamped whole image).
- ``CenterCrop(224, resize_short=256)``: resize the shorter side to 256 (keeping the aspect),
  then the central 224 x 224; ``resize_short=(256, 320)`` draws the shorter side per sample
  (scale jitter); without ``resize_short`` the crop is taken at the image's own scale.
- ``RandomCrop(224, resize_short=...)``: the same at a uniformly drawn position.

Any object with ``size``, ``box`` (and optionally ``interpolation``) passed as
``ShardDataset(decode=Decode(crop=...))`` is used the same way, in the workers. ``uniforms``
yields floats in [0, 1) that are a pure function of (seed, epoch, rank, sample key)
(``geometry.sample_uniforms``): draw from it only, and a run repeats whatever the number of
workers. The flip (``Decode(flip=True)``) draws after the box.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import InputError, TransformError, check_choice
from .decode import DEFAULT_MAX_PIXELS

__all__ = [
    "BOX_FORMATS",
    "INTERPOLATIONS",
    "CenterCrop",
    "CropError",
    "RandomCrop",
    "RandomResizedCrop",
    "center_crop_box",
    "check_box",
    "policy_box",
    "random_resized_crop_box",
]

#: Box layouts in pixels: corners, or COCO's (x, y, width, height). Here, beside the crops
#: and without torch, so ``Boxes`` checks its format in the torch-free field module.
BOX_FORMATS = ("xyxy", "xywh")

#: Resize filters, antialiased when shrinking (torch's and PIL's: bicubic with a = -0.5).
INTERPOLATIONS = ("bilinear", "bicubic")


def _check_size(size) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InputError(f"size={size!r} must be an int >= 1 (the square output's side)")
    if size * size > DEFAULT_MAX_PIXELS:
        raise InputError(
            f"size={size} makes {size} x {size} = {size * size} output pixels per image, over "
            f"{DEFAULT_MAX_PIXELS} (max_pixels' default): give the side in pixels, e.g. 224"
        )
    return size


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_pair(name: str, value, rule: str, ok) -> tuple[float, float]:
    """``value`` as a (min, max) pair of finite numbers for which ``ok(lo, hi)`` holds; else one
    InputError naming the argument and the rule (not numpy's or Python's unpacking error)."""
    pair = tuple(value) if isinstance(value, (tuple, list)) else None
    if (
        pair is None
        or len(pair) != 2
        or not all(_is_number(v) and math.isfinite(v) for v in pair)
        or not ok(*pair)
    ):
        raise InputError(
            f"{name}={value!r} must be a (min, max) pair of finite numbers with {rule}"
        )
    return float(pair[0]), float(pair[1])


def _check_common(crop) -> None:
    _check_size(crop.size)
    check_choice("interpolation", crop.interpolation, INTERPOLATIONS)


@dataclass(frozen=True)
class RandomResizedCrop:
    """A random area fraction ``scale`` and aspect ``ratio`` of the image, resized to ``size``."""

    size: int
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        _check_common(self)
        scale = _check_pair(
            "scale", self.scale, "0 < min <= max <= 1 (fractions of the image's area)",
            lambda lo, hi: 0 < lo <= hi <= 1,
        )  # fmt: skip
        ratio = _check_pair(
            "ratio", self.ratio, "0 < min <= max (width / height, e.g. (3/4, 4/3))",
            lambda lo, hi: 0 < lo <= hi,
        )  # fmt: skip
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", ratio)

    def box(self, height: int, width: int, uniforms: Iterator[float]):
        return random_resized_crop_box(height, width, self.scale, self.ratio, uniforms)


#: The largest ``resize_short``: the side of a max_pixels' default square (a larger one would
#: describe a resized image no decoder is allowed to make).
MAX_SHORT_SIDE = math.isqrt(DEFAULT_MAX_PIXELS)


def _short_range(value, size: int) -> tuple[int, int] | None:
    if value is None:
        return None
    pair = (value, value) if not isinstance(value, (tuple, list)) else tuple(value)
    ints = len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
    if not ints or not size <= pair[0] <= pair[1] <= MAX_SHORT_SIDE:
        raise InputError(
            f"resize_short={value!r} must be an int or (min, max) of ints with "
            f"size ({size}) <= min <= max <= {MAX_SHORT_SIDE}: the shorter side in pixels "
            "before the crop (e.g. 256)"
        )
    return pair


@dataclass(frozen=True)
class _ShortSideCrop:
    size: int
    resize_short: int | tuple[int, int] | None = None
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        _check_common(self)
        _short_range(self.resize_short, self.size)

    def _target(self, height: int, width: int, uniforms: Iterator[float]) -> tuple[int, int]:
        """The (height, width) torchvision's ``Resize(short)`` gives the image, the shorter side
        ``resize_short`` (drawn in its range; None: the image's own, enlarged to ``size``)."""
        short = min(height, width)
        span = _short_range(self.resize_short, self.size)
        if span is None:
            target = max(short, self.size)
        else:
            lo, hi = span
            target = lo + int(next(uniforms) * (hi - lo + 1)) if hi > lo else lo
        if height <= width:
            return target, max(self.size, int(target * width / height))
        return max(self.size, int(target * height / width)), target

    def _box(self, height: int, width: int, top: int, left: int, rh: int, rw: int):
        """The full-size box of the resized image's ``size`` x ``size`` window at (top, left)."""
        sy, sx = height / rh, width / rw
        h, w = min(height, max(1, round(self.size * sy))), min(width, max(1, round(self.size * sx)))
        return min(height - h, round(top * sy)), min(width - w, round(left * sx)), h, w


class CenterCrop(_ShortSideCrop):
    """The central ``size`` x ``size`` after resizing the shorter side to ``resize_short``
    (an int, or (min, max) drawn per sample; None: the image's own scale). The box is the
    window torchvision's ``Resize`` then ``CenterCrop`` keeps, rounded to whole full-size pixels
    (half a pixel at most per edge), resized in one step; ``resize_short=size`` is exactly the
    central square."""

    def box(self, height: int, width: int, uniforms: Iterator[float]):
        rh, rw = self._target(height, width, uniforms)
        if self.size == min(rh, rw):  # the central square (``crop="center"``), exactly
            return center_crop_box(height, width)
        top, left = int(round((rh - self.size) / 2.0)), int(round((rw - self.size) / 2.0))
        return self._box(height, width, top, left, rh, rw)


class RandomCrop(_ShortSideCrop):
    """A ``size`` x ``size`` crop at a uniformly drawn position, after resizing the shorter side
    to ``resize_short`` (an int, or (min, max) drawn per sample; None: the image's own scale)."""

    def box(self, height: int, width: int, uniforms: Iterator[float]):
        rh, rw = self._target(height, width, uniforms)
        top = int(next(uniforms) * (rh - self.size + 1))
        left = int(next(uniforms) * (rw - self.size + 1))
        return self._box(height, width, top, left, rh, rw)


# --- the box rules ------------------------------------------------------------------------------


def center_crop_box(height: int, width: int) -> tuple[int, int, int, int]:
    """The central square: what resize-shorter-side then center-crop keeps."""
    side = min(height, width)
    return (height - side) // 2, (width - side) // 2, side, side


def random_resized_crop_box(
    height: int,
    width: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    uniforms: Iterator[float],
) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``: 10 tries of (area, log-uniform aspect),
    then the whole image clamped to ``ratio``, centered. Any finite positive ``ratio`` gives a
    box of at least one pixel: a side that overflows to infinity fails its try (as a side
    over the image does), and the clamped whole image keeps one row or column at least."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * (scale[0] + (scale[1] - scale[0]) * next(uniforms))
        aspect = math.exp(log_lo + (log_hi - log_lo) * next(uniforms))
        wf, hf = math.sqrt(target * aspect), math.sqrt(target / aspect)
        if wf < width + 1 and hf < height + 1:  # else round() is over the image (or infinite)
            w, h = int(round(wf)), int(round(hf))
            if 0 < w <= width and 0 < h <= height:
                top = int(next(uniforms) * (height - h + 1))
                left = int(next(uniforms) * (width - w + 1))
                return top, left, h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, max(1, int(round(width / ratio[0])))
    elif in_ratio > ratio[1]:
        h, w = height, max(1, int(round(height * ratio[1])))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def check_crop(crop) -> None:
    """A user's crop object has what the decoder calls: raised at construction, not in a worker."""
    if not callable(getattr(crop, "box", None)) or not hasattr(crop, "size"):
        raise InputError(
            f"crop={crop!r} is not a crop object: give "
            "shardkit.RandomResizedCrop/CenterCrop/RandomCrop, or an object with size and "
            "box(height, width, uniforms) -> (top, left, h, w)"
        )
    _check_size(crop.size)
    check_choice("interpolation", getattr(crop, "interpolation", "bilinear"), INTERPOLATIONS)


class CropError(TransformError, InputError):
    """A crop object's ``box`` raised, or returned no box inside the image: a bug in the policy
    (user code, as a transform's), raised whatever ``on_error``, never a skipped sample."""


def policy_box(crop, height: int, width: int, uniforms, key: str = ""):
    """A user's crop object's box for sample ``key``, checked; its own exception is the cause."""
    try:
        box = crop.box(height, width, uniforms)
    except Exception as exc:
        raise CropError(
            f"sample {key!r}: {type(crop).__name__}.box({height}, {width}, ...) raised "
            f"{type(exc).__name__}: {exc}",
            key=key,
        ) from exc
    return check_box(crop, box, height, width, key)


def check_box(crop, box, height: int, width: int, key: str = "") -> tuple[int, int, int, int]:
    """A box a crop object returned, as four ints inside the image (else a one-line error)."""
    try:
        top, left, h, w = (int(v) for v in box)
    except (TypeError, ValueError, OverflowError):  # not four numbers, NaN, infinity
        top = left = h = w = -1
    if not (0 <= top and 0 <= left and h >= 1 and w >= 1) or top + h > height or left + w > width:
        raise CropError(
            f"sample {key!r}: {type(crop).__name__}.box({height}, {width}, ...) returned "
            f"{box!r}: it must be (top, left, h, w) ints with h, w >= 1 inside the image",
            key=key,
        )
    return top, left, h, w
