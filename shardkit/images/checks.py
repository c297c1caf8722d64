"""Which files and bytes are images, and the checks on them: cheap (structure) and full (decode).

One home for what pack, verify, the folder reader, the tar reader and ``ShardWriter`` all need,
so "is this an image?" has one answer everywhere: one extension set, one magic-number table.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

__all__ = [
    "IMAGE_EXTENSIONS",
    "JPEG_MAGIC",
    "TRAILER_WINDOW",
    "check_image_bytes",
    "decode_error",
    "image_ext",
    "is_jpeg",
]

#: File extensions (lowercase, no dot) taken as images, in folders and as tar members; matched
#: case-insensitively. Every one is decoded by Pillow and checked by ``check_image_bytes``.
IMAGE_EXTENSIONS = frozenset(
    {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm"}
)
#: How far from the end of a file the JPEG end-of-image marker / PNG IEND chunk may sit: writers
#: sometimes pad a few bytes after it.
TRAILER_WINDOW = 256

JPEG_MAGIC = b"\xff\xd8\xff"
#: The magic-number table: leading bytes -> the extension a stored member gets. WebP (``RIFF``
#: with ``WEBP`` at offset 8) is the one format told by more than a prefix.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (JPEG_MAGIC, "jpg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"P5", "pgm"),
    (b"P6", "ppm"),
)


def is_jpeg(data: bytes) -> bool:
    return data[:3] == JPEG_MAGIC


def image_ext(data: bytes) -> str | None:
    """The member extension for encoded image bytes, from their magic number (None: unknown)."""
    head = bytes(data[:12])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    for magic, ext in _MAGIC:
        if head.startswith(magic):
            return ext
    return None


def _not_an_image(data: bytes) -> str:
    return f"not a JPEG, PNG, WebP, BMP, GIF, TIFF or PPM/PGM file (starts with {data[:8]!r})"


def _check_jpeg(data: bytes) -> str | None:
    if data.rfind(b"\xff\xd9", max(0, len(data) - TRAILER_WINDOW)) < 0:
        return "truncated JPEG (no end-of-image marker)"
    return None


def _check_png(data: bytes) -> str | None:
    if data.rfind(b"IEND", max(0, len(data) - TRAILER_WINDOW)) < 0:
        return "truncated PNG (no IEND chunk)"
    return None


def _check_webp(data: bytes) -> str | None:
    if len(data) < int.from_bytes(data[4:8], "little") + 8:
        return "truncated WebP"
    return None


def _check_bmp(data: bytes) -> str | None:
    if len(data) < 6:
        return _not_an_image(data)
    if len(data) < int.from_bytes(data[2:6], "little"):
        return "truncated BMP"
    return None


def _check_gif(data: bytes) -> str | None:
    if not data.rstrip(b"\x00\n").endswith(b"\x3b"):  # the trailer must end the file
        return "truncated GIF (no trailer byte)"
    return None


def _check_tiff(data: bytes) -> str | None:
    return None  # offsets point anywhere in the file: no cheap completeness check


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


#: Per format (by ``image_ext``), whether the file is whole.
_COMPLETE: dict[str, Callable[[bytes], str | None]] = {
    "jpg": _check_jpeg,
    "png": _check_png,
    "webp": _check_webp,
    "bmp": _check_bmp,
    "gif": _check_gif,
    "tiff": _check_tiff,
    "pgm": _check_pnm,
    "ppm": _check_pnm,
}


def check_image_bytes(data: bytes) -> str | None:
    """Cheap structural check: the reason the bytes are not a complete image, or None.

    Magic bytes say the format; the end says whether the file is whole (JPEG end-of-image marker,
    PNG IEND chunk, GIF trailer, the sizes in RIFF/BMP/PNM headers). Costs microseconds, unlike a
    decode.
    """
    if len(data) == 0:
        return "empty file"
    check = _COMPLETE.get(image_ext(data))
    return _not_an_image(data) if check is None else check(data)


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
