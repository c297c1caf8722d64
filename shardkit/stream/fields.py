"""Extra fields of a sample (``txt``, ``json``, ``seg.png`` ...), decoded by their extension.

``ShardDataset(fields=...)`` names the fields to read. A sequence decodes each by the last part
of its name (``FIELD_DECODERS``: ``seg.png`` is an image, ``meta.json`` JSON); a mapping says per
field how: ``"auto"`` (by extension), ``"raw"`` (the stored bytes) or a callable taking the bytes.
``decode="raw"`` with a sequence keeps fields as stored bytes and gives None where a sample lacks
one (the stored-as-is view); decoded fields are required: a sample without one is an error
naming shard and key (a counted skip under ``on_error="skip"``).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError, SampleError, check_choice
from ..images.checks import IMAGE_EXTENSIONS
from ..images.crops import BOX_FORMATS
from ..images.decode import DEFAULT_MAX_PIXELS, check_pixels
from ..records import Record

__all__ = [
    "FIELD_DECODERS",
    "Boxes",
    "FieldDecoder",
    "decode_field_image",
    "field_spec",
    "sample_geometry",
]

#: Decodes one field's stored bytes; None: the bytes as stored.
FieldDecoder = Callable[[bytes], Any] | None


def decode_field_image(data: bytes, max_pixels: int | None = DEFAULT_MAX_PIXELS):
    """uint8 CHW tensor of an image field, values as stored: a mask keeps its class indices.

    Greyscale (``L``) and palette (``P``) images give one channel (a palette image its indices,
    not its colours), RGB three, RGBA four; other modes (16-bit, CMYK ...) are converted to RGB.
    A header declaring more than ``max_pixels`` pixels (the dataset's) is refused before any
    pixel is decoded, as for the sample's image: a small PNG may declare 13000x13000.
    """
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        check_pixels(img.size[1], img.size[0], max_pixels)
        if img.mode not in ("L", "P", "RGB", "RGBA"):
            img = img.convert("RGB")
        array = np.array(img, dtype=np.uint8)  # a copy: writable, as torch wants
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)  # never unpickle what a shard holds


def _text(data: bytes) -> str:
    return data.decode("utf-8")


#: Extension (the last part of a field's name) -> its decoder.
FIELD_DECODERS: dict[str, Callable[[bytes], Any]] = {
    "txt": _text,
    "text": _text,
    "json": json.loads,
    "cls": lambda data: int(data),
    "npy": _npy,
    **{ext: decode_field_image for ext in IMAGE_EXTENSIONS},
}


def _by_extension(name: str) -> FieldDecoder:
    return FIELD_DECODERS.get(name.rsplit(".", 1)[-1])


def field_spec(
    fields: str | Sequence[str] | Mapping[str, Any], decode: str
) -> tuple[tuple[str, ...], tuple[FieldDecoder, ...] | None]:
    """``(names, decoders)`` from ``fields=``; decoders None: raw bytes, None where missing."""
    if isinstance(fields, str):
        fields = (fields,)
    if not isinstance(fields, Mapping):
        names = tuple(f.lower() for f in fields)
        if decode == "raw" or not names:
            return names, None
        return names, tuple(_by_extension(n) for n in names)
    decoders = []
    for name, how in fields.items():
        if how == "auto":
            decoders.append(_by_extension(name.lower()))
        elif how == "raw":
            decoders.append(None)
        elif callable(how):
            decoders.append(how)
        else:
            raise InputError(
                f'fields={{{name!r}: {how!r}}}: say "auto" (decode by extension), "raw" (stored '
                "bytes) or give a callable taking the bytes"
            )
    return tuple(n.lower() for n in fields), tuple(decoders)


@dataclass(frozen=True, slots=True)
class Boxes:
    """Where a sample's boxes are: the decoded ``field`` (one of ``fields=``), inside it the
    list under ``key`` (None: the field itself, e.g. an (N, 4) ``npy``), each box a list of 4
    finite pixel numbers or a dict holding one under ``"bbox"`` (a COCO annotation); ``format``
    "xyxy" (corners) or "xywh" (COCO's x, y, width, height). Anything else (rows of 5, a flat
    list, inf or nan) is an error naming shard and key, never reshaped or clipped into boxes."""

    field: str
    key: str | None = None
    format: str = "xyxy"

    def __post_init__(self) -> None:
        check_choice("format", self.format, BOX_FORMATS)

    def stored(self, value) -> np.ndarray:
        """The (N, 4) float64 boxes held by the field's decoded ``value``; ValueError where it
        is not rows of 4 finite numbers. Never reshaped: rows of 5 (``x0, y0, x1, y1, class``)
        read as 4 would silently be other boxes, and an infinite corner a whole-image box."""
        if self.key is not None:
            value = value[self.key]
        try:
            if isinstance(value, np.ndarray):
                boxes = value.astype(np.float64)
            else:
                rows = [b["bbox"] if isinstance(b, Mapping) else b for b in value]
                boxes = np.asarray(rows, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"holds no rows of numbers ({exc})") from None
        if boxes.size == 0:
            return np.empty((0, 4), dtype=np.float64)
        if boxes.ndim != 2 or boxes.shape[1] != 4:
            raise ValueError(f"holds boxes of shape {boxes.shape}, not (N, 4)")
        if not np.isfinite(boxes).all():
            bad = int(np.flatnonzero(~np.isfinite(boxes).all(axis=1))[0])
            raise ValueError(f"box {bad} is {boxes[bad].tolist()}: not finite")
        return boxes


def sample_geometry(
    decoder, names: Sequence[str], decoders: Sequence[FieldDecoder], boxes: Boxes | None
) -> Callable[[Record, tuple], tuple] | None:
    """``(rec, fields, box) -> fields + (boxes, box_index)?``: the image's crop, resize and
    flip applied to its image fields (masks, nearest neighbour) and to its ``boxes``; None when
    there is nothing to move. ``box`` is the ``CropBox`` the sample's image was (or will be)
    decoded at: ``decoder.crop_box`` asked once per sample, its answer passed to the decoder
    and here alike, so a crop policy whose answer changes between calls still cuts image,
    masks and boxes at one box. ``decoder`` is the dataset's ``TensorDecoder`` with a
    geometry."""
    from ..images.geometry import crop_boxes, crop_mask  # torch: only a tensor decode moves fields

    masks = [i for i, d in enumerate(decoders) if d is decode_field_image]
    at = None
    if boxes is not None:
        if boxes.field not in names:
            raise InputError(
                f"boxes=Boxes({boxes.field!r}) reads field {boxes.field!r}: add it to fields="
            )
        at = names.index(boxes.field)
    if not masks and at is None:
        return None
    size = decoder.geometry.size

    def apply(rec: Record, extra: tuple, box) -> tuple:
        out = list(extra)
        for i in masks:
            try:
                out[i] = crop_mask(out[i], box, size)
            except ValueError as exc:
                raise SampleError(
                    f"{rec.shard}: sample {rec.key!r}: field {names[i]!r} {exc}; a mask must "
                    'have its image\'s size: fix it and re-pack, or pass on_error="skip"',
                    shard=rec.shard,
                    key=rec.key,
                ) from None
        if at is None:
            return tuple(out)
        try:
            stored = boxes.stored(extra[at])
        except (KeyError, TypeError, ValueError) as exc:
            where = f"field {boxes.field!r}" + (f" at {boxes.key!r}" if boxes.key else "")
            why = str(exc) if type(exc) is ValueError else f"holds no boxes ({exc!r})"
            raise SampleError(
                f"{rec.shard}: sample {rec.key!r}: {where} {why}; each box is 4 finite pixel "
                "numbers (keep classes in another field or key: box_index maps the kept boxes "
                'to them); fix it and re-pack, or pass on_error="skip"',
                shard=rec.shard,
                key=rec.key,
            ) from None
        return (*out, *crop_boxes(stored, box, size, boxes.format))

    return apply
