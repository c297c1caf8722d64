"""Shard formats by name: one module per format (tar: one package), each holding its writer, its
readers and its ``ShardFormat`` subclass (``tar.format.TarFormat``, ``lmdb.LmdbFormat``).

A ``ShardFormat`` (``base``) bundles the few operations the packer and the streaming path need,
so neither of them branches on the format anywhere else. FORMAT.md specifies the bytes of each.

- ``tar/``: tar shards in the WebDataset convention (``format``, ``writer``, ``parse``,
  ``reader``, ``tally``).
- ``lmdb/``: single-file LMDB shards (``writer``, ``btree``, ``reader``, and ``index``, the
  sample index record inside each shard).
- ``sample_index``: the sample index beside each tar shard (``.tar.idx``): offsets, key hashes,
  keys, labels and members, so nothing has to walk a shard's headers.
- ``key_file``: the dataset's key file (``manifest.keys``): every key hash sorted with its
  shard, its head and sha256, memory-mapped for growth and for a view's ``get(key)``.
- ``base``: ``ShardFormat`` and ``FormatWriter``, what every format provides.
"""

from __future__ import annotations

import os
import re

from ..errors import InputError
from .base import FormatWriter, ShardFormat
from .lmdb import LmdbFormat
from .tar import IMAGE_EXTS, TarFormat

__all__ = [
    "FORMATS",
    "IMAGE_EXTS",
    "FormatWriter",
    "LmdbFormat",
    "ShardFormat",
    "TarFormat",
    "decode_key",
    "encode_key",
    "format_for_path",
    "get_format",
    "is_shard_name",
]


FORMATS: dict[str, ShardFormat] = {f.name: f for f in (TarFormat(), LmdbFormat())}


def get_format(name: str) -> ShardFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise InputError(
            f"unknown shard format {name!r}; choose one of: {', '.join(FORMATS)}"
        ) from None


def format_for_path(path: str) -> ShardFormat:
    """The format of a shard path or URL, by its suffix (query strings ignored)."""
    base = os.fspath(path).split("?", 1)[0].rstrip("/")
    for fmt in FORMATS.values():
        if fmt.matches(base):
            return fmt
    raise InputError(
        f"{path}: cannot tell the shard format from the name; shards end in "
        + " or ".join(s for f in FORMATS.values() for s in (f.suffix, *f.also))
    )


def is_shard_name(name: str) -> bool:
    """Whether a file name ends like a shard (``.tar``, ``.tar.gz``, ``.tgz``, ``.lmdb``)."""
    return any(f.matches(name) for f in FORMATS.values())


def encode_key(stem: str) -> str:
    """Make a sample key from a relative path: '%' and '.' are percent-encoded, '/' kept.

    WebDataset readers split a member name at the first dot of its basename, so keys must hold
    none; percent-encoding keeps distinct paths distinct and is reversible with decode_key.
    A name that is not valid UTF-8 (``os.fsdecode`` gives lone surrogates for its bad bytes)
    has each undecodable byte written as ``%XX`` (``b"caf\\xe9"`` -> ``caf%E9``): a key is always
    UTF-8 text, so every reader can store and show it, and decode_key gives the name back.
    """
    key = stem.replace("%", "%25").replace(".", "%2E")
    if not key.isascii() and _SURROGATE.search(key):
        key = _SURROGATE.sub(lambda m: "%%%02X" % (ord(m.group()) - 0xDC00), key)
    return key


def decode_key(key: str) -> str:
    """The relative path (without extension) a key was made from; inverse of encode_key.

    Only the escapes encode_key writes are undone (``%25``, ``%2E``, and ``%80``-``%FF`` for
    bytes of a name that is not UTF-8, which come back as ``os.fsdecode`` would give them).
    """
    if "%" not in key:
        return key
    raw = key.encode("utf-8", "surrogateescape")
    raw = _ESCAPE.sub(lambda m: bytes([int(m.group()[1:], 16)]), raw)
    return raw.decode("utf-8", "surrogateescape")


#: A byte of a name that is not valid UTF-8, as ``os.fsdecode`` (surrogateescape) gives it.
_SURROGATE = re.compile("[\udc80-\udcff]")
#: The escapes encode_key writes: ``%25``, ``%2E``, and one undecodable byte ``%80``-``%FF``.
_ESCAPE = re.compile(rb"%(?:25|2E|[89A-F][0-9A-F])")
