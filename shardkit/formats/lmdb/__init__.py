"""LMDB shards: one single-file LMDB per shard, writer and reader side by side.

Why LMDB beside tar: it gives random access by index (a B-tree keyed by zero-padded sample
number) while staying one file that reads sequentially, and readers need no lock file. Values are
a fixed little-endian header plus key, extension and bytes (FORMAT.md), never pickle. The
``lmdb`` library writes shards (``writer``); shardkit reads them with plain reads of the B-tree
(``btree``: the on-disk pages, checked as read; ``reader``: the ``pread`` reader), never through
a mapping, so a shard truncated or rewritten under a reader is an error, not a signal. ``index``
is the index record inside each shard (every key and split hash).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ...records import Record, ShardInfo
from ..base import ShardFormat
from ..sample_index import ShardSides, on_sides
from .index import INDEX_KEY, LmdbIndex, LmdbIndexError, decode_lmdb_index, encode_lmdb_index
from .reader import (
    LmdbSampleReader,
    count_lmdb_samples,
    file_stamp,
    iter_lmdb_records,
    lmdb_index_front,
    lmdb_keys,
    read_lmdb_index,
)
from .writer import (
    META_KEY,
    LmdbShardWriter,
    LmdbSizer,
    decode_value,
    encode_value,
    field_key,
    sample_key,
)

__all__ = [
    "INDEX_KEY",
    "META_KEY",
    "LmdbFormat",
    "LmdbIndex",
    "LmdbIndexError",
    "LmdbSampleReader",
    "LmdbShardWriter",
    "LmdbSizer",
    "count_lmdb_samples",
    "decode_lmdb_index",
    "decode_value",
    "encode_lmdb_index",
    "encode_value",
    "field_key",
    "file_stamp",
    "iter_lmdb_records",
    "lmdb_index_front",
    "lmdb_keys",
    "read_lmdb_index",
    "sample_key",
]


class LmdbFormat(ShardFormat):
    """LMDB shards as a ``ShardFormat``: the reader reads a whole file at random offsets, so a
    shard is reached through ``storage.local_path()``."""

    name = "lmdb"
    suffix = ".lmdb"
    maps_file = True

    def open_writer(self, path: str) -> LmdbShardWriter:
        return LmdbShardWriter(path)

    def sizer(self) -> LmdbSizer:
        return LmdbSizer()

    def iter_records(
        self,
        source: Any,
        *,
        shard: str = "",
        start: int = 0,
        stop: int | None = None,
        index: Sequence[int] = (),
        fields: Sequence[str] = (),
        digests: Any = None,
    ) -> Iterator[Record]:
        return iter_lmdb_records(
            source, shard=shard, start=start, stop=stop, fields=fields, digests=digests
        )

    def records(
        self,
        storage: Any,
        shard: ShardInfo,
        start: int = 0,
        stop: int | None = None,
        fields: Sequence[str] = (),
        sides: ShardSides | None = None,
        digests: Any = None,
    ) -> Iterator[Record]:
        """``digests``: the shard's index record's (``LmdbIndex.digests``), each sample
        checked against its own before it is handed out (a read of part of the dataset)."""
        path = storage.local_path(shard)  # now, not on the first sample: a missing file is named
        records = iter_lmdb_records(
            path, shard=shard.url, start=start, stop=stop, fields=fields, digests=digests
        )
        return records if sides is None else on_sides(records, start, sides, shard.url)

    def count(self, storage: Any, shard: ShardInfo) -> int:
        return count_lmdb_samples(storage.local_path(shard), shard=shard.url)
