"""Shard formats by name: one module per format, each holding its writer and reader.

A ``ShardFormat`` bundles the few operations the packer and the streaming path need, so neither
of them branches on the format anywhere else. FORMAT.md specifies the bytes of each.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InputError
from ..records import Record, ShardStats
from .lmdb import LmdbShardWriter, count_lmdb_samples, iter_lmdb_records
from .tar import IMAGE_EXTS, TarShardWriter, count_tar_samples, iter_tar_records

__all__ = [
    "FORMATS",
    "IMAGE_EXTS",
    "ShardFormat",
    "FormatWriter",
    "decode_key",
    "encode_key",
    "format_for_path",
    "get_format",
    "is_shard_name",
]


class FormatWriter(Protocol):
    """One shard file of one format (``shardkit.ShardWriter`` rolls them and writes the manifest).

    ``extra`` holds a sample's extra fields as ``(name, bytes)`` pairs.
    """

    samples: int

    def projected_size(
        self, key: str, ext: str, nbytes: int, extra: Sequence[tuple[str, bytes]] = ()
    ) -> int: ...
    def add(
        self, key: str, ext: str, data: bytes, label: int, extra: Sequence[tuple[str, bytes]] = ()
    ) -> None: ...
    def close(self) -> ShardStats: ...
    def abort(self) -> None: ...


@dataclass(frozen=True)
class ShardFormat:
    name: str
    suffix: str
    #: LMDB maps a file, so remote shards must be fetched to a local file first; tar streams.
    needs_local_file: bool
    _writer: Callable[[str], FormatWriter]
    _iter: Callable[..., Iterator[Record]]
    _count: Callable[..., int]
    #: Other name endings read as this format (compressed tars: ``.tar.gz``, ``.tgz``).
    also: tuple[str, ...] = ()

    def matches(self, name: str) -> bool:
        return name.endswith((self.suffix, *self.also))

    def open_writer(self, path: str) -> FormatWriter:
        return self._writer(path)

    def iter_records(
        self,
        source: Any,
        *,
        shard: str = "",
        start: int = 0,
        stop: int | None = None,
        index: Sequence[int] = (),
        fields: Sequence[str] = (),
    ) -> Iterator[Record]:
        """Samples ``[start, stop)``; ``index`` is the manifest's sparse offset index, if any;
        ``fields``: extra members to carry in ``Record.fields`` (tar only)."""
        extra = {"fields": fields} if fields else {}
        return self._iter(source, shard=shard, start=start, stop=stop, index=index, **extra)

    def count_samples(self, source: Any, *, shard: str = "") -> int:
        return self._count(source, shard=shard)


FORMATS: dict[str, ShardFormat] = {
    "tar": ShardFormat(
        "tar", ".tar", False, TarShardWriter, iter_tar_records, count_tar_samples,
        also=(".tar.gz", ".tgz"),
    ),
    "lmdb": ShardFormat(
        "lmdb", ".lmdb", True, LmdbShardWriter, iter_lmdb_records, count_lmdb_samples
    ),
}


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
    """
    return stem.replace("%", "%25").replace(".", "%2E")


def decode_key(key: str) -> str:
    return key.replace("%2E", ".").replace("%25", "%")
