"""Decoding stored image bytes to pixels, and re-encoding for ``pack --resize``.

Two decoders. JPEG goes through libjpeg-turbo's TurboJPEG API (``simplejpeg``): from memory, into
a caller-given buffer, at a reduced DCT scale when a smaller image will do, with the GIL released.
Pillow decodes everything else (PNG, WebP, ...) and is the fallback for any JPEG TurboJPEG
refuses (12-bit, damaged but still readable); if Pillow fails too, the sample is corrupt. Both
link libjpeg-turbo with the same settings (accurate integer DCT, fancy upsampling), so their
pixels agree: measured on the synthetic LFW and ImageNet sets, full-size decodes are identical
(max abs difference 0) and CMYK JPEGs differ by at most 1 level (``MAX_PATH_DIFFERENCE``).
Neither library decodes a region of interest, so ``decode_jpeg_region`` does it through
``_native`` (built from ``_native.c``, libjpeg's ``jpeg_crop_scanline`` and
``jpeg_skip_scanlines``); where that extension is not built, crops decode the whole image at the
DCT scale. Which bytes are images, and the checks on them, are in ``checks``.
"""

from __future__ import annotations

import io
import threading
import warnings

import numpy as np
import simplejpeg

from .checks import is_jpeg

try:  # built from _native.c when libjpeg's headers were there at install; optional
    from . import _native
except ImportError:
    _native = None

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "FAST_DCT_DIFFERENCE",
    "MAX_PATH_DIFFERENCE",
    "ImageTooLarge",
    "check_pixels",
    "RESIZE_QUALITY",
    "BufferShapeError",
    "decode_image",
    "decode_jpeg_batch",
    "decode_jpeg_region",
    "decode_rgb",
    "image_size",
    "jpeg_scale",
    "resize_short_side",
    "scratch_hwc",
    "to_planes",
]

#: JPEG quality of images re-encoded by ``resize_short_side`` (high enough that training accuracy
#: does not notice, as in FFCV's and ImageNet-resize pipelines).
RESIZE_QUALITY = 90
#: Largest difference in 8-bit levels between a pixel decoded by simplejpeg and by Pillow from the
#: same JPEG at the same scale (CMYK conversion rounds differently; RGB/gray JPEGs agree exactly).
MAX_PATH_DIFFERENCE = 1


def resize_short_side(data: bytes, short: int, quality: int = RESIZE_QUALITY) -> bytes | None:
    """Re-encode as JPEG with the shorter side ``short`` pixels; None if it is already that small.

    Pixels are kept as stored (EXIF orientation is not applied), so a resized image looks the
    same to a decoder as its original does; alpha is dropped, other modes become RGB.
    """
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if min(w, h) <= short:
                return None
            if w <= h:
                size = (short, max(1, round(h * short / w)))
            else:
                size = (max(1, round(w * short / h)), short)
            img.draft("RGB", size)  # JPEG: let libjpeg scale by 1/2, 1/4, 1/8 while decoding
            img = img.convert("L" if img.mode in ("L", "1", "I;16", "I", "F") else "RGB")
            img = img.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=quality)
            return buf.getvalue()


#: Largest difference in 8-bit levels between libjpeg-turbo's fast integer IDCT (``fast_dct``,
#: FFCV's default) and the accurate one: measured 9 on LFW-shaped full decodes, 22 on
#: ImageNet-shaped ones, 17 on their random-resized crops; the mean is ~1 level. It bought 1-2%
#: of decode time here (libjpeg-turbo 2.1's SIMD accurate IDCT is nearly as fast).
FAST_DCT_DIFFERENCE = 24

#: Images whose header declares more pixels than this are refused before any pixel is decoded:
#: a 2 KB JPEG may declare 60000x60000 (a 10 GiB allocation). 100 megapixels (300 MB as RGB) is
#: above any camera photo in a training set; ``Decode(max_pixels=)`` moves it.
DEFAULT_MAX_PIXELS = 100_000_000

#: What a stored image becomes: an RGB PIL image, a uint8 CHW RGB tensor, or the stored bytes.
DECODE_MODES = ("pil", "tensor", "raw")
#: JPEG inverse DCTs: libjpeg-turbo's accurate one (the default), or its fast integer one.
DCT_MODES = ("accurate", "fast")


class ImageTooLarge(ValueError):
    """The header declares more pixels than the limit (a decompression bomb, or a huge scan)."""


