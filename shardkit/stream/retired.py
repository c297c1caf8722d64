"""ShardDataset's retired keywords, kept for one release: each builds the object that replaced it.

The flat keywords became objects (``Decode`` for what an image becomes, ``Order`` for how an epoch
is ordered, ``Source`` for what is read, one storage object for where it lives). An old call still
works and gives the same samples and the same ``state_dict()``: its keywords are turned into those
objects here, with one ``FutureWarning`` per call that prints the new spelling (a
``DeprecationWarning`` is hidden when the call sits in an imported module: in training code). An
old and a new spelling of one group in the same call is an ``InputError`` naming both (which
would win is not obvious). Delete this module, and the ``**retired`` of ``ShardDataset``, after
one release.
"""

from __future__ import annotations

import os
import warnings

from ..errors import InputError, UnknownKeywordError
from ..images.geometry import Decode, Geometry
from ..redact import redact, secret_values
from ..sizes import parse_size
from .mix import Source
from .shuffle import Order

__all__ = ["GROUPS", "PREFIX", "translate"]

#: Each retired keyword's group: the new keyword that now carries it.
GROUPS = {
    "size": "decode",
    "crop": "decode",
    "flip": "decode",
    "max_pixels": "decode",
    "dct": "decode",
    "shuffle": "order",
    "buffer_size": "order",
    "equalize": "order",
    "subset": "source",
    "split": "source",
    "val_fraction": "source",
    "storage_options": "storage",
    "cache_dir": "storage",
    "cache_limit": "storage",
    "prefetch": "storage",
}


#: How every retired-keyword warning begins: a fixed text, so ``-W "error:retired keyword"``
#: (and the doc test) can turn exactly these into errors.
PREFIX = "retired keyword"


def translate(
    retired: dict,
    *,
    source,
    decode,
    order,
    storage,
    owner: str = "ShardDataset",
    groups: tuple[str, ...] = ("decode", "order", "source", "storage"),
    stacklevel: int = 3,
):
    """``(source, decode, order, storage)`` with the retired keywords folded in: one
    ``FutureWarning`` per call, printing the new spelling. ``groups``: those ``owner``
    had keywords of. What an old call gave and nothing read (``buffer_size`` without a shuffle,
    ``val_fraction`` without a split) is dropped: the new objects refuse it."""
    unknown = sorted(k for k in retired if GROUPS.get(k) not in groups)
    if unknown:
        raise UnknownKeywordError(
            f"{owner} got an unknown keyword {unknown[0]}=; see help(shardkit.{owner})"
        )
    if not retired:
        return source, decode, order, storage
    spelled = []
    given = {g: [k for k in retired if GROUPS[k] == g] for g in ("decode", "order", "source")}
    given["storage"] = [k for k in retired if GROUPS[k] == "storage"]
    if given["decode"]:
        if isinstance(decode, Decode):
            _both(given["decode"], "decode=Decode(...)")
        decode = _decode(decode, retired)
        spelled.append(f"decode={decode!r}")
    if given["order"]:
        if order is not None:
            _both(given["order"], "order=Order(...)")
        order = _order(retired, given["order"])
        spelled.append(f"order={order!r}")
    if given["storage"]:
        if storage is not None:
            _both(given["storage"], "storage=")
        from ..remote.storage import RemoteStorage

        kw = {k: retired[k] for k in given["storage"]}
        if kw.get("cache_limit") is not None and kw.get("cache_dir") is None:
            parse_size(kw.pop("cache_limit"), "cache_limit", minimum=0)  # limits no cache
        storage = RemoteStorage(**kw)
        spelled.append("storage=RemoteStorage(" + _args(retired, given["storage"]) + ")")
    if given["source"]:
        source = _source(source, retired, given["source"])
        if isinstance(source, Source):
            kept = [k for k in given["source"] if k != "val_fraction" or source.split]
            spelled.insert(0, f"Source(path, {_args(retired, kept)})")
    old = ", ".join(f"{k}={retired[k]!r}" for k in retired)
    secrets = secret_values(retired.get("storage_options"))  # printed as the user gave them
    warnings.warn(
        redact(
            f"{PREFIX}s {owner}({old}): write {owner}({', '.join(spelled)}) (the old keywords "
            "go in the next release)",
            secrets,
        ),
        FutureWarning,
        stacklevel=stacklevel,
    )
    return source, decode, order, storage


def _both(old: list[str], new: str) -> None:
    raise InputError(
        f"{'=, '.join(old)}= and {new} both set one option group: give only {new} "
        f"({'/'.join(old)} are its retired spelling)"
    )


def _order(retired: dict, keys: list[str]) -> Order:
    kw = {k: retired[k] for k in keys}
    if not kw.get("shuffle", True):
        kw.pop("buffer_size", None)  # nothing is buffered without a shuffle
    return Order(**kw)


def _decode(mode, retired: dict) -> Decode:
    """The old size/crop/flip keywords as a ``Decode``: a shorthand crop ("center", "random")
    with ``size``, or a crop object; no size and a shorthand: full-size images (flip unused)."""
    if not isinstance(mode, str):
        raise InputError(f'decode={mode!r}: give "tensor", "pil", "raw" or a shardkit.Decode')
    size, crop = retired.get("size"), retired.get("crop", "center")
    flip = retired.get("flip", False)
    rest = {k: retired[k] for k in ("max_pixels", "dct") if k in retired}
    if size is None and isinstance(crop, str):
        return Decode(mode, **rest)
    if mode != "tensor":
        what = f"size={size}" if size is not None else f"crop={crop!r}"
        raise InputError(f'{what} needs decode="tensor" (got decode={mode!r})')
    geometry = Geometry(None if size is None else int(size), crop, bool(flip))
    return Decode(mode, crop=geometry.crop, flip=geometry.flip, **rest)


def _source(source, retired: dict, keys: list[str]):
    many = isinstance(source, Source) or (
        not isinstance(source, (str, os.PathLike)) and any(isinstance(s, Source) for s in source)
    )
    if many:
        raise InputError("with Source()s, give subset= and split= to each Source")
    if retired.get("subset") is None and retired.get("split") is None:
        return source  # val_fraction alone changed nothing
    if retired.get("split") is None:
        keys = [k for k in keys if k != "val_fraction"]  # it sizes a split: none here
    return Source(source, **{k: retired[k] for k in keys})


def _args(retired: dict, keys: list[str]) -> str:
    return ", ".join(f"{k}={retired[k]!r}" for k in keys)
