"""``Decode``, what a stored image becomes, and ``Geometry``, the fixed-size output of its crop.

One value every reader takes (``ShardDataset``, ``ShardLoader``, ``ShardView``, ``FolderDataset``,
``shardkit bench``), checked once at construction. This module imports no torch, so the readers
that only inspect (``ShardView`` under ``shardkit ls``/``show``) take a ``Decode`` without paying
for it; its decoder is ``images.geometry.TensorDecoder.of(decode, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import InputError, check_choice
from .crops import CenterCrop, RandomResizedCrop, check_crop
from .decode import DCT_MODES, DECODE_MODES, DEFAULT_MAX_PIXELS, decode_image

__all__ = ["CROP_MODES", "CropBox", "Decode", "Geometry"]

CROP_MODES = ("center", "random")


class CropBox(NamedTuple):
    """A sample's crop: the image's (height, width), the box (top, left, h, w) in its full-size
    pixels, and whether the crop is mirrored."""

    height: int
    width: int
    top: int
    left: int
    h: int
    w: int
    flip: bool


@dataclass(frozen=True)
class Geometry:
    """``size`` x ``size`` output of a crop policy (``shardkit.images.crops``): ``crop`` is a
    crop object, or the shorthands "center" (``CenterCrop(size, resize_short=size)``: the
    central square) and "random" (``RandomResizedCrop(size)``: ImageNet's scale 0.08-1, ratio
    3/4-4/3, bilinear); ``flip``: mirror left-right with probability 1/2. With a crop object
    ``size`` may be None (the object's) or must equal it."""

    size: int | None
    crop: object = "center"
    flip: bool = False

    def __post_init__(self) -> None:
        crop = self.crop
        if isinstance(crop, str):
            if self.size is None or isinstance(self.size, bool) or self.size < 1:
                raise InputError(f"size={self.size} must be >= 1 (the output side in pixels)")
            check_choice("crop", crop, CROP_MODES)
            size = int(self.size)
            crop = RandomResizedCrop(size) if crop == "random" else CenterCrop(size, size)
        else:
            check_crop(crop)
            if self.size is not None and self.size != crop.size:
                raise InputError(
                    f"size={self.size} but crop={crop!r} makes {crop.size} x {crop.size}: "
                    "give the size in one place (the crop object)"
                )
        object.__setattr__(self, "crop", crop)
        object.__setattr__(self, "size", int(crop.size))
        object.__setattr__(self, "flip", bool(self.flip))

    @property
    def interpolation(self) -> str:
        return getattr(self.crop, "interpolation", "bilinear")

    def check_output(self, max_pixels: int | None) -> None:
        """Refuse an output larger than the images the dataset may decode (``max_pixels``):
        every sample would be upscaled past the limit that guards memory and time."""
        size = self.size
        if max_pixels is not None and size * size > max_pixels:
            raise InputError(
                f"size {size} makes {size} x {size} = {size * size} output pixels per image, "
                f"over max_pixels={max_pixels}: give a smaller size (or crop=) or a larger "
                "max_pixels="
            )


@dataclass(frozen=True)
class Decode:
    """What a stored image becomes, as one value every reader takes (``ShardDataset``,
    ``ShardLoader``, ``ShardView``, ``FolderDataset``, ``shardkit bench``), checked once here.

    ``mode``: "tensor" (uint8 CHW RGB), "pil" (RGB PIL image, for PIL transforms) or "raw" (the
    stored bytes). Left out, it is "pil", the readers' own default (``decode="pil"``), unless
    ``crop=`` or ``dct="fast"`` is given: only "tensor" does those, so they choose it (a "pil" or
    "raw" ``Decode`` with either is refused, never accepted and ignored). ``crop``: a crop
    object (``shardkit.RandomResizedCrop(224)``, ``CenterCrop(224, resize_short=256)``,
    ``RandomCrop``, or any object with ``size`` and ``box(height, width, uniforms)``):
    fixed-size output, only the crop decoded. ``flip``: mirror half the crops. ``max_pixels``:
    an image whose header declares more pixels is undecodable (None: no limit). ``dct="fast"``:
    libjpeg-turbo's fast integer IDCT for JPEGs (see docs/loader.md). A plain string
    ``"tensor"`` stands for ``Decode("tensor")``.
    """

    mode: str | None = None
    crop: object | None = None
    flip: bool = False
    max_pixels: int | None = DEFAULT_MAX_PIXELS
    dct: str = "accurate"

    def __post_init__(self) -> None:
        check_choice("dct", self.dct, DCT_MODES)
        if self.mode is None:
            tensor_only = self.crop is not None or self.dct == "fast"
            object.__setattr__(self, "mode", "tensor" if tensor_only else "pil")
        check_choice("mode", self.mode, DECODE_MODES)
        if self.dct == "fast" and self.mode != "tensor":
            raise InputError(
                f'Decode({self.mode!r}, dct="fast"): the fast IDCT is the tensor decoder\'s; '
                f'give Decode("tensor", dct="fast"), or leave dct= out for mode {self.mode!r}'
            )
        m = self.max_pixels
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise InputError(f"max_pixels={m!r} must be an int >= 1, or None (no limit)")
        if not isinstance(self.flip, (bool, np.bool_)):
            raise InputError(f"flip={self.flip!r} must be True or False")
        object.__setattr__(self, "flip", bool(self.flip))
        if self.crop is None:
            if self.flip:
                raise InputError(
                    "Decode(flip=True) mirrors crops: give crop= too (e.g. "
                    "crop=shardkit.RandomResizedCrop(224))"
                )
            return
        if isinstance(self.crop, str):
            raise InputError(
                f"Decode(crop={self.crop!r}) takes a crop object: "
                "shardkit.RandomResizedCrop(size) or CenterCrop(size, resize_short=size)"
            )
        if self.mode != "tensor":
            raise InputError(f'Decode(crop=...) needs mode="tensor" (got mode={self.mode!r})')
        check_crop(self.crop)
        self.geometry.check_output(self.max_pixels)

    def __repr__(self) -> str:  # what differs from the defaults: a spelling to copy
        parts = [repr(self.mode)] + [
            f"{name}={getattr(self, name)!r}"
            for name, default in (("crop", None), ("flip", False),
                                  ("max_pixels", DEFAULT_MAX_PIXELS), ("dct", "accurate"))
            if getattr(self, name) != default
        ]  # fmt: skip
        return f"Decode({', '.join(parts)})"

    @classmethod
    def of(cls, value: Decode | str) -> Decode:
        """``value`` as a ``Decode``: a mode string is ``Decode(mode)``."""
        if isinstance(value, Decode):
            return value
        if not isinstance(value, str):
            raise InputError(f'decode={value!r}: give "tensor", "pil", "raw" or a shardkit.Decode')
        check_choice("decode", value, DECODE_MODES)
        return cls(value)

    def image(self, data: bytes):
        """``data`` decoded whole as this value says (``mode``, ``max_pixels``, ``dct``): what
        a reader without a crop makes of a stored image. A crop is drawn per sample by the
        ``TensorDecoder`` of ``shardkit.images.geometry``, not here."""
        return decode_image(data, self.mode, self.max_pixels, self.dct == "fast")

    @property
    def geometry(self) -> Geometry | None:
        """The fixed-size output ``TensorDecoder`` makes, None without a crop."""
        if self.crop is None:
            return None
        return Geometry(None, self.crop, self.flip)

    @property
    def size(self) -> int | None:
        """The output side in pixels, None without a crop (each image keeps its size)."""
        return None if self.crop is None else int(self.crop.size)
