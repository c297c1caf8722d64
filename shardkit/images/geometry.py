"""Fixed-size images in one pass: crop box, DCT-scaled decode, antialiased uint8 resize, flip.

``ShardDataset(decode=Decode(crop=..., flip=...))`` and ``ShardLoader`` both decode
through ``TensorDecoder``, so a sample gets the same pixels through either.

Only the work the output needs is done: the crop box is chosen from the JPEG header before any
pixel is decoded, the image is decoded at the smallest DCT scale (1/2, 1/4, 1/8) whose crop still
covers ``size`` x ``size``, and only the crop's rows and columns are decoded (DALI's ROI decode,
through ``shardkit.images._native``: rows below the crop never, rows above without the inverse DCT,
columns cut to the crop's iMCUs). Pixels are identical with and without the region decoder
(tested); without it (not built, CMYK, damaged data) the whole image is decoded and cropped.

Randomness is a pure function of (seed, epoch, rank, sample key): a run repeats exactly whatever
the number of DataLoader workers or loader threads, and a sample's crop does not depend on which
worker read it. Each sample hashes its own key (blake2b) into a splitmix64 stream: building a
numpy Generator per sample would cost ~10 us, a tenth of a small image's decode.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError, check_choice
from .crops import (
    BOX_FORMATS,
    center_crop_box,
    policy_box,
    random_resized_crop_box,
)
from .decode import (
    DEFAULT_MAX_PIXELS,
    BufferShapeError,
    check_pixels,
    decode_jpeg_batch,
    decode_jpeg_region,
    decode_rgb,
    image_size,
    jpeg_scale,
    scratch_hwc,
    to_planes,
)
from .options import CROP_MODES, CropBox, Decode, Geometry

__all__ = [
    "scaled_box",
    "CROP_MODES",
    "CropBox",
    "Decode",
    "Geometry",
    "TensorDecoder",
    "BOX_FORMATS",
    "center_crop_box",
    "crop_boxes",
    "crop_mask",
    "random_resized_crop_box",
    "resized",
    "sample_seed",
    "sample_uniforms",
]


# --- randomness -------------------------------------------------------------------------------

_MASK = (1 << 64) - 1


def sample_uniforms(seed: int, epoch: int, rank: int, key: str) -> Iterator[float]:
    """Uniform floats in [0, 1) determined by (seed, epoch, rank, key) only (splitmix64)."""
    digest = hashlib.blake2b(f"{seed}\0{epoch}\0{rank}\0{key}".encode(), digest_size=8).digest()
    state = int.from_bytes(digest, "little")
    while True:
        state = (state + 0x9E3779B97F4A7C15) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        yield ((z ^ (z >> 31)) >> 11) * (1.0 / (1 << 53))


def sample_seed(seed: int, epoch: int, key: str) -> int:
    """A 63-bit seed for a user's transform, a function of (seed, epoch, key) only: the same
    sample gets the same augmentation whatever worker, worker count or rank reads it. Hashed
    apart from ``sample_uniforms`` so it does not repeat the built-in crop's draws."""
    text = f"{seed}\0{epoch}\0{key}\0transform".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


# --- decoding ---------------------------------------------------------------------------------


