"""Byte sizes as people write them (``256MB``, ``64MiB``, ``1.5G``), for every size parameter.

One parser, so ``pack(shard_size=)``, ``RemoteStorage(cache_limit=)`` and the CLI flags accept the
same spellings; ``name`` is the Python parameter the caller exposes, so the error names it.
"""

from __future__ import annotations

import re

from .errors import InputError

__all__ = ["parse_size", "size_text"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i)?)?(b)?\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: str | int, name: str = "shard_size", *, minimum: int = 1) -> int:
    """Bytes from ``256MB``, ``64MiB``, ``1G``, ``1.5GiB`` or a plain byte count.

    Decimal units (kB, MB, GB, with or without the B) are powers of 1000, binary ones (KiB, MiB,
    GiB) powers of 1024, as disk and cloud tools count them. Raises ``InputError`` naming
    ``name`` (a Python parameter, or a CLI flag such as ``--shard-size``); sizes below ``minimum``
    are refused.
    """
    example = "use e.g. 256MB, 64MiB, 1G or a plain number of bytes"
    # ``--flag 'x'`` for the CLI, ``param='x'`` for Python callers
    given = f"{name} {value!r}" if name.startswith("-") else f"{name}={value!r}"
    if isinstance(value, bool):
        raise InputError(f"invalid {given}; {example}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise InputError(f"invalid {given}; {example}")
        digits, unit, binary, _b = m.groups()
        mult = (1024 if binary else 1000) ** _POWERS[unit.lower()] if unit else 1
        size = int(float(digits) * mult) if "." in digits else int(digits) * mult
    if size < minimum:
        raise InputError(
            f"invalid {given}: must be at least {minimum} byte"
            f"{'s' if minimum != 1 else ''}; {example}"
        )
    return size


def size_text(nbytes: int | float) -> str:
    """``199489536`` -> ``"199.5 MB"``; small sizes in kB or bytes, never ``"0.0 MB"``."""
    if nbytes >= 100_000:
        return f"{nbytes / 1e6:.1f} MB"
    if nbytes >= 1000:
        return f"{nbytes / 1e3:.1f} kB"
    return f"{int(nbytes)} bytes"
