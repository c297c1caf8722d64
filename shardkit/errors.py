"""Exceptions of our own, so the CLI can turn user errors into one line and a non-zero exit.

Every message names the file (or URL) at fault and, where there is one, the fix. ``check_choice``
is the one wording for an option given a value outside its choices.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from .redact import redact

__all__ = [
    "ShardkitError",
    "InputError",
    "OutputError",
    "ShardFormatError",
    "ManifestError",
    "SampleError",
    "TransformError",
    "StorageError",
    "MissingExtraError",
    "UnknownKeywordError",
]


class ShardkitError(Exception):
    """Base class: anything the user can act on. The CLI prints ``error: <message>`` and exits 1."""

    exit_code = 1

    def __str__(self) -> str:
        # Every message we show passes here: URLs with user:password@ or signed query strings
        # are masked whatever code built the message.
        return redact(super().__str__())


class InputError(ShardkitError):
    """A source path or argument is unusable (missing, empty, wrong type, bad option value)."""

    exit_code = 2


class OutputError(ShardkitError):
    """The output location cannot be written as asked (not empty, no overwrite, ...)."""

    exit_code = 2


class ShardFormatError(ShardkitError):
    """A shard's bytes do not follow FORMAT.md: truncated, bad header, wrong record layout."""


class ManifestError(ShardkitError):
    """manifest.json is missing a field, has the wrong version, or disagrees with the shards."""


class SampleError(ShardkitError):
    """One sample cannot be decoded; carries the shard and key so it can be found and removed."""

    def __init__(self, message: str, *, shard: str = "", key: str = ""):
        super().__init__(message)
        self.shard = shard
        self.key = key


class TransformError(ShardkitError):
    """The dataset's ``transform`` raised on one sample: a bug in the transform, never counted as
    an undecodable sample. Names shard and key; the transform's own exception is its cause."""

    def __init__(self, message: str, *, shard: str = "", key: str = ""):
        super().__init__(message)
        self.shard = shard
        self.key = key

    def __reduce__(self):
        return (_rebuild_keyed, (type(self), str(self), self.shard, self.key))


def _rebuild_keyed(cls, message: str, shard: str, key: str):
    return cls(message, shard=shard, key=key)


class StorageError(ShardkitError):
    """Remote storage failed after retries, or an object is missing; never includes credentials."""


class MissingExtraError(ShardkitError):
    """An optional dependency is not installed; the message names the extra to install."""


class UnknownKeywordError(InputError, TypeError):
    """A keyword the callable does not take: a ``TypeError``, as Python's own functions raise
    for one, and an ``InputError`` so the CLI prints it as one line."""


def check_int(
    name: str, value, least: int = 0, most: int | None = None, *, none: bool = False, hint=""
) -> int | None:
    """``value`` as an int in [``least``, ``most``], or ``InputError`` naming ``name``.

    One check for every whole-number option: a bool, a float (even a whole one: ``2.9`` is not
    silently 2) and anything else not an integer are refused; numpy integers pass. ``none``:
    None is allowed (and returned). ``hint``: what the option means, e.g. " (0: no prefetch)".
    """
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(f"{name}={value!r} must be a whole number >= {least}{hint}")
    if value < least or (most is not None and value > most):
        bound = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise InputError(f"{name}={value!r} must be a whole number {bound}{hint}")
    return int(value)


def check_number(
    name: str, value, least: float = 0.0, *, above: bool = False, none: bool = False, hint=""
) -> float | None:
    """``value`` as a finite float >= ``least`` (> with ``above``), or ``InputError``: NaN,
    infinity and bools are refused, as every comparison with NaN is False and would let it by."""
    if value is None and none:
        return None
    op = ">" if above else ">="
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or (value <= least if above else value < least)
    ):
        raise InputError(f"{name}={value!r} must be a finite number {op} {least:g}{hint}")
    return float(value)


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """One wording for every enumerated option (``decode=``, ``equalize=``, ``crop=`` ...)."""
    if value not in choices:
        raise InputError(f"{name}={value!r} is not one of: {', '.join(map(repr, choices))}")