def check_pixels(height: int, width: int, max_pixels: int | None) -> None:
    """Raise ``ImageTooLarge`` if ``height`` x ``width`` exceeds ``max_pixels`` (None: no limit)."""
    if max_pixels is not None and height * width > max_pixels:
        raise ImageTooLarge(
            f"its header declares {width}x{height} = {height * width} pixels, over the limit "
            f"max_pixels={max_pixels} (a decompression bomb, or an image larger than any "
            "training photo: pass decode=Decode(max_pixels=...) to allow it)"
        )


# --- decoding ----------------------------------------------------------------------------------


def jpeg_scale(height: int, width: int, min_size: tuple[int, int] | None) -> int:
    """The largest DCT down-scaling divisor (8, 4, 2 or 1) that keeps the image >= ``min_size``.

    Only powers of two: libjpeg-turbo's other factors (7/8, 3/4, 5/8 ...) measured 20-60% SLOWER
    than a full decode on ImageNet-sized JPEGs, and 1/2 only ~20% faster (at quality 90 Huffman
    decoding, which no scale skips, is most of the cost).
    """
    if not min_size:
        return 1
    need_h, need_w = min_size
    for d in (8, 4, 2):
        if -(-height // d) >= need_h and -(-width // d) >= need_w:
            return d
    return 1


def decode_jpeg_region(
    data: bytes, scale: int, top: int, left: int, height: int, width: int, fast_dct: bool = False
) -> np.ndarray | None:
    """Only the rows and columns of a crop, decoded at 1/``scale`` DCT scale (DALI's ROI decode).

    Coordinates are in the scaled image. Returns an HWC uint8 view with exactly the pixels that
    ``decode_rgb`` at that scale has there (tested), or None where the region decoder is not
    built or libjpeg declines (CMYK, 12-bit, damaged data): the caller then decodes in full,
    which also raises the error a damaged image deserves. Rows below the crop are never decoded;
    rows above are skipped without the inverse DCT or colour conversion; columns are cut to the
    crop's iMCUs: ~0.7 of a full decode for an ImageNet-sized random-resized crop (measured).
    """
    if _native is None or not is_jpeg(data):
        return None
    try:
        buf, x0, out_width = _native.decode(data, scale, top, left, height, width, fast_dct)
    except ValueError:
        return None
    rows = np.frombuffer(buf, np.uint8).reshape(height, out_width, 3)
    return rows[:, left - x0 : left - x0 + width]


def decode_jpeg_batch(
    datas: list[bytes], out: np.ndarray, first: int, planar: bool, fast_dct: bool = False
) -> int:
    """Whole JPEGs of ``out``'s image size into its images ``first``, ``first + 1``, ... in one
    native call (one decompressor, the GIL released, a planar batch transposed strip by strip);
    the number decoded. It stops at the first image it does not take (not a JPEG of exactly that
    size, CMYK, any libjpeg warning or error): the caller decodes that one through ``decode_rgb``,
    which decides, so outcomes never depend on this path. Pixels equal ``decode_rgb``'s (tested).
    ``out``: C-contiguous uint8 (N, H, W, 3), or (N, 3, H, W) with ``planar``. 0 where
    ``_native`` is not built."""
    if _native is None or not datas:
        return 0
    height, width = out.shape[2:] if planar else out.shape[1:3]
    return _native.decode_batch(datas, out, first, height, width, planar, fast_dct)


def to_planes(hwc: np.ndarray, chw: np.ndarray) -> None:
    """Copy an interleaved (H, W, 3) image into a planar (3, H, W) one: a contiguous batch slot.

    The native loop where it is built and both arrays are C-contiguous (~9 us for 250x250);
    numpy's strided copy (~60 us) otherwise.
    """
    native = _native is not None and hwc.flags.c_contiguous and chw.flags.c_contiguous
    if native and chw.shape == (3, *hwc.shape[:2]) and hwc.shape[2] == 3:
        _native.hwc_to_chw(hwc, chw)
    else:
        np.copyto(chw, hwc.transpose(2, 0, 1))


_scratch = threading.local()


def scratch_hwc(height: int, width: int) -> np.ndarray:
    """This thread's reused (height, width, 3) uint8 array, for pixels on their way elsewhere.

    A fresh 190 KB array per image is an mmap and ~50 page faults; one reused per thread is none.
    Valid until this thread asks again.
    """
    arr = getattr(_scratch, "arr", None)
    if arr is None or arr.shape != (height, width, 3):
        arr = _scratch.arr = np.empty((height, width, 3), np.uint8)
    return arr


def image_size(data: bytes) -> tuple[int, int]:
    """(height, width) from the header alone (microseconds for JPEG: no pixels are decoded)."""
    if is_jpeg(data):
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return height, width
        except ValueError:
            pass  # Pillow may still read it
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        width, height = img.size
    return height, width


class BufferShapeError(ValueError):
    """The image does not have the shape of the buffer it was to be decoded into."""

    def __init__(self, shape: tuple[int, ...], buffer: tuple[int, ...]):
        super().__init__(f"decoded {tuple(shape)} does not fit the buffer {tuple(buffer)}")
        self.shape, self.buffer = tuple(shape), tuple(buffer)


def decode_rgb(
    data: bytes,
    *,
    min_size: tuple[int, int] | None = None,
    out: np.ndarray | None = None,
    pillow: bool = False,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    fast_dct: bool = False,
) -> np.ndarray:
    """Decode to an HWC uint8 RGB array, at the smallest DCT scale still >= ``min_size`` (h, w).

    ``min_size`` None decodes at full size. ``out``: a C-contiguous HWC array of exactly the
    decoded shape to write into (saves an allocation and a copy per image). ``pillow=True``
    forces the Pillow path (tests compare the two). An image declaring more than ``max_pixels``
    raises ``ImageTooLarge`` from its header. ``fast_dct``: libjpeg-turbo's fast integer IDCT
    for JPEGs (``FAST_DCT_DIFFERENCE``; Pillow has none, so its fallback stays accurate).
    Raises whatever the decoder raises for corrupt data; callers wrap it in ``SampleError``
    naming shard and key.
    """
    if (
        out is not None
        and min_size is None
        and not pillow
        and (max_pixels is None or out.shape[0] * out.shape[1] <= max_pixels)
        and is_jpeg(data)
    ):
        # A batch slot of a fixed size: decode straight in, without parsing the header first
        # (~5% of a 250x250 decode); the buffer bounds the allocation. Any other answer (too
        # large, smaller than the slot, not for TurboJPEG) goes through the full path below.
        try:
            got = simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out, fastdct=fast_dct)
            if got.shape == out.shape:
                return got
        except ValueError:
            pass
    if not pillow and is_jpeg(data):
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            height = 0  # TurboJPEG cannot read the header: Pillow decides
        if height:
            check_pixels(height, width, max_pixels)
            d = jpeg_scale(height, width, min_size)
            shape = (-(-height // d), -(-width // d), 3)
            if out is not None and out.shape != shape:
                raise BufferShapeError(shape, out.shape)
            try:
                return simplejpeg.decode_jpeg(
                    data,
                    colorspace="RGB",
                    min_height=shape[0],
                    min_width=shape[1],
                    buffer=out,
                    fastdct=fast_dct,
                )
            except ValueError:
                pass  # not for TurboJPEG (12-bit, lossless, damaged): Pillow decides
    return _decode_pillow(data, min_size, out, max_pixels)


def _decode_pillow(
    data: bytes,
    min_size: tuple[int, int] | None,
    out: np.ndarray | None,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        check_pixels(img.size[1], img.size[0], max_pixels)  # from the header: nothing decoded
        if min_size and img.format == "JPEG":
            width, height = img.size
            d = jpeg_scale(height, width, min_size)
            if d > 1:  # draft's divisor is the largest power of two <= min(W // w, H // h)
                img.draft("RGB", (max(1, width // d), max(1, height // d)))
        rgb = img.convert("RGB") if img.mode != "RGB" else img
        rgb.load()
        arr = np.asarray(rgb)
    if out is None:
        return np.array(arr)  # writable, like simplejpeg's (torch warns on read-only arrays)
    if out.shape != arr.shape:
        raise BufferShapeError(arr.shape, out.shape)
    np.copyto(out, arr)
    return out


def decode_image(
    data: bytes, mode: str, max_pixels: int | None = DEFAULT_MAX_PIXELS, fast_dct: bool = False
):
    """Decode one stored image: "pil" (RGB PIL image), "tensor" (uint8 CHW RGB), "raw" (bytes).

    Shared by ShardDataset and FolderDataset so both pay exactly the same decode cost.
    """
    if mode == "raw":
        return data
    if mode == "pil":
        from PIL import Image

        img = Image.open(io.BytesIO(data))
        check_pixels(img.size[1], img.size[0], max_pixels)
        if img.mode != "RGB":
            img = img.convert("RGB")
        else:
            img.load()
        return img
    import torch

    # A contiguous CHW tensor: a permuted view of the HWC array would make the DataLoader's
    # collate a strided transpose of every image (measured: ~40 us more per 250x250 image).
    rgb = decode_rgb(data, max_pixels=max_pixels, fast_dct=fast_dct)
    height, width, _ = rgb.shape
    out = torch.empty((3, height, width), dtype=torch.uint8)
    np.copyto(out.numpy(), rgb.transpose(2, 0, 1))
    return out
