"""Shard formats by name: one module per format, each holding its writer and reader.

A ``ShardFormat`` bundles the few operations the packer and the streaming path need, so neither
of them branches on the format anywhere else: in particular the format, not its callers, decides
how a shard is reached through a ``Storage`` (tar streams front to back from ``open()``; LMDB maps
a file, so it asks for ``local_path()``). FORMAT.md specifies the bytes of each.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InputError
from ..records import Record, ShardInfo, ShardStats
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


def _streamed(iter_records: Callable[..., Iterator[Record]], count_fn: Callable[..., int]):
    """Records of a format read front to back from ``storage.open()``."""

    def records(storage, shard: ShardInfo, start: int, stop: int | None, fields=()):
        extra = {"fields": fields} if fields else {}
        with storage.open(shard) as stream:
            yield from iter_records(
                stream, shard=shard.url, start=start, stop=stop, index=shard.index, **extra
            )

    def count(storage, shard: ShardInfo) -> int:
        with storage.open(shard) as stream:
            return count_fn(stream, shard=shard.url)

    return records, count


def _mapped(iter_records: Callable[..., Iterator[Record]], count_fn: Callable[..., int]):
    """Records of a format that maps a whole file: it needs ``storage.local_path()``."""

    def records(storage, shard: ShardInfo, start: int, stop: int | None, fields=()):
        extra = {"fields": fields} if fields else {}
        path = storage.local_path(shard)
        return iter_records(
            path, shard=shard.url, start=start, stop=stop, index=shard.index, **extra
        )

    def count(storage, shard: ShardInfo) -> int:
        return count_fn(storage.local_path(shard), shard=shard.url)

    return records, count


@dataclass(frozen=True)
class ShardFormat:
    name: str
    suffix: str
    _writer: Callable[[str], FormatWriter]
    _iter: Callable[..., Iterator[Record]]
    _count: Callable[..., int]
    #: How a shard is reached through a Storage: (records, count) from ``_streamed``/``_mapped``.
    _access: tuple[Callable[..., Iterator[Record]], Callable[..., int]]
    #: Other name endings read as this format (compressed tars: ``.tar.gz``, ``.tgz``).
    also: tuple[str, ...] = ()

    def matches(self, name: str) -> bool:
        return name.endswith((self.suffix, *self.also))

    @property
    def maps_file(self) -> bool:
        """True when the reader maps the file (LMDB): damaged bytes can crash it, not raise."""
        return self._access[0].__qualname__.startswith("_mapped")

    def open_writer(self, path: str) -> FormatWriter:
        return self._writer(path)

    def records(
        self,
        storage: Any,
        shard: ShardInfo,
        start: int = 0,
        stop: int | None = None,
        fields: Sequence[str] = (),
    ) -> Iterator[Record]:
        """Samples ``[start, stop)`` of ``shard``, reached through ``storage`` as this format
        needs (a stream or a local file), seeking with ``shard.index`` where it helps;
        ``fields``: extra members to carry in ``Record.fields`` (tar only)."""
        return self._access[0](storage, shard, start, stop, fields)

    def count(self, storage: Any, shard: ShardInfo) -> int:
        """Samples in ``shard`` (no manifest says), reached through ``storage``."""
        return self._access[1](storage, shard)

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
        """Samples ``[start, stop)`` of a local file (or, for tar, a stream); ``index`` is the
        manifest's sparse offset index, if any; ``fields``: extra members to carry in
        ``Record.fields`` (tar only)."""
        extra = {"fields": fields} if fields else {}
        return self._iter(source, shard=shard, start=start, stop=stop, index=index, **extra)

    def count_samples(self, source: Any, *, shard: str = "") -> int:
        return self._count(source, shard=shard)


FORMATS: dict[str, ShardFormat] = {
    "tar": ShardFormat(
        "tar",
        ".tar",
        TarShardWriter,
        iter_tar_records,
        count_tar_samples,
        _streamed(iter_tar_records, count_tar_samples),
        also=(".tar.gz", ".tgz"),
    ),
    "lmdb": ShardFormat(
        "lmdb",
        ".lmdb",
        LmdbShardWriter,
        iter_lmdb_records,
        count_lmdb_samples,
        _mapped(iter_lmdb_records, count_lmdb_samples),
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