class TensorDecoder:
    """Stored image bytes -> uint8 CHW RGB tensor, fixed-size when ``geometry`` is given.

    Bound to one (seed, epoch, rank): build one per epoch and worker. ``out`` (a (3, H, W) uint8
    tensor, any strides: a slot of a batch buffer) receives the pixels instead of a new tensor;
    when its memory is HWC (a channels_last batch) a full-size JPEG is decoded straight into it.
    Without geometry ``out`` may also be an (H, W, 3) numpy array (the loader's fastest path).
    """

    @classmethod
    def of(cls, decode: Decode, seed: int = 0, epoch: int = 0, rank: int = 0) -> TensorDecoder:
        """Bytes -> uint8 CHW tensor for ``decode``, bound to (seed, epoch, rank)."""
        return cls(decode.geometry, seed, epoch, rank, decode.max_pixels, decode.dct == "fast")

    def __init__(
        self,
        geometry: Geometry | None,
        seed: int = 0,
        epoch: int = 0,
        rank: int = 0,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        fast_dct: bool = False,
    ):
        self.geometry = geometry
        self.seed, self.epoch, self.rank = int(seed), int(epoch), int(rank)
        self.max_pixels = max_pixels
        self.fast_dct = bool(fast_dct)
        self.resize_s = 0.0  # seconds in crop/resize so far (ShardLoader's stats read it)

    def __call__(self, data: bytes, key: str = "", out=None, box: CropBox | None = None):
        """``data``'s pixels; ``box``: its crop as ``crop_box`` gave it (None: asked here). A
        sample's masks and boxes are cut at the box its image was: pass the one box to both."""
        if self.geometry is None:
            return self._full(data, key, out)
        crop = self.crop_box(data, key) if box is None else box
        height, width, top, left, h, w, flip = crop
        size = self.geometry.size
        # Smallest decode whose crop still covers size x size (never larger than the image).
        need = (min(height, -(-height * size // h)), min(width, -(-width * size // w)))
        # Only the crop's rows and columns where the region decoder can (a JPEG), else all of it.
        d = jpeg_scale(height, width, need)
        dh, dw = -(-height // d), -(-width // d)  # what libjpeg makes at 1/d
        t0, l0, t1, l1 = _scaled_box(top, left, h, w, height, width, dh, dw)
        pixels = decode_jpeg_region(data, d, t0, l0, t1 - t0, l1 - l0, self.fast_dct)
        if pixels is None:
            rgb = decode_rgb(
                data, min_size=need, max_pixels=self.max_pixels, fast_dct=self.fast_dct
            )
            # the same box on whatever scale the fallback decoded (Pillow's draft may differ)
            t0, l0, t1, l1 = _scaled_box(top, left, h, w, height, width, *rgb.shape[:2])
            pixels = rgb[t0:t1, l0:l1]
        return self._finish(pixels, flip, out)

    def crop_box(self, data: bytes, key: str = "") -> CropBox:
        """The sample's crop in full-size pixels and its flip, from the header alone: what a
        decoder elsewhere (``shardkit.images.device``) needs to give the same sample.

        The crop object is asked once per call: a caller that also moves masks or boxes asks
        once per sample and passes the box to ``__call__`` (a policy whose answer changes
        between calls, a counter or a curriculum, then still cuts a sample's image and masks
        at one box). Whatever the crop raises or returns outside the image is a ``CropError``
        (a bug in the policy or its arguments, never an undecodable sample)."""
        g = self.geometry
        height, width = image_size(data)
        check_pixels(height, width, self.max_pixels)
        uniforms = sample_uniforms(self.seed, self.epoch, self.rank, key)
        top, left, h, w = policy_box(g.crop, height, width, uniforms, key)
        flip = g.flip and next(uniforms) < 0.5
        return CropBox(height, width, top, left, h, w, flip)

    def _finish(self, pixels: np.ndarray, flip: bool, out):
        size = self.geometry.size
        # (1, 3, h, w) channels_last: the layout of torch's AVX uint8 resize, which runs 2x
        # slower on the strided view of a crop than on a contiguous copy of it. The flip is
        # made in that copy (flip and resize commute), so it costs no extra pass.
        t0 = time.perf_counter()
        x = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)
        img = resized(x, size, flip, self.geometry.interpolation)[0]
        self.resize_s += time.perf_counter() - t0
        if out is None:
            return img.contiguous()
        hwc = img.permute(1, 2, 0)
        if out.is_contiguous() and hwc.is_contiguous():  # a contiguous batch slot
            to_planes(hwc.numpy(), out.numpy())
        else:
            out.copy_(img)
        return out

    def into_planes(self, data: bytes, key: str, out: np.ndarray) -> np.ndarray:
        """Full decode into a C-contiguous (3, H, W) array (a slot of a contiguous batch).

        Decoded interleaved into this thread's scratch array, then transposed into the planes:
        no tensor is made per image (the loader's contiguous path, where ~10 us of tensor calls
        per image under two threads' GIL hand-offs measured as much as the transpose itself).
        """
        try:  # the decoder checks the size against the scratch array: one header parse
            rgb = decode_rgb(
                data,
                out=scratch_hwc(out.shape[1], out.shape[2]),
                max_pixels=self.max_pixels,
                fast_dct=self.fast_dct,
            )
        except BufferShapeError as exc:
            raise _shape_error(key, exc.shape[:2], exc.buffer[:2]) from None
        to_planes(rgb, out)
        return out

    def into_batch(self, datas: list[bytes], out: np.ndarray, first: int, planar: bool) -> int:
        """Without geometry: whole images into a batch's images ``first``, ... in one native
        call (``decode_jpeg_batch``); how many it decoded. The caller sends the next one through
        ``__call__`` or ``into_planes``, which decide what it is (the same pixels either way)."""
        if self.geometry is not None:
            return 0
        height, width = out.shape[2:] if planar else out.shape[1:3]
        if self.max_pixels is not None and height * width > self.max_pixels:
            return 0  # the per-image path names the image that is too large
        return decode_jpeg_batch(datas, out, first, planar, self.fast_dct)

    def _full(self, data: bytes, key: str, out) -> torch.Tensor | np.ndarray:
        if out is None:
            rgb = decode_rgb(data, max_pixels=self.max_pixels, fast_dct=self.fast_dct)
            res = torch.empty((3, rgb.shape[0], rgb.shape[1]), dtype=torch.uint8)
            np.copyto(res.numpy(), rgb.transpose(2, 0, 1))
            return res
        try:
            if isinstance(out, np.ndarray):  # an HWC slot of a channels_last batch: straight in
                return decode_rgb(data, out=out, max_pixels=self.max_pixels, fast_dct=self.fast_dct)
            hwc = out.permute(1, 2, 0)
            if hwc.is_contiguous():
                decode_rgb(
                    data, out=hwc.numpy(), max_pixels=self.max_pixels, fast_dct=self.fast_dct
                )
            else:  # a contiguous batch slot: decode interleaved, then into the planes
                self.into_planes(data, key, out.numpy())
            return out
        except BufferShapeError as exc:
            raise _shape_error(key, exc.shape[:2], exc.buffer[:2]) from None


def resized(
    crop: torch.Tensor, size: int, flip: bool, interpolation: str = "bilinear"
) -> torch.Tensor:
    """A (1, 3, h, w) uint8 crop (any strides) as (1, 3, size, size), mirrored if ``flip``: the
    one uint8 resize of every CPU path (``TensorDecoder``, the device path's CPU backend).
    Bicubic is torch's (and PIL's) antialiased filter (a = -0.5) at every scale, as
    torchvision's uint8 ``resize(antialias=True)`` gives it."""
    if flip:
        crop = crop.flip(-1)  # a channels_last copy, like .contiguous() below
    ch, cw = crop.shape[-2:]
    if (ch, cw) != (size, size):
        crop = F.interpolate(
            crop.contiguous(memory_format=torch.channels_last),
            size=(size, size),
            mode=interpolation,
            # Antialiasing only changes a bilinear downscale; on a pure upscale the plain kernel
            # gives identical pixels 3x faster (measured). Bicubic's antialiased kernel differs
            # from the plain one (a = -0.5 against -0.75) at every scale.
            antialias=interpolation == "bicubic" or ch > size or cw > size,
            align_corners=False,
        )
    return crop


def _nearest(start: int, length: int, size: int) -> np.ndarray:
    """Source rows (or columns) of ``size`` outputs over ``length`` pixels from ``start``: each
    output pixel takes the pixel under its centre (PIL's NEAREST, torch's "nearest-exact"), in
    integers so no rounding of a float scale can move it."""
    return start + (np.arange(size) * 2 + 1) * length // (2 * size)


def crop_mask(mask: torch.Tensor, box: CropBox, size: int) -> torch.Tensor:
    """A (C, H, W) image field (a mask) cut by its image's ``box``, resized to ``size`` x
    ``size`` by nearest neighbour (class indices never blend) and flipped with it.

    The image's pixel (i, j) and the mask's come from the same full-size position (up to the
    bilinear filter's blur). A mask of another size than its image raises ``ValueError``:
    the caller names shard, key and field. The image's fused decode is not touched. Two numpy
    gathers (rows, then columns): 3x faster than torch indexing on a 64-pixel output."""
    height, width = mask.shape[-2:]
    if (height, width) != (box.height, box.width):
        raise ValueError(f"it is {width}x{height} but its image is {box.width}x{box.height}")
    rows = _nearest(box.top, box.h, size)
    cols = _nearest(box.left, box.w, size)
    if box.flip:
        cols = cols[::-1]  # mirror the output, as the image's resize-then-flip does
    return torch.from_numpy(np.ascontiguousarray(mask.numpy()[:, rows][:, :, cols]))


def crop_boxes(
    boxes, box: CropBox, size: int, format: str = "xyxy"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(boxes, index)``: (N, 4) pixel boxes of the full-size image moved onto its
    ``size`` x ``size`` output (shifted by the crop, scaled, flipped, clipped to the output) as
    float32 (K, 4) xyxy, and the int64 (K,) positions of the kept boxes in the input. Boxes left
    with no area are dropped: ``N - K`` were cut away; ``index`` keeps their labels aligned."""
    check_choice("format", format, BOX_FORMATS)
    array = np.asarray(boxes, dtype=np.float64)
    if array.size == 0:
        array = array.reshape(0, 4)
    if array.ndim != 2 or array.shape[1] != 4:  # never reshaped: rows of 5 are not boxes
        raise ValueError(f"boxes of shape {array.shape}, not (N, 4)")
    b = torch.as_tensor(array)
    x0, y0 = b[:, 0], b[:, 1]
    x1, y1 = (b[:, 2], b[:, 3]) if format == "xyxy" else (x0 + b[:, 2], y0 + b[:, 3])
    sx, sy = size / box.w, size / box.h
    x0, x1 = (x0 - box.left) * sx, (x1 - box.left) * sx
    y0, y1 = (y0 - box.top) * sy, (y1 - box.top) * sy
    if box.flip:
        x0, x1 = size - x1, size - x0
    out = torch.stack([x0, y0, x1, y1], dim=1).clamp_(0, size)
    keep = (out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])
    index = torch.nonzero(keep).flatten()
    return out[index].to(torch.float32), index


def _shape_error(key: str, size: tuple[int, int], batch: tuple[int, int]) -> ShapeError:
    (height, width), (bh, bw) = size, batch
    return ShapeError(
        f"sample {key!r} is {width}x{height} but its batch holds {bw}x{bh} images; "
        "pass decode=Decode(crop=...) to ShardDataset for fixed-size batches"
    )


def _scaled_box(top, left, h, w, height, width, dh, dw) -> tuple[int, int, int, int]:
    """A crop box of the full (height, width) image on the same image decoded at (dh, dw)."""
    sh, sw = dh / height, dw / width
    t0, l0 = int(top * sh), int(left * sw)
    t1 = max(t0 + 1, min(dh, round((top + h) * sh)))
    l1 = max(l0 + 1, min(dw, round((left + w) * sw)))
    return t0, l0, t1, l1


class ShapeError(InputError):
    """An image does not have the size of its batch (a usage error, not a corrupt sample)."""


#: Public name of the box scaling a region decode uses (benchmarks/bench_crops.py's breakdown
#: times the same steps the decoder takes).
scaled_box = _scaled_box
