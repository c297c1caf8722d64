"""Python sample sources for ``pack``: a list/iterable of ``(image, label)`` or a torch Dataset.

Images arrive as encoded bytes (kept as they are), PIL images, or uint8 arrays/tensors; anything
not yet encoded is encoded once here: JPEG at ``SAMPLE_JPEG_QUALITY`` (PNG when it has an alpha
channel, which JPEG cannot hold). Keys are the sample's position in the source, zero-padded
(``sample_key``), so shard order, keys and a re-run agree.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..images.checks import image_ext
from ..images.decode import RESIZE_QUALITY

if TYPE_CHECKING:
    from .options import PackOptions

__all__ = [
    "SAMPLE_JPEG_QUALITY",
    "encode_image",
    "is_indexable",
    "load_sample",
    "loader",
    "sample_key",
    "split_sample",
    "tasks",
]

#: Quality of the JPEG an array/PIL image is encoded as: the same as ``resize_short`` uses.
SAMPLE_JPEG_QUALITY = RESIZE_QUALITY


def sample_key(index: int) -> str:
    """``000000042``: nine digits (more past a billion), so keys sort in source order."""
    return f"{index:09d}"


def is_indexable(source: Any) -> bool:
    """Random access by position (a list, a map-style Dataset): shuffle and threads can use it.

    A torch ``IterableDataset`` inherits ``__getitem__`` from ``Dataset`` but cannot use it.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(source, torch.utils.data.IterableDataset):
        return False
    return hasattr(source, "__len__") and hasattr(source, "__getitem__")


def split_sample(sample: Any) -> tuple[Any, Any]:
    """``(image, label)`` from a sample (a 2-tuple/list, as torch Datasets yield)."""
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        return sample[0], sample[1]
    raise ValueError(f"expected an (image, label) pair, got a {type(sample).__name__}")


def _label(value: Any) -> int:
    """An int label from an int, a numpy integer or a 0-d integer tensor."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, (bool, float)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"label {value!r} is not an integer")
    if value < 0:
        raise ValueError(f"label {value} is negative")
    return int(value)


def encode_image(image: Any) -> tuple[bytes, str]:
    """``(encoded bytes, member extension)`` for one image of any accepted kind.

    Raises ValueError with the reason for anything else (pack turns it into a skip or an error).
    """
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        ext = image_ext(data)
        if ext is None:
            raise ValueError("bytes that are not an encoded image (JPEG, PNG, WebP ...)")
        return data, ext
    from PIL import Image

    if isinstance(image, Image.Image):
        return _encode_pil(image)
    array = _to_hwc(image)
    return _encode_pil(Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array))


def _to_hwc(image: Any) -> np.ndarray:
    """uint8 HWC from a tensor (CHW first, as torchvision gives) or an array (HWC first, as PIL)."""
    is_tensor = type(image).__module__.startswith("torch")
    if is_tensor:
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise ValueError(
            f"a {type(image).__name__} is not an image; pass encoded bytes, a PIL image, or a "
            "uint8 array/tensor"
        )
    if image.dtype != np.uint8:
        raise ValueError(
            f"a {image.dtype} array; images must be uint8 (scale to 0..255 and cast first)"
        )
    if image.ndim == 2:
        return image[:, :, None]
    if image.ndim != 3:
        raise ValueError(f"an array of shape {image.shape}; expected HxW, HxWxC or CxHxW")
    chw, hwc = image.shape[0] in (1, 3, 4), image.shape[2] in (1, 3, 4)
    if chw and (is_tensor or not hwc):
        return np.ascontiguousarray(image.transpose(1, 2, 0))
    if hwc:
        return image
    raise ValueError(f"an array of shape {image.shape}; expected 1, 3 or 4 channels")


def _encode_pil(img) -> tuple[bytes, str]:
    buf = io.BytesIO()
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        img.save(buf, "PNG")
        return buf.getvalue(), "png"
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    img.save(buf, "JPEG", quality=SAMPLE_JPEG_QUALITY)
    return buf.getvalue(), "jpg"


def load_sample(sample: Any) -> tuple[bytes, str, int]:
    """``(bytes, ext, label)`` of one source sample; ValueError with the reason if unusable."""
    image, label = split_sample(sample)
    data, ext = encode_image(image)
    return data, ext, _label(label)


def tasks(
    source: Any, o: PackOptions, size: int
) -> tuple[Iterable[list[tuple[int, Any]]], int, bool]:
    """Reader-thread tasks ``[(i, sample or None), ...]`` in pack order, the count (-1: unknown
    until the end) and whether the order is shuffled.

    With random access the tasks carry positions (a thread fetches ``source[i]``) in the
    permutation of ``o.seed`` (with ``o.shuffle``); an iterator is read on the calling thread,
    in its own order.
    """
    if is_indexable(source):
        n, shuffle = len(source), o.shuffle
        rng = np.random.default_rng(o.seed)
        order = (rng.permutation(n) if shuffle else np.arange(n)).tolist()
        return ([(i, None) for i in order[k : k + size]] for k in range(0, n, size)), n, shuffle
    return _batches(source, size), -1, False


def _batches(items: Iterable[Any], size: int) -> Iterable[list[Any]]:
    batch: list[Any] = []
    for i, item in enumerate(items):
        batch.append((i, item))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def loader(source: Any, check: Callable[[bytes, str], tuple]) -> Callable[[list], list]:
    """The reader-thread task: fetch (``source[i]``) where needed, encode, then ``check`` (pack's
    validate + resize) each sample; a loaded sample is ``(i, key, bytes|None, ext, reason,
    label, fields)`` (fields: None; a Python sample carries none yet)."""

    def load(task: list) -> list:
        out = []
        for i, sample in task:
            key = sample_key(i)
            try:
                data, ext, label = load_sample(source[i] if sample is None else sample)
            except (ValueError, TypeError, OSError) as exc:
                out.append((i, key, None, "", f"unusable sample: {exc}", -1, None))
                continue
            out.append((i, key, *check(data, ext), label, None))
        return out

    return load
