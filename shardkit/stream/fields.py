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
from typing import Any

import numpy as np

from ..errors import InputError
from ..images.checks import IMAGE_EXTENSIONS

__all__ = ["FIELD_DECODERS", "FieldDecoder", "decode_field_image", "field_spec"]

#: Decodes one field's stored bytes; None: the bytes as stored.
FieldDecoder = Callable[[bytes], Any] | None


def decode_field_image(data: bytes):
    """uint8 CHW tensor of an image field, values as stored: a mask keeps its class indices.

    Greyscale (``L``) and palette (``P``) images give one channel (a palette image its indices,
    not its colours), RGB three, RGBA four; other modes (16-bit, CMYK ...) are converted to RGB.
    """
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
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
