"""What every shard format provides: ``ShardFormat``, subclassed once per format beside its code.

A format, not its callers, decides how a shard is reached through a ``Storage`` (tar streams
front to back from ``open()``; LMDB reads a file at random offsets, so it asks for
``local_path()``), so neither the packer nor the streaming path branches on the format anywhere
else.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from ..records import Record, ShardInfo, ShardStats
from .sample_index import ShardSides

__all__ = ["FormatWriter", "ShardFormat"]


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


class ShardFormat:
    """One shard format: its file names, its writer, and its readers of a file and of a shard.

    A subclass sets ``name``, ``suffix`` (and ``also``, ``maps_file``) and implements the four
    methods below; ``shardkit.formats.FORMATS`` holds one instance of each.
    """

    name: str
    suffix: str
    #: Other name endings read as this format (compressed tars: ``.tar.gz``, ``.tgz``).
    also: tuple[str, ...] = ()
    #: True when the reader maps the file (LMDB): damaged bytes can crash it, not raise.
    maps_file: bool = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def matches(self, name: str) -> bool:
        return name.endswith((self.suffix, *self.also))

    def open_writer(self, path: str) -> FormatWriter:
        raise NotImplementedError

    def sizer(self) -> Any:
        """A shard's projected size from sample sizes alone (``projected_size(klen, elen,
        nbytes)``, ``add(klen, elen, nbytes)``, ``samples``; lengths of the key and extension in
        bytes), exactly as the writer rolls: what a pack is planned with before any image is
        read."""
        raise NotImplementedError

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
        raise NotImplementedError

    def records(
        self,
        storage: Any,
        shard: ShardInfo,
        start: int = 0,
        stop: int | None = None,
        fields: Sequence[str] = (),
        sides: ShardSides | None = None,
    ) -> Iterator[Record]:
        """Samples ``[start, stop)`` of ``shard``, reached through ``storage`` as this format
        needs (a stream or a local file), seeking with ``shard.index`` where it helps;
        ``fields``: extra members to carry in ``Record.fields`` (tar only); ``sides`` (a
        split's read): each sample checked by its own key against the side the split put it
        on, one on the other side a ``ShardFormatError`` naming it."""
        raise NotImplementedError

    def count(self, storage: Any, shard: ShardInfo) -> int:
        """Samples in ``shard`` (no manifest says), reached through ``storage``."""
        raise NotImplementedError
