"""``TarFormat``: tar shards as a ``ShardFormat``, read front to back from ``storage.open()``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ...records import Record, ShardInfo
from ..base import ShardFormat
from .reader import iter_tar_records
from .tally import count_tar_samples
from .writer import TarShardWriter, TarSizer


class TarFormat(ShardFormat):
    name = "tar"
    suffix = ".tar"
    also = (".tar.gz", ".tgz")

    def open_writer(self, path: str) -> TarShardWriter:
        return TarShardWriter(path)

    def sizer(self) -> TarSizer:
        return TarSizer()

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
        return iter_tar_records(
            source, shard=shard, start=start, stop=stop, index=index, fields=fields
        )

    def records(
        self,
        storage: Any,
        shard: ShardInfo,
        start: int = 0,
        stop: int | None = None,
        fields: Sequence[str] = (),
    ) -> Iterator[Record]:
        with storage.open(shard) as stream:  # a generator: opened on the first sample asked
            yield from iter_tar_records(
                stream, shard=shard.url, start=start, stop=stop, index=shard.index, fields=fields
            )

    def count(self, storage: Any, shard: ShardInfo) -> int:
        with storage.open(shard) as stream:
            return count_tar_samples(stream, shard=shard.url)
