"""Byte sizes as people write them (``256MB``, ``64MiB``, ``1G``): one parser for every option."""

from __future__ import annotations

import re

from .errors import InputError

__all__ = ["parse_size"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i)?)?(b)?\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: str | int) -> int:
    """Bytes from ``256MB``, ``64MiB``, ``1G``, ``1.5GiB`` or a plain byte count.

    Decimal units (kB, MB, GB, with or without the B) are powers of 1000, binary ones (KiB, MiB,
    GiB) powers of 1024, as disk and cloud tools count them.
    """
    example = "use e.g. 256MB, 64MiB, 1G or a plain number of bytes"
    if isinstance(value, bool):
        raise InputError(f"invalid shard_size={value!r}; {example}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise InputError(f"invalid shard_size={value!r}; {example}")
        digits, unit, binary, _b = m.groups()
        mult = (1024 if binary else 1000) ** _POWERS[unit.lower()] if unit else 1
        size = int(float(digits) * mult) if "." in digits else int(digits) * mult
    if size < 1:
        raise InputError(f"invalid shard_size={value!r}: must be at least 1 byte; {example}")
    return size
