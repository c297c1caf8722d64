"""Images: which files are images, the cheap and full checks on their bytes, and decoding.

One home for what pack, verify, the folder reader and the streaming decode stage all need, so
"is this an image?" has one answer everywhere (pack used to accept 5 types, the tar reader 10).
"""

from __future__ import annotations

import io
import warnings

import numpy as np

__all__ = [
    "IMAGE_EXTENSIONS",
    "RESIZE_QUALITY",
    "TRAILER_WINDOW",
    "check_image_bytes",
    "decode_error",
    "decode_image",
    "resize_short_side",
]

#: File extensions (lowercase, no dot) taken as images, in folders and as tar members; matched
#: case-insensitively. Every one is decoded by Pillow and checked by ``check_image_bytes``.
IMAGE_EXTENSIONS = frozenset(
    {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm"}
)
#: JPEG quality of images re-encoded by ``resize_short`` (high enough that training accuracy does
#: not notice, as in FFCV's and ImageNet-resize pipelines).
RESIZE_QUALITY = 90
#: How far from the end of a file the JPEG end-of-image marker / PNG IEND chunk may sit: writers
#: sometimes pad a few bytes after it.
TRAILER_WINDOW = 256


_JPEG = b"\xff\xd8\xff"
_PNG = b"\x89PNG\r\n\x1a\n"


def check_image_bytes(data: bytes) -> str | None:
    """Cheap structural check: the reason the bytes are not a complete image, or None.

    Magic bytes say the format; the end says whether the file is whole (JPEG end-of-image marker,
    PNG IEND chunk, GIF trailer, the sizes in RIFF/BMP/PNM headers). Costs microseconds, unlike a
    decode.
    """
    n = len(data)
    if n == 0:
        return "empty file"
    tail = max(0, n - TRAILER_WINDOW)
    if data.startswith(_JPEG):
        if data.rfind(b"\xff\xd9", tail) < 0:
            return "truncated JPEG (no end-of-image marker)"
        return None
    if data.startswith(_PNG):
        if data.rfind(b"IEND", tail) < 0:
            return "truncated PNG (no IEND chunk)"
        return None
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        if n < int.from_bytes(data[4:8], "little") + 8:
            return "truncated WebP"
        return None
    if data[:2] == b"BM" and n >= 6:
        if n < int.from_bytes(data[2:6], "little"):
            return "truncated BMP"
        return None
    if data[:6] in (b"GIF87a", b"GIF89a"):
        if not data.rstrip(b"\x00\n").endswith(b"\x3b"):  # the trailer must end the file
            return "truncated GIF (no trailer byte)"
        return None
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return None  # TIFF: offsets point anywhere in the file, no cheap completeness check
    if data[:2] in (b"P5", b"P6"):
        return _check_pnm(data)
    return f"not a JPEG, PNG, WebP, BMP, GIF, TIFF or PPM/PGM file (starts with {data[:8]!r})"


def _check_pnm(data: bytes) -> str | None:
    """Binary PGM/PPM: header ``P5|P6 width height maxval`` then exactly the raster."""
    fields = data[:64].split(maxsplit=4)
    try:
        width, height, maxval = (int(f) for f in fields[1:4])
    except (ValueError, IndexError):
        return "damaged PPM/PGM header"
    header = data.index(fields[3], len(fields[0])) + len(fields[3]) + 1
    channels = 3 if data[:2] == b"P6" else 1
    need = header + width * height * channels * (2 if maxval > 255 else 1)
    return "truncated PPM/PGM" if len(data) < need else None


def decode_error(data: bytes) -> str | None:
    """Full decode with PIL: the reason it fails, or None."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as img:
                img.load()
    except Exception as exc:
        return f"cannot decode: {exc}"
    return None


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


def decode_image(data: bytes, mode: str):
    """Decode one stored image: "pil" (RGB PIL image), "tensor" (uint8 CHW RGB), "raw" (bytes).

    Shared by ShardDataset and FolderDataset so both pay exactly the same decode cost.
    """
    if mode == "raw":
        return data
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    if img.mode != "RGB":
        img = img.convert("RGB")
    else:
        img.load()
    if mode == "pil":
        return img
    import torch

    # Planar copy band by band straight into a contiguous CHW tensor. A permuted view of the
    # HWC array would cost the same here but make the DataLoader's collate a strided transpose
    # of every image (measured: ~40 us more per 250x250 image in the workers).
    width, height = img.size
    out = torch.empty((3, height, width), dtype=torch.uint8)
    planes = out.numpy()
    for c, band in enumerate(img.split()):
        planes[c] = np.asarray(band)
    return out
