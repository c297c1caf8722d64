"""Exceptions of our own, so the CLI can turn user errors into one line and a non-zero exit.

Every message names the file (or URL) at fault and, where there is one, the fix. ``check_choice``
is the one wording for an option given a value outside its choices.
"""

from __future__ import annotations

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


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """One wording for every enumerated option (``decode=``, ``equalize=``, ``crop=`` ...)."""
    if value not in choices:
        raise InputError(f"{name}={value!r} is not one of: {', '.join(map(repr, choices))}")
